"""Settings with the PostgreSQL broker (``jobs.broker.PostgresBroker``) on top of a base module.

The base is ``tests.settings`` unless ``BROKER_BASE_SETTINGS`` names another (the
benchmark's clusters run ``bench.settings`` this way), so a test or a benchmark turns
the broker on by pointing ``DJANGO_SETTINGS_MODULE`` here, with nothing else changed.
"""

from __future__ import annotations

import importlib
import os

_base = importlib.import_module(os.environ.get("BROKER_BASE_SETTINGS", "tests.settings"))
globals().update({k: v for k, v in vars(_base).items() if k.isupper()})

Q_CLUSTER = {**_base.Q_CLUSTER, "broker_class": "jobs.broker.PostgresBroker"}
if os.environ.get("Q_POLL"):
    Q_CLUSTER["poll"] = float(os.environ["Q_POLL"])
for _name, _type in (("broker_heartbeat", float), ("broker_listen_retry", float)):
    _value = os.environ.get(f"Q_{_name.upper()}")
    if _value:
        Q_CLUSTER[_name] = _type(_value)
