"""Test settings: the site's settings with short leases and the test job kinds."""

import os

# The tests run the site with DEBUG on, as the demo does (DEBUG is off unless set); the
# variable also reaches the subprocesses tests start. Tests of production mode set DEBUG=0
# in their subprocess's environment.
os.environ["DEBUG"] = "1"

# Per test database, so suites running side by side do not wipe each other's files.
_suite = os.environ.get("TEST_DATABASE_NAME", "default")
os.environ.setdefault(
    "ARTIFACT_ROOT",
    os.path.join(os.path.dirname(__file__), "..", "var", f"test-artifacts-{_suite}"),
)
# Per pytest-xdist worker too (gw0, gw1, ...), as pytest-django gives each its own test
# database. Workers inherit the controller's ARTIFACT_ROOT; the suffix is added once, so
# the processes a worker starts (they inherit both variables) keep its folder.
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker and os.environ.get("TEST_ARTIFACTS_WORKER") != _worker:
    os.environ["ARTIFACT_ROOT"] = f"{os.environ['ARTIFACT_ROOT']}-{_worker}"
    os.environ["TEST_ARTIFACTS_WORKER"] = _worker

from permits.settings import *  # noqa: E402, F403
from permits.settings import INSTALLED_APPS, Q_CLUSTER, STORAGES  # noqa: E402

INSTALLED_APPS = [*INSTALLED_APPS, "tests.testapp"]

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

# Pages render without collectstatic (pytest-django turns DEBUG off, and the manifest
# storage would then need a manifest); whitenoise serves from the source folders.
# tests/e2e/test_production.py runs the production storage, with collectstatic.
STORAGES = {
    **STORAGES,
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
}
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = True

# Short leases so crash and takeover tests finish in seconds; the order
# lease < timeout < retry is the one production uses (jobs.checks).
JOBS_LEASE_SECONDS = float(os.environ.get("JOBS_LEASE_SECONDS", "2"))
JOBS_BACKOFF_FLOOR_SECONDS = 0.2
JOBS_BACKOFF_BASE_SECONDS = 0.2
JOBS_BACKOFF_CAP_SECONDS = 2.0
JOBS_EFFECT_LEASE_SECONDS = float(os.environ.get("JOBS_EFFECT_LEASE_SECONDS", "2"))
JOBS_EFFECT_MAX_ATTEMPTS = int(os.environ.get("JOBS_EFFECT_MAX_ATTEMPTS", "8"))
JOBS_TENANT_DEFER_SECONDS = 0.2
# The fair claim is the default (docs/app/fairness.md); said here too so that the suite
# keeps running it whatever the default; the tests of the due order across tenants turn it
# off themselves.
JOBS_FAIR_SHARE = True
# django.tasks through the engine (jobs.backends); "once" gives a task a single attempt.
TASKS = {
    "default": {"BACKEND": "jobs.backends.JobsBackend"},
    "once": {"BACKEND": "jobs.backends.JobsBackend", "OPTIONS": {"MAX_ATTEMPTS": 1}},
}
Q_CLUSTER = {
    **Q_CLUSTER,
    "workers": int(os.environ.get("TEST_Q_WORKERS", "1")),
    # An e2e test whose work must not outlive its lease on a loaded machine raises all
    # three together (lease < timeout < retry).
    "timeout": int(os.environ.get("TEST_Q_TIMEOUT", "5")),
    "retry": int(os.environ.get("TEST_Q_RETRY", "7")),
    "poll": 0.1,
}

# Flow control and the circuit breaker: e2e tests set these for their subprocesses.
for _name, _type in (
    ("JOBS_FLOW_CACHE_SECONDS", float),
    ("JOBS_CIRCUIT_FAILURES", int),
    ("JOBS_CIRCUIT_PROBE_SECONDS", float),
    ("JOBS_CIRCUIT_PROBE_CAP_SECONDS", float),
    ("JOBS_PROVIDER_SLOT_WAIT_SECONDS", float),
    ("JOBS_FOLLOW_ON_SECONDS", float),
):
    if os.environ.get(_name):
        globals()[_name] = _type(os.environ[_name])

# Several suites may share one server (developers, helpers, CI): let each pick its test database.
if os.environ.get("TEST_DATABASE_NAME"):
    DATABASES["default"].setdefault("TEST", {})["NAME"] = os.environ["TEST_DATABASE_NAME"]  # noqa: F405

# Outages (database, artifact storage) wait instead of dying: short caps for the tests.
JOBS_OUTAGE_BACKOFF_CAP_SECONDS = float(os.environ.get("JOBS_OUTAGE_BACKOFF_CAP_SECONDS", "2"))
