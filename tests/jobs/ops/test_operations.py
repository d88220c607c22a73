"""The admin's operator buttons apply where the engine's arrows start, read from one rule."""

from __future__ import annotations

import pytest

from jobs import rules
from jobs.ops.operations import EFFECT_OPERATIONS, JOB_OPERATIONS

OPERATIONS = {**JOB_OPERATIONS, **EFFECT_OPERATIONS}


def test_operations__one_button_per_operator_arrow():
    assert sorted(OPERATIONS) == sorted(rules.OPERATOR_SOURCES)


@pytest.mark.parametrize("name", sorted(OPERATIONS))
def test_operations__states_are_the_rules_source_states(name):
    assert OPERATIONS[name].states == rules.OPERATOR_SOURCES[name]


def test_operations__read_the_rule_not_a_copy(monkeypatch):
    # A rule changed in jobs.rules changes where the button applies: nothing spells it again.
    monkeypatch.setitem(rules.OPERATOR_SOURCES, "cancel", ("queued",))
    assert JOB_OPERATIONS["cancel"].states == ("queued",)
