"""Settings with the claiming broker's knobs from the environment on top of a base module.

The broker is ``jobs.claiming.ClaimingBroker`` (the jobs table as the queue, woken by
NOTIFY) unless ``TEST_BROKER_CLASS`` names another claiming broker (the ORM's,
``jobs.claiming_orm.OrmClaimingBroker``, which polls). The base is ``tests.settings``
unless ``BROKER_BASE_SETTINGS`` names another, so a test turns the broker and its knobs
(``Q_POLL``, ``Q_BROKER_HEARTBEAT``, ``Q_BROKER_LISTEN_RETRY``) on by pointing
``DJANGO_SETTINGS_MODULE`` here, with nothing else changed.
"""

from __future__ import annotations

import importlib
import os

_base = importlib.import_module(os.environ.get("BROKER_BASE_SETTINGS", "tests.settings"))
globals().update({k: v for k, v in vars(_base).items() if k.isupper()})

Q_CLUSTER = {
    **_base.Q_CLUSTER,
    "broker_class": os.environ.get("TEST_BROKER_CLASS", "jobs.claiming.ClaimingBroker"),
}
if os.environ.get("Q_POLL"):
    Q_CLUSTER["poll"] = float(os.environ["Q_POLL"])
for _name, _type in (("broker_heartbeat", float), ("broker_listen_retry", float)):
    _value = os.environ.get(f"Q_{_name.upper()}")
    if _value:
        Q_CLUSTER[_name] = _type(_value)
