"""Each job gets a uid its keys and object names derive from (issue 47: a failover's
rewound sequence can hand an id out twice, never a uid).

Jobs that exist when this runs keep the keys they had: ``keys_from_id`` is true for
them (their keys and object names still derive from their id, exactly as before: a key
already sent to a provider, an object already in the bucket, keep their names) and
false for every job made afterwards. They get a uid too (dated by their
``created_at``), so every job has one.
"""

from django.db import migrations, models

import jobs.identity

BATCH = 2000


def give_existing_jobs_a_uid(apps, schema_editor):
    """A UUIDv7 dated by ``created_at`` for each job made before this migration, in
    batches walked by the primary key (each one an index range, not a scan)."""
    Job = apps.get_model("jobs", "Job")
    db = schema_editor.connection.alias
    rows = Job.objects.using(db).order_by("pk").only("pk", "created_at")
    last = None
    while batch := list((rows if last is None else rows.filter(pk__gt=last))[:BATCH]):
        for job in batch:
            job.uid = jobs.identity.uuid7(int(job.created_at.timestamp() * 1000))
        Job.objects.using(db).bulk_update(batch, ["uid"])
        last = batch[-1].pk


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0023_notice_in_app_message_words"),
    ]

    operations = [
        # Every row that exists now keeps its id-derived keys (a constant default: no
        # rewrite of the table on PostgreSQL 11+); new rows default to false.
        migrations.AddField(
            model_name="job",
            name="keys_from_id",
            field=models.BooleanField(default=True, editable=False),
            preserve_default=False,
        ),
        migrations.AlterField(
            model_name="job",
            name="keys_from_id",
            field=models.BooleanField(
                db_default=False,
                default=False,
                editable=False,
                help_text="made before migration 0024: its keys derive from its id, as they did",
            ),
        ),
        migrations.AddField(
            model_name="job",
            name="uid",
            field=models.UUIDField(editable=False, null=True),
        ),
        migrations.RunPython(give_existing_jobs_a_uid, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="job",
            name="uid",
            field=models.UUIDField(
                default=jobs.identity.new_uid,
                editable=False,
                help_text="unique forever, failovers included; keys and object names derive "
                "from it",
                unique=True,
            ),
        ),
        migrations.AlterField(
            model_name="artifact",
            name="key",
            field=models.CharField(
                help_text="derived from the job's uid and revision", max_length=200, unique=True
            ),
        ),
    ]
