"""Find what a failover lost, ask for it again, and record what the outside world has (issue 47).

After a failover to an asynchronous standby the database lacks the last commits the old
primary acknowledged, while the outside world keeps what they did: objects in the
bucket, notices a provider accepted. ``reconcile`` (``manage.py jobs_reconcile``, and the
maintenance loop after a timeline change, ``jobs.reconcile.timeline``):

1. lists the storage: jobs whose objects or identity manifest are stored and whose rows
   are not (``evidence.lost_jobs``);
2. asks every provider with a listing what it applied lately, and keeps the keys the
   ledger lacks (``outside.listed_keys``; an operator's export works too);
3. asks again for each lost job whose subject still exists, through ``jobs.request``,
   under its own uid (``ask_again``): the same keys, so a notice already accepted is the
   same effect, looked up and recorded as applied, never sent a second time;
4. marks the jobs that exist but may have lost a publish or a ledger arrow (unsettled,
   with objects in the bucket or keys at a provider): their sends are looked up first.

Run it before ``jobs_prune`` removes manifests and orphans older than
``JOBS_ORPHAN_GRACE_SECONDS``: they are the evidence.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from jobs.reconcile import ask_again as _ask
from jobs.reconcile.evidence import LostJob, Scan, lost_jobs, scan, unsettled_jobs
from jobs.reconcile.outside import UnknownKey, listed_keys, read_provider_keys, unknown_keys

__all__ = [
    "LostJob",
    "Report",
    "Scan",
    "UnknownKey",
    "listed_keys",
    "lost_jobs",
    "read_provider_keys",
    "reconcile",
    "scan",
    "unknown_keys",
]

DEFAULT_SINCE_SECONDS = 24 * 3600.0  # how far back providers are asked by default


@dataclass
class Report:
    """What one reconcile found and did."""

    lost: list[LostJob] = field(default_factory=list)
    outcomes: dict[str, tuple[str, int | None]] = field(default_factory=dict)  # uid -> (what, id)
    unknown: list[UnknownKey] = field(default_factory=list)
    providers: dict[str, str] = field(default_factory=dict)  # name -> what it answered
    marked: int = 0  # existing jobs whose sends are now looked up first
    dry_run: bool = False

    @property
    def asked_again(self) -> int:
        return sum(1 for what, _ in self.outcomes.values() if what == _ask.REQUESTED)

    def as_dict(self) -> dict:
        return {
            "lost_jobs": [
                {
                    **job.as_dict(),
                    "outcome": self.outcomes.get(job.job, ("", None))[0],
                    "asked_as": self.outcomes.get(job.job, ("", None))[1],
                }
                for job in self.lost
            ],
            "unknown_keys": [asdict(u) for u in self.unknown],
            "providers": dict(self.providers),
            "asked_again": self.asked_again,
            "marked": self.marked,
            "dry_run": self.dry_run,
        }


def reconcile(
    *,
    accepted: list[tuple[str, str]] | None = None,
    since: float | None = None,
    ask_providers: bool = True,
    dry_run: bool = False,
    names: list[str] | None = None,
) -> Report:
    """Compare the storage and the providers with the database; ask for lost jobs again.

    ``accepted``: a provider's export (``read_provider_keys``) besides the listings;
    ``since``: Unix seconds the providers are asked from (default a day back);
    ``dry_run``: report only, write nothing.
    """
    report = Report(dry_run=dry_run)
    found = scan(names)
    report.lost = lost_jobs(found=found)
    if accepted:
        report.unknown += unknown_keys(accepted)
    if ask_providers:
        since = time.time() - DEFAULT_SINCE_SECONDS if since is None else since
        listed, report.providers = listed_keys(since)
        seen = {u.idempotency_key for u in report.unknown}
        report.unknown += [u for u in listed if u.idempotency_key not in seen]
    for job in report.lost:
        report.outcomes[job.job] = _ask.ask_again(job.manifest, dry_run=dry_run)
    lost_tokens = {job.job for job in report.lost}
    # Jobs that exist but whose publish or ledger arrows the failover may have lost.
    tokens = (found.tokens() - lost_tokens) | {u.job for u in report.unknown if u.job}
    tokens -= lost_tokens
    unsettled = unsettled_jobs(tokens)
    report.marked = len(unsettled) if dry_run else _ask.mark(unsettled)
    return report
