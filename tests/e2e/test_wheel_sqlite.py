"""The app's wheel without any PostgreSQL driver: a project on SQLite runs a job.

Issue 18's driver promise, as a user meets it: ``pip install`` the wheel with no extra
(so no psycopg), a fresh project on SQLite, ``jobs.tasks`` importable, ``check
--database default`` naming the ORM path, and a real ``qcluster`` that claims, stores
and publishes a job. Nothing here needs PostgreSQL.
"""

from __future__ import annotations

import os
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
    wheel,
)

pytestmark = [pytest.mark.drill, pytest.mark.wheel, pytest.mark.slow]

SETTINGS = """
from pathlib import Path
BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = "wheel-sqlite-test-only"
DEBUG = True
ALLOWED_HOSTS = ["localhost"]
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", "django_q", "jobs",
                  "shop"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3",
                         "NAME": BASE_DIR / "db.sqlite3",
                         "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 20,
                                     "init_command": "PRAGMA journal_mode=WAL;"}}}
USE_TZ = True
import jobs  # noqa: E402
Q_CLUSTER = jobs.q_cluster(DATABASES, name="shop", workers=1, timeout=30, retry=45, poll=0.2)
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
    ctx.store_artifact(b"receipt\\n", content_type="text/plain", extension="txt")
    return [jobs.EffectSpec("receipt-ready", "inapp", ctx.params["user_id"])]
"""

REQUEST = """
import jobs
from django.contrib.auth.models import User
user = User.objects.create_user("bea")
handle = jobs.request("shop.receipt", ("shop.order", 1), params={"user_id": user.pk})
print("JOB", handle.id)
"""

STATE = """
import sys
import jobs.tasks
from jobs.models import Artifact, Job, Notice
job = Job.objects.get()
print("STATE", job.state, Artifact.objects.count(), Notice.objects.count(),
      "psycopg" in sys.modules)
"""


def test_wheel_without_psycopg__sqlite_project_runs_a_job_in_a_real_qcluster(
    wheel,  # noqa: F811 - the fixture imported above
    tmp_path,
):
    python = _python("3.11")
    venv, project = tmp_path / "venv", tmp_path / "project"
    _run([python, "-m", "venv", venv], cwd=tmp_path, env=os.environ)
    env = {
        "PATH": f"{venv}/bin:/usr/local/bin:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "VIRTUAL_ENV": str(venv),
        "PIP_CACHE_DIR": str(PIP_CACHE),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PYTHONUNBUFFERED": "1",
        "DJANGO_SETTINGS_MODULE": "shopsite.settings",
    }
    _run(["pip", "install", "--quiet", str(wheel)], cwd=tmp_path, env=env)
    no_driver = subprocess.run(
        [venv / "bin" / "python", "-c", "import psycopg"], capture_output=True, env=env
    )
    assert no_driver.returncode != 0, "the wheel without extras must not bring psycopg"

    (project / "shopsite").mkdir(parents=True)
    (project / "shopsite" / "__init__.py").write_text("")
    (project / "shopsite" / "settings.py").write_text(textwrap.dedent(SETTINGS))
    (project / "shop").mkdir()
    (project / "shop" / "__init__.py").write_text("")
    (project / "shop" / "jobkinds.py").write_text(textwrap.dedent(KINDS))
    (project / "manage.py").write_text(
        "import sys\nfrom django.core.management import execute_from_command_line\n"
        "execute_from_command_line(sys.argv)\n"
    )

    def manage(*args: str) -> str:
        return _run(["python", "manage.py", *args], cwd=project, env=env)

    manage("migrate", "-v0")
    checked = subprocess.run(
        ["python", "manage.py", "check", "--database", "default"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 0, checked.stderr
    assert "jobs.I001" in checked.stdout + checked.stderr
    assert "sqlite, not PostgreSQL: the ORM path" in checked.stdout + checked.stderr
    assert "jobs.W015" not in checked.stdout + checked.stderr  # IMMEDIATE and WAL: no warning
    assert "JOB " in manage("shell", "-c", REQUEST)

    procs = Processes(env, tmp_path, command=(str(venv / "bin" / "python"),), cwd=project)
    try:
        procs.start("qcluster", "manage.py", "qcluster")
        deadline = time.monotonic() + 120
        state = ""
        while time.monotonic() < deadline:
            state = manage("shell", "-c", STATE).split("STATE ", 1)[1].strip()
            if state.startswith("succeeded"):
                break
            time.sleep(1)
        procs.check_alive()
    finally:
        procs.stop_all()
    assert state == "succeeded 1 1 False", f"job state, artifacts, notices, psycopg: {state}"
    assert len(list(Path(project / "artifacts").rglob("*.txt"))) == 1
