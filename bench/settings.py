"""The site's settings pointed at the benchmark databases.

Everything that shapes throughput (``Q_CLUSTER``, persistent connections,
``save_limit``, logging) is the production value from ``permits.settings``;
only the database name, the worker count of a run and the artifact folder move
(and ``CONN_HEALTH_CHECKS`` in the knobs section's runs that measure it). ``bench``
is an installed app here, for the plain same-work tasks' notice table.
"""

from __future__ import annotations

import os

# The benchmarks run on this machine with the demo's settings mode, as they always did
# (DEBUG is off unless set, and then a real SECRET_KEY and ALLOWED_HOSTS are required).
os.environ.setdefault("DEBUG", "1")

from permits.settings import *  # noqa: F403
from permits.settings import DATABASES, INSTALLED_APPS, Q_CLUSTER

# bench.models holds the plain same-work tasks' notice table (no migrations: the bench
# creates it when it prepares its database). The site's own settings never list it.
INSTALLED_APPS = [*INSTALLED_APPS, "bench"]

BENCH_DB = os.environ.get("BENCH_DB", "bench_e2e")
BENCH_LEDGER_DB = os.environ.get("BENCH_LEDGER_DB", "bench_ledger")

# The knobs section runs the workers once with health checks off ("0") to measure them.
if os.environ.get("BENCH_CONN_HEALTH_CHECKS"):
    DATABASES["default"]["CONN_HEALTH_CHECKS"] = os.environ["BENCH_CONN_HEALTH_CHECKS"] != "0"

if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    DATABASES["default"]["NAME"] = BENCH_DB
    # The ledger-scaling tables (bulk-loaded to 1M rows) live apart from the e2e runs.
    DATABASES["ledger"] = {**DATABASES["default"], "NAME": BENCH_LEDGER_DB}

# The fairshare section drains with the fair share on ("1") and off ("0").
if os.environ.get("BENCH_FAIR_SHARE"):
    JOBS_FAIR_SHARE = os.environ["BENCH_FAIR_SHARE"] != "0"

if os.environ.get("BENCH_WORKERS"):
    Q_CLUSTER = {**Q_CLUSTER, "workers": int(os.environ["BENCH_WORKERS"])}

# The HTTP notice provider of the latency burst (the stand-in on loopback), when set.
NOTICE_PROVIDER_URL = os.environ.get("NOTICE_PROVIDER_URL", "")
NOTICE_PROVIDER_TOKEN = os.environ.get("NOTICE_PROVIDER_TOKEN", "")
