"""A worker that finished a claimed job keeps claiming (``jobs.claiming.keep_going``): its
budget (``runner.follow_on_budget``). The claims themselves are in ``test_claiming.py``.

The message follow-on of the message brokers (``jobs.tasks.follow_on``: acknowledge, take
the next message, re-send django-q2's signals) is gone with the messages (issue 41).
"""

from __future__ import annotations

import dataclasses

from django_q.conf import Conf

from jobs import registry
from jobs.delivery import runner


def test_follow_on__budget_leaves_the_longest_kind_its_timeout_and_grace(monkeypatch, settings):
    """Claimed-on jobs run under django-q2's alarm for the first task: the budget ends early
    enough that a job taken at its end still has its kind's timeout and grace."""
    monkeypatch.setattr(Conf, "TIMEOUT", 120)
    settings.JOBS_TIMEOUT_GRACE_SECONDS = 5
    settings.JOBS_FOLLOW_ON_SECONDS = 1.0
    kind = registry.get_kind("test.steps")

    def with_timeout(seconds):
        monkeypatch.setitem(registry._kinds, kind.name, dataclasses.replace(kind, timeout=seconds))
        return runner.follow_on_budget()

    assert with_timeout(10) == 1.0
    assert with_timeout(113.5) == 0.5  # 120 - 113.5 - 5 - 1 (runner.HARD_STOP_MARGIN)
    assert with_timeout(119) == 0.0
