"""A waiting job of a paused scope is held: ``Job.held_by`` names the scope.

The claim's two partial indexes (0017) now leave held jobs out (``held_by = ''`` in
their predicate, as in ``rules.CLAIMABLE``): a claim of another scope's job reads the
first row of an index scan however many jobs a paused scope holds. The column has a
database default, so adding it rewrites no row on PostgreSQL 11+.
"""

from django.db import migrations, models

WAITING = "state IN ('queued', 'retry_wait') AND held_by = ''"
SINCE = "(COALESCE(next_attempt_at, created_at))"

INDEXES = {
    "jobs_job_claim_prio_idx": f"queue, priority DESC, {SINCE}, id",
    "jobs_job_claim_wait_idx": f"queue, {SINCE}, id",
}
BEFORE = "state IN ('queued', 'retry_wait')"


class Migration(migrations.Migration):
    dependencies = [("jobs", "0021_flow_verdict")]

    operations = [
        migrations.AddField(
            model_name="job",
            name="held_by",
            field=models.CharField(
                blank=True,
                db_default="",
                default="",
                help_text="the paused scope holding this waiting job; empty when none",
                max_length=200,
            ),
        ),
        migrations.RunSQL(
            [f"DROP INDEX IF EXISTS {name}" for name in INDEXES]
            + [
                f"CREATE INDEX {name} ON jobs_job ({columns}) WHERE {WAITING}"
                for name, columns in INDEXES.items()
            ],
            [f"DROP INDEX IF EXISTS {name}" for name in INDEXES]
            + [
                f"CREATE INDEX {name} ON jobs_job ({columns}) WHERE {BEFORE}"
                for name, columns in INDEXES.items()
            ],
        ),
        # Releasing a resumed scope's jobs reads them by the scope that holds them.
        migrations.AddIndex(
            model_name="job",
            index=models.Index(
                fields=["held_by"],
                name="jobs_job_held_idx",
                condition=~models.Q(held_by=""),
            ),
        ),
    ]
