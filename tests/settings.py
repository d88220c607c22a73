"""Test settings: the site's settings with short leases and the test job kinds."""

import os

os.environ.setdefault(
    "ARTIFACT_ROOT", os.path.join(os.path.dirname(__file__), "..", "var", "test-artifacts")
)

from permits.settings import *  # noqa: F403
from permits.settings import INSTALLED_APPS, Q_CLUSTER

INSTALLED_APPS = [*INSTALLED_APPS, "tests.testapp"]

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

# Short leases so crash and takeover tests finish in seconds; the order
# lease < timeout < retry is the one production uses (jobs.checks).
JOBS_LEASE_SECONDS = float(os.environ.get("JOBS_LEASE_SECONDS", "2"))
JOBS_BACKOFF_FLOOR_SECONDS = 0.2
JOBS_BACKOFF_BASE_SECONDS = 0.2
JOBS_BACKOFF_CAP_SECONDS = 2.0
JOBS_EFFECT_LEASE_SECONDS = 2.0
JOBS_TENANT_DEFER_SECONDS = 0.2
Q_CLUSTER = {**Q_CLUSTER, "workers": 1, "timeout": 5, "retry": 7, "poll": 0.1}
