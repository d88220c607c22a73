"""Debounce (issue 42, docs/app/debounce.md): a job's debounce window and how many requests
replaced its params.

The three columns have database defaults (or are nullable), so adding them rewrites no
row on PostgreSQL 11+. The unique partial index covers only open windows (a debounced
job still queued and never claimed): at most one per key, so concurrent requests for one
key cannot make two waiting jobs; a claimed job leaves it for good (a claim counts an
attempt).
"""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("jobs", "0030_fair_share_functions")]

    operations = [
        migrations.AddField(
            model_name="job",
            name="debounce_key",
            field=models.CharField(
                blank=True,
                db_default="",
                default="",
                help_text="the debounce window this job belongs to; empty when not debounced",
                max_length=200,
            ),
        ),
        migrations.AddField(
            model_name="job",
            name="debounce_replaced",
            field=models.PositiveIntegerField(
                db_default=0,
                default=0,
                help_text="requests whose params replaced the waiting job's",
            ),
        ),
        migrations.AddField(
            model_name="job",
            name="debounce_until",
            field=models.DateTimeField(
                blank=True, help_text="the latest due time requests may push it to", null=True
            ),
        ),
        migrations.AddConstraint(
            model_name="job",
            constraint=models.UniqueConstraint(
                condition=models.Q(("attempts", 0), ("state", "queued"))
                & ~models.Q(("debounce_key", "")),
                fields=("debounce_key",),
                name="jobs_job_one_open_debounce_window",
            ),
        ),
    ]
