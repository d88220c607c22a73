"""Issue 46: the archive walks long-finished jobs oldest first by an index of its own.

``jobs_job_finished_idx``: (finished_at, id) of the finished jobs. Without it each
archive batch read the jobs backward by id past every younger row (bench history: 16 s a
batch of 1,000 at 10 M jobs). On PostgreSQL it is built ``CONCURRENTLY`` (the migration
is not atomic: workers keep writing while a large table is indexed); elsewhere as usual.
"""

from django.db import migrations, models

INDEX = models.Index(
    fields=["finished_at", "id"],
    name="jobs_job_finished_idx",
    condition=models.Q(state__in=["succeeded", "failed", "dead", "cancelled"]),
)
CREATE_PG = (
    "CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_job_finished_idx ON jobs_job "
    "(finished_at, id) WHERE state IN ('succeeded', 'failed', 'dead', 'cancelled')"
)


def create(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(CREATE_PG)
    else:
        schema_editor.add_index(apps.get_model("jobs", "Job"), INDEX)


def drop(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("DROP INDEX CONCURRENTLY IF EXISTS jobs_job_finished_idx")
    else:
        schema_editor.remove_index(apps.get_model("jobs", "Job"), INDEX)


class Migration(migrations.Migration):
    atomic = False
    dependencies = [("jobs", "0036_notice_outlives_its_effect")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.AddIndex(model_name="job", index=INDEX)],
            database_operations=[migrations.RunPython(create, drop, elidable=False)],
        )
    ]
