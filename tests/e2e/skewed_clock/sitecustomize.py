"""Put a process's clock ``TEST_CLOCK_SKEW_SECONDS`` off (on PYTHONPATH for a child process).

Shifts what the process reads as the wall clock: ``time.time()``, ``time.time_ns()``
and ``django.utils.timezone.now()`` (the engine's and django-q2's clock), as a worker
on a machine with a wrong clock would. Monotonic time (sleeps, timeouts) is left
alone. (Debian's libfaketime was tried first: under Python 3.11 its sleeps fail
with EINVAL or hang, so the skew is applied inside the interpreter instead.)
"""

import os
import time
from datetime import timedelta

_skew = float(os.environ.get("TEST_CLOCK_SKEW_SECONDS") or 0)
if _skew:
    _time, _time_ns = time.time, time.time_ns
    time.time = lambda: _time() + _skew
    time.time_ns = lambda: _time_ns() + int(_skew * 1e9)

    import django.utils.timezone as _timezone

    _now = _timezone.now
    _timezone.now = lambda: _now() + timedelta(seconds=_skew)
