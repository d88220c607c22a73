"""The practice drill (DESIGN.md): real runner, ledger and provider stand-in, faults on purpose.

Runs in a scratch database (``manage.py drill`` makes one and drops it), so an
operator can rerun it before every release without touching real data. Each
step drives the real code paths; pausing and failing go through the runner's
stage hook, not a reimplementation. Every verification is recorded; the drill
passes only if all of them hold.
"""

from __future__ import annotations

import hashlib
import os
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connection, connections, transaction

import jobs
from jobs import artifacts
from jobs.delivery.runner import JobContext, run_delivery
from jobs.exceptions import TemporaryFailure
from jobs.models import Artifact, Attempt, Effect, Job, JobStep, Notice
from jobs.registry import EffectSpec, register_kind
from jobs.retry import POLICY, ErrorClass
from jobs.tasks import release_effect
from jobs.testing.fakeprovider import Faults, Record, start_in_thread
from jobs.testing.queue import run_queued_effects
from permits import reports
from permits.models import PermitRequest
from permits.services import report_request, revoke_reviewer

DEADLOCK_KIND = "drill.deadlock"
RENDERED_KIND = "drill.rendered_report"
TWO_STEP_KIND = "drill.two_step_report"
# How often each durable step's fn ran, per job (the drill runs its workers in one process).
STEP_RUNS: dict[tuple[int, str], int] = {}


@dataclass
class Row:
    step: str
    worker: str
    happened: str
    artifact: str = "-"
    ledger: str = "-"
    at_provider: str = "-"


@dataclass
class Drill:
    provider: Record
    rows: list[Row] = field(default_factory=list)
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    seen: dict[str, str] = field(default_factory=dict)  # error class -> where

    def check(self, what: str, ok: bool, detail: str = "") -> bool:
        self.checks.append((what, bool(ok), detail))
        return bool(ok)

    @property
    def passed(self) -> bool:
        return all(ok for _, ok, _ in self.checks)

    def applied_at_provider(self, job: Job) -> int:
        ids = set(
            Effect.objects.filter(job=job, provider="webhook").values_list("effect_id", flat=True)
        )
        return sum(len(s) for e, s in self.provider.sends_by_effect().items() if e in ids)

    def row(self, step: str, worker: str, happened: str, job: Job | None = None) -> None:
        if job is None:
            self.rows.append(Row(step, worker, happened))
            return
        arts = list(Artifact.objects.filter(job=job).values_list("pk", flat=True))
        self.rows.append(
            Row(
                step,
                worker,
                happened,
                artifact=",".join(map(str, arts)) or "-",
                ledger=str(Effect.objects.filter(job=job).count()),
                at_provider=str(self.applied_at_provider(job)),
            )
        )


def _identity(label: str) -> str:
    # Two worker identities in one process: host:pid:<label> instead of a boot nonce.
    return f"{socket.gethostname()}:{os.getpid()}:{label}"


# --- the deadlock kind -----------------------------------------------------------------


def _provoke_deadlock(ctx: JobContext) -> None:
    """Two transactions lock two rows in opposite order; PostgreSQL aborts this one (40P01).

    The rows are this job's own (its job row and its attempt row), so deadlock jobs
    running side by side never wait on each other.
    """
    holding, go = threading.Event(), threading.Event()
    first = ("jobs_job", ctx.job.pk)
    second = ("jobs_attempt", ctx.attempt.pk)

    def lock(cursor, row: tuple[str, int]) -> None:
        cursor.execute(f"SELECT id FROM {row[0]} WHERE id = %s FOR UPDATE", [row[1]])

    def other():
        try:
            with transaction.atomic(), connection.cursor() as cur:
                cur.execute("SET LOCAL deadlock_timeout = '5s'")  # the handler is the victim
                lock(cur, second)
                holding.set()
                go.wait(10)
                lock(cur, first)
        finally:
            connection.close()

    thread = threading.Thread(target=other)
    thread.start()
    try:
        with transaction.atomic(), connection.cursor() as cur:
            cur.execute("SET LOCAL deadlock_timeout = '100ms'")
            lock(cur, first)
            holding.wait(10)
            go.set()
            lock(cur, second)
    finally:
        go.set()
        thread.join(15)


def deadlock_handler(ctx: JobContext) -> list[EffectSpec]:
    """Deadlocks on its first attempt (a real one on PostgreSQL), then succeeds."""
    if ctx.job.attempts == 1:
        if connection.vendor != "postgresql":
            raise TemporaryFailure("database lock wait", code="lock_wait")
        _provoke_deadlock(ctx)
    ctx.store_artifact(b"deadlock drill\n", content_type="text/plain", extension="txt")
    return []


def rendered_handler(ctx: JobContext) -> list[EffectSpec]:
    """The permit report, rendered, then a pause point, then stored with no heartbeat between.

    Like a plain function (a ``django.tasks`` task) that cannot heartbeat: a worker
    paused at "rendered" still stores its bytes after its lease ran out.
    """
    ctx.check_owner()
    permit = PermitRequest.objects.select_related("tenant").get(pk=int(ctx.job.subject_id))
    pdf = reports.render_report(permit, ctx.job)
    ctx.stage("rendered")
    ctx.store_artifact(pdf, content_type="application/pdf", extension="pdf")
    return []


def _seal(data: bytes) -> str:
    """The separate expensive stage: a slow digest of the rendered bytes (a stand-in for
    a signing service or a heavy post-processing pass)."""
    return hashlib.pbkdf2_hmac("sha256", data, b"drill-seal", 20_000).hex()


def two_step_handler(ctx: JobContext) -> list[EffectSpec]:
    """The permit report in two durable steps: ``render`` stores the bytes as the artifact
    file and records a reference to it; ``seal`` runs the expensive stage on those bytes.
    An attempt that finds ``render`` done reads its bytes back by that reference."""
    permit = PermitRequest.objects.select_related("tenant").get(pk=int(ctx.job.subject_id))

    def count(name: str) -> None:
        STEP_RUNS[ctx.job.pk, name] = STEP_RUNS.get((ctx.job.pk, name), 0) + 1

    rendered_now: dict[str, bytes] = {}

    def render() -> dict:
        count("render")
        pdf = reports.render_report(permit, ctx.job)
        art = ctx.store_artifact(pdf, content_type="application/pdf", extension="pdf")
        rendered_now["pdf"] = pdf
        return {"file": art.storage_name, "sha256": art.sha256}

    rendered = ctx.step("render", render)
    ctx.stage("between_steps")
    pdf = rendered_now.get("pdf")
    if pdf is None:  # an earlier attempt rendered: its file, verified, is this one's artifact
        with artifacts.get_storage().open(rendered["file"], "rb") as f:
            pdf = f.read()
        if artifacts.sha256_hex(pdf) != rendered["sha256"]:
            raise RuntimeError("the rendered file does not match its step's sha256")
        ctx.store_artifact(pdf, content_type="application/pdf", extension="pdf")

    def seal() -> dict:
        count("seal")
        return {"seal": _seal(pdf)}

    ctx.step("seal", seal)
    return []


def register() -> None:
    register_kind(DEADLOCK_KIND, deadlock_handler, max_attempts=3)
    register_kind(RENDERED_KIND, rendered_handler, max_attempts=3)
    register_kind(TWO_STEP_KIND, two_step_handler, max_attempts=3)


# --- the steps ---------------------------------------------------------------------------


def _wait_until_due(effect: Effect) -> None:
    effect.refresh_from_db()
    if effect.next_attempt_at is not None:
        from django.utils import timezone

        time.sleep(max(0.0, (effect.next_attempt_at - timezone.now()).total_seconds()) + 0.05)


def step_takeover(d: Drill) -> None:
    """Job 84 r29: worker 1 pauses after the artifact, loses its lease, publishes nothing."""
    job = Job.objects.get(pk=84)
    first, second = _identity("worker-1"), _identity("worker-2")
    stored, resume = threading.Event(), threading.Event()
    result: dict = {}

    def pause_after_artifact(stage: str, ctx: JobContext) -> None:
        if stage == "artifact_stored":
            result["name"] = ctx.artifact.storage_name
            stored.set()
            resume.wait(60)

    def run_first():
        try:
            result["first"] = run_delivery(job.pk, worker=first, on_stage=pause_after_artifact)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run_first)
    thread.start()
    d.check("worker 1 stored the artifact", stored.wait(30))
    storage = artifacts.get_storage()
    path = storage.path(result["name"])
    first_file = os.stat(path).st_ino
    d.check(
        "the artifact's row waits for worker 1's publish",
        not Artifact.objects.filter(job=job).exists(),
    )
    d.row("1 claim, store, pause", "worker-1", "claimed; artifact file stored; paused", job)
    time.sleep(float(settings.JOBS_LEASE_SECONDS) + 0.3)
    d.row(
        "2 lease expires", "worker-1", f"lease ran out after {settings.JOBS_LEASE_SECONDS:g}s", job
    )

    second_result = run_delivery(job.pk, worker=second)
    run_queued_effects(second)
    d.check(
        "worker 2 reclaims and publishes",
        second_result.outcome == "succeeded",
        second_result.outcome,
    )
    rows = list(Artifact.objects.filter(job=job))
    same = os.stat(path).st_ino == first_file and [(a.storage_name, a.rewrites) for a in rows] == [
        (result["name"], 0)
    ]
    d.check("worker 2 verified worker 1's file instead of making one", same)
    d.row(
        "3 reclaim, verify, publish", "worker-2", f"{second_result.outcome}; artifact verified", job
    )

    resume.set()
    thread.join(30)
    d.check(
        "worker 1's publish CAS fails",
        result.get("first") and result["first"].outcome == "lease_lost",
    )
    d.row(
        "4 resume",
        "worker-1",
        f"publish CAS lost -> {result['first'].outcome}; nothing published",
        job,
    )

    ledger_rows = Effect.objects.filter(job=job)
    reviewers = reports.reviewers_of(PermitRequest.objects.get(pk=job.subject_id)).count()
    d.check("one artifact row", Artifact.objects.filter(job=job).count() == 1)
    d.check(
        "one ledger row per notice identity",
        ledger_rows.count()
        == 2 * reviewers
        == len(set(ledger_rows.values_list("effect_id", flat=True))),
        f"{ledger_rows.count()} rows for {reviewers} reviewer(s) x 2 channels",
    )
    d.check(
        "one in-app notice per reviewer",
        Notice.objects.filter(effect__job=job).count() == reviewers,
    )
    d.check("the provider applied one notice per reviewer", d.applied_at_provider(job) == reviewers)
    d.check(
        "stored bytes match the recorded sha256",
        artifacts.is_intact(Artifact.objects.get(job=job)),
    )


def step_stale_bytes(d: Drill) -> None:
    """Worker 1 renders, pauses before it stores; the office is renamed; worker 2 publishes
    other bytes; worker 1 stores late: the published bytes stay worker 2's."""
    permit = PermitRequest.objects.select_related("tenant").get(pk=1)
    job = jobs.request(
        RENDERED_KIND,
        ("permits.permitrequest", permit.pk),
        revision=permit.output_revision,
        tenant=permit.tenant.key,
    ).job
    first, second = _identity("worker-1"), _identity("worker-2")
    rendered, resume = threading.Event(), threading.Event()
    seen: dict = {}

    def pause_before_store(stage: str, ctx: JobContext) -> None:
        if stage == "rendered":
            rendered.set()
            resume.wait(60)
        elif stage == "artifact_stored":
            seen["first"] = ctx.artifact.storage_name

    def run_first():
        try:
            seen["first_result"] = run_delivery(job.pk, worker=first, on_stage=pause_before_store)
        finally:
            connections.close_all()

    def note_second(stage: str, ctx: JobContext) -> None:
        if stage == "artifact_stored":
            seen["second"] = (ctx.artifact.storage_name, ctx.artifact.sha256)

    thread = threading.Thread(target=run_first)
    thread.start()
    d.check("worker 1 rendered its bytes", rendered.wait(30))
    d.row("4a claim, render, pause", "worker-1", "rendered; paused before it stores", job)
    time.sleep(float(settings.JOBS_LEASE_SECONDS) + 0.3)
    tenant = permit.tenant
    old_name = tenant.name
    type(tenant).objects.filter(pk=tenant.pk).update(name=f"{old_name} (renamed)")
    try:
        second_result = run_delivery(job.pk, worker=second, on_stage=note_second)
        d.check("worker 2 publishes other bytes", second_result.outcome == "succeeded")
        d.row("4b office renamed; reclaim", "worker-2", f"{second_result.outcome}", job)
        resume.set()
        thread.join(30)
    finally:
        resume.set()
        type(tenant).objects.filter(pk=tenant.pk).update(name=old_name)
    first_result = seen.get("first_result")
    d.check(
        "late worker 1 publishes nothing",
        first_result is not None and first_result.outcome == "lease_lost",
    )
    rows = list(Artifact.objects.filter(job=job))
    d.check("one artifact row", len(rows) == 1)
    art = rows[0] if rows else None
    second_name, second_sha = seen.get("second", ("", ""))
    d.check(
        "the row names worker 2's file and hash",
        art is not None and (art.storage_name, art.sha256) == (second_name, second_sha),
    )
    d.check(
        "worker 1's late bytes went to their own file",
        bool(seen.get("first")) and seen["first"] != second_name,
    )
    d.check(
        "the published bytes stay worker 2's",
        art is not None and artifacts.sha256_hex(artifacts.read_verified(art)) == second_sha,
    )
    d.row(
        "4c resume, store late",
        "worker-1",
        "stored an orphan; publish CAS lost -> " + (first_result.outcome if first_result else "?"),
        job,
    )


def step_two_steps(d: Drill) -> None:
    """A two-step report: worker 1 renders (step 1 recorded), pauses between the steps and
    loses its lease; worker 2 skips the done render and runs the expensive stage; worker 1
    resumes and publishes nothing. Each step's fn ran once in all. The render stands for a
    second's work: recorded at its end (a quicker step rides on the next fenced write,
    ``jobs.delivery.steps.RIDE_SECONDS``)."""
    from jobs.delivery import steps

    ride, steps.RIDE_SECONDS = steps.RIDE_SECONDS, 0.0
    try:
        _two_steps(d)
    finally:
        steps.RIDE_SECONDS = ride


def _two_steps(d: Drill) -> None:
    permit = PermitRequest.objects.select_related("tenant").get(pk=1)
    job = jobs.request(
        TWO_STEP_KIND,
        ("permits.permitrequest", permit.pk),
        revision=permit.output_revision,
        tenant=permit.tenant.key,
    ).job
    first, second = _identity("worker-1"), _identity("worker-2")
    between, resume = threading.Event(), threading.Event()
    seen: dict = {}

    def pause_between_steps(stage: str, ctx: JobContext) -> None:
        seen.setdefault("first_stages", []).append(stage)
        if stage == "between_steps":
            between.set()
            resume.wait(60)

    def run_first():
        try:
            seen["first"] = run_delivery(job.pk, worker=first, on_stage=pause_between_steps)
        finally:
            connections.close_all()

    def note_second(stage: str, ctx: JobContext) -> None:
        seen.setdefault("second_stages", []).append(stage)

    thread = threading.Thread(target=run_first)
    thread.start()
    d.check("worker 1 recorded step 1 (render)", between.wait(30))
    d.row("11a render, pause", "worker-1", "step render recorded; paused between steps", job)
    time.sleep(float(settings.JOBS_LEASE_SECONDS) + 0.3)
    try:
        second_result = run_delivery(job.pk, worker=second, on_stage=note_second)
    finally:
        resume.set()
        thread.join(30)
    stages = seen.get("second_stages", [])
    d.check("worker 2 publishes", second_result.outcome == "succeeded", second_result.outcome)
    skipped = "step_reused:render" in stages and "step_started:render" not in stages
    d.check("worker 2 skipped the done render step", skipped)
    d.row(
        "11b reclaim, skip render",
        "worker-2",
        ("render skipped (done by attempt 1)" if skipped else "render ran again")
        + f"; seal ran -> {second_result.outcome}",
        job,
    )
    first_result = seen.get("first")
    d.check(
        "late worker 1 publishes nothing",
        first_result is not None and first_result.outcome == "lease_lost",
    )
    late = seen.get("first_stages", [])
    late = late[late.index("between_steps") + 1 :] if "between_steps" in late else []
    d.check("late worker 1 did not run the seal", "step_started:seal" not in late)
    d.row(
        "11c resume",
        "worker-1",
        ("seal found done" if "step_reused:seal" in late else "seal refused")
        + "; publish CAS lost -> "
        + (first_result.outcome if first_result else "?"),
        job,
    )
    runs = {name: STEP_RUNS.get((job.pk, name), 0) for name in ("render", "seal")}
    d.check(
        "each step's fn ran once in all",
        runs == {"render": 1, "seal": 1},
        ", ".join(f"{name} ran {n}x" for name, n in runs.items()),
    )
    steps = {s.name: s for s in JobStep.objects.filter(job=job)}
    d.check(
        "one recorded step each: render by worker 1, seal by worker 2",
        set(steps) == {"render", "seal"}
        and (steps["render"].worker, steps["seal"].worker) == (first, second),
    )
    rows = list(Artifact.objects.filter(job=job))
    d.check(
        "one artifact row, the rendered bytes",
        len(rows) == 1 and rows[0].sha256 == steps["render"].output["sha256"],
    )


def step_provider_timeout(d: Drill, server) -> None:
    """The provider accepts a send and stalls past our read timeout: same key, one notice."""
    permit = PermitRequest.objects.get(pk=1)
    job, _ = report_request(permit)
    server.faults.stall = 1.0
    result = run_delivery(job.pk, worker=_identity("worker-1"))
    run_queued_effects(_identity("worker-1"))
    server.faults.stall = 0.0
    effect = Effect.objects.get(job=job, provider="webhook")
    d.check(
        "the stalled send is 'unknown', not failed",
        effect.state == Effect.State.UNKNOWN,
        effect.state,
    )
    d.seen[effect.last_error_class or ErrorClass.PROVIDER_TIMEOUT] = (
        "provider accepted, then timed out"
    )
    d.row(
        "5 provider stalls",
        "worker-1",
        f"job {result.outcome}; notice sent, no answer -> unknown",
        job,
    )
    _wait_until_due(effect)
    outcome = release_effect(effect.pk)
    effect.refresh_from_db()
    keys = {
        r["idempotency_key"] for r in d.provider.requests() if r["effect_id"] == effect.effect_id
    }
    d.check("the retry is applied", outcome == Effect.State.APPLIED, outcome)
    d.check("both calls carried the same key", keys == {effect.idempotency_key}, str(len(keys)))
    d.check("the provider applied it once", d.applied_at_provider(job) == 1)
    # With the provider's lookup (NOTICE_PROVIDER_LOOKUP, on by default) the re-drive asks
    # what became of the key and sends nothing; without it, it sends again under the key.
    posts = len(d.provider.requests_for(effect.idempotency_key))
    lookups = len(d.provider.lookups_for(effect.idempotency_key))
    how = (
        f"looked up by key: applied, {posts} POST in all"
        if lookups
        else f"provider replayed the send ({posts} POSTs)"
    )
    d.check("a key found by lookup is not sent again", not lookups or posts == 1, str(posts))
    d.row("6 re-drive, same key", "dispatcher", f"{how} -> {outcome}", job)


def step_deadlock(d: Drill) -> None:
    job = jobs.request(DEADLOCK_KIND, ("drill", "deadlock")).job
    first = run_delivery(job.pk, worker=_identity("worker-1"))
    attempt = Attempt.objects.filter(job=job).order_by("id").first()
    real = connection.vendor == "postgresql"
    expected = "pg_40P01" if real else "lock_wait"
    d.check("the deadlock is classified temporary", attempt.error_class == ErrorClass.TEMPORARY)
    d.check(
        "PostgreSQL reported 40P01" if real else "lock wait code", attempt.error_code == expected
    )
    d.seen[ErrorClass.TEMPORARY] = "database deadlock (40P01)" if real else "lock wait (SQLite)"
    how = "real deadlock, 40P01" if real else "SQLite serializes writers: a lock wait stands in"
    d.row("7 deadlock", "worker-1", f"{how} -> {first.outcome}", job)
    job.refresh_from_db()
    _wait_until_due_job(job)
    second = run_delivery(job.pk, worker=_identity("worker-2"))
    d.check("the retry succeeds", second.outcome == "succeeded", second.outcome)
    d.row("8 retry when due", "worker-2", second.outcome, job)


def _wait_until_due_job(job: Job) -> None:
    from django.utils import timezone

    if job.next_attempt_at is not None:
        time.sleep(max(0.0, (job.next_attempt_at - timezone.now()).total_seconds()) + 0.05)


def step_malformed(d: Drill) -> None:
    job = jobs.request(reports.KIND, (reports.SUBJECT_TYPE, "not-a-permit")).job
    result = run_delivery(job.pk, worker=_identity("worker-1"))
    job.refresh_from_db()
    d.check("a malformed payload fails at once", job.state == Job.State.FAILED, job.state)
    d.check(
        "after exactly one attempt",
        job.attempts == 1 and Attempt.objects.filter(job=job).count() == 1,
    )
    d.seen[job.last_error_class] = f"malformed payload: {job.last_error_detail}"
    d.row("9 malformed payload", "worker-1", f"{result.outcome}: {job.last_error_detail}", job)


def step_revoked(d: Drill) -> None:
    permit = PermitRequest.objects.get(pk=2)
    reviewer = get_user_model().objects.get(username="reviewer47")
    job, _ = report_request(permit)

    def revoke(stage: str, ctx: JobContext) -> None:
        if stage == "before_publish":
            revoke_reviewer(permit, reviewer)

    result = run_delivery(job.pk, worker=_identity("worker-1"), on_stage=revoke)
    run_queued_effects(_identity("worker-1"))
    states = set(Effect.objects.filter(job=job).values_list("state", flat=True))
    d.check("the job may finish", result.outcome == "succeeded", result.outcome)
    d.check("every notice is withheld", states == {Effect.State.WITHHELD}, ",".join(sorted(states)))
    d.check("no in-app notice", not Notice.objects.filter(effect__job=job).exists())
    d.check("the provider saw nothing", d.applied_at_provider(job) == 0)
    d.seen[ErrorClass.AUTHORIZATION] = "reviewer revoked mid-job"
    d.row("10 reviewer revoked mid-job", "worker-1", "job succeeded; notices withheld", job)


# --- running and printing ------------------------------------------------------------------


def run(write: Callable[[str], None]) -> bool:
    """Seed, run every step, print the table and the classes; True when every check held."""
    settings.JOBS_LEASE_SECONDS = 1.0
    settings.JOBS_BACKOFF_FLOOR_SECONDS = 0.2
    settings.JOBS_BACKOFF_BASE_SECONDS = 0.2
    settings.JOBS_BACKOFF_CAP_SECONDS = 1.0
    settings.NOTICE_PROVIDER_READ_TIMEOUT = 1.0
    settings.NOTICE_PROVIDER_CONNECT_TIMEOUT = 1.0
    call_command("seed_demo", stdout=open("/dev/null", "w"))  # noqa: SIM115

    record = Path(tempfile.mkdtemp(prefix="drill-provider-")) / "record.sqlite3"
    server = start_in_thread(record, faults=Faults(stall_seconds=3.0), token="drill-token")
    settings.NOTICE_PROVIDER_URL, settings.NOTICE_PROVIDER_TOKEN = server.url, "drill-token"
    d = Drill(provider=Record(record))
    try:
        for step in (
            step_takeover,
            step_stale_bytes,
            lambda d: step_provider_timeout(d, server),
            step_deadlock,
            step_malformed,
            step_revoked,
            step_two_steps,
        ):
            try:
                step(d)
            except Exception as exc:  # a step that breaks is a failed verification, not a crash
                d.check(f"step ran ({getattr(step, '__name__', 'step')})", False, repr(exc)[:200])
    finally:
        server.stop()
    d.check("no duplicate effect at the provider", not d.provider.duplicate_effects())
    d.check("no duplicate effect identity in the ledger", _ledger_duplicates() == 0)
    _print(d, write)
    return d.passed


def _ledger_duplicates() -> int:
    from django.db.models import Count

    return Effect.objects.values("effect_id").annotate(n=Count("id")).filter(n__gt=1).count()


def _table(rows: list[list[str]], write) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for n, r in enumerate(rows):
        write("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
        if n == 0:
            write("  ".join("-" * w for w in widths))


def _print(d: Drill, write) -> None:
    write(f"Practice drill on {connection.vendor} (lease {settings.JOBS_LEASE_SECONDS:g}s)\n")
    _table(
        [["step", "worker", "what happened", "artifact id", "ledger rows", "notices at provider"]]
        + [[r.step, r.worker, r.happened, r.artifact, r.ledger, r.at_provider] for r in d.rows],
        write,
    )
    write("\nFailure classes seen")
    _table(
        [["class", "seen as", "verdict", "why"]]
        + [
            [
                cls,
                where,
                "safe to retry" if POLICY[ErrorClass(cls)].safe_to_retry else "operator review",
                POLICY[ErrorClass(cls)].meaning,
            ]
            for cls, where in d.seen.items()
        ],
        write,
    )
    write("\nVerifications")
    for what, ok, detail in d.checks:
        write(
            f"  [{'ok' if ok else 'FAIL'}] {what}" + (f" ({detail})" if detail and not ok else "")
        )
    failed = sum(not ok for _, ok, _ in d.checks)
    write(f"\nverifications held: {len(d.checks) - failed} of {len(d.checks)}")
