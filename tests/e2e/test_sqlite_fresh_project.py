"""SQLite that does not lock the caller: a fresh project, Django's default SQLite settings.

``django-admin startproject`` writes Django's default ``DATABASES`` (SQLite, no options).
On those, concurrent ``jobs.request()`` calls can fail with ``OperationalError: database
is locked`` (a burst of 60 enqueues did, in a fresh project): a deferred transaction
takes the write lock at its first write, and when two writers meet SQLite cannot make one
wait. Here, with the app's sdist installed alone in a fresh virtualenv:

- on the defaults, ``manage.py check`` warns ``jobs.W015``, naming the options to add,
  and ``manage.py jobs_worker`` refuses to start with the same words;
- with the snippet of ``docs/app/deployment.md`` (read from that page, so the page and
  the test cannot drift) the check is silent, and 200 requests from 4 threads while a
  supervised worker runs are all answered, none ``database is locked``; every job then
  succeeds and no attempt recorded a lock error.

"""

from __future__ import annotations

import json
import os
import re
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from jobs.testing.processes import Processes
from tests.e2e.test_wheel import (  # noqa: F401 (fixtures)
    PIP_CACHE,
    _python,
    _run,
    clone,
    dists,
    sdist,
)

pytestmark = [pytest.mark.drill, pytest.mark.e2e, pytest.mark.wheel, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENT = ROOT / "docs" / "app" / "deployment.md"
THREADS, PER_THREAD = 4, 50

APP_SETTINGS = """
INSTALLED_APPS += ["django_q", "jobs", "shop"]
import jobs  # noqa: E402
Q_CLUSTER = jobs.q_cluster(DATABASES, name="shop", workers=2, timeout=30, retry=45, poll=0.2)
JOBS_LEASE_SECONDS = 20
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    "artifacts": {"BACKEND": "jobs.artifacts.AtomicFileSystemStorage",
                  "OPTIONS": {"location": BASE_DIR / "artifacts"}},
}
"""

KINDS = """
import jobs

@jobs.kind("shop.receipt")
def receipt(ctx):
    ctx.check_owner()
    ctx.store_artifact(f"receipt {ctx.job.subject_id}\\n".encode(),
                       content_type="text/plain", extension="txt")
"""

BURST = f"""
import collections, json, threading
import jobs
from django.db import OperationalError, connection

ok, errors, lock = [], collections.Counter(), threading.Lock()
start = threading.Barrier({THREADS})

def burst(t):
    start.wait()
    try:
        for i in range({PER_THREAD}):
            try:
                handle = jobs.request("shop.receipt", ("shop.order", t * 1000 + i))
            except OperationalError as exc:
                with lock:
                    errors[str(exc)] += 1
            else:
                with lock:
                    ok.append(handle.id)
    finally:
        connection.close()

threads = [threading.Thread(target=burst, args=(t,)) for t in range({THREADS})]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("BURST " + json.dumps({{"ok": len(set(ok)), "errors": dict(errors)}}))
"""

STATE = """
import json
from django.db.models import Count
from jobs.models import Attempt, Job
print("STATE " + json.dumps({
    "jobs": dict(Job.objects.values_list("state").annotate(n=Count("id"))),
    "locked_attempts": Attempt.objects.filter(error_message__icontains="locked").count(),
}))
"""


def snippet() -> str:
    """The SQLite snippet as docs/app/deployment.md prints it."""
    section = DEPLOYMENT.read_text().split("## SQLite (one machine)", 1)[1].split("\n## ", 1)[0]
    [code] = re.findall(r"```python\n(.*?)```", section, re.S)
    assert "transaction_mode" in code and "journal_mode=WAL" in code, code
    return code


def test_sqlite_defaults_warn_and_the_documented_snippet_takes_a_burst_without_locks(
    sdist,  # noqa: F811 - the fixture imported above
    tmp_path,
):
    python = _python("3.11")
    venv = tmp_path / "venv"
    _run([python, "-m", "venv", venv], cwd=tmp_path, env=os.environ)
    env = {
        "PATH": f"{venv}/bin:/usr/local/bin:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "VIRTUAL_ENV": str(venv),
        "PIP_CACHE_DIR": str(PIP_CACHE),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PYTHONUNBUFFERED": "1",
    }
    _run(["pip", "install", "--quiet", str(sdist), "Django>=5.2,<5.3"], cwd=tmp_path, env=env)
    figures = {}

    def project(name: str, extra: str) -> Path:
        path = tmp_path / name
        path.mkdir()
        _run(["django-admin", "startproject", "shopsite", "."], cwd=path, env=env)
        (path / "shop").mkdir()
        (path / "shop" / "__init__.py").write_text("")
        (path / "shop" / "jobkinds.py").write_text(textwrap.dedent(KINDS))
        settings = path / "shopsite" / "settings.py"
        assert "'ENGINE': 'django.db.backends.sqlite3'" in settings.read_text()
        settings.write_text(settings.read_text() + APP_SETTINGS + extra)
        return path

    def manage(path: Path, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["python", "manage.py", *args],
            cwd=path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    def run_burst(path: Path) -> dict:
        assert manage(path, "migrate", "-v0").returncode == 0
        procs = Processes(env, path, command=(str(venv / "bin" / "python"),), cwd=path)
        try:
            procs.start("worker", "manage.py", "jobs_worker")
            time.sleep(3)  # the worker is up and polling: the burst meets it
            done = manage(path, "shell", "-c", BURST)
            assert done.returncode == 0, done.stderr[-3000:]
            burst = json.loads(done.stdout.split("BURST ", 1)[1])
            deadline, state = time.monotonic() + 240, {}
            while time.monotonic() < deadline:
                out = manage(path, "shell", "-c", STATE)
                state = json.loads(out.stdout.split("STATE ", 1)[1])
                if state["jobs"].get("succeeded", 0) >= burst["ok"]:
                    break
                time.sleep(2)
            procs.check_alive()
        finally:
            procs.stop_all()
        return {**burst, **state}

    # Django's defaults: the check names what to add.
    defaults = project("defaults", "")
    checked = manage(defaults, "check")
    assert checked.returncode == 0, checked.stderr  # a warning, not an error
    assert "jobs.W015" in checked.stderr, checked.stderr
    assert "transaction_mode" in checked.stderr and "journal_mode=WAL" in checked.stderr
    # The worker refuses to start there, with the settings to paste: no enqueue meets a
    # worker on a database that makes writers fail instead of wait.
    assert manage(defaults, "migrate", "-v0").returncode == 0
    refused = manage(defaults, "jobs_worker")
    assert refused.returncode != 0, refused.stdout[-2000:]
    assert "refusing to start" in refused.stderr and "transaction_mode" in refused.stderr
    assert "journal_mode=WAL" in refused.stderr, refused.stderr[-2000:]
    figures["defaults"] = "jobs_worker refused: " + refused.stderr.strip().splitlines()[-1][:200]

    # With the documented snippet: silent, and nothing is locked.
    safe = project("snippet", "\n" + snippet())
    checked = manage(safe, "check")
    assert checked.returncode == 0 and "jobs.W015" not in checked.stderr, checked.stderr
    figures["snippet"] = seen = run_burst(safe)
    print("sqlite burst " + json.dumps(figures))

    assert seen["errors"] == {}, seen
    assert seen["ok"] == THREADS * PER_THREAD
    assert seen["jobs"] == {"succeeded": THREADS * PER_THREAD}, seen
    assert seen["locked_attempts"] == 0, seen
