"""The maintenance round: schedule ticks, group joins an operator's edit left behind, and
retention.

Due jobs, retries, expired leases and due effect releases are not its work: they are due
times on their rows, claimed by the clusters (``jobs.claiming``) in due order. What is left
here is what no row makes due by itself: the next tick of each periodic kind (one job per
tick, ``jobs.schedules``), the joins of groups whose children ended outside an arrow,
with ``JOBS_RETENTION_DAYS`` set the hourly prune of old history (``jobs.retention``), with
``JOBS_ARCHIVE_AFTER_DAYS`` set the archive of long-finished jobs (``jobs.archive``), and
a look at the database's timeline: a failover is reconciled once (``jobs.reconcile``).

Run by ``manage.py jobs_worker``'s cluster (a django-q2 schedule, every minute) and,
finer-grained, by the optional ``manage.py jobs_dispatcher``. Several may run at once:
a tick is one job by its identity, a join one by its group.
"""

from __future__ import annotations

import logging

from jobs import archive, retention, schedules
from jobs.engine import groups
from jobs.reconcile import timeline

log = logging.getLogger("jobs.dispatch")


def dispatch_once() -> dict[str, int]:
    """Make the due ticks' jobs and the missed joins now; returns how many of each."""
    done = {"ticks": sum(handle.created for handle in schedules.fire_due())}
    done["group_ends"] = groups.sweep()
    done["pruned"] = retention.prune_when_due()
    done["archived"] = archive.archive_when_due()
    # A backstop for an idle cluster: a sequence's head left held by a worker killed
    # between its last commit and its look (docs/app/sequences.md).
    from jobs.claiming import claims

    done["sequence_heads"] = claims().release_heads()
    timeline.watch()  # issue 47: a promotion (new timeline) is reconciled once (jobs.reconcile)
    if any(done.values()):
        log.info("dispatch %s", " ".join(f"{k}={v}" for k, v in done.items()))
    return done
