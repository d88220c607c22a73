"""Settings for the scale-out drill's hosts: the soak's timers, without the soak's faults.

The drill's faults are a whole host killed; its checks expect every notice applied,
so the soak's injected release-check failures (tests/chaos/faults.py) are off.
"""

from tests.chaos.settings import *  # noqa: F403

SOAK_RELEASE_CHECK_FAULTS = False
