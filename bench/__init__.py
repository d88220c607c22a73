"""``make bench``: what exactly-once effects cost, measured side by side in one run.

Run as ``python -m bench`` with ``DATABASE_URL`` naming a PostgreSQL server; the
benchmarks create and use their own ``bench_*`` databases on it. They print
figures and assert nothing (the pinned query counts live in the test suite).
"""
