"""Issue 42: an attempt keeps the time its job was due, so the console can show each
tenant's wait (due → start) over a window.

``due_at``: the job's due time when the claim took it (its ``next_attempt_at``, else its
request); empty on attempts from before this migration and on rows that record a delivery
that did no work. On PostgreSQL a BRIN index on ``started_at`` lets the window's read skip
the years of attempts before it (an attempt is written once, in start order, so the
table's blocks follow ``started_at``; the index costs the claim next to nothing to keep;
autovacuum summarizes each filled block range). It is built ``CONCURRENTLY``: the
migration is not atomic.
"""

from django.db import migrations, models

CREATE_PG = (
    "CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_attempt_started_brin "
    "ON jobs_attempt USING brin (started_at) WITH (autosummarize = on)"
)


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE_PG)


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP INDEX CONCURRENTLY IF EXISTS jobs_attempt_started_brin")


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("jobs", "0038_held_index_leaves_sequences_out")]

    operations = [
        migrations.AddField(
            model_name="attempt",
            name="due_at",
            field=models.DateTimeField(blank=True, help_text="due since: its wait", null=True),
        ),
        migrations.RunPython(create, drop, elidable=False),
    ]
