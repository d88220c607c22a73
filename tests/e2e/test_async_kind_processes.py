"""An ``async def`` kind under real workers, on PostgreSQL and on SQLite (issue 45).

A fresh project (``django-admin startproject``, this checkout's app, no ``permits``) whose
one app declares an ``async def`` kind with a fenced read (``ctx.aread``), a durable step
(``ctx.astep``) and an HTTP effect (the ``webhook`` provider, sent to the stand-in notice
provider on loopback, whose own record is the witness of what arrived). Its
``manage.py jobs_worker`` (the supervised django-q2 ``qcluster``, two worker processes)
runs four jobs of it:

- ``calm``: runs once; one artifact, one send;
- ``hang``: its worker process is SIGKILLed while the handler awaits; the job is claimed
  again once its lease has expired and ends with one artifact and one send, the step's
  function run once (its output reused);
- ``slow``: its first attempt awaits past the kind's timeout and is stopped at that
  await (the attempt reads ``timeout``); the retry succeeds with one send;
- ``cancel``: cancelled (``jobs.cancel``) while it awaits; it stops at an await, ends
  ``cancelled``, publishes nothing and sends nothing.

PostgreSQL: a scratch database on ``DATABASE_URL``'s server, the claiming broker of
docs/app/deployment.md (the jobs table is the queue). SQLite: the one recipe of
docs/app/deployment.md and the claiming broker over the ORM
(``jobs.claiming_orm.OrmClaimingBroker``). On both, no job or effect ever has a django-q2
message (read at every look at the state).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from jobs.testing import scratchdb
from jobs.testing.fakeprovider import start_in_thread
from jobs.testing.processes import Processes

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENT = ROOT / "docs" / "app" / "deployment.md"
TOKEN = "async-e2e-token"
LEASE_SECONDS = 8  # a killed worker's job is claimable again 8 s after its last heartbeat
KIND_TIMEOUT = 4  # shop.async_slow's attempts; its first awaits 60 s

SETTINGS = """
INSTALLED_APPS += ["django_q", "jobs", "shop"]
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    "artifacts": {"BACKEND": "jobs.artifacts.AtomicFileSystemStorage",
                  "OPTIONS": {"location": BASE_DIR / "artifacts"}},
}
JOBS_LEASE_SECONDS = %(lease)d
NOTICE_PROVIDER_URL = %(provider)r
NOTICE_PROVIDER_TOKEN = %(token)r
Q_CLUSTER = {"name": "shop", "orm": "default", "workers": 2, "timeout": 30, "retry": 45,
             "poll": 0.2}
"""
POSTGRES_SETTINGS = """
DATABASES = {"default": {"ENGINE": "django.db.backends.postgresql", "NAME": %(name)r,
                         "HOST": %(host)r, "PORT": %(port)r, "USER": %(user)r,
                         "PASSWORD": %(password)r, "CONN_MAX_AGE": 600,
                         "CONN_HEALTH_CHECKS": True}}
Q_CLUSTER.update({"broker_class": "jobs.claiming.ClaimingBroker", "max_attempts": 0,
                  "save_limit": -1, "ack_failures": False, "catch_up": False})
"""
SQLITE_SETTINGS = """
Q_CLUSTER.update({"broker_class": "jobs.claiming_orm.OrmClaimingBroker", "max_attempts": 0,
                  "save_limit": -1, "ack_failures": False, "catch_up": False})
"""

KINDS = """
import asyncio
import os
from pathlib import Path

from django.contrib.auth import get_user_model

import jobs

MARKS = Path(__file__).resolve().parent.parent / "marks.txt"


def mark(line):
    with MARKS.open("a") as marks:
        marks.write(line + "\\n")


async def receipt(ctx: jobs.AsyncJobContext) -> list[jobs.EffectSpec]:
    users = await ctx.aread(get_user_model().objects.filter(pk=ctx.params["user_id"]))
    if not users:
        raise jobs.PayloadInvalid("params.user_id names no user")

    async def count():
        mark(f"step {ctx.job.pk}")
        await asyncio.sleep(0)
        return 7

    total = await ctx.astep("count", count)
    mode, attempt = ctx.params.get("mode"), ctx.job.attempts
    mark(f"run {ctx.job.pk} {attempt} {os.getpid()}")
    if mode == "hang" and attempt == 1:
        await asyncio.sleep(120)  # SIGKILL arrives here
    if mode == "slow" and attempt == 1:
        await asyncio.sleep(60)  # the kind's timeout stops it here
    if mode == "cancel":
        for _ in range(240):  # healthy work, heartbeating; the cancel stops it at an await
            await ctx.aheartbeat()
            await asyncio.sleep(0.5)
    mark(f"publish {ctx.job.pk} {attempt}")
    await ctx.astore_artifact(f"receipt {total}\\n".encode(), content_type="text/plain",
                              extension="txt")
    return [jobs.EffectSpec("receipt-ready", "webhook", str(users[0].pk))]


jobs.kind("shop.async_receipt", max_attempts=3)(receipt)
jobs.kind("shop.async_slow", max_attempts=3, timeout=%(timeout)d)(receipt)
"""

REQUEST = """
import json
import jobs
from django.contrib.auth.models import User
user = User.objects.create_user("bea")
ids = {}
for n, mode in enumerate(("calm", "hang", "slow", "cancel")):
    kind = "shop.async_slow" if mode == "slow" else "shop.async_receipt"
    ids[mode] = jobs.request(kind, ("shop.order", n), params={"user_id": user.pk, "mode": mode}).id
print("IDS " + json.dumps(ids))
"""

STATE = """
import json
from django_q.models import OrmQ
from jobs.models import Artifact, Attempt, Effect, Job
print("MESSAGES %d" % OrmQ.objects.count())
print("STATE " + json.dumps({
    str(job.pk): {
        "state": job.state,
        "attempts": job.attempts,
        "artifacts": Artifact.objects.filter(job=job).count(),
        "effects": sorted(Effect.objects.filter(job=job).values_list("state", flat=True)),
        "effect_ids": sorted(Effect.objects.filter(job=job).values_list("effect_id", flat=True)),
        "outcomes": list(Attempt.objects.filter(job=job).order_by("number").values_list(
            "outcome", "error_code")),
    }
    for job in Job.objects.order_by("pk")
}))
"""


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 120) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(params=["postgres", "sqlite"])
def shop(request, tmp_path):
    """A fresh project on the leg's database, its kinds declared, the stand-in provider
    on loopback: (project, env, provider record, database)."""
    database = request.param
    project = tmp_path / "project"
    project.mkdir()
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "PYTHONUNBUFFERED": "1",
    }
    provider = start_in_thread(tmp_path / "provider.sqlite3", token=TOKEN)
    request.addfinalizer(provider.stop)
    _run([sys.executable, "-m", "django", "startproject", "shop_site", "."], cwd=project, env=env)
    _run([sys.executable, "manage.py", "startapp", "shop"], cwd=project, env=env)
    settings = project / "shop_site" / "settings.py"
    text = settings.read_text() + SETTINGS % {
        "lease": LEASE_SECONDS,
        "provider": provider.url,
        "token": TOKEN,
    }
    if database == "postgres":
        server = scratchdb.server_url(purpose="the async kind's e2e test")
        name = f"async_{secrets.token_hex(5)}"
        scratchdb.create(server, name)
        request.addfinalizer(lambda: scratchdb.drop(server, name))
        parts = urlsplit(server)
        text += POSTGRES_SETTINGS % {
            "name": name,
            "host": parts.hostname or "127.0.0.1",
            "port": str(parts.port or 5432),
            "user": parts.username or "",
            "password": parts.password or "",
        }
    else:
        section = DEPLOYMENT.read_text().split("## SQLite (one machine)", 1)[1]
        [recipe] = re.findall(r"```python\n(.*?)```", section.split("\n## ", 1)[0], re.S)
        text += recipe + SQLITE_SETTINGS
    settings.write_text(text)
    (project / "shop" / "jobkinds.py").write_text(KINDS % {"timeout": KIND_TIMEOUT})
    _run([sys.executable, "manage.py", "migrate", "-v0"], cwd=project, env=env)
    check = _run([sys.executable, "manage.py", "check"], cwd=project, env=env)
    assert "no issues" in check, check
    return project, env, provider.record, database


def test_async_kind__runs_once__killed__timed_out_and_cancelled_at_an_await(shop, tmp_path):
    project, env, record, database = shop

    def manage(*args: str) -> str:
        return _run([sys.executable, "manage.py", *args], cwd=project, env=env)

    messages: list[int] = []

    def state() -> dict:
        out = manage("shell", "-c", STATE)
        messages.append(int(out.split("MESSAGES ", 1)[1].split()[0]))
        return json.loads(out.split("STATE ", 1)[1])

    ids = json.loads(manage("shell", "-c", REQUEST).split("IDS ", 1)[1])
    marks = project / "marks.txt"
    procs = Processes(env, tmp_path, command=(sys.executable,), cwd=project)
    began = time.monotonic()
    killed = cancel_asked = cancel_answer = cancelled_after = None
    seen: dict = {}
    try:
        procs.start("worker", "manage.py", "jobs_worker")
        deadline = began + 180
        while time.monotonic() < deadline:
            runs = marks.read_text().splitlines() if marks.exists() else []
            first = [r for r in runs if r.startswith(f"run {ids['hang']} 1 ")]
            if first and killed is None:
                killed = int(first[0].split()[3])
                time.sleep(0.5)  # inside its asyncio.sleep
                os.kill(killed, signal.SIGKILL)
            if cancel_asked is None and any(r.startswith(f"run {ids['cancel']} 1 ") for r in runs):
                time.sleep(1)  # in its awaits
                cancel_asked = time.monotonic()
                cancel_answer = (
                    manage("shell", "-c", f"import jobs; print(jobs.cancel({ids['cancel']}))")
                    .strip()
                    .splitlines()[-1]
                )  # after Django's shell's "objects imported" line
            seen = state()
            finished = {mode: seen[str(pk)]["state"] for mode, pk in ids.items()}
            if cancel_asked and cancelled_after is None and finished["cancel"] == "cancelled":
                cancelled_after = time.monotonic() - cancel_asked
            if killed and finished == {
                "calm": "succeeded",
                "hang": "succeeded",
                "slow": "succeeded",
                "cancel": "cancelled",
            }:
                effects = [e for row in seen.values() for e in row["effects"]]
                if effects == ["applied"] * 3:
                    break
            time.sleep(1)
        elapsed = time.monotonic() - began
        procs.check_alive()
    finally:
        procs.stop_all()
    runs = marks.read_text().splitlines()
    sends = record.sends_by_effect()
    print(
        f"\n{database}: {elapsed:.1f} s; killed worker {killed}; cancel: {cancel_answer}, "
        f"cancelled {cancelled_after and round(cancelled_after, 1)} s after it was asked"
    )
    for mode, pk in ids.items():
        row = seen[str(pk)]
        sent = sum(len(sends.get(e, [])) for e in row["effect_ids"])
        print(
            f"  {mode:7} job {pk}: {row['state']}, attempts {row['attempts']}, "
            f"artifacts {row['artifacts']}, effects {row['effects']}, "
            f"outcomes {row['outcomes']}, HTTP sends {sent}"
        )
    print(f"  marks: {runs}")
    by_mode = {mode: seen[str(pk)] for mode, pk in ids.items()}

    assert killed is not None, f"the hanging job never started: {runs}"
    assert record.duplicate_effects() == {}
    for mode in ("calm", "hang", "slow"):
        row = by_mode[mode]
        assert row["state"] == "succeeded" and row["artifacts"] == 1, (mode, row)
        assert row["effects"] == ["applied"], (mode, row)
        [effect_id] = row["effect_ids"]
        assert len(sends.get(effect_id, [])) == 1, (mode, sends)  # one HTTP send arrived
        # The step's fn ran once, but for the job killed half a second after it: its quick
        # step waited for the next fenced write (jobs.delivery.steps.RIDE_SECONDS).
        ran = runs.count(f"step {ids[mode]}")
        assert ran == 1 or (mode == "hang" and ran == 2), (mode, runs)
    assert len(record.sends()) == 3
    assert messages and set(messages) == {0}, f"django-q2 messages seen: {messages}"
    calm = by_mode["calm"]
    assert calm["attempts"] == 1 and calm["outcomes"] == [["succeeded", ""]], calm
    hang = by_mode["hang"]
    assert hang["attempts"] >= 2 and hang["outcomes"][-1] == ["succeeded", ""], hang
    assert hang["outcomes"][0][0] != "succeeded", hang  # the killed attempt is recorded
    assert f"publish {ids['hang']} 1" not in runs
    slow = by_mode["slow"]
    assert slow["outcomes"][0] == ["retry", "timeout"], slow  # stopped at its await
    assert f"publish {ids['slow']} 1" not in runs and f"publish {ids['slow']} 2" in runs
    cancel = by_mode["cancel"]
    assert cancel_answer == "requested", cancel_answer
    # Seen within the polling of this loop (a shell process a second): the watcher looks
    # once a second, the handler's next await then raises.
    assert cancelled_after is not None and cancelled_after < 20, cancelled_after
    assert cancel["state"] == "cancelled" and cancel["artifacts"] == 0, cancel
    assert cancel["effects"] == [] and not any(
        r.startswith(f"publish {ids['cancel']}") for r in runs
    )
