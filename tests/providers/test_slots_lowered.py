"""Lowering a provider's bound binds at once: held slots count, whatever their number.

Real senders, each a thread on its own database session (PostgreSQL: its own
advisory locks; SQLite: its own open files). Four hold slots under a bound of 4; the
bound is lowered to 1 (``jobs_limits set provider:webhook --concurrency 1``); new
senders keep trying through the engine's own gate (``flow.provider_gate`` and
``flow.slots``). The holders are let go one at a time, slot 0's first (the slot a
sender under a bound of 1 used to look at alone). No new sender may start while a
held slot remains, and the gauge the console and ``/metrics`` read
(``bounds.in_flight_now``) equals the calls really in flight at each step.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import pytest
from django.core.management import call_command
from django.db import connection

from jobs import flow
from jobs.providers import bounds
from tests.providers.conftest import wait_for

PROVIDER = "webhook"


@dataclass
class Ledger:
    """What the senders did, written under one lock: the calls in flight and each start."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    in_flight: int = 0
    starts: list[tuple[int, int]] = field(default_factory=list)  # (bound seen, in flight)
    refused_under: dict[int, int] = field(default_factory=dict)  # bound seen: refusals

    def start(self, bound: int) -> None:
        with self.lock:
            self.in_flight += 1
            self.starts.append((bound, self.in_flight))

    def end(self) -> None:
        with self.lock:
            self.in_flight -= 1

    def refused(self, bound: int) -> None:
        with self.lock:
            self.refused_under[bound] = self.refused_under.get(bound, 0) + 1


class Holder(threading.Thread):
    """A call admitted under the old bound that runs until it is let go."""

    def __init__(self, ledger: Ledger, bound: int) -> None:
        super().__init__(daemon=True)
        self.ledger, self.bound = ledger, bound
        self.index: int | None = None
        self.holding = threading.Event()
        self.go = threading.Event()

    def run(self) -> None:
        try:
            slot = bounds.acquire(PROVIDER, self.bound, wait=10)
            assert slot is not None, "four of four slots were free"
            self.index = slot.index
            self.ledger.start(self.bound)
            self.holding.set()
            self.go.wait(60)
            self.ledger.end()  # the call returned; then the slot is given back
            slot.release()
        finally:
            connection.close()


class Sender(threading.Thread):
    """A new sender: the engine's gate (the rule in force) and its slots, again and again."""

    def __init__(self, ledger: Ledger, stop: threading.Event, n: int) -> None:
        super().__init__(daemon=True)
        self.ledger, self.stop, self.n = ledger, stop, n

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                gate = flow.provider_gate(PROVIDER, 4, lambda: "t1", f"sender-{self.n}")
                bound = gate.limits[0][1]
                with flow.slots(gate, deadline=time.monotonic() + 0.05) as admitted:
                    if admitted:
                        self.ledger.start(bound)
                        time.sleep(0.01)
                        self.ledger.end()
                    else:
                        self.ledger.refused(bound)
                time.sleep(0.005)
        finally:
            connection.close()


def _gauge(bound: int = 1) -> int:
    """What the console and /metrics show under ``bound``, read on the test's own session."""
    return bounds.in_flight_now(PROVIDER, bound)


@pytest.mark.django_db(transaction=True)
def test_lowered_bound__no_new_call_while_held_slots_reach_it(settings):
    settings.JOBS_FLOW_CACHE_SECONDS = 0.2
    call_command("jobs_limits", "set", f"provider:{PROVIDER}", "--concurrency", "4")
    ledger = Ledger()
    holders = [Holder(ledger, 4) for _ in range(4)]
    for holder in holders:
        holder.start()
    for holder in holders:
        assert holder.holding.wait(20), "a holder took no slot"
    assert sorted(h.index for h in holders) == [0, 1, 2, 3]
    assert ledger.in_flight == 4 and _gauge(4) == 4

    call_command("jobs_limits", "set", f"provider:{PROVIDER}", "--concurrency", "1")
    stop = threading.Event()
    senders = [Sender(ledger, stop, n) for n in range(3)]
    for sender in senders:
        sender.start()
    try:
        # The new bound is in force for the senders (their cache is 0.2 s).
        wait_for(lambda: ledger.refused_under.get(1, 0) >= 20, timeout=20, what="bound 1 seen")
        figures = []
        for holder in sorted(holders, key=lambda h: h.index):
            # Let the senders try for a while with this many calls still held.
            before = ledger.refused_under.get(1, 0)
            wait_for(
                lambda before=before: ledger.refused_under.get(1, 0) >= before + 10,
                timeout=20,
                what="more tries under bound 1",
            )
            with ledger.lock:
                new_starts = [s for s in ledger.starts if s[0] == 1]
                really = ledger.in_flight
            gauge = _gauge()
            figures.append((really, gauge, len(new_starts)))
            assert not new_starts, f"a call started under bound 1 with {really} in flight"
            holder.go.set()
            holder.join(20)
        wait_for(
            lambda: any(bound == 1 for bound, _ in ledger.starts),
            timeout=20,
            what="a new call once every held slot was given back",
        )
    finally:
        stop.set()
        for holder in holders:
            holder.go.set()
        for thread in [*senders, *holders]:
            thread.join(20)
    print(f"\n(in flight, gauge, new starts) before each holder ended: {figures}")
    assert all(gauge == really for really, gauge, _ in figures), "the gauge is what is in flight"
    late = [s for s in ledger.starts if s[0] == 1]
    print(f"starts under bound 1 after the last holder: {len(late)}; {ledger.refused_under=}")
    assert all(in_flight == 1 for _, in_flight in late), f"bound 1 exceeded: {late}"
    assert _gauge() == 0


class Session(threading.Thread):
    """A thread with a database session of its own that runs what it is handed, in order."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.inbox: queue.Queue = queue.Queue()
        self.start()

    def call(self, fn, *args):
        answer: queue.Queue = queue.Queue()
        self.inbox.put((fn, args, answer))
        ok, value = answer.get(timeout=30)
        if not ok:
            raise value
        return value

    def run(self) -> None:
        try:
            while (item := self.inbox.get()) is not None:
                fn, args, answer = item
                try:
                    answer.put((True, fn(*args)))
                except Exception as exc:
                    answer.put((False, exc))
        finally:
            connection.close()

    def close(self) -> None:
        self.inbox.put(None)
        self.join(20)


@pytest.mark.django_db(transaction=True)
def test_bounds__a_lower_limit_counts_slots_taken_under_a_higher_one():
    """The bounds alone, on two sessions: slot 0 given back first admits no one under 1."""
    other = Session()
    try:
        held = [other.call(bounds.try_acquire, "lowered", 3) for _ in range(3)]
        assert sorted(s.index for s in held) == [0, 1, 2]
        assert bounds.in_flight_now("lowered", 1) == 3, "every held slot counts"
        assert bounds.try_acquire("lowered", 2) is None, "3 held, bound 2"
        other.call(held[0].release)  # slot 0 first
        assert bounds.in_flight_now("lowered", 1) == 2
        assert bounds.try_acquire("lowered", 1) is None, "2 held, bound 1, slot 0 free"
        assert bounds.try_acquire("lowered", 2) is None, "2 held, bound 2"
        third = bounds.try_acquire("lowered", 3)
        assert third is not None and third.index == 0, "the lowest free slot"
        assert bounds.in_flight_now("lowered") == 3
        third.release()
        for slot in held[1:]:
            other.call(slot.release)
    finally:
        other.close()
    assert bounds.in_flight_now("lowered") == 0
    slot = bounds.try_acquire("lowered", 1)
    assert slot is not None and slot.index == 0
    slot.release()
