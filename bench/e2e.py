"""One measured run: empty tables, a full queue, a real cluster, the drain timed."""

from __future__ import annotations

from dataclasses import dataclass

from django.db import connections

from bench import infra, workloads

BARE, SUMMARY, REPORT = "bare", "summary", "report"
LABELS = {
    BARE: "bare django-q2 no-op",
    SUMMARY: "demo.summary (whole engine)",
    REPORT: "permits.report (PDF)",
}


@dataclass
class Run:
    kind: str
    workers: int
    n: int
    drain: infra.Drain
    check: dict[str, int]
    round: int = 0

    @property
    def rate(self) -> float:
        return self.drain.rate

    @property
    def ok(self) -> bool:
        """Every job went through the engine exactly once (bare tasks: nothing to check)."""
        if self.kind == BARE:
            return True
        c = self.check
        per_job = c["effects"] // max(1, c["jobs"])
        return (
            c["succeeded"] == c["jobs"] == self.n
            and c["artifacts"] == self.n
            and c["effects_applied"] == c["effects"] == c["notices"]
            and per_job >= 1
        )


def run(kind: str, n: int, workers: int, user_id: int, *, round: int = 0) -> Run:
    infra.reset_run_tables()
    if kind == BARE:
        workloads.enqueue_noop(n)
    elif kind == SUMMARY:
        workloads.enqueue_summaries(n, user_id)
    else:
        workloads.enqueue_reports(n)
    # Close this process's connection: its counters reach the server before the run.
    connections.close_all()
    infra.vacuum_analyze()
    drain = infra.drain(workers, f"{kind}-{workers}w-r{round}", n)
    check = {} if kind == BARE else workloads.outcome_counts()
    return Run(kind, workers, n, drain, check, round)
