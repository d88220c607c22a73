"""The soak's lookup figure (issue 43): made-up provider records, no database.

A key found applied by a lookup is settled: a POST under it after the lookup counts as a
send the lookup should have spared; POSTs before it (the stalled first send) do not."""

from __future__ import annotations

from tests.chaos import checker


def _q(key: str, status: int, at: float, outcome: str = "") -> dict:
    return {
        "idempotency_key": key,
        "status": status,
        "outcome": outcome,
        "received_at": at,
        "answered_at": at + 0.01,
    }


def test_lookup_figures__counts_sends_after_a_found_lookup_only():
    lookups = [
        _q("k1", 200, 2.0, "lookup_found"),
        _q("k2", 404, 2.0, "lookup_not_found"),
        _q("k1", 200, 3.0, "lookup_found"),
    ]
    sends = [
        _q("k1", 201, 1.0, "applied_stalled"),  # before: the send whose answer was lost
        _q("k2", 201, 2.5, "applied"),  # after a 404: the send that had to happen
    ]
    figures = checker.lookup_figures(lookups, sends)
    assert figures == {
        "answers": {"200 lookup_found": 2, "404 lookup_not_found": 1},
        "keys_found_applied": 1,
        "sends_after_found": 0,
    }
    late = [*sends, _q("k1", 200, 2.5, "replay")]
    assert checker.lookup_figures(lookups, late)["sends_after_found"] == 1
