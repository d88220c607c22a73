"""``python -m bench.pairs A B N ROUNDS [WORKERS]``: one kind against another, interleaved.

A quicker look than ``make bench`` at one same-work ratio while changing the hot path:
``ROUNDS`` rounds of ``bench.e2e.run`` (empty tables, ``N`` queued messages, a real
``qcluster`` drain) of kind ``A`` then kind ``B``, with the same settings, database and
signing key as ``make bench``; prints each round's rates and ratio B/A and the median
ratio. Kinds: ``bench.e2e.LABELS`` (e.g. ``plain_minimal summary``, ``plain_report
report``). Like ``make bench``, it needs a PostgreSQL ``DATABASE_URL`` and drops and
recreates the ``bench_e2e`` database.
"""

from __future__ import annotations

import statistics
import sys


def main(argv: list[str]) -> int:
    from bench import infra

    if len(argv) not in (4, 5):
        print(__doc__.split("\n\n")[0], file=sys.stderr)
        return 2
    a, b, n, rounds = argv[0], argv[1], int(argv[2]), int(argv[3])
    workers = int(argv[4]) if len(argv) == 5 else 2
    infra.start_django()
    from bench import e2e, workloads

    for kind in (a, b):
        if kind not in e2e.LABELS:
            print(f"unknown kind {kind!r}; one of: {', '.join(e2e.LABELS)}", file=sys.stderr)
            return 2
    user_id = workloads.prepare_database()
    ratios = []
    for r in range(rounds):
        first = e2e.run(a, n, workers, user_id, round=r)
        second = e2e.run(b, n, workers, user_id, round=r)
        ratios.append(second.rate / first.rate)
        print(
            f"round {r + 1}: {a} {first.rate:.1f} jobs/s (checked {first.ok}), "
            f"{b} {second.rate:.1f} jobs/s (checked {second.ok}): ratio {ratios[-1]:.3f}",
            flush=True,
        )
    print(f"median ratio {b}/{a}: {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
