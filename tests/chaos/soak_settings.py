"""Settings for the soak's processes: the soak's timers (``tests.chaos.settings``) and the
soak's own kinds, periodic and chained (``tests.chaos.soak_kinds``).

Apart from ``tests.chaos.settings`` because the scale-out drill shares those timers and
must not get ticks it does not check.
"""

from tests.chaos.settings import *  # noqa: F403
from tests.chaos.settings import INSTALLED_APPS

INSTALLED_APPS = [*INSTALLED_APPS, "tests.chaos.soak_kinds.SoakKindsConfig"]
