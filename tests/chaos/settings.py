"""Settings for the soak's processes: the test settings, with timers sized for provider faults.

tests.settings gives the short leases (lease 2 s) every crash test uses. The soak
also sends webhook notices through a provider that stalls past the read timeout,
so a send (connect + read + slot wait = 3 s) must end inside its sending lease
(4 s, system check jobs.E010), and one delivery (the job, then its in-app and
webhook releases) must end inside Q_CLUSTER['timeout']; the order lease <
timeout < retry (jobs.E002) still holds. Everything the soak varies per run
comes from environment variables (SOAK_Q_WORKERS, SOAK_EFFECT_LEASE_SECONDS,
JOBS_TENANT_CONCURRENCY and the NOTICE_PROVIDER_* variables read by permits.settings).
"""

import os

from tests.settings import *  # noqa: F403
from tests.settings import Q_CLUSTER

JOBS_EFFECT_LEASE_SECONDS = float(os.environ.get("SOAK_EFFECT_LEASE_SECONDS", "4"))
JOBS_PROVIDER_SLOT_WAIT_SECONDS = 1.0
JOBS_PROVIDER_DEFER_SECONDS = 0.3
Q_CLUSTER = {
    **Q_CLUSTER,
    "workers": int(os.environ.get("SOAK_Q_WORKERS", "2")),
    "timeout": 6,
    "retry": 9,
}

# A kind's release check raises for some effects (tests/chaos/faults.py).
SOAK_RELEASE_CHECK_FAULTS = True
