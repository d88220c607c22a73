"""Fixtures for end-to-end tests with real processes."""

from __future__ import annotations

import pytest

from jobs.testing.fakeprovider import start_in_thread
from tests.e2e.processes import PROVIDER_TOKEN, site_processes, subprocess_env


@pytest.fixture
def procs(request, transactional_db, tmp_path):
    """Start processes through this; all are killed before the database is flushed."""
    failed_before = request.session.testsfailed
    processes = site_processes(subprocess_env(), tmp_path)
    try:
        yield processes
    finally:
        processes.stop_all()
        if request.session.testsfailed > failed_before:
            print(f"\n===== subprocess logs (in {tmp_path}) =====\n{processes.logs(tail=400)}")


@pytest.fixture
def provider(tmp_path):
    """The stand-in notice provider on loopback (token ``PROVIDER_TOKEN``); set its faults."""
    server = start_in_thread(tmp_path / "provider.sqlite3", token=PROVIDER_TOKEN)
    yield server
    server.stop()
