"""Django's test runner with real workers: a qcluster and the dispatcher loop on the test
database, started once it exists and stopped (their whole process group) before it goes.

A ``TransactionTestCase`` ends with ``flush`` (one ``TRUNCATE`` of every table) while the
workers keep claiming: a claim that holds one table and reads another the ``TRUNCATE``
already locked is a deadlock, and PostgreSQL may end either side. A worker's claim is
retried by the worker; the flush is retried here (its transaction was rolled back whole).
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from django.conf import settings
from django.core.management.base import CommandError
from django.db import connections
from django.test.runner import DiscoverRunner
from django.test.testcases import TransactionTestCase

FLUSH_TRIES = 5
_flush = TransactionTestCase._fixture_teardown


def _flush_past_deadlocks(self: TransactionTestCase) -> None:
    for attempt in range(1, FLUSH_TRIES + 1):
        try:
            return _flush(self)
        except CommandError as exc:
            if attempt == FLUSH_TRIES or "deadlock detected" not in str(exc.__cause__):
                raise
            print(f"flush met a worker's claim (deadlock), try {attempt + 1}", file=sys.stderr)
            time.sleep(0.2 * attempt)


TransactionTestCase._fixture_teardown = _flush_past_deadlocks


class WorkerRunner(DiscoverRunner):
    def setup_databases(self, **kwargs):
        config = super().setup_databases(**kwargs)
        name = connections["default"].settings_dict["NAME"]
        env = {**os.environ, "CONTRACT_DB_NAME": name}
        log_dir = Path(settings.BASE_DIR)
        self.workers = []
        for label, command in (
            ("qcluster", ["qcluster"]),
            ("dispatcher", ["jobs_dispatcher", "--interval", "0.2"]),
        ):
            out = open(log_dir / f"{label}.log", "ab")  # noqa: SIM115 - closed at teardown
            proc = subprocess.Popen(
                [sys.executable, "-m", "django", *command],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self.workers.append((proc, out))
        time.sleep(1.0)  # the cluster's workers fork and connect
        return config

    def teardown_databases(self, old_config, **kwargs):
        for proc, _ in self.workers:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc, out in self.workers:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            out.close()
        connections.close_all()
        super().teardown_databases(old_config, **kwargs)
