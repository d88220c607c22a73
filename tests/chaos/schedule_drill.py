"""The schedule drill: ``python -m tests.chaos.schedule_drill [--minutes 5] [--every 60]``.

Issue 31's promise, with real processes on PostgreSQL: three ``manage.py
jobs_dispatcher`` processes (three hosts) and a periodic kind every minute for five
minutes make exactly five jobs, one per tick, each run once; and with the database
stopped across two ticks, the kind's catch-up policy holds (``catch_up="latest"``: one
job, for the newest missed tick; ``catch_up="all"``: one per missed tick).

1. A scratch PostgreSQL database (``schedule_drill_<random>``, created, migrated,
   dropped at the end) and a scratch folder ``var/schedule-drill/<name>/`` (the
   processes' logs; kept when a check failed or with ``--keep``).
2. Three ``jobs_dispatcher`` processes and one ``jobs_worker`` (it runs and supervises
   a qcluster), all connected through a relay to the database
   (``tests.chaos.dbproxy.DatabaseProxy``). Two periodic kinds are declared in those
   processes only (``child`` below): ``drill.tick_latest`` (``catch_up="latest"``) and
   ``drill.tick_all`` (``catch_up="all"``), both every ``--every`` seconds. At 60 s the
   schedule is the cron ``* * * * *`` in UTC, what an operator writes for "every minute",
   so the full-scale run goes through the cron parser and its walk over wall times;
   another period is an interval (``timedelta``, a cron cannot say "every 3 s"). Both
   put their ticks on the same instants (whole UTC minutes at 60 s).
3. Healthy: ``--minutes`` ticks after every dispatcher sweeps. Per kind, the jobs whose
   tick lies in that window must be exactly one per tick, each run once (one Attempt
   row with number > 0), and each tick created by one dispatcher (its log's
   ``schedule <kind>: created tick(s)`` line).
4. Outage: once the newest tick's jobs exist, the relay goes down (new connections
   refused, open ones cut: a stopped server) until halfway into the period after
   ``--outage-ticks`` more ticks, then comes back. Then the next tick is awaited too (the
   schedule goes on, and no late job for an older missed tick can come after it). The
   ``latest`` kind must have one job for the newest missed tick and none for the older
   ones; the ``all`` kind one per missed tick; each run once, one creator each.

The processes observe nothing of this drill; it reads the database on its own direct
connection. Exit 0 when every check holds, 1 when one failed (named in the last line),
2 when the drill could not run (no PostgreSQL, a setup failure, or an outage that did
not span the planned ticks on a machine too slow to keep the plan).

``tests/e2e/test_schedule_hosts.py`` runs the same phases at a 3 s period.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve()
SETTINGS_MODULE = "tests.settings"
KINDS = {"drill.tick_latest": "latest", "drill.tick_all": "all"}
EVERY_VARIABLE = "SCHEDULE_DRILL_EVERY"  # the children's period, in seconds
DISPATCHERS = ("dispatcher-1", "dispatcher-2", "dispatcher-3")
WORKER = "jobs_worker"


class CouldNotRun(Exception):
    """The drill could not run here, or not as planned; the message says why (exit 2)."""


# --- the periodic kinds, declared in the child processes --------------------------------


def spec(every: int) -> str | timedelta:
    """The kinds' schedule: ``* * * * *`` at 60 s (cron, UTC), an interval otherwise."""
    return "* * * * *" if every == 60 else timedelta(seconds=every)


def schedules(every: int) -> dict:
    """The drill kinds' ``Schedule`` objects, as the children declare them."""
    from jobs.schedules import make_schedule

    return {
        kind: make_schedule(kind, spec(every), tz="UTC", catch_up=policy)
        for kind, policy in KINDS.items()
    }


def tick_handler(ctx) -> list:
    """A periodic job with nothing to publish: its ledger of attempts is what is counted."""
    ctx.check_owner()
    return []


def child() -> None:
    """A child process: declare the drill's kinds, then run ``manage.py <argv>``.

    Started as ``python tests/chaos/schedule_drill.py <command> ...``: jobs_worker starts
    its qcluster the way it was started itself (``jobs.supervisor.qcluster_command``:
    this script, ``qcluster``), so the cluster that runs the ticks declares them too.
    """
    here = str(SCRIPT.parent)
    sys.path[:] = [str(ROOT) if p == here else p for p in sys.path]
    import django

    django.setup()
    from django.core.management import call_command

    from jobs.registry import register_kind

    every = int(os.environ[EVERY_VARIABLE])
    for kind, policy in KINDS.items():
        register_kind(kind, tick_handler, schedule=spec(every), schedule_tz="UTC", catch_up=policy)
    call_command(*sys.argv[1:])


def child_processes(env: dict[str, str], log_dir: Path, every: int):
    """Processes that run ``manage.py`` commands with the drill's kinds declared."""
    from jobs.testing.processes import Processes

    return Processes(
        {**env, EVERY_VARIABLE: str(every)},
        log_dir,
        command=(sys.executable, str(SCRIPT)),
        cwd=ROOT,
    )


def start_hosts(children, every: int) -> list:
    """Three dispatchers and one jobs_worker. The dispatchers sweep every 0.3 s and try a
    lost database at most every ``every / 6`` s (5 s, the default, at a minute): a
    dispatcher back within that after the outage fires before the next tick."""
    backoff = f"{min(5.0, every / 6):g}"
    started = [
        children.start(name, "jobs_dispatcher", "--interval", "0.3", "--max-backoff", backoff)
        for name in DISPATCHERS
    ]
    started.append(children.start(WORKER, "jobs_worker"))
    return started


# --- observing -------------------------------------------------------------------------


class ProcessDied(Exception):
    """A drill process exited on its own (a dispatcher must outlive the database)."""


def alive(children) -> None:
    for proc in children.procs:
        if not proc.killed and proc.popen.poll() is not None:
            raise ProcessDied(f"{proc.name} exited with {proc.popen.returncode}")


def wait_for(children, check, *, timeout: float, interval: float = 0.1) -> bool:
    """Poll ``check`` until it is true (True) or ``timeout`` passes (False)."""
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return True
        alive(children)
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def sleep_until(children, instant: datetime, offset: float) -> None:
    """Sleep until the database server's clock shows ``instant``."""
    while True:
        left = instant.timestamp() - (time.time() + offset)
        if left <= 0:
            return
        alive(children)
        time.sleep(min(left, 0.2))


def clock_offset() -> float:
    """Seconds the database server's clock is ahead of this host's."""
    from jobs.schedules import server_now

    return server_now().timestamp() - time.time()


def sweeping(children) -> bool:
    return all("jobs_dispatcher: sweeping every" in _log(children, name) for name in DISPATCHERS)


def _log(children, name: str) -> str:
    path = Path(children.log_dir) / f"{name}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def created_by(children, kind: str) -> dict[str, list[str]]:
    """Per dispatcher, the ticks of ``kind`` its own log says it created."""
    line = re.compile(rf"schedule {re.escape(kind)}: created tick\(s\) (.+)$", re.MULTILINE)
    found = {}
    for name in DISPATCHERS:
        shown = line.findall(_log(children, name))
        found[name] = [t for text in shown for t in text.split() if t[:1] == "2"]
    return found


def outage_lines(children, name: str) -> tuple[int, int]:
    """How often a process logged the database's loss and its return."""
    text = _log(children, name)
    return text.count("database unavailable"), len(re.findall(r"database back after", text))


def succeeded(kind: str, ticks: list[str]) -> int:
    from jobs.models import Job

    return Job.objects.filter(kind=kind, subject_id__in=ticks, state=Job.State.SUCCEEDED).count()


def exist(kind: str, ticks: list[str]) -> bool:
    from jobs.models import Job

    return Job.objects.filter(kind=kind, subject_id__in=ticks).count() == len(ticks)


# --- the verdict ------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class Tally:
    """One kind's ticks in one phase: expected, created, run, created by whom."""

    phase: str
    kind: str
    catch_up: str
    expected: list[str]
    created: list[str]  # subject ids of the kind's jobs in the phase's window
    runs: dict[str, int]  # tick -> Attempt rows with number > 0
    succeeded: list[str]  # ticks whose job succeeded
    creators: dict[str, int]  # tick -> dispatchers whose log says they created it
    absent: list[str] = field(default_factory=list)  # ticks that must have no job

    @property
    def run_once(self) -> int:
        return sum(self.runs.get(t) == 1 for t in self.expected)

    @property
    def one_creator(self) -> int:
        return sum(self.creators.get(t) == 1 for t in self.expected)

    def checks(self) -> list[Check]:
        where = f"{self.phase} {self.kind}"
        extra = sorted(set(self.created) - set(self.expected))
        missing = sorted(set(self.expected) - set(self.created))
        twice = sorted(t for t, n in Counter(self.created).items() if n > 1)
        found = [
            Check(
                f"{where}: one job per expected tick",
                self.created == self.expected,
                f"missing {missing} extra {extra} twice {twice}"
                if missing or extra or twice
                else "",
            ),
            Check(
                f"{where}: each job run once",
                self.run_once == len(self.expected) and set(self.expected) <= set(self.succeeded),
                f"attempts per tick {self.runs}, succeeded {self.succeeded}",
            ),
            Check(
                f"{where}: one creator per tick",
                self.one_creator == len(self.expected),
                f"creators per tick {self.creators}",
            ),
        ]
        if self.absent:
            late = sorted(set(self.absent) & set(self.created))
            found.append(
                Check(
                    f"{where}: no job for the older missed tick(s)",
                    not late,
                    f"jobs for {late}" if late else "",
                )
            )
        return found


def tally(children, phase: str, kind: str, expected: list[str], after: str, upto: str, **extra):
    """The kind's jobs with a tick in (``after``, ``upto``] and what became of them."""
    from jobs.models import Attempt, Job

    jobs = Job.objects.filter(kind=kind, subject_id__gt=after, subject_id__lte=upto)
    created = sorted(jobs.values_list("subject_id", flat=True))
    runs = Counter(
        Attempt.objects.filter(job__in=jobs, number__gt=0).values_list("job__subject_id", flat=True)
    )
    creators = Counter(
        t for ticks in created_by(children, kind).values() for t in ticks if after < t <= upto
    )
    return Tally(
        phase=phase,
        kind=kind,
        catch_up=KINDS[kind],
        expected=expected,
        created=created,
        runs=dict(runs),
        succeeded=sorted(
            jobs.filter(state=Job.State.SUCCEEDED).values_list("subject_id", flat=True)
        ),
        creators=dict(creators),
        **extra,
    )


# --- the phases -------------------------------------------------------------------------


def _ids(ticks: list[datetime]) -> list[str]:
    from jobs.schedules import tick_id

    return [tick_id(t) for t in ticks]


def healthy_phase(children, every: int, ticks: int) -> list[Tally]:
    """``ticks`` ticks after every dispatcher sweeps: one job each, run once, per kind."""
    from jobs.schedules import server_now, tick_id

    schedule = next(iter(schedules(every).values()))
    now = server_now()
    first = schedule.next_after(now)
    window = [first + timedelta(seconds=every * i) for i in range(ticks)]
    ids = _ids(window)
    until = (window[-1] - now).total_seconds() + every + 90
    wait_for(
        children,
        lambda: all(succeeded(kind, ids) == len(ids) for kind in KINDS),
        timeout=until,
        interval=0.5,
    )
    before = tick_id(first - timedelta(seconds=every))
    return [tally(children, "healthy", kind, ids, before, ids[-1]) for kind in KINDS]


@dataclass
class Outage:
    down_at: datetime
    up_at: datetime
    missed: list[str]
    resumed: str  # the first tick after the outage
    catch_up_after: dict[str, float]  # kind -> seconds from up to its first job's creation

    @property
    def seconds(self) -> float:
        return (self.up_at - self.down_at).total_seconds()


def outage_phase(children, proxy, every: int, outage_ticks: int) -> tuple[list[Tally], Outage]:
    """The database away across ``outage_ticks`` ticks, then back: each kind's catch-up."""
    from django.db.models import Min

    from jobs.models import Job
    from jobs.schedules import server_now, tick_id

    schedule = next(iter(schedules(every).values()))
    offset = clock_offset()

    def fired() -> datetime | None:
        """The newest tick, once both kinds' jobs for it exist and the next is not close."""
        now = server_now()
        last = schedule.latest_at(now)
        early = (now - last).total_seconds() <= 0.6 * every
        return last if early and all(exist(k, [tick_id(last)]) for k in KINDS) else None

    seen: list[datetime] = []

    def ready() -> bool:
        tick = fired()
        if tick is not None:
            seen.append(tick)
        return tick is not None

    if not wait_for(children, ready, timeout=3 * every + 60):
        raise CouldNotRun("no tick's jobs appeared early enough in a period to start the outage")
    last = seen[-1]
    proxy.down()
    down_at = server_now()
    up_due = last + timedelta(seconds=every * (outage_ticks + 0.5))
    sleep_until(children, up_due, offset)
    proxy.up()
    up_at = server_now()
    missed = _ids(schedule.ticks(down_at, up_at, limit=1000))
    if len(missed) != outage_ticks:
        raise CouldNotRun(
            f"the database was away {down_at:%H:%M:%S.%f}..{up_at:%H:%M:%S.%f}, across "
            f"{len(missed)} ticks, not {outage_ticks} (the machine too slow for the plan?)"
        )
    resumed = tick_id(schedule.next_after(up_at))
    expected = {
        "drill.tick_latest": [missed[-1], resumed],
        "drill.tick_all": [*missed, resumed],
    }
    until = (schedule.next_after(up_at) - server_now()).total_seconds() + every + 90
    wait_for(
        children,
        lambda: all(succeeded(kind, ids) == len(ids) for kind, ids in expected.items()),
        timeout=until,
        interval=0.5,
    )
    after = {}
    for kind in KINDS:
        first = Job.objects.filter(kind=kind, subject_id__in=missed).aggregate(Min("created_at"))
        if first["created_at__min"] is not None:
            after[kind] = round((first["created_at__min"] - up_at).total_seconds(), 1)
    tallies = [
        tally(
            children,
            "outage",
            kind,
            expected[kind],
            tick_id(last),
            resumed,
            absent=missed[:-1] if KINDS[kind] == "latest" else [],
        )
        for kind in KINDS
    ]
    return tallies, Outage(down_at, up_at, missed, resumed, after)


def all_checks(tallies: list[Tally]) -> list[Check]:
    return [check for t in tallies for check in t.checks()]


def table(tallies: list[Tally]) -> list[str]:
    """Ticks expected, created, run once and with one creator, per phase and kind."""
    head = f"{'phase':8} {'kind':18} {'catch_up':8} {'expected':>8} {'created':>7} "
    head += f"{'run once':>8} {'1 creator':>9}  ticks"
    lines = [head]
    for t in tallies:
        shown = " ".join(x[11:19] for x in t.expected)
        lines.append(
            f"{t.phase:8} {t.kind:18} {t.catch_up:8} {len(t.expected):>8} {len(t.created):>7} "
            f"{t.run_once:>8} {t.one_creator:>9}  {shown}"
        )
    return lines


def creators_per_dispatcher(children) -> dict[str, int]:
    return {
        name: sum(len(created_by(children, kind)[name]) for kind in KINDS) for name in DISPATCHERS
    }


# --- the drill --------------------------------------------------------------------------


def _hms(instant: datetime) -> str:
    return instant.astimezone(UTC).strftime("%H:%M:%S.%f")[:-3] + "Z"


def _say(text: str) -> None:
    print(text, flush=True)


def run(minutes: int, every: int, outage_ticks: int, keep: bool) -> int:
    from jobs.testing import scratchdb
    from tests.chaos.dbproxy import DatabaseProxy

    started = time.monotonic()
    try:
        url = scratchdb.server_url(purpose="the schedule drill")
    except scratchdb.NotPostgres as exc:
        raise CouldNotRun(str(exc)) from None
    name = f"schedule_drill_{secrets.token_hex(5)}"
    work = ROOT / "var" / "schedule-drill" / name
    logs = work / "logs"
    logs.mkdir(parents=True)
    parts = urlsplit_host(url)
    proxy = DatabaseProxy(*parts)
    children = None
    created = False
    verdict = 2
    try:
        scratch = scratchdb.create(url, name)
        created = True
        proxy.start()
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("TEST_DATABASE_NAME", "DJANGO_SETTINGS_MODULE", "PYTEST_XDIST_WORKER")
        }
        env.update(
            DJANGO_SETTINGS_MODULE=SETTINGS_MODULE,
            DATABASE_URL=via_relay(scratch, proxy.port),
            ARTIFACT_ROOT=str(work / "artifacts"),
            PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
            PYTHONUNBUFFERED="1",
            LOG_LEVEL="INFO",
            LOG_FORMAT="plain",  # the creators are read from the dispatchers' plain lines
            Q_LOG_LEVEL="INFO",
        )
        migrate = subprocess.run(
            [sys.executable, str(ROOT / "manage.py"), "migrate", "--noinput", "-v0"],
            cwd=ROOT,
            env={**env, "DATABASE_URL": scratch},
            capture_output=True,
            text=True,
            timeout=300,
        )
        if migrate.returncode:
            raise CouldNotRun(f"migrating {name} failed:\n{migrate.stderr[-3000:]}")
        # This process observes the scratch database on its own direct connection.
        os.environ.update({k: env[k] for k in env if k != "PYTHONPATH"})
        os.environ.update(DATABASE_URL=scratch, LOG_LEVEL="WARNING", Q_LOG_LEVEL="WARNING")
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        import django

        django.setup()

        described = "cron '* * * * *' in UTC" if every == 60 else f"an interval of {every} s"
        _say(
            f"schedule drill {name}: 3 dispatchers + {WORKER} through a relay, kinds "
            f"{', '.join(f'{k} ({p})' for k, p in KINDS.items())} on {described}; "
            f"{minutes} healthy ticks, then the database away across {outage_ticks} ticks; "
            f"logs in {logs}"
        )
        children = child_processes(env, logs, every)
        start_hosts(children, every)
        if not wait_for(children, lambda: sweeping(children), timeout=120, interval=0.3):
            raise CouldNotRun("the three dispatchers did not all sweep within 120 s")
        setup_seconds = time.monotonic() - started
        _say(f"setup {setup_seconds:.0f} s; healthy phase: {minutes} ticks every {every} s")
        checks: list[Check] = []
        tallies = healthy_phase(children, every, minutes)
        checks += all_checks(tallies)
        healthy_seconds = time.monotonic() - started - setup_seconds
        _say(f"healthy phase done after {healthy_seconds:.0f} s; outage phase")
        outage_tallies, outage = outage_phase(children, proxy, every, outage_ticks)
        tallies += outage_tallies
        checks += all_checks(outage_tallies)
        alive(children)
        checks.append(Check("no process exited", True))

        _say("")
        for line in table(tallies):
            _say(line)
        _say("")
        _say(
            f"outage: down {_hms(outage.down_at)}, up {_hms(outage.up_at)} "
            f"({outage.seconds:.1f} s); missed ticks {' '.join(outage.missed)}; "
            f"next tick {outage.resumed}"
        )
        _say(
            "catch-up: first missed-tick job created "
            + ", ".join(f"{k} {s:+.1f} s" for k, s in outage.catch_up_after.items())
            + " after the database came back"
        )
        _say(f"relay: {proxy.accepted} connections accepted, {proxy.cut} cut when it went down")
        _say(
            "creators per dispatcher (ticks created, both kinds, both phases): "
            + ", ".join(f"{n} {c}" for n, c in creators_per_dispatcher(children).items())
        )
        _say(
            "outage log lines (unavailable/back): "
            + ", ".join(
                f"{n} {u}/{b}"
                for n, (u, b) in ((n, outage_lines(children, n)) for n in (*DISPATCHERS, WORKER))
            )
        )
        _say(
            f"wall time {time.monotonic() - started:.0f} s (setup {setup_seconds:.0f} s, "
            f"healthy {healthy_seconds:.0f} s, outage phase "
            f"{time.monotonic() - started - setup_seconds - healthy_seconds:.0f} s)"
        )
        failed = [c for c in checks if not c.ok]
        for check in failed:
            _say(f"FAILED {check.name}: {check.detail}")
        if failed:
            _say(
                f"schedule drill: FAIL ({len(failed)} of {len(checks)} checks): "
                + "; ".join(c.name for c in failed)
            )
            verdict = 1
        else:
            _say(f"schedule drill: PASS (all {len(checks)} checks)")
            verdict = 0
        return verdict
    except ProcessDied as exc:
        _say(f"schedule drill: FAIL (a process died): {exc}")
        if children is not None:
            _say(children.logs(tail=40))
        verdict = 1
        return verdict
    finally:
        if children is not None:
            children.stop_all()
        proxy.close()
        with contextlib.suppress(Exception):
            from django.db import connections

            connections.close_all()
        if created:
            with contextlib.suppress(Exception):
                scratchdb.drop(url, name)
        if keep or verdict != 0:
            _say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def urlsplit_host(url: str) -> tuple[str, int]:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 5432


def via_relay(url: str, port: int) -> str:
    """``url`` with its server at 127.0.0.1:``port`` (the relay in front of it)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@127.0.0.1:{port}" if userinfo else f"127.0.0.1:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.chaos.schedule_drill",
        description="Three dispatchers, two periodic kinds, a database outage (PostgreSQL).",
    )
    p.add_argument("--minutes", type=int, default=5, help="healthy ticks to count (default 5)")
    p.add_argument("--every", type=int, default=60, help="seconds between ticks (default 60)")
    p.add_argument(
        "--outage-ticks", type=int, default=2, help="ticks the database is away for (default 2)"
    )
    p.add_argument("--keep", action="store_true", help="keep the scratch folder")
    a = p.parse_args(argv)
    if a.minutes < 1 or a.every < 2 or a.outage_ticks < 1:
        p.error("--minutes and --outage-ticks at least 1, --every at least 2")
    # A SIGTERM (a CI timeout, a parent giving up) still stops the processes, drops the database.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run(a.minutes, a.every, a.outage_ticks, a.keep)
    except CouldNotRun as exc:
        print(f"schedule drill: could not run: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError, ImportError) as exc:  # setup failed: no verdict
        print(f"schedule drill: could not run: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):
        child()  # a drill process: python tests/chaos/schedule_drill.py <command> ...
    else:
        sys.exit(main())
