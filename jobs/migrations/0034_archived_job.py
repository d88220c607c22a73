"""The archived job's identity record (issue 46, ``jobs.archived``): a new table, no rewrite."""

import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0033_job_held_looks_deferred_by"),
    ]

    operations = [
        migrations.CreateModel(
            name="ArchivedJob",
            fields=[
                ("uid", models.UUIDField(editable=False, primary_key=True, serialize=False)),
                (
                    "job_id",
                    models.PositiveBigIntegerField(help_text="the job's id (its readable name)"),
                ),
                (
                    "keys_from_id",
                    models.BooleanField(
                        default=False,
                        help_text="made before migration 0024: its keys derive from its id",
                    ),
                ),
                ("kind", models.CharField(max_length=64)),
                ("subject_type", models.CharField(max_length=100)),
                ("subject_id", models.CharField(max_length=64)),
                ("output_revision", models.PositiveIntegerField()),
                ("state", models.CharField(help_text="its final state", max_length=16)),
                ("finished_at", models.DateTimeField(null=True)),
                ("artifact_key", models.CharField(blank=True, default="", max_length=200)),
                (
                    "artifact_name",
                    models.CharField(
                        blank=True,
                        default="",
                        help_text="the storage name of its file",
                        max_length=300,
                    ),
                ),
                ("artifact_sha256", models.CharField(blank=True, default="", max_length=64)),
                ("artifact_size", models.PositiveBigIntegerField(null=True)),
                ("artifact_content_type", models.CharField(blank=True, default="", max_length=100)),
                ("effects", models.JSONField(blank=True, default=dict)),
                ("archived_at", models.DateTimeField(default=django.utils.timezone.now)),
            ],
            options={
                "ordering": ["-job_id"],
                "indexes": [models.Index(fields=["job_id"], name="jobs_archived_job_id_idx")],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("kind", "subject_type", "subject_id", "output_revision"),
                        name="jobs_archived_one_per_identity",
                    )
                ],
            },
        ),
    ]
