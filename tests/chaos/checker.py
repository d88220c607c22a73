"""The soak's checker: the history in the database, the storage and the provider's record,
held against every invariant of DESIGN.md.

Runs after every process stopped. Each check is a (what, held, detail) row; the
soak fails when any row did not hold. The provider's record (its own SQLite file)
is an independent witness: sends applied, keys and bodies seen, calls in flight.
"""

from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobs import identity, manifests
from jobs.engine import effect_machine
from tests.chaos.intervals import Slot, merge, tenant_peaks

if TYPE_CHECKING:
    from tests.chaos.soak import Config, Kill, Outage, Watcher, World

RETRYABLE = {"transport", "temporary", "provider_timeout", "unknown"}
# A release passes its authorization recheck right before the call; the provider
# (or the in-app row) records it a moment later. Anything recorded later than this
# after a revocation committed was released without current authorization.
RELEASE_SLACK_SECONDS = 2.0
# The recorded instants around a commit (see ``attempt_slots``) are log lines with
# millisecond resolution: overlaps shorter than twice this are not counted.
CLOCK_SKEW_SECONDS = 0.005
# A tick's job is made by a round that read the server's clock at or after the tick; its
# created_at is this host's clock (the same host in the soak), read a moment later.
TICK_SLACK_SECONDS = 0.05


@dataclass
class Inputs:
    cfg: Config
    world: World
    watcher: Watcher
    kills: list[Kill]
    record: Path
    logs: Path
    artifact_root: Path
    queue_left: int
    settled: bool
    unexpected_exits: list[str]
    chaos_seconds: float
    # What each jobs_worker logged about restarting its qcluster: "exited", "stalled".
    restarts: dict[str, list[str]] = field(default_factory=dict)
    outages: list[Outage] = field(default_factory=list)
    # Periodic kind -> (last tick when the dispatcher began, last tick when the run ended):
    # the ticks in between are held to one job each and the kind's catch-up policy.
    tick_window: dict[str, tuple[datetime | None, datetime | None]] = field(default_factory=dict)


@dataclass
class Report:
    figures: dict[str, Any] = field(default_factory=dict)
    # (promise, what, held, detail): the promise is the function that checked the row.
    checks: list[tuple[str, str, bool, str]] = field(default_factory=list)
    promise: str = ""

    def check(self, what: str, held: bool, detail: str = "") -> bool:
        self.checks.append((self.promise, what, bool(held), detail))
        return bool(held)

    @property
    def passed(self) -> bool:
        return all(held for _, _, held, _ in self.checks)

    @property
    def broken(self) -> list[str]:
        """The promises with at least one row that did not hold, in check order."""
        return list(dict.fromkeys(p for p, _, held, _ in self.checks if not held))

    def as_dict(self) -> dict:
        return {
            "passed": self.passed,
            "broken_promises": self.broken,
            "figures": self.figures,
            "checks": [
                {"promise": p, "what": w, "held": h, "detail": d} for p, w, h, d in self.checks
            ],
        }

    def lines(self) -> list[str]:
        f = self.figures

        def kv(d: dict) -> str:
            return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "none"

        rows = [
            (
                "jobs",
                f"{f['jobs']['total']} ({kv(f['jobs']['by_kind'])}); "
                f"by state: {kv(f['jobs']['by_state'])}",
            ),
            ("kills (SIGKILL)", f"{f['kills']['total']} ({kv(f['kills']['by_what'])})"),
            ("kills mid-job by kind", kv(f["kills"].get("mid_job_by_kind", {}))),
            (
                "ticks",
                "; ".join(
                    f"{kind} ({t['policy']}): {t['jobs']} jobs for {t['ticks']} ticks "
                    f"{t['window'][0]}..{t['window'][1]}, {t['missing']} skipped; "
                    f"{t['due_during_outage']} due from the database outage until the "
                    "dispatcher was back, "
                    f"{t['made_for_those']} made {t['first_made_after_outage_s']} s after; "
                    f"{t['late_excluded']} after the window left out"
                    for kind, t in sorted(f.get("ticks", {}).items())
                )
                or "none",
            ),
            ("chains", _chains_line(f.get("chains", {}))),
            ("debounced", kv(f.get("debounce", {})) or "none"),
            (
                "qclusters restarted by jobs_worker",
                f"{f['cluster_restarts']['exited']} after exiting, "
                f"{f['cluster_restarts']['stalled']} stalled (wedged)",
            ),
            (
                "outages",
                "; ".join(
                    f"{o['what']} {o['seconds']} s, open jobs settled {o['settled_seconds']} s "
                    f"after it ended (open then: {o.get('jobs_open_when_it_began', '?')}, "
                    f"{kv(o.get('open_by_soak_kind', {}))} of the soak's kinds)"
                    for o in f["outages"]
                )
                or "none",
            ),
            ("deliveries", f["deliveries"]),
            ("duplicate deliveries", f["duplicate_deliveries"]),
            ("lease losses", f["lease_losses"]),
            ("expired leases seen", f["expired_leases_seen"]),
            ("crashes", f"{f['crashes']} ({f['q_cluster_timeouts']} Q_CLUSTER timeouts)"),
            (
                "retries by class",
                f"{kv(f['retries_by_class'])} (deadlocks 40P01: {f['deadlock_retries']})",
            ),
            ("effects applied", f"{f['effects_applied_total']} ({kv(f['effects_applied'])})"),
            ("effects by state", kv(f["effects_by_state"])),
            ("provider answers", kv(f["provider"]["answers"])),
            ("sends applied at provider", f["provider"]["sends_applied"]),
            ("resends under same key", f["provider"]["resends_same_key"]),
            (
                "lookups (issue 43)",
                f"{kv(f['provider']['lookups']['answers'])}; "
                f"{f['provider']['lookups']['keys_found_applied']} keys found applied, "
                f"{f['provider']['lookups']['sends_after_found']} sends after one was found",
            ),
            ("duplicate effects", f["duplicate_effects"]),
            ("lost jobs", f["lost_jobs"]),
            (
                "tenant peak (bound)",
                f"{f['tenant_peak']['watcher']} seen live / {f['tenant_peak']['intervals']} "
                f"from attempts (bound {f['tenant_peak']['bound']})",
            ),
            (
                "provider peak (bound)",
                f"{f['provider']['max_in_flight']} in flight (bound {f['provider']['bound']})",
            ),
            ("revocations", f"{f['revocations']} ({f['withheld']} effects withheld)"),
            ("wall time", f"{f.get('wall_seconds', 0)} s ({kv(f.get('phases_seconds', {}))})"),
        ]
        width = max(len(k) for k, _ in rows)
        out = ["", "Figures"]
        out += [f"  {k.ljust(width)}  {v}" for k, v in rows]
        out += ["", "Invariants"]
        for promise, what, held, detail in self.checks:
            mark = "ok" if held else f"FAIL {promise}"
            out.append(f"  [{mark}] {what}" + (f": {detail}" if detail else ""))
        failed = sum(not held for _, _, held, _ in self.checks)
        out.append("")
        out.append(
            f"soak {'PASSED' if not failed else 'FAILED'}: "
            f"{len(self.checks) - failed} of {len(self.checks)} checks held"
            + (f"; broken promises: {', '.join(self.broken)}" if failed else "")
        )
        return out


def _chains_line(c: dict) -> str:
    if not c:
        return "none"
    return (
        f"{c['parents']} parents, {c['groups']} groups, {c['children']} children "
        f"({c['children_not_succeeded']} did not succeed), {c['joins']} joins "
        f"({c['joins_ran']} ran)"
    )


def _ts(value: datetime | None) -> float | None:
    return value.timestamp() if value is not None else None


def _few(items, n: int = 5) -> str:
    items = list(items)
    more = f" (+{len(items) - n} more)" if len(items) > n else ""
    return "; ".join(str(i) for i in items[:n]) + more


def transition_times(log_dir: Path) -> dict[tuple[int, str, int, str], float]:
    """(job, worker, attempt, arrow) -> when the worker logged that transition (JSON logs).

    The engine logs one line per transition (``jobs.transitions``); the workers run
    with ``LOG_FORMAT=json``, whose ``ts`` is the moment of the log call (ms).
    """
    out: dict[tuple[int, str, int, str], float] = {}
    for path in sorted(log_dir.glob("*.log")):
        with open(path, errors="replace") as fh:
            for line in fh:
                if not line.startswith("{") or '"arrow"' not in line:
                    continue
                try:
                    entry = json.loads(line)
                    key = (int(entry["job"]), entry["worker"], int(entry["attempt"]))
                    at = datetime.fromisoformat(entry["ts"]).timestamp()
                except (ValueError, KeyError, TypeError):
                    continue
                if entry.get("logger") == "jobs.transitions":
                    out.setdefault((*key, str(entry["arrow"])), at)
    return out


def attempt_slots(
    attempts,
    tenant_of: dict[int, str],
    watcher: Watcher,
    now: float,
    logged: dict[tuple[int, str, int, str], float] | None = None,
    *,
    lease: float,
):
    """Each claimed attempt's stay in ``running`` with a live lease, as honestly as recorded.

    Returns ``(slots, unlogged, gaps)``: the slots (an attempt whose lease lapsed
    and was renewed has two), how many claims had no log line (their clock
    reading is used), and how many attempts held a lapsed lease for a while.

    The engine counts a job against its tenant while the job is ``running`` in the
    database with an unexpired lease; a claim counts the others under the tenant's
    advisory lock. So a slot runs from the commit of the claim to the commit of the
    transition out of ``running``, but only while a lease holds:

    - start: the claim's log line (``arrow=claim``), written after the claim counted
      and updated the row, just before it commits (``Attempt.started_at`` is the
      lease's start, which may come before a commit that waited).
    - end, when the worker moved the job out of ``running`` itself: for ``succeeded``
      ``Attempt.finished_at``, stamped inside the publish transaction, just before
      its commit; for ``retry``/``failed``/``dead`` the transition's log line, written
      right after its (autocommitted) compare-and-swap, else ``finished_at``.
    - end, when it did not (``crashed``, ``lease_lost``, or still open): its
      ``finished_at`` is stamped when another delivery reclaims the job (after the
      dispatcher's sweep and the queue's latency), later than the engine stopped
      counting the job, so only the leases below bound it.
    - the leases: the claim writes ``started_at + lease`` (both claims record the
      lease's own start as ``started_at``) and each heartbeat
      ``now + lease``, so a lease value ``v`` was written at ``v - lease`` and holds
      until ``v``; the slot is cut to the union of those spans. The claim's own value
      is known exactly; the heartbeats' values come from the watcher, which reads
      every running row five times a second. A value that mattered (the last one of
      a crashed worker, one that outlived the previous lease) stays in the row for a
      full lease (2 s), so the watcher sees it. A lease that lapsed and was renewed
      afterwards (a paused or starved worker, not yet reclaimed) leaves a gap: the
      engine did not count the job in it, and counts it again after the renewal.

    With these ends a recorded overlap means a claim counted while the other job
    was committed as running under a live lease, so it is a breach, not a timing
    artefact; only the log's millisecond resolution and the instructions between
    a commit and its recorded instant remain (``CLOCK_SKEW_SECONDS``).
    """
    logged = logged or {}
    slots: list[Slot] = []
    unlogged = gaps = 0
    for a in attempts:
        if a.number == 0:  # duplicate, deferred or buried delivery: never running
            continue
        t0 = a.started_at.timestamp()
        claimed_at = logged.get((a.job_id, a.worker, a.number, "claim"))
        if claimed_at is None:
            unlogged += 1
            claimed_at = t0
        start = max(claimed_at, t0)
        finished = _ts(a.finished_at)
        if a.outcome == "succeeded":
            end = finished
        elif a.outcome in ("retry", "failed", "dead"):
            end = logged.get((a.job_id, a.worker, a.number, a.outcome), finished)
        else:
            end = finished if finished is not None else now
        values = {t0 + lease} | {
            expires
            for seen_at, expires in watcher.leases.get((a.job_id, a.worker), [])
            if t0 - 0.001 <= seen_at <= end + 0.001
        }
        cover = merge((v - lease, v) for v in values)
        pieces = [(max(s, start), min(e, end)) for s, e in cover if min(e, end) > max(s, start)]
        if len(pieces) > 1:
            gaps += 1
        tenant = tenant_of.get(a.job_id, "")
        slots.extend(Slot(tenant, a.job_id, s, e) for s, e in pieces)
    return slots, unlogged, gaps


@dataclass
class History:
    """What the promises are held against, read once after every process stopped."""

    inp: Inputs
    stats: dict[str, Any]
    jobs: dict[int, Any]
    by_job: dict[int, list]
    claimed: dict[int, list]
    effects: list
    notices: dict[int, Any]
    revoked: dict[tuple[int, str], float]
    record: Any
    sends: list[dict]
    requests: list[dict]
    sends_by_effect: dict[str, list[dict]]
    # The site's follow-up notice jobs (``permits.notices``), apart from the soak's requests.
    follow_ups: list = field(default_factory=list)
    # Jobs the engine made of the soak's kinds (ticks, parts, joins): in ``jobs``, not in
    # the expectations; ``ticks_follow_their_schedule`` and ``chains_follow_up_once``
    # account for each. Ticks after the run's window are left out of ``jobs`` (``late``).
    engine_made: set[int] = field(default_factory=set)
    late_ticks: list = field(default_factory=list)
    # What a promise found that the figures report too (dead_by_kills, retried, ...).
    found: dict[str, Any] = field(default_factory=dict)

    @property
    def expects(self) -> dict:
        return self.inp.world.expects

    def was_revoked(self, fx) -> bool:
        """The effect's reviewer lost access to the permit during the run."""
        subject = fx.job.subject_id
        return subject.isdigit() and (int(subject), fx.recipient) in self.revoked


def read_history(inp: Inputs) -> History:
    from jobs import stats
    from jobs.models import Attempt, Effect, Job, Notice
    from jobs.schedules import tick_of
    from jobs.testing.fakeprovider import Record
    from permits import notices
    from tests.chaos import soak_kinds

    # The site's follow-up notices (a new assignment, a report that could not be built)
    # are jobs of their own kinds, asked for by the site, not by the soak: they are held to
    # their own promise (``follow_up_notices_once``), the rest to the soak's requests.
    follow_ups = (notices.ASSIGNED, notices.STOPPED)
    jobs, late = {}, []
    for j in Job.objects.exclude(kind__in=follow_ups):
        if j.kind in soak_kinds.PERIODIC:
            end = inp.tick_window.get(j.kind, (None, None))[1]
            if end is None or tick_of(j) > end:
                late.append(j)  # the dispatcher ran on after the window: not held to it
                continue
        jobs[j.pk] = j
    by_job: dict[int, list] = defaultdict(list)
    for a in Attempt.objects.order_by("id"):
        by_job[a.job_id].append(a)
    record = Record(inp.record)
    return History(
        inp=inp,
        stats=stats.collect(),
        jobs=jobs,
        by_job=by_job,
        claimed={pk: [a for a in by_job[pk] if a.number > 0] for pk in jobs},
        effects=list(Effect.objects.select_related("job").order_by("id")),
        notices={n.effect_id: n for n in Notice.objects.all()},
        revoked={(v.permit, str(v.user)): v.at for v in inp.world.revocations},
        record=record,
        sends=record.sends(),
        requests=record.requests(),
        sends_by_effect=record.sends_by_effect(),
        follow_ups=list(Job.objects.filter(kind__in=follow_ups)),
        engine_made={pk for pk, j in jobs.items() if j.kind in soak_kinds.ENGINE_MADE},
        late_ticks=late,
    )


def check(inp: Inputs) -> Report:
    """Read everything, hold it against each promise, collect the figures."""
    h = read_history(inp)
    r = Report()
    for promise in PROMISES:
        r.promise = promise.__name__
        promise(h, r)
    r.promise = ""
    _figures(h, r)
    return r


# --- the promises: one function each, named after what it promises --------------------
# Each adds its rows to the report; the number in a row names DESIGN.md's invariant.


def no_job_is_lost_or_made_twice(h: History, r: Report) -> None:
    """Invariant 1: one job per (kind, subject, revision), none lost."""
    from django.db.models import Count

    from jobs.models import Job

    missing = sorted(set(h.expects) - set(h.jobs))
    # Ticks, parts and joins are the engine's: their own promises account for each.
    extra = sorted(set(h.jobs) - set(h.expects) - h.engine_made)
    h.found["missing"] = missing
    twins = (
        Job.objects.values("kind", "subject_type", "subject_id", "output_revision")
        .annotate(n=Count("id"))
        .filter(n__gt=1)
        .count()
    )
    r.check(
        "1 every requested job exists, one per (kind, subject, revision): none lost",
        not missing and not extra and twins == 0,
        f"missing {missing[:5]} extra {extra[:5]} twins {twins}"
        if missing or extra or twins
        else f"{len(h.expects)} jobs requested, {len(h.engine_made)} made by the engine "
        "(ticks, parts, joins)",
    )
    world = h.inp.world
    r.check(
        "1 asking again for a report returns the same job",
        not world.again_mismatch and world.asked_again > 0,
        _few(world.again_mismatch) or f"{world.asked_again} asked again",
    )


def follow_up_notices_once(h: History, r: Report) -> None:
    """The site's follow-up notices (issue 33): each one job per event, ended, and at most
    one applied notice per recipient, whatever the kills did."""
    from collections import Counter

    open_ones = [j for j in h.follow_ups if not j.is_terminal]
    ids = {j.pk for j in h.follow_ups}
    applied = Counter(
        (fx.job_id, fx.recipient) for fx in h.effects if fx.job_id in ids and fx.state == "applied"
    )
    twice = [k for k, n in applied.items() if n > 1]
    r.check(
        "1 each follow-up notice (assignment, report not built) is one job, ended, "
        "with one notice per recipient",
        not open_ones and not twice,
        _few([f"job {j.pk} {j.state}" for j in open_ones] + [f"{k} twice" for k in twice])
        or f"{len(h.follow_ups)} follow-up jobs, {sum(applied.values())} notices",
    )


def every_job_ends_as_expected(h: History, r: Report) -> None:
    """Every job is terminal, in the state its kind and the chaos allow."""
    from jobs.models import Job

    open_jobs = [j for j in h.jobs.values() if not j.is_terminal]
    h.found["open_jobs"] = open_jobs
    r.check(
        "every job terminal",
        not open_jobs and h.inp.settled,
        _few(f"job {j.pk} {j.state}" for j in open_jobs)
        or ("" if h.inp.settled else "effects still open at the deadline"),
    )
    unexpected, dead_by_kills = [], []
    for pk, e in h.expects.items():
        job = h.jobs.get(pk)
        if job is None or not job.is_terminal:
            continue
        outcomes = {a.outcome for a in h.claimed[pk]}
        if e.kind == "malformed":
            ok = job.state == Job.State.FAILED and job.last_error_class == "validation"
        else:
            ok = job.state == Job.State.SUCCEEDED
        # The budget went on crashes (and a deadlock's retry): dead for operator review.
        if (
            not ok
            and job.state == Job.State.DEAD
            and e.kind != "malformed"
            and job.attempts == job.max_attempts
            and outcomes <= {"crashed", "lease_lost", "retry"}
        ):
            dead_by_kills.append(pk)
            ok = True
        if not ok:
            unexpected.append(
                f"job {pk} ({e.kind}) {job.state} {job.last_error_class}/{job.last_error_code}"
            )
    h.found["dead_by_kills"] = dead_by_kills
    r.check(
        "jobs ended as expected (reports, summaries, deadlocks, chains and debounced jobs "
        "succeeded, malformed "
        "failed; "
        "dead only when kills spent the attempt budget)",
        not unexpected,
        _few(unexpected) or (f"dead by kills: {dead_by_kills}" if dead_by_kills else ""),
    )


def nothing_retries_forever(h: History, r: Report) -> None:
    """Invariant 5 for jobs: the attempt budget, and only transient classes retried."""
    from jobs.models import Attempt, Job

    budget = []
    for pk, job in h.jobs.items():
        numbers = sorted(a.number for a in h.claimed[pk])
        if job.attempts > job.max_attempts or numbers != list(range(1, job.attempts + 1)):
            budget.append(f"job {pk}: attempts {job.attempts}/{job.max_attempts} claims {numbers}")
    r.check(
        "5 nothing retried past max_attempts (claims numbered 1..attempts <= max_attempts)",
        not budget,
        _few(budget)
        or f"most claims of one job: {max((j.attempts for j in h.jobs.values()), default=0)}",
    )
    permanent = []
    for pk, job in h.jobs.items():
        if job.state != Job.State.FAILED:
            continue
        outcomes = [a.outcome for a in h.claimed[pk]]
        if (
            outcomes.count("failed") != 1
            or outcomes[-1] != "failed"
            or "retry" in outcomes
            or job.last_error_class != "validation"
        ):
            permanent.append(f"job {pk}: {outcomes} {job.last_error_class}")
    retried = Counter(
        (a.error_class, a.error_code)
        for pk in h.jobs
        for a in h.claimed[pk]
        if a.outcome == Attempt.Outcome.RETRY
    )
    h.found["retried"] = retried
    wrong_class = {k: n for k, n in retried.items() if k[0] not in RETRYABLE}
    r.check(
        "5 permanent failures stop at once; only transient classes are retried",
        not permanent and not wrong_class,
        _few(permanent) or (str(wrong_class) if wrong_class else ""),
    )


def one_compare_and_swap_publishes(h: History, r: Report) -> None:
    """Invariant 3: one succeeded claim per succeeded job, and it is the last."""
    from jobs.models import Attempt, Job

    publishes = []
    for pk, job in h.jobs.items():
        wins = [a for a in h.claimed[pk] if a.outcome == Attempt.Outcome.SUCCEEDED]
        if job.state == Job.State.SUCCEEDED:
            if len(wins) != 1 or h.claimed[pk][-1] is not wins[0]:
                publishes.append(f"job {pk}: {[a.outcome for a in h.claimed[pk]]}")
        elif wins:
            publishes.append(f"job {pk} {job.state} with a published attempt")
    r.check(
        "3 only one CAS publishes: one succeeded claim per succeeded job, and it is the last",
        not publishes,
        _few(publishes),
    )


def an_expired_lease_publishes_nothing(h: History, r: Report) -> None:
    """Invariant 3: a worker seen running on an expired lease did not publish after it."""
    from jobs.models import Attempt

    # The watcher saw the job still running under this owner with the lease already
    # expired; the same claim must not have published afterwards (another worker
    # reclaims, or nobody publishes).
    zombies = []
    for pk in h.jobs:
        for a in h.claimed[pk]:
            seen = h.inp.watcher.expired.get((pk, a.worker))
            if (
                a.outcome == Attempt.Outcome.SUCCEEDED
                and seen is not None
                and a.started_at.timestamp() <= seen <= a.finished_at.timestamp()
            ):
                zombies.append(
                    f"job {pk}: {a.worker}'s lease seen expired at +"
                    f"{seen - a.started_at.timestamp():.2f}s, published at +"
                    f"{(a.finished_at - a.started_at).total_seconds():.2f}s"
                )
    h.found["zombies"] = zombies
    r.check(
        "3 a worker whose lease expired publishes nothing",
        not zombies,
        _few(zombies) or f"{len(h.inp.watcher.expired)} expired leases seen before a reclaim",
    )


def one_artifact_per_job(h: History, r: Report) -> None:
    """Invariant 1 for artifacts: one per succeeded job, intact, and no second file."""
    from jobs import artifacts
    from jobs.models import Artifact, Job
    from tests.chaos import soak_kinds

    arts = defaultdict(list)
    for art in Artifact.objects.all():
        arts[art.job_id].append(art)
    art_problems = []
    for pk, job in h.jobs.items():
        mine = arts.get(pk, [])
        if job.kind in soak_kinds.KINDS:  # ticks and chains store nothing
            if mine:
                art_problems.append(f"job {pk} ({job.kind}) stored {[a.key for a in mine]}")
            continue
        if job.state == Job.State.SUCCEEDED:
            if len(mine) != 1 or mine[0].key != artifacts.artifact_key(job):
                art_problems.append(f"job {pk}: {[a.key for a in mine]}")
        elif len(mine) > 1 or (job.state == Job.State.FAILED and mine):
            art_problems.append(f"job {pk} {job.state}: {[a.key for a in mine]}")
    corrupt = [a.key for rows in arts.values() for a in rows if not artifacts.is_intact(a)]
    r.check(
        "1 one artifact per succeeded job under its stable key; stored bytes match sha256",
        not art_problems and not corrupt,
        _few(art_problems + [f"corrupt {k}" for k in corrupt])
        or f"{sum(len(v) for v in arts.values())} artifacts verified",
    )
    names = {a.storage_name for rows in arts.values() for a in rows}
    files, temps = set(), 0
    root = h.inp.artifact_root
    for folder, _, filenames in os.walk(root):
        for filename in filenames:
            if filename.startswith(".tmp-"):
                temps += 1  # a worker killed mid-write leaves its temporary file
                continue
            name = os.path.relpath(os.path.join(folder, filename), root)
            if not manifests.is_manifest(name):  # a job's identity (issue 47), no artifact
                files.add(name)
    # A worker killed between storing the file and inserting its row leaves a file
    # the next claim adopts (same bytes, same <key>-<sha12> name); only a job that never
    # succeeded keeps it unrecorded.
    # A file's name carries its job's uid (jobs.identity), not its id.
    by_key = {identity.job_key(job): job for job in h.jobs.values()}
    orphans = {
        f
        for f in files - names
        if (m := identity.KEY_IN_NAME.search(f))
        and m["job"] in by_key
        and by_key[m["job"]].state != Job.State.SUCCEEDED
    }
    unrecorded, missing_files = files - names - orphans, names - files
    r.check(
        "1 the storage holds exactly the recorded artifacts (no second file for a key)",
        not unrecorded and not missing_files,
        f"unrecorded {_few(sorted(unrecorded))}; missing {_few(sorted(missing_files))}"
        if unrecorded or missing_files
        else f"{len(files)} files ({len(orphans)} of jobs that never succeeded); "
        f"{temps} temporary files of killed writers",
    )


def one_ledger_row_per_effect_identity(h: History, r: Report) -> None:
    """Invariant 2: the identity and the key are derived, never regenerated."""
    from django.db.models import Count

    from jobs.models import Effect

    underived = []
    for fx in h.effects:
        if fx.effect_id != effect_machine.effect_identity(fx.job, fx.name, fx.recipient):
            underived.append(f"{fx.effect_id}: not derived from its job")
        if fx.idempotency_key != effect_machine.idempotency_key(fx.effect_id):
            underived.append(f"{fx.effect_id}: key not derived from the identity")
    twice = Effect.objects.values("effect_id").annotate(n=Count("id")).filter(n__gt=1).count()
    r.check(
        "2 one ledger row per effect identity; keys derived from it",
        not underived and twice == 0,
        _few(underived) or f"{len(h.effects)} rows, {twice} identities twice",
    )


def each_job_asks_for_its_notices(h: History, r: Report) -> None:
    """Invariant 2: a succeeded job's publish asked for exactly its kind's effects."""
    from jobs.models import Job
    from permits import reports

    by_job_fx = defaultdict(set)
    for fx in h.effects:
        by_job_fx[fx.job_id].add((fx.name, fx.provider, fx.recipient))
    mismatch = []
    for pk, e in h.expects.items():
        job = h.jobs.get(pk)
        have = by_job_fx.get(pk, set())
        if job is None or job.state != Job.State.SUCCEEDED or e.kind == "malformed":
            if have:
                mismatch.append(f"job {pk} ({e.kind}, {job and job.state}) has effects")
            continue
        if e.kind in ("chain", "debounced"):  # follow-up jobs or a result: no effect
            if have:
                mismatch.append(f"job {pk} ({e.kind}): has effects {sorted(have)}")
            continue
        if e.kind in ("deadlock", "summary"):
            want = {(reports.NOTICE, "inapp", str(u)) for u in e.recipients}
            if have != want:
                mismatch.append(f"job {pk} ({e.kind}): have {sorted(have)} want {sorted(want)}")
            continue
        want = {
            (name, provider, str(u))
            for u in e.recipients
            for name, provider in ((reports.NOTICE, "inapp"), (reports.EXTERNAL_NOTICE, "webhook"))
        }
        # A reviewer revoked before the publish gets no effect row at all.
        absent_ok = {w for w in want if (e.permit, w[2]) in h.revoked}
        if not have <= want or (want - have) - absent_ok:
            mismatch.append(f"job {pk}: have {sorted(have)} want {sorted(want)}")
    mismatch += [
        f"job {pk} ({h.jobs[pk].kind}): has effects {sorted(by_job_fx[pk])}"
        for pk in sorted(h.engine_made)
        if by_job_fx.get(pk)
    ]
    r.check(
        "2 each succeeded report asked for one in-app and one webhook notice per reviewer "
        "(a summary job for one in-app notice; chains, parts, joins and ticks for none)",
        not mismatch,
        _few(mismatch),
    )


def every_effect_settles(h: History, r: Report) -> None:
    """Invariant 2: applied, withheld after a revocation, or stopped by its budget."""
    from jobs.models import Effect
    from tests.chaos.faults import release_check_fault

    states = []
    withheld = 0
    for fx in h.effects:
        if fx.state == Effect.State.APPLIED:
            continue
        if fx.state == Effect.State.WITHHELD and h.was_revoked(fx):
            withheld += 1
            continue
        if fx.state == Effect.State.NEEDS_REVIEW and release_check_fault(fx.job) == "always":
            continue  # effects_keep_their_send_budget checks these
        states.append(f"{fx.effect_id} {fx.provider} {fx.state} ({fx.reason})")
    h.found["withheld"] = withheld
    r.check(
        "2 every effect applied, withheld because its reviewer was revoked, or stopped by a "
        "release check that always failed",
        not states,
        _few(states),
    )


def one_notice_per_applied_effect(h: History, r: Report) -> None:
    """Invariant 2 in the app: one in-app notice per applied in-app effect, applied once."""
    from django.db.models import Count

    from jobs.models import Effect, EffectEvent

    notice_problems = []
    for fx in h.effects:
        n = h.notices.get(fx.pk)
        if fx.provider == "inapp" and fx.state == Effect.State.APPLIED:
            if n is None or str(n.recipient_id) != fx.recipient:
                notice_problems.append(f"{fx.effect_id}: no notice for its reviewer")
        elif n is not None:
            notice_problems.append(f"{fx.effect_id} ({fx.state}): has a notice")
    applied_twice = (
        EffectEvent.objects.filter(outcome=Effect.State.APPLIED)
        .values("effect")
        .annotate(n=Count("id"))
        .filter(n__gt=1)
        .count()
    )
    r.check(
        "2 one in-app notice per applied in-app effect, none otherwise; applied once in the ledger",
        not notice_problems and applied_twice == 0,
        _few(notice_problems) or f"{len(h.notices)} notices",
    )


def the_provider_applies_each_effect_once(h: History, r: Report) -> None:
    """Invariant 2 at the provider, by its own record: once, under one key, one body."""
    from jobs.models import Effect

    duplicates = h.record.duplicate_effects()
    h.found["provider_duplicates"] = duplicates
    r.check(
        "2 the provider applied each effect at most once",
        not duplicates,
        _few(f"{e} x{n}" for e, n in duplicates.items()) or f"{len(h.sends)} sends applied",
    )
    webhook = {fx.effect_id: fx for fx in h.effects if fx.provider == "webhook"}
    agree = []
    for effect_id, fx in webhook.items():
        got = h.sends_by_effect.get(effect_id, [])
        if fx.state == Effect.State.APPLIED:
            if len(got) != 1 or got[0]["send_id"] != fx.provider_ref:
                agree.append(f"{effect_id} applied as {fx.provider_ref!r}, provider {got}")
            elif got[0]["idempotency_key"] != fx.idempotency_key:
                agree.append(f"{effect_id}: provider applied another key")
    stray = sorted(set(h.sends_by_effect) - set(webhook))
    r.check(
        "2 every applied webhook effect is exactly the provider's one send; no stray sends",
        not agree and not stray,
        _few(agree + [f"stray {s}" for s in stray]),
    )
    keys = defaultdict(set)
    for req in h.requests:
        if req["effect_id"]:
            keys[req["effect_id"]].add(req["idempotency_key"])
    several = {e: k for e, k in keys.items() if len(k) > 1}
    refused = Counter(
        f"{q['status']} {q['outcome']}"
        for q in h.requests
        if q["status"] in (400, 401, 403, 409, 422)
    )
    r.check(
        "2 the provider saw each effect under one key, with one body (no 409/422/400/401)",
        not several and not refused,
        _few(several) or (str(dict(refused)) if refused else ""),
    )


def effects_keep_their_send_budget(h: History, r: Report) -> None:
    """Invariant 5 for effects: the send budget; failing release checks stop or retry."""
    from jobs.models import Effect, EffectEvent
    from tests.chaos.faults import release_check_fault

    over_budget, not_stopped, not_retried = [], [], []
    sent_effects = set(
        EffectEvent.objects.filter(action=EffectEvent.Action.SEND, error_class="")
        .exclude(outcome="lease_lost")
        .values_list("effect", flat=True)
    )
    hit = Counter()
    for fx in h.effects:
        if fx.attempts > fx.max_attempts:
            over_budget.append(f"{fx.effect_id}: {fx.attempts} of {fx.max_attempts}")
        fault = release_check_fault(fx.job)
        if fault is None:
            continue
        hit[fault] += 1
        if fault == "always" and not (
            fx.state == Effect.State.NEEDS_REVIEW
            and fx.attempts == fx.max_attempts
            and fx.pk not in sent_effects
            and fx.effect_id not in h.sends_by_effect
        ):
            not_stopped.append(f"{fx.effect_id}: {fx.state} {fx.attempts}/{fx.max_attempts}")
        if fault == "transient" and not h.was_revoked(fx) and fx.state != Effect.State.APPLIED:
            not_retried.append(f"{fx.effect_id}: {fx.state} ({fx.reason})")
    r.check(
        "5 no effect spent more sends than its budget; a release check that always fails "
        "stops at the budget in needs_review, never sent",
        not over_budget and not not_stopped and hit["always"] > 0,
        _few(over_budget + not_stopped)
        or f"{hit['always']} effects hit by an always-failing check, all stopped at the budget",
    )
    r.check(
        "5 a release check that failed transiently was retried by the table and released",
        not not_retried and hit["transient"] > 0,
        _few(not_retried) or f"{hit['transient']} effects hit, all applied (or revoked)",
    )


def every_effect_change_has_its_event(h: History, r: Report) -> None:
    """Invariant 10: each state change of an effect committed with its event row."""
    from jobs.models import Effect, EffectEvent

    versions = defaultdict(set)
    for effect_pk, version in EffectEvent.objects.values_list("effect", "version"):
        versions[effect_pk].add(version)
    unlogged = []
    for fx in h.effects:
        missing = [v for v in range(1, fx.version + 1) if v not in versions[fx.pk]]
        if fx.version == 0 and fx.state != Effect.State.PENDING and 0 not in versions[fx.pk]:
            missing.append(0)  # born applied or withheld in the publish, with its event
        if missing:
            unlogged.append(f"{fx.effect_id} ({fx.state} v{fx.version}): no event for {missing}")
    r.check(
        "10 every state change of every effect committed with its event",
        not unlogged,
        _few(unlogged)
        or f"{len(h.effects)} effects, {sum(len(v) for v in versions.values())} event versions",
    )


def release_follows_current_authorization(h: History, r: Report) -> None:
    """Invariant 6: nothing reaches a reviewer after their revocation committed."""
    late = []
    for fx in h.effects:
        if not fx.job.subject_id.isdigit():
            continue
        at = h.revoked.get((int(fx.job.subject_id), fx.recipient))
        if at is None:
            continue
        n = h.notices.get(fx.pk)
        if n is not None and n.created_at.timestamp() > at + RELEASE_SLACK_SECONDS:
            late.append(f"{fx.effect_id}: in-app notice {n.created_at.timestamp() - at:.1f}s after")
        for send in h.sends_by_effect.get(fx.effect_id, []):
            if send["applied_at"] > at + RELEASE_SLACK_SECONDS:
                late.append(
                    f"{fx.effect_id}: provider applied {send['applied_at'] - at:.1f}s after"
                )
    r.check(
        "6 nothing released to a reviewer after the revocation committed",
        not late,
        _few(late)
        or f"{len(h.inp.world.revocations)} revocations, {h.found.get('withheld', 0)} effects "
        "withheld",
    )


def the_provider_bound_holds(h: History, r: Report) -> None:
    """Invariant 7: calls in flight at the provider never above its bound."""
    cfg = h.inp.cfg
    in_flight = h.record.max_in_flight()
    h.found["in_flight"] = in_flight
    r.check(
        "7 per-provider bound: calls in flight at the provider never above the bound",
        in_flight <= cfg.provider_in_flight,
        f"{in_flight} at once (bound {cfg.provider_in_flight})",
    )


def the_tenant_bound_holds(h: History, r: Report) -> None:
    """Invariant 7: live running jobs per tenant, by snapshots and by attempt intervals."""
    cfg, watcher = h.inp.cfg, h.inp.watcher
    seen = {t: p[0] for t, p in watcher.peaks.items()}
    over_seen = {t: p for t, p in watcher.peaks.items() if p[0] > cfg.tenant_concurrency}
    r.check(
        "7 per-tenant bound in every watched snapshot (running jobs with a live lease)",
        not over_seen and watcher.samples > 0,
        f"{over_seen}"
        if over_seen
        else f"peaks {seen} in {watcher.samples} snapshots (largest gap "
        f"{watcher.max_gap:.2f}s, {watcher.errors} failed reads)",
    )
    tenant_of = {pk: j.tenant_key for pk, j in h.jobs.items()}
    all_attempts = [a for rows in h.by_job.values() for a in rows]
    logged = transition_times(h.inp.logs)
    slots, unlogged, gaps = attempt_slots(
        all_attempts, tenant_of, watcher, _now(), logged, lease=cfg.lease
    )
    peaks = tenant_peaks(slots, skew=CLOCK_SKEW_SECONDS, bound=cfg.tenant_concurrency)
    raw = tenant_peaks(slots, bound=cfg.tenant_concurrency)
    over = {
        t: f"{p.count} jobs {p.jobs} for {p.over:.3f}s"
        for t, p in peaks.items()
        if p.count > cfg.tenant_concurrency
    }
    raw_over = max((p.over for p in raw.values()), default=0.0)
    counts = {t: p.count for t, p in peaks.items()}
    raw_counts = {t: p.count for t, p in raw.items()}
    h.found["tenant_peak"] = {
        "watcher": max(seen.values(), default=0),
        "intervals": max((p.count for p in peaks.values()), default=0),
        "intervals_without_skew": max((p.count for p in raw.values()), default=0),
        "longest_over_bound_without_skew_ms": round(raw_over * 1000, 1),
        "bound": cfg.tenant_concurrency,
        "claims_without_log_line": unlogged,
        "attempts_with_lapsed_lease": gaps,
    }
    # The watcher must have read the rows more often than once per lease, or a
    # heartbeat's lease value could have been missed (see attempt_slots).
    watched = watcher.samples > 0 and watcher.max_gap < cfg.lease
    r.check(
        "7 per-tenant bound from recorded attempt intervals (claims to transitions, cut to "
        "the leases held)",
        not over and watched,
        str(over)
        if over
        else f"peaks {counts}; without the skew allowance {raw_counts} (longest stretch above "
        f"the bound {raw_over * 1000:.0f} ms); {len(slots)} slots, {unlogged} claims without "
        f"a log line, {gaps} attempts that held a lapsed lease"
        + ("" if watched else f"; WATCHER GAP {watcher.max_gap:.1f}s >= lease"),
    )


def nothing_private_leaks(h: History, r: Report) -> None:
    """Invariant 8: no private field in a notice body, a log line or an error field."""
    from django.db.models import Q

    from jobs.models import Attempt, Effect, EffectEvent, Job, Notice
    from jobs.providers.webhook import BODY_FIELDS
    from tests.chaos.soak import PRIVATE_MARKER

    leaks = []
    for send in h.sends:
        body = json.loads(send["body"])
        if set(body) != set(BODY_FIELDS):
            leaks.append(f"{send['effect_id']}: body fields {sorted(body)}")
        if PRIVATE_MARKER in send["body"].lower():
            leaks.append(f"{send['effect_id']}: private value in the notice body")
    q_timeouts = 0
    logs = sorted(h.inp.logs.glob("*.log"))
    for path in logs:
        text = path.read_text(errors="replace")
        if PRIVATE_MARKER in text.lower():
            leaks.append(f"private value in {path.name}")
        # django-q2 stopped a delivery at Q_CLUSTER['timeout'] (a crash, for the engine)
        q_timeouts += sum(
            1
            for line in text.splitlines()
            if "Failed" in line and "Task exceeded maximum timeout" in line
        )
    h.found["q_timeouts"] = q_timeouts
    fields = {
        Job: [
            "last_error_detail",
            "last_error_code",
            "last_error_message",
            "last_error_traceback",
            "params",
        ],
        Attempt: ["error_code", "error_message", "error_traceback"],
        Effect: ["reason", "data", "last_error_code"],
        EffectEvent: ["note", "error_code"],
        Notice: ["title", "link"],
    }
    for model, names_ in fields.items():
        query = Q()
        for name in names_:
            query |= Q(**{f"{name}__icontains": PRIVATE_MARKER})
        n = model.objects.filter(query).count()
        if n:
            leaks.append(f"{n} {model.__name__} row(s) with a private value")
    r.check(
        "8 no private field in a notice body, a log line or an error field",
        not leaks,
        _few(leaks) or f"{len(h.sends)} bodies, {len(logs)} logs scanned",
    )


def duplicates_are_counted_apart(h: History, r: Report) -> None:
    """Invariant 9: duplicate deliveries are counted, and no effect is duplicated."""
    figures = h.stats
    r.check(
        "9 duplicate deliveries counted apart; duplicate effects 0",
        figures["duplicate_effects"] == 0,
        f"{figures['duplicate_deliveries']} duplicate deliveries, "
        f"{figures['duplicate_effects']} duplicate effects",
    )


def every_message_is_acknowledged(h: History, r: Report) -> None:
    """Invariant 4: each queue message acknowledged once its outcome committed."""
    left = h.inp.queue_left
    r.check(
        "4 every queue message was acknowledged once its outcome committed (queue drained)",
        left == 0,
        f"{left} job/effect messages never acknowledged" if left else "",
    )


def only_killed_processes_die(h: History, r: Report) -> None:
    """No process of the run ended except the ones the chaos killed."""
    r.check(
        "no process died except the ones the chaos killed",
        not h.inp.unexpected_exits,
        _few(h.inp.unexpected_exits),
    )


def the_dispatcher_lives_through_outages(h: History, r: Report) -> None:
    """A database outage is logged once at its start and once at its end, never fatal."""
    database_outages = [o for o in h.inp.outages if o.what == "database"]
    if not database_outages:
        return
    begun, ended = _dispatcher_outage_lines(h.inp.logs)
    r.check(
        "the dispatcher lived through each database outage, logging its start and end once",
        begun >= len(database_outages) and begun == ended,
        f"{len(database_outages)} outage(s); the dispatcher logged {begun} start(s), "
        f"{ended} end(s)",
    )


# --- the soak's own kinds: periodic ticks and chains (tests.chaos.soak_kinds) ----------


def _ran_to_one_outcome(job, claims: list) -> str | None:
    """Why ``job`` did not run to one outcome (None: it did): terminal, at most one
    succeeded attempt, and succeeded, or dead with its budget spent by kills."""
    from jobs.models import Attempt, Job

    wins = sum(a.outcome == Attempt.Outcome.SUCCEEDED for a in claims)
    if not job.is_terminal:
        return f"job {job.pk} ({job.kind}) still {job.state}"
    if wins > 1:
        return f"job {job.pk} ({job.kind}): {wins} succeeded attempts"
    if job.state == Job.State.SUCCEEDED:
        return None if wins == 1 else f"job {job.pk} ({job.kind}) succeeded with no attempt"
    outcomes = {a.outcome for a in claims}
    if (
        job.state == Job.State.DEAD
        and job.attempts == job.max_attempts
        and outcomes <= {"crashed", "lease_lost", "retry"}
    ):
        return None  # the kills spent its budget: dead for an operator, as a report can be
    return f"job {job.pk} ({job.kind}) {job.state} {job.last_error_class}/{job.last_error_code}"


def _dead_by_kills(jobs) -> list[int]:
    return [j.pk for j in jobs if j.state == "dead"]


def ticks_follow_their_schedule(h: History, r: Report) -> None:
    """Periodic kinds: one job per tick of the run's window, none before its tick, each
    run to one outcome; the ticks due while the database was away follow the kind's
    catch-up policy ("all": each gets its job when it is back; "latest": the newest only).
    """
    from jobs.schedules import tick_id, tick_of
    from tests.chaos import soak_kinds

    db = next((o for o in h.inp.outages if o.what == "database" and o.began and o.ended), None)
    found: dict[str, Any] = {}
    for kind, (policy, step) in soak_kinds.PERIODIC.items():
        what = f"{kind} (every {step} s, catch_up {policy})"
        start, end = h.inp.tick_window.get(kind, (None, None))
        if start is None or end is None:
            r.check(f"ticks of {what}: its schedule state read at both ends", False, "not read")
            continue
        mine = sorted((j for j in h.jobs.values() if j.kind == kind), key=tick_of)
        at = {int(tick_of(j).timestamp()): j for j in mine}
        first, last = int(start.timestamp()), int(end.timestamp())
        expected = list(range(first + step, last + 1, step))
        problems = []
        per_tick = Counter(tick_of(j) for j in mine)
        problems += [f"tick {tick_id(t)}: {n} jobs" for t, n in per_tick.items() if n > 1]
        for j in mine:
            tick = tick_of(j).timestamp()
            if j.subject_type != "jobs.tick" or j.output_revision != 1 or tick % step:
                problems.append(f"job {j.pk}: {j.subject_type} {j.subject_id} is not a tick")
            if _ts(j.created_at) < tick - TICK_SLACK_SECONDS:
                problems.append(f"job {j.pk}: created {tick - _ts(j.created_at):.2f}s early")
            why = _ran_to_one_outcome(j, h.claimed[j.pk])
            if why:
                problems.append(why)
            elif j.state == "succeeded" and j.result != {"tick": j.subject_id}:
                problems.append(f"job {j.pk}: result {j.result!r} names another tick")
        lags = sorted(_ts(j.created_at) - tick_of(j).timestamp() for j in mine)
        r.check(
            f"ticks of {what}: one job per tick, none created before its tick, each ran to "
            "one outcome (one succeeded attempt, or dead by kills)",
            not problems,
            _few(problems)
            or f"{len(mine)} jobs for ticks {tick_id(start)}..{tick_id(end)}; created "
            f"{lags[len(lags) // 2]:.2f}s after the tick (median), {lags[-1]:.2f}s at most"
            if lags
            else "no ticks in the window",
        )
        missing = [t for t in expected if t not in at]
        # The ticks due while the dispatcher could not reach the database: after the
        # outage began, up to the one the first job made after it was for.
        missed, made, back = [], [], None
        if db is not None:
            after = [j for j in mine if tick_of(j).timestamp() > db.began]
            if after:
                # A round makes at most one job of a kind: the earliest made is the
                # first round's (on a tie, the newer tick).
                first = min(after, key=lambda j: (_ts(j.created_at), -tick_of(j).timestamp()))
                back = _ts(first.created_at)
                # "latest": the first round back made the newest tick due when it read the
                # clock, and that reading came before the job's created_at (a slow insert
                # under load put a later tick's normal job among the missed ones): the
                # missed ticks end at the first job's own tick.
                until = tick_of(first).timestamp() if policy == "latest" else back
                missed = [t for t in expected if db.began < t <= until]
                made = [t for t in missed if t in at]
        during = [t for t in missed if db is not None and t <= db.ended]
        # An outage as long as the interval always spans a tick; a shorter one may not.
        spans = db is not None and (bool(during) or db.ended - db.began < step)
        skipped = [t for t in missed if t not in at]
        iso = [tick_id(_epoch(t)) for t in missed]
        found[kind] = {
            "policy": policy,
            "window": [tick_id(start), tick_id(end)],
            "ticks": len(expected),
            "jobs": len(mine),
            "missing": len(missing),
            "due_during_outage": len(missed),
            "made_for_those": len(made),
            "first_made_after_outage_s": round(back - db.ended, 1) if back and db else None,
            "late_excluded": sum(1 for j in h.late_ticks if j.kind == kind),
            "dead_by_kills": _dead_by_kills(mine),
        }
        if policy == "all":
            caught_late = [
                tick_id(_epoch(t))
                for t in missed
                if t in at and _ts(at[t].created_at) < db.ended - TICK_SLACK_SECONDS
            ]
            r.check(
                f"ticks of {what}: every tick of the window has its job; those due while the "
                "database was away were each created once it was back",
                not missing and not caught_late and (db is None or spans),
                f"missing {_few(tick_id(_epoch(t)) for t in missing)}"
                if missing
                else f"created during the outage: {caught_late}"
                if caught_late
                else "no tick fell in the database outage"
                if db is not None and not spans
                else f"{len(expected)} ticks; {len(missed)} due from the outage until the "
                "dispatcher was back "
                f"({_few(iso)}), all made {found[kind]['first_made_after_outage_s']}s after "
                "it came back",
            )
            continue
        # latest: a tick is skipped only when a newer one was due when its job was made,
        # and no round ran while it was the newest: a round fires every kind with one
        # clock reading, so another kind's tick u >= t made before t + step is such a
        # round (one the outage cut between the two kinds, just before it began, aside).
        unexplained = []
        rounds = [
            (tick_of(j).timestamp(), _ts(j.created_at))
            for j in h.jobs.values()
            if j.kind in soak_kinds.PERIODIC and j.kind != kind
        ]
        for t in missing:
            newer = next((u for u in expected if u > t and u in at), None)
            if newer is None or _ts(at[newer].created_at) < t + step - TICK_SLACK_SECONDS:
                unexplained.append(f"{tick_id(_epoch(t))} (its successor was made too early)")
                continue
            ran = [
                c
                for u, c in rounds
                if u >= t
                and c < t + step - TICK_SLACK_SECONDS
                and not (db is not None and db.began - 1.0 <= c <= db.began)
            ]
            if ran:
                unexplained.append(
                    f"{tick_id(_epoch(t))} (a round made another kind's tick "
                    f"{ran[0] - t:.2f}s after it)"
                )
        r.check(
            f"ticks of {what}: a tick without a job was skipped for a newer one already due; "
            "of the ticks due while the database was away only the newest got a job",
            not unexplained and (db is None or (spans and len(made) == (1 if missed else 0))),
            f"skipped while it was the newest: {_few(unexplained)}"
            if unexplained
            else f"due from the outage until the dispatcher was back {iso}, jobs for "
            f"{[tick_id(_epoch(t)) for t in made]}"
            if db is not None and (not spans or len(made) != (1 if missed else 0))
            else f"{len(expected)} ticks, {len(missing)} skipped; due from the outage until "
            f"the dispatcher was back {_few(iso)}: {len(skipped)} skipped, one job for "
            f"{tick_id(_epoch(made[0])) if made else '-'}",
        )
    h.found["ticks"] = found


def chains_follow_up_once(h: History, r: Report) -> None:
    """Chains: each parent's publish made its group once (``size`` children under their
    identities), each child's end counted once, one join per group that ended once, and
    a join that ran saw every child's end and result."""
    from jobs.models import JobGroup
    from tests.chaos import soak_kinds

    chains = {pk: h.jobs[pk] for pk, e in h.expects.items() if e.kind == "chain" and pk in h.jobs}
    groups = list(JobGroup.objects.order_by("pk"))
    by_parent = defaultdict(list)
    for g in groups:
        by_parent[g.parent_id].append(g)
    members = defaultdict(list)
    for j in sorted(h.jobs.values(), key=lambda j: j.pk):
        if j.group_id is not None:
            members[j.group_id].append(j)
    parts = [j for j in h.jobs.values() if j.kind == soak_kinds.PART]
    joins = [j for j in h.jobs.values() if j.kind == soak_kinds.JOIN]

    made = []
    for pk, parent in chains.items():
        mine = by_parent.get(pk, [])
        size = parent.params["parts"]
        why = _ran_to_one_outcome(parent, h.claimed[pk])
        if why:
            made.append(why)
        if parent.state != "succeeded":
            if mine:
                made.append(f"chain {pk} {parent.state} made {len(mine)} group(s)")
            continue
        if len(mine) != 1:
            made.append(f"chain {pk}: {len(mine)} groups")
            continue
        g = mine[0]
        children = members.get(g.pk, [])
        want = sorted(f"{pk}.{soak_kinds.GROUP_NAME}.p{n}" for n in range(size))
        have = sorted(c.subject_id for c in children)
        if g.size != size or g.name != soak_kinds.GROUP_NAME or have != want:
            made.append(f"chain {pk}: group {g.pk} {g.name} size {g.size}, children {have}")
        for c in children:
            if (c.kind, c.subject_type, c.output_revision, c.parent_id) != (
                soak_kinds.PART,
                "jobs.job",
                1,
                pk,
            ) or c.tenant_key != parent.tenant_key:
                made.append(f"chain {pk}: child {c.pk} {c.kind} {c.subject_type} {c.subject_id}")
    stray_groups = [g.pk for g in groups if g.parent_id not in chains]
    stray_parts = [j.pk for j in parts if j.group_id is None or j.parent_id not in chains]
    r.check(
        "chains: each succeeded parent's publish made one group of its 2-3 children, once "
        "(identities <parent>.parts.p<n>, its tenant); no group or child without its parent",
        not made and not stray_groups and not stray_parts,
        _few(
            made
            + [f"stray group {g}" for g in stray_groups]
            + [f"stray part {j}" for j in stray_parts]
        )
        or f"{len(chains)} parents, {len(groups)} groups, {len(parts)} children",
    )

    counted = []
    for g in groups:
        children = members.get(g.pk, [])
        not_succeeded = sum(c.group_outcome != "succeeded" for c in children)
        if (g.ended, g.version, g.not_succeeded, len(children)) != (
            g.size,
            g.size,
            not_succeeded,
            g.size,
        ):
            counted.append(
                f"group {g.pk}: ended {g.ended} version {g.version} of size {g.size} with "
                f"{len(children)} children, not succeeded {g.not_succeeded} (children say "
                f"{not_succeeded})"
            )
        for c in children:
            why = _ran_to_one_outcome(c, h.claimed[c.pk])
            if why:
                counted.append(why)
            if c.group_outcome != c.state:
                counted.append(f"child {c.pk} {c.state} counted as {c.group_outcome!r}")
    r.check(
        "groups: every child's end counted once (ended == size == version at the end); each "
        "child ran to one outcome",
        not counted,
        _few(counted)
        or f"{sum(g.size for g in groups)} ends counted in {len(groups)} groups; "
        f"{sum(g.not_succeeded for g in groups)} children did not succeed",
    )

    one_join = []
    by_subject = defaultdict(list)
    for j in joins:
        by_subject[(j.subject_type, j.subject_id)].append(j)
    for g in groups:
        mine = by_subject.get(("jobs.group", str(g.pk)), [])
        if len(mine) != 1 or g.join_id != mine[0].pk:
            one_join.append(f"group {g.pk}: joins {[j.pk for j in mine]}, group says {g.join_id}")
            continue
        why = _ran_to_one_outcome(mine[0], h.claimed[mine[0].pk])
        if why:
            one_join.append(why)
    known = {("jobs.group", str(g.pk)) for g in groups}
    stray_joins = [j.pk for key, js in by_subject.items() if key not in known for j in js]
    r.check(
        "joins: exactly one per group by identity (soak.join, jobs.group, <group>), the "
        "group's own, and it ended once",
        not one_join and not stray_joins,
        _few(one_join + [f"stray join {j}" for j in stray_joins])
        or f"{len(joins)} joins for {len(groups)} groups",
    )

    saw = []
    ran = 0
    by_pk = {g.pk: g for g in groups}
    for j in joins:
        g = by_pk.get(int(j.subject_id)) if j.subject_id.isdigit() else None
        if g is None or j.state != "succeeded":
            continue
        ran += 1
        children = members.get(g.pk, [])
        want = [
            [
                c.subject_id.rsplit(".", 1)[-1],
                c.pk,
                c.group_outcome,
                c.result if c.group_outcome == "succeeded" else None,
            ]
            for c in children
        ]
        total = sum(c.result["value"] for c in children if c.group_outcome == "succeeded")
        if j.result != {"seen": want, "total": total}:
            saw.append(f"join {j.pk}: saw {j.result!r}, children {want}")
        for c in children:
            if c.group_outcome == "succeeded" and c.result != {
                "part": c.params["part"],
                "value": soak_kinds.part_value(c.params["chain"], c.params["part"]),
            }:
                saw.append(f"child {c.pk}: result {c.result!r}")
    r.check(
        "a join that ran saw every child's end and result (its result against the children's)",
        not saw,
        _few(saw) or f"{ran} joins ran and each saw all its children",
    )
    kinds_of = {pk: j.kind for pk, j in h.jobs.items()}
    hit = Counter(
        kinds_of.get(int(k.subject.split()[1]), "?")
        for k in h.inp.kills
        if k.subject.startswith("job ") and k.subject.split()[1].isdigit()
    )
    h.found["chains"] = {
        "parents": len(chains),
        "groups": len(groups),
        "children": len(parts),
        "children_not_succeeded": sum(g.not_succeeded for g in groups),
        "joins": len(joins),
        "joins_ran": ran,
        "dead_by_kills": _dead_by_kills([*chains.values(), *parts, *joins]),
    }
    h.found["kills_mid_job_by_kind"] = dict(hit)


def debounce_keeps_the_latest(h: History, r: Report) -> None:
    """Issue 42: requests of one debounced key close together make one job, which runs
    once with the params of the last request that reached it and counts the others it
    replaced; a request refused (its job was claimed) changed nothing."""
    from jobs.models import Job

    reached: dict[int, list[int]] = defaultdict(list)  # job -> the seqs that reached it
    refused = 0
    for _key, seq, pk in h.inp.world.debounced:
        if pk is None:
            refused += 1
        else:
            reached[pk].append(seq)
    wrong = []
    for pk, seqs in sorted(reached.items()):
        job = h.jobs.get(pk)
        if job is None:
            wrong.append(f"job {pk} missing")
            continue
        if job.state != Job.State.SUCCEEDED:
            continue  # dead by kills or open: every_job_ends_as_expected says which
        ran = (job.result or {}).get("seq")
        succeeded = sum(1 for a in h.claimed[pk] if a.outcome == "succeeded")
        if ran != max(seqs) or job.debounce_replaced != len(seqs) - 1 or succeeded != 1:
            wrong.append(
                f"job {pk}: ran seq {ran} (last {max(seqs)}), replaced "
                f"{job.debounce_replaced} of {len(seqs)} requests, succeeded {succeeded}x"
            )
    h.found["debounce"] = {
        "keys": len({key for key, _seq, _pk in h.inp.world.debounced}),
        "requests": len(h.inp.world.debounced),
        "jobs": len(reached),
        "replaced": sum(h.jobs[pk].debounce_replaced for pk in reached if pk in h.jobs),
        "refused": refused,
    }
    r.check(
        "debounced requests: one job a window, run once with the last request's params, "
        "the others counted as replaced",
        bool(reached) and not wrong,
        _few(wrong) or " ".join(f"{k}={v}" for k, v in h.found["debounce"].items()),
    )


def reports_keep_their_permits_order(h: History, r: Report) -> None:
    """Issue 42: the site's reports are one sequence per permit request: a revision's
    report starts after the one before it ended and its notices settled (or an operator
    released it), never in another order (``tests.chaos.sequence_drill``'s check)."""
    from tests.chaos.sequence_drill import check_order

    problems, checked = check_order()
    h.found["sequences"] = {"starts_checked": checked, "problems": len(problems)}
    r.check(
        "reports of one permit request start in request order, each after the one before "
        "ended and its notices settled (or an operator released it)",
        not problems,
        _few(problems) or f"{checked} starts after another of their permit checked",
    )


PROMISES = (
    no_job_is_lost_or_made_twice,
    every_job_ends_as_expected,
    nothing_retries_forever,
    one_compare_and_swap_publishes,
    an_expired_lease_publishes_nothing,
    one_artifact_per_job,
    follow_up_notices_once,
    one_ledger_row_per_effect_identity,
    each_job_asks_for_its_notices,
    every_effect_settles,
    one_notice_per_applied_effect,
    the_provider_applies_each_effect_once,
    effects_keep_their_send_budget,
    every_effect_change_has_its_event,
    release_follows_current_authorization,
    the_provider_bound_holds,
    the_tenant_bound_holds,
    nothing_private_leaks,
    duplicates_are_counted_apart,
    every_message_is_acknowledged,
    only_killed_processes_die,
    the_dispatcher_lives_through_outages,
    ticks_follow_their_schedule,
    chains_follow_up_once,
    debounce_keeps_the_latest,
    reports_keep_their_permits_order,
)


def lookup_figures(lookups: list[dict], sends: list[dict]) -> dict:
    """Issue 43's figure for a fault run: the lookups' answers, and the POSTs a key got
    after a lookup had found it applied (a lookup that found a key settles it: 0)."""
    found_at: dict[str, float] = {}
    for q in lookups:
        if q["status"] == 200:
            found_at.setdefault(q["idempotency_key"], q["answered_at"])
    after = [
        q
        for q in sends
        if q["idempotency_key"] in found_at and q["received_at"] > found_at[q["idempotency_key"]]
    ]
    return {
        "answers": dict(Counter(f"{q['status']} {q['outcome']}" for q in lookups)),
        "keys_found_applied": len(found_at),
        "sends_after_found": len(after),
    }


def _figures(h: History, r: Report) -> None:
    """The run's figures, from the history and what the promises found."""
    from jobs.models import Effect

    inp, cfg, figures, found = h.inp, h.inp.cfg, h.stats, h.found
    answers = Counter(f"{q['status']} {q['outcome']}" for q in h.requests)
    by_key = Counter(q["idempotency_key"] for q in h.requests if q["status"] in (200, 201))
    applied = Counter(fx.provider for fx in h.effects if fx.state == Effect.State.APPLIED)
    kinds = Counter(e.kind for e in h.expects.values())
    retried = found.get("retried", Counter())
    lost = len(found.get("missing", [])) + sum(
        1 for j in found.get("open_jobs", []) if j.pk in h.expects
    )
    r.figures.update(
        jobs={
            "total": len(h.jobs),
            "by_kind": dict(kinds),
            "by_state": figures["jobs"]["by_state"],
            "dead_by_kills": found.get("dead_by_kills", []),
        },
        kills={
            "total": sum(1 for k in inp.kills if not k.what.startswith("pause")),
            "by_what": dict(Counter(k.what for k in inp.kills)),
            "pauses": sum(1 for k in inp.kills if k.what.startswith("pause")),
            "mid_job_by_kind": found.get("kills_mid_job_by_kind", {}),
        },
        ticks=found.get("ticks", {}),
        chains=found.get("chains", {}),
        debounce=found.get("debounce", {}),
        deliveries=figures["deliveries"],
        deliveries_by_outcome=figures["deliveries_by_outcome"],
        duplicate_deliveries=figures["duplicate_deliveries"],
        lease_losses=figures["lease_losses"],
        expired_leases_seen=len(inp.watcher.expired),
        zombie_publishes=len(found.get("zombies", [])),
        crashes=figures["crashes"],
        q_cluster_timeouts=found.get("q_timeouts", 0),
        retries_by_class=figures["retries_by_class"],
        retries_by_code={f"{c}/{k}": n for (c, k), n in sorted(retried.items())},
        deadlock_retries=sum(n for (c, k), n in retried.items() if k == "pg_40P01"),
        effects_applied=dict(applied),
        effects_applied_total=sum(applied.values()),
        effects_by_state=figures["effects"]["by_state"],
        effect_sends=figures["providers"],
        provider={
            "answers": dict(answers),
            "sends_applied": len(h.sends),
            "resends_same_key": sum(n - 1 for n in by_key.values()),
            "max_in_flight": found.get("in_flight", 0),
            "bound": cfg.provider_in_flight,
            "lookups": lookup_figures(h.record.lookups(), h.requests),
        },
        duplicate_effects=figures["duplicate_effects"] + len(found.get("provider_duplicates", {})),
        lost_jobs=lost,
        tenant_peak=found.get("tenant_peak", {}),
        revocations=len(inp.world.revocations),
        withheld=found.get("withheld", 0),
        queue_left=inp.queue_left,
        wedged_clusters_restarted=inp.restarts.get("stalled", []),
        cluster_restarts={k: len(v) for k, v in sorted(inp.restarts.items())},
        outages=_outages(inp, h.jobs),
        chaos_seconds=round(inp.chaos_seconds, 1),
        kill_log=[
            {
                "at": round(k.at, 3),
                "what": k.what,
                "cluster": k.cluster,
                "pid": k.pid,
                "subject": k.subject,
                "seconds": round(k.seconds, 2),
            }
            for k in inp.kills
        ],
    )


def _dispatcher_outage_lines(log_dir: Path) -> tuple[int, int]:
    """How many database outages the dispatcher logs say began, and how many ended."""
    begun = ended = 0
    for path in sorted(log_dir.glob("dispatcher.*.log")):
        text = path.read_text(errors="replace")
        begun += text.count("jobs_dispatcher: database unavailable")
        ended += text.count("jobs_dispatcher: database back after")
    return begun, ended


def _outages(inp: Inputs, jobs: dict) -> list[dict]:
    """Each outage, and when the jobs open as it began had all ended (time to settle)."""
    from tests.chaos.soak_kinds import KINDS as soak

    out = []
    for o in inp.outages:
        if o.began is None or o.ended is None:
            out.append({"what": o.what, "seconds": o.seconds, "settled_seconds": None})
            continue
        caught = [
            j
            for j in jobs.values()
            if _ts(j.created_at) < o.began
            and (j.finished_at is None or _ts(j.finished_at) > o.began)
        ]
        finished = [_ts(j.finished_at) for j in caught if j.finished_at is not None]
        settled = (
            round(max(finished) - o.ended, 1) if finished and len(finished) == len(caught) else None
        )
        out.append(
            {
                "what": o.what,
                "seconds": round(o.ended - o.began, 1),
                "jobs_open_when_it_began": len(caught),
                # the soak's own kinds among them: ticks, chains, parts, joins
                "open_by_soak_kind": dict(Counter(j.kind for j in caught if j.kind in soak)),
                "settled_seconds": settled,
            }
        )
    return out


def _epoch(seconds: float) -> datetime:
    from datetime import UTC

    return datetime.fromtimestamp(seconds, tz=UTC)


def _now() -> float:
    import time

    return time.time()
