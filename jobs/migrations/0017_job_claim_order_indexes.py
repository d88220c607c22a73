"""The claim's order (docs/app/scheduling.md): two partial indexes on waiting jobs.

A claim looks at two jobs of the named job's queue: the due one best by priority
(``priority DESC``, then due time, then id) and the one waiting longest (due time,
then id). Each is one index scan here. The due time is ``COALESCE(next_attempt_at,
created_at)``; the predicate is the claim's own literal ``state IN (...)``, so the
PostgreSQL statement's plan uses them prepared or not. Plain SQL that SQLite and
PostgreSQL both accept; the model's state is unchanged (no field moves).
"""

from django.db import migrations

WAITING = "state IN ('queued', 'retry_wait')"
SINCE = "(COALESCE(next_attempt_at, created_at))"

INDEXES = {
    "jobs_job_claim_prio_idx": f"queue, priority DESC, {SINCE}, id",
    "jobs_job_claim_wait_idx": f"queue, {SINCE}, id",
}


class Migration(migrations.Migration):
    dependencies = [("jobs", "0016_job_priority_queue_progress")]

    operations = [
        migrations.RunSQL(
            f"CREATE INDEX IF NOT EXISTS {name} ON jobs_job ({columns}) WHERE {WAITING}",
            f"DROP INDEX IF EXISTS {name}",
        )
        for name, columns in INDEXES.items()
    ]
