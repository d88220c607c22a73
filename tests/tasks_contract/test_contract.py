"""Django's own ``django.tasks`` tests, adapted to ``JobsBackend``, pass on Django 6.x.

Builds (once; cached under ``var/tasks-contract/`` by a hash of ``requirements.txt``, the
app's build file and the Python version) a Python 3.12 virtualenv with Django 6.x,
installs the app from ``packaging/django-jobs-ledger`` (a copy of today's tree, not
editable), then runs
``contract_tasks.py`` and ``contract_immediate_backend.py`` with Django's test runner and
a real qcluster and dispatcher on a scratch PostgreSQL database. Every test passes except
the refusals, each skipped with its reason and listed in docs/app/tasks.md.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import secrets
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from jobs.testing import scratchdb

pytestmark = [pytest.mark.drill, pytest.mark.e2e]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CACHE = ROOT / "var" / "tasks-contract"
# pip's own download cache: a fresh clone (CI) reuses what earlier runs downloaded.
PIP_CACHE = Path(os.environ.get("PIP_CACHE_DIR") or Path.home() / ".cache" / "pip")
API_DOC = ROOT / "docs" / "app" / "tasks.md"
APP_BUILD = "packaging/django-jobs-ledger/pyproject.toml"
RESULT = re.compile(r"^(test\w+) \(([\w.]+)\)[^\n]*? \.\.\. (ok|skipped '.*'|FAIL|ERROR)$", re.M)
SUMMARY = re.compile(r"^Ran (\d+) tests? in [\d.]+s\n\n(OK|FAILED)(?: \((.*)\))?$", re.M)


def python312() -> str:
    root = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    found = sorted(glob.glob(f"{root}/versions/3.12.*/bin/python3.12"))
    exe = found[-1] if found else shutil.which("python3.12")
    if not exe:
        pytest.fail("Python 3.12 is needed for Django 6 (pyenv install 3.12)")
    return exe


def _run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, **kwargs)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def contract_venv(python: str) -> Path:
    """The cached virtualenv for these requirements on this Python (built when missing)."""
    version = _run([python, "-c", "import sys; print(sys.version)"]).stdout
    # The app is installed into it on every run (--no-deps): its dependencies count too.
    needs = (HERE / "requirements.txt").read_text() + (ROOT / APP_BUILD).read_text()
    key = hashlib.sha256((needs + version).encode())
    venv = CACHE / f"venv-{key.hexdigest()[:12]}"
    stamp = venv / ".complete"
    if not stamp.exists():
        shutil.rmtree(venv, ignore_errors=True)
        _run([python, "-m", "venv", venv])
        env = {**os.environ, "PIP_CACHE_DIR": str(PIP_CACHE), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        _run(
            [venv / "bin/python", "-m", "pip", "install", "-q", "-r", HERE / "requirements.txt"],
            env=env,
        )
        stamp.touch()
    return venv


def install_app(venv: Path, app_root: Path, scratch: Path) -> None:
    """Install ``jobs`` from ``app_root``'s packaging folder (a clean copy: no build/ left)."""
    src = scratch / "src"
    shutil.copytree(app_root / "jobs", src / "jobs", ignore=shutil.ignore_patterns("__pycache__"))
    pkg = src / "packaging" / "django-jobs-ledger"
    shutil.copytree(app_root / "packaging" / "django-jobs-ledger", pkg)
    _run(
        [
            venv / "bin/python",
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--force-reinstall",
            pkg,
        ],
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )


def run_contract(
    app_root: Path, scratch: Path, suite: Path = HERE
) -> tuple[subprocess.CompletedProcess, dict]:
    """Run the adapted tests against the app in ``app_root``; (process, outcome by test)."""
    venv = contract_venv(python312())
    install_app(venv, app_root, scratch)
    work = scratch / "work"
    shutil.copytree(suite, work / "tasks_contract", ignore=shutil.ignore_patterns("__pycache__"))
    server = scratchdb.server_url(purpose="the django.tasks contract tests")
    parts = urlsplit(server)
    name = f"contract_{secrets.token_hex(5)}"
    env = {
        "PATH": f"{venv}/bin:/usr/local/bin:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "DJANGO_SETTINGS_MODULE": "tasks_contract.settings",
        "CONTRACT_DIR": str(work),
        "CONTRACT_DB_NAME": name,
        "PGHOST": parts.hostname or "127.0.0.1",
        "PGPORT": str(parts.port or 5432),
        "PGUSER": parts.username or "root",
        "PGPASSWORD": parts.password or "",
        "PYTHONUNBUFFERED": "1",
    }
    try:
        done = subprocess.run(
            [
                venv / "bin/python",
                "-m",
                "django",
                "test",
                "tasks_contract",
                "-p",
                "contract_*.py",
                "-v",
                "2",
                "--noinput",
            ],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
    finally:
        scratchdb.drop(server, name)
    outcomes = {
        f"{cls.split('.')[-2]}.{test}": status for test, cls, status in RESULT.findall(done.stderr)
    }
    return done, outcomes


def summary(stderr: str) -> dict[str, int]:
    """``{"ran": 55, "skipped": 4, "failures": 0, "errors": 0}`` from the runner's last lines."""
    [(ran, _, counts)] = SUMMARY.findall(stderr)
    found = {"ran": int(ran), "skipped": 0, "failures": 0, "errors": 0}
    for part in filter(None, counts.split(", ")):
        name, value = part.split("=")
        found[name] = int(value)
    return found


def test_tasks_contract__djangos_tests_pass_against_jobs_backend(tmp_path):
    done, outcomes = run_contract(ROOT, tmp_path)
    counts = summary(done.stderr)
    passed = counts["ran"] - counts["skipped"] - counts["failures"] - counts["errors"]
    print(f"tasks contract: {counts} -> {passed} passed")
    assert done.returncode == 0, done.stderr[-6000:]
    assert (counts["failures"], counts["errors"]) == (0, 0), counts
    assert counts["ran"] >= 55, counts  # every adapted test ran
    skipped = {t: s for t, s in outcomes.items() if s.startswith("skipped")}
    assert len(skipped) == counts["skipped"], skipped
    documented = API_DOC.read_text()
    for test, status in skipped.items():
        assert status.startswith("skipped 'refused: "), (test, status)
        assert test.split(".", 1)[1] in documented, f"{test} is refused but not in {API_DOC}"
