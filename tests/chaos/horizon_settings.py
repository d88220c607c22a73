"""Settings for the horizon drill's hosts: the scale-out drill's, with short redelivery
delays (lease 2 s < timeout 3 s < retry 4 s) and no floor of days on the archive window,
so that the redelivery safety window (100 x the longest delay: 400 s) lets jobs leave
the working set within the drill's first minutes."""

from tests.chaos.scaleout_settings import *  # noqa: F403
from tests.chaos.scaleout_settings import Q_CLUSTER

JOBS_LEASE_SECONDS = 2.0
JOBS_EFFECT_LEASE_SECONDS = 2.0
JOBS_PRUNE_MIN_DAYS = 0.001  # 86 s: the 100 x delays rule (400 s) decides
Q_CLUSTER = {**Q_CLUSTER, "timeout": 3, "retry": 4}
