"""The jobs table as django-q2's queue on any database: the claiming broker over the ORM.

Selected by ``Q_CLUSTER["broker_class"] = "jobs.claiming_orm.OrmClaimingBroker"`` (SQLite,
or PostgreSQL through psycopg2). The same claims, turns and idle count as
``jobs.claiming.ClaimingBroker``, through the ORM (``jobs.executors.ormclaim``): no
engine job has a message; plain django-q2 messages keep django-q2's ORM table. SQLite
has no LISTEN: an idle pusher looks again every ``Q_CLUSTER["poll"]`` seconds, or at
once when one of its workers finishes.
"""

from __future__ import annotations

import select

from django.db import connections
from django.utils import timezone
from django_q.conf import Conf

from jobs.broker import OrmQueues
from jobs.claiming import Claiming, _drain, _make_shared


class OrmClaimingBroker(Claiming, OrmQueues):
    """django-q2's broker over the jobs table through the ORM: ``dequeue`` is the claim."""

    @property
    def served(self) -> list[str]:
        return self.keys

    def info(self) -> str:
        if not self._info:
            self._info = f"jobs table (claim) + ORM {Conf.ORM}, polling"
        return self._info

    def _take_plain(self) -> tuple[int, str] | None:
        """One due plain message of a served list, taken by moving its lock (as django-q2's
        ORM broker takes one; a lost race leaves it to the other cluster)."""
        due = self.get_connection().filter(key__in=self.keys, lock__lt=timezone.now())
        for task in due.order_by("id")[:1]:
            moved = (
                self.get_connection()
                .filter(id=task.id, lock=task.lock)
                .update(lock=self.timeout(task))
            )
            if moved:
                return task.pk, task.payload
        return None

    def _wait_for_work(self) -> None:
        """``poll`` seconds, or until a worker of this cluster finishes."""
        _in_hand, r, _w = _make_shared()
        try:
            ready, _, _ = select.select([r], [], [], float(Conf.POLL))
        except InterruptedError:
            return
        if r in ready:
            _drain(r)
        if self._idle() > 0:
            self._claimer.look_now()  # no due time is read here: look for leases too

    def _close_django_connection(self) -> None:
        conn = connections[Conf.ORM or "default"]
        if not conn.in_atomic_block:
            conn.close()
