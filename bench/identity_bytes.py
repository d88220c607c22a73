"""What an archived job's identity costs on PostgreSQL (issue 46), against its live rows.

    DATABASE_URL=postgres://... python -m bench.identity_bytes [--jobs 2000] [--effects 2]

Writes ``--jobs`` finished report-like jobs (one attempt, one artifact row, ``--effects``
settled effects with one event each) into the database's tables, measures what their
rows take, archives them (``jobs.archive``) and measures the records, then deletes the
records. It needs a database whose jobs tables are empty (a scratch one: ``migrate``
first) so that table sizes are its rows' alone, and empties them again at the end.
"""

from __future__ import annotations

import argparse
import os
import uuid
from datetime import timedelta

SIZES = """
SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)
FROM pg_class c WHERE c.relname = ANY(%s) AND c.relkind = 'r'
"""
LIVE = ["jobs_job", "jobs_attempt", "jobs_artifact", "jobs_effect", "jobs_effectevent"]
# Every table that refers to a job or an effect: empty before, emptied after.
EMPTIED = [
    *LIVE,
    "jobs_archivedjob",
    "jobs_jobevent",
    "jobs_jobstep",
    "jobs_notice",
    "jobs_jobgroup",
]


def _sizes(cursor, tables: list[str]) -> int:
    cursor.execute("VACUUM (ANALYZE) " + ", ".join(tables))
    cursor.execute(SIZES, [tables])
    return int(cursor.fetchone()[0])


def _load(n: int, effects: int) -> None:
    """``n`` finished jobs with their rows, written in bulk (ORM, batches of 500)."""
    from django.utils import timezone

    from jobs import artifacts, identity
    from jobs.engine.effect_machine import effect_identity, idempotency_key
    from jobs.models import Artifact, Attempt, Effect, EffectEvent, Job

    old = timezone.now() - timedelta(days=400)
    base = Job.objects.count()
    rows = [
        Job(
            kind="permits.report",
            uid=identity.uuid7(),
            subject_type="permits.permitrequest",
            subject_id=str(900000 + base + i),
            output_revision=29,
            tenant_key="office-1",
            state="succeeded",
            attempts=1,
            finished_at=old,
            started_at=old,
        )
        for i in range(n)
    ]
    jobs_ = Job.objects.bulk_create(rows, batch_size=500)
    Attempt.objects.bulk_create(
        [Attempt(job=j, number=1, worker="host-1:4242:w1", outcome="succeeded") for j in jobs_],
        batch_size=500,
    )
    Artifact.objects.bulk_create(
        [
            Artifact(
                job=j,
                key=artifacts.artifact_key(j),
                storage_name=f"artifacts/permits-report/{artifacts.artifact_key(j)}-"
                f"{uuid.uuid4().hex[:12]}.pdf",
                sha256=uuid.uuid4().hex * 2,
                size=48213,
                content_type="application/pdf",
            )
            for j in jobs_
        ],
        batch_size=500,
    )
    made = []
    for j in jobs_:
        for r in range(effects):
            effect_id = effect_identity(j, "completion-notice", str(40 + r))
            made.append(
                Effect(
                    job=j,
                    effect_id=effect_id,
                    name="completion-notice",
                    provider="webhook",
                    recipient=str(40 + r),
                    idempotency_key=idempotency_key(effect_id),
                    state="applied",
                    attempts=1,
                    provider_ref=f"ntc_{uuid.uuid4().hex[:16]}",
                )
            )
    made = Effect.objects.bulk_create(made, batch_size=500)
    EffectEvent.objects.bulk_create(
        [
            EffectEvent(effect=e, provider="webhook", action="send", actor="w1", outcome="applied")
            for e in made
        ],
        batch_size=500,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--effects", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "permits.settings")
    os.environ.setdefault("DEBUG", "1")
    import django

    django.setup()
    from django.db import connection

    from jobs import archive
    from jobs.archived import ArchivedJob
    from jobs.models import Job, JobGroup, Notice

    assert connection.vendor == "postgresql", "run it with DATABASE_URL=postgres://..."
    if any(m.objects.exists() for m in (Job, ArchivedJob, JobGroup, Notice)):
        raise SystemExit("identity_bytes: the jobs tables are not empty; use a scratch database")
    with connection.cursor() as cursor:
        live_before = _sizes(cursor, LIVE)
        rec_before = _sizes(cursor, ["jobs_archivedjob"])
        _load(args.jobs, args.effects)
        live = _sizes(cursor, LIVE) - live_before
        done = archive.archive(older_than_days=365)
        records = _sizes(cursor, ["jobs_archivedjob"]) - rec_before
        cursor.execute(
            "SELECT avg(pg_column_size(a.*)), avg(pg_column_size(a.effects)) "
            "FROM jobs_archivedjob a WHERE a.kind = 'permits.report'"
        )
        row_bytes, effect_bytes = cursor.fetchone()
        cursor.execute("TRUNCATE " + ", ".join(EMPTIED))  # empty, as they were found
    n = max(1, done.jobs)
    print(
        f"identity-bytes jobs={done.jobs} effects/job={args.effects} "
        f"archive-s={done.seconds:.2f} live-bytes/job={live / n:.0f} "
        f"record-bytes/job={records / n:.0f} (table+indexes) row={float(row_bytes):.0f} "
        f"effects-json={float(effect_bytes):.0f}"
    )


if __name__ == "__main__":
    main()
