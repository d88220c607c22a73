"""Helpers of the adapted tests: results come from a real worker, so the tests wait."""

import time
from pathlib import Path

from asgiref.sync import sync_to_async
from django.conf import settings
from django.test import TransactionTestCase

WAIT_SECONDS = 30


def wait(result, timeout: float = WAIT_SECONDS):
    """Refresh ``result`` until a worker finished it (the reference backends return finished)."""
    deadline = time.monotonic() + timeout
    while not result.is_finished:
        if time.monotonic() > deadline:
            raise AssertionError(f"task result {result.id} not finished after {timeout} s")
        time.sleep(0.05)
        result.refresh()
    return result


async def await_finished(result, timeout: float = WAIT_SECONDS):
    return await sync_to_async(wait)(result, timeout)


def worker_log(result_id: str, count: int, timeout: float = 10) -> list[str]:
    """The worker's ``django.tasks`` lines about ``result_id`` (at least ``count`` of them)."""
    path = Path(settings.BASE_DIR) / "worker-tasks.log"
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text() if path.exists() else ""
        lines = [line for line in text.splitlines() if f"id={result_id} " in line]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


class WorkerTestCase(TransactionTestCase):
    """The reference tests are SimpleTestCases: these use the database the workers share."""

    serialized_rollback = False
