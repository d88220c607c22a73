"""One measured run: empty tables, a full queue, a real cluster, the drain timed."""

from __future__ import annotations

from dataclasses import dataclass

from django.db import connections

from bench import infra, workloads

BARE, SUMMARY, REPORT = "bare", "summary", "report"
# The minimal kind over four tenants (each claim contended), and the same in 50 sequences:
# the fair share and sequences in use (bench.fairshare).
TENANTS, SEQUENCED = "summary_tenants", "summary_sequenced"
# The same work as SUMMARY and REPORT in plain django-q2 tasks (bench.plain), no engine:
# on django-q2's default ORM broker (what a user would otherwise run), and the same
# tasks on the engine's PostgreSQL broker.
PLAIN_MINIMAL, PLAIN_REPORT = "plain_minimal", "plain_report"
PLAIN_MINIMAL_PG, PLAIN_REPORT_PG = "plain_minimal_pg", "plain_report_pg"
PLAIN = (PLAIN_MINIMAL, PLAIN_REPORT, PLAIN_MINIMAL_PG, PLAIN_REPORT_PG)
ENGINE = (SUMMARY, REPORT, TENANTS, SEQUENCED)
LABELS = {
    BARE: "bare django-q2 no-op (ORM)",
    PLAIN_MINIMAL: "plain minimal's work (ORM)",
    PLAIN_MINIMAL_PG: "plain minimal's work (PG brk)",
    SUMMARY: "demo.summary (engine, jobs table)",
    PLAIN_REPORT: "plain report's work (ORM)",
    PLAIN_REPORT_PG: "plain report's work (PG brk)",
    REPORT: "permits.report (engine, jobs table)",
    TENANTS: "demo.summary, 4 tenants (engine)",
    SEQUENCED: "demo.summary, 4 tenants, 50 sequences (engine)",
}
# The broker each kind's cluster runs: django-q2's ORM broker for the bare no-op and
# the plain tasks (their default), the site's default on PostgreSQL for the engine and the
# plain tasks' second run (jobs.claiming.ClaimingBroker: jobs claimed from their table,
# plain tasks taken from django_q_ormq with PostgresBroker's statement).
ORM_BROKER_ENV = {"Q_BROKER": "orm"}
BROKER_ENV = {BARE: ORM_BROKER_ENV, PLAIN_MINIMAL: ORM_BROKER_ENV, PLAIN_REPORT: ORM_BROKER_ENV}


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
        """Every job went through the engine exactly once (bare tasks: nothing to check).

        Plain tasks: one file each, every expected notice, no failed task.
        """
        if self.kind == BARE:
            return True
        c = self.check
        if self.kind in PLAIN:
            return (
                c["files"] == self.n
                and c["notices"] == c["expected_notices"] >= self.n
                and c["failed"] == 0
            )
        per_job = c["effects"] // max(1, c["jobs"])
        return (
            c["succeeded"] == c["jobs"] == self.n
            and c["artifacts"] == self.n
            and c["effects_applied"] == c["effects"] == c["notices"]
            and per_job >= 1
        )


def run(
    kind: str,
    n: int,
    workers: int,
    user_id: int,
    *,
    round: int = 0,
    env: dict[str, str] | None = None,
) -> Run:
    """Empty the tables, enqueue ``n`` messages of ``kind``, drain them with a cluster.

    ``env`` goes to the cluster's processes (e.g. a settings switch of the knobs section).
    """
    infra.reset_run_tables()
    expected_notices = 0
    if kind == BARE:
        workloads.enqueue_noop(n)
    elif kind == SUMMARY:
        workloads.enqueue_summaries(n, user_id)
    elif kind in (TENANTS, SEQUENCED):
        workloads.enqueue_summaries(n, user_id, tenants=4, sequences=50 if kind == SEQUENCED else 0)
    elif kind == REPORT:
        workloads.enqueue_reports(n)
    elif kind in (PLAIN_MINIMAL, PLAIN_MINIMAL_PG):
        expected_notices = workloads.enqueue_plain_minimal(n, user_id)
    elif kind in (PLAIN_REPORT, PLAIN_REPORT_PG):
        expected_notices = workloads.enqueue_plain_reports(n)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    # Close this process's connection: its counters reach the server before the run.
    connections.close_all()
    infra.vacuum_analyze()
    env = {**BROKER_ENV.get(kind, {}), **(env or {})}
    label = f"{kind}-{workers}w-r{round}" + "".join(f"-{k.lower()}{v}" for k, v in env.items())
    drain = infra.drain(workers, label, n, **env)
    if kind == BARE:
        check = {}
    elif kind in PLAIN:
        check = workloads.plain_outcome_counts(expected_notices)
    else:
        check = workloads.outcome_counts()
    return Run(kind, workers, n, drain, check, round)
