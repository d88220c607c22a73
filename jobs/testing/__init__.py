"""Tools for testing and drilling projects that use ``jobs``; the engine never imports them.

- ``jobs.testing.fakeprovider``: the stand-in notice provider (HTTP on loopback,
  fault switches, its own SQLite record as an independent witness).
- ``jobs.testing.processes``: real subprocesses, each leading its own process
  group, so a whole qcluster can be killed at once.
- ``jobs.testing.mode``: the testing mode for a project's own kinds: ``run_inline()``,
  ``drain()``, ``requested()``, ``effects()`` (re-exported here, loaded on first use so
  the other helpers import without Django's apps; docs/app/testing.md).
- ``jobs.testing.scratchdb``: PostgreSQL databases a test, drill or benchmark
  creates and drops on the server ``DATABASE_URL`` names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_MODE = ("Drained", "DrainLimitReached", "drain", "effects", "requested", "run_inline")
__all__ = ["DrainLimitReached", "Drained", "drain", "effects", "requested", "run_inline"]
assert sorted(__all__) == sorted(_MODE)

if TYPE_CHECKING:
    from jobs.testing.mode import (
        Drained,
        DrainLimitReached,
        drain,
        effects,
        requested,
        run_inline,
    )


def __getattr__(name: str) -> Any:
    if name not in _MODE:
        raise AttributeError(f"module 'jobs.testing' has no attribute {name!r}")
    return getattr(importlib.import_module("jobs.testing.mode"), name)
