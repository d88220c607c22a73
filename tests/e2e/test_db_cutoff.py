"""A worker host cut off from PostgreSQL without a word says so within seconds.

``jobs_worker`` runs against a relay to the test database (tests/chaos/dbproxy.py).
The relay then stops forwarding: every connection stays open, nothing is refused or
reset, the bytes go nowhere (a partition, a NAT or a firewall dropping packets). A
query on such a connection would wait for many minutes; the supervisor's look at the
database has a deadline (``--ping-timeout``), so the log names the host that lost
the database within 10 s. When the relay forwards again the outage's end is logged.
"""

from __future__ import annotations

import re
import time

import pytest

from tests.chaos.dbproxy import DatabaseProxy
from tests.e2e.processes import database_address, subprocess_env, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.django_db(transaction=True)]

HOST = "cutoff-host-1"
DEADLINE = 10.0  # seconds from the cut to the log line


def _lines(proc, pattern: str) -> list[str]:
    text = proc.log_path.read_text(errors="replace")
    return [line for line in text.splitlines() if re.search(pattern, line)]


def test_cutoff__a_relay_that_stops_forwarding_is_logged_within_10_s(procs):
    relay = DatabaseProxy(*database_address()).start()
    try:
        env = {**subprocess_env(port=relay.port), "JOBS_HOST_NAME": HOST}
        # A stall threshold of 30 s gives the slowest cadence of looks the command
        # chooses (one every 2.5 s), as in production; the ping's deadline is its default.
        worker = procs.start("jobs_worker", "jobs_worker", "--stall-seconds", "30", env=env)
        wait_until(
            procs,
            "jobs_worker to start its qcluster",
            lambda: _lines(worker, r"jobs_worker: started qcluster pid \d+"),
            timeout=60,
        )
        # A few healthy looks first: the supervisor holds an open connection through
        # the relay, the one a partition leaves hanging.
        wait_until(procs, "connections through the relay", lambda: relay.accepted >= 2, timeout=30)
        time.sleep(3)
        assert not _lines(worker, "database unavailable"), "no outage before the cut"

        relay.stall()
        cut = time.monotonic()
        pattern = (
            rf"jobs_worker: database unavailable \(OperationalError db_unavailable\) on host {HOST}"
        )
        wait_until(procs, "the outage in the log", lambda: _lines(worker, pattern), timeout=30)
        seen = time.monotonic() - cut
        print(f"\ncut off at t=0; 'database unavailable' on host {HOST} logged at {seen:.1f} s")
        assert seen < DEADLINE, f"logged {seen:.1f} s after the cut (deadline {DEADLINE:g} s)"
        assert procs.check_alive() is None, "the supervisor lives through it"

        relay.flow()
        healed = time.monotonic()
        wait_until(
            procs,
            "the outage's end in the log",
            lambda: _lines(worker, r"jobs_worker: database back after \d+\.\d s"),
            timeout=30,
        )
        print(f"forwarding again: 'database back' logged {time.monotonic() - healed:.1f} s later")
        assert len(_lines(worker, "database unavailable")) == 1, "one line per outage"
    finally:
        procs.stop_all()
        relay.close()
