"""Tools for testing and drilling projects that use ``jobs``; the engine never imports them.

- ``jobs.testing.fakeprovider``: the stand-in notice provider (HTTP on loopback,
  fault switches, its own SQLite record as an independent witness).
- ``jobs.testing.processes``: real subprocesses, each leading its own process
  group, so a whole qcluster can be killed at once.
- ``jobs.testing.scratchdb``: PostgreSQL databases a test, drill or benchmark
  creates and drops on the server ``DATABASE_URL`` names.
"""
