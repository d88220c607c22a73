"""The horizon drill's verdict over its minutes' rows (pure: no database)."""

from __future__ import annotations

from tests.chaos.horizon import high_water, verdict


def _rows(bytes_, dead, finished=100, pickup=50.0):
    return [
        {"bytes": b, "dead": d, "finished": finished, "p99_pickup_ms": pickup}
        for b, d in zip(bytes_, dead, strict=True)
    ]


def test_high_water__keeps_each_minutes_highest_so_far():
    assert high_water([3, 1, 4, 1, 5, 2]) == [3, 3, 4, 4, 5, 5]


def test_verdict__a_bounded_sawtooth_of_dead_tuples_levels_off():
    # Vacuum takes the dead tuples back down every few minutes; the last third ends on a
    # peak and the one before it on a trough: end points alone call it growth.
    dead = [0, 400, 800, 50, 450, 820, 60, 430, 40, 440, 810, 30, 420, 815, 810]
    rows = _rows([1000 + min(i, 4) * 100 for i in range(15)], dead)
    assert verdict(rows) == []


def test_verdict__dead_tuples_that_keep_climbing_fail():
    dead = [i * 500 for i in range(15)]
    failures = verdict(_rows([1000] * 15, dead))
    assert any(f.startswith("dead grew") for f in failures)


def test_verdict__bytes_that_keep_growing_fail():
    failures = verdict(_rows([1000 + i * 100 for i in range(15)], [0] * 15))
    assert any(f.startswith("bytes grew") for f in failures)
