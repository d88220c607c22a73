"""The compare-and-swap every state change goes through.

An UPDATE whose WHERE names the version the caller read and, for a worker's
own writes, its lease: the same owner and a lease not yet expired by the
database server's clock (``jobs.rules.OWNER_FENCE``). Zero rows updated means someone else
moved first, or the lease ran out; either way the caller must do nothing more
(a worker whose lease expired publishes nothing, even when nobody has
reclaimed the job yet).
"""

from __future__ import annotations

from django.db import models
from django.db.models import F, Q
from django.db.models.functions import Now


def compare_and_swap(
    obj: models.Model,
    *,
    owner: str | None = None,
    margin: float = 0.0,
    where: Q | None = None,
    **changes,
) -> bool:
    """Apply ``changes`` to ``obj``'s row if it is still at ``obj.version``; mirror them if won.

    ``margin``: with ``owner``, the lease must hold at least this many seconds more
    (a publish must be able to commit before the lease ends). ``where`` adds
    conditions the row must meet at the moment of the UPDATE (e.g. "due by the
    server's clock"). Values that are expressions are evaluated by the
    database and are not mirrored on ``obj``.
    """
    qs = type(obj)._default_manager.filter(pk=obj.pk, version=obj.version)
    if owner is not None:  # the owner fence of ``jobs.rules`` (the statements embed it too)
        from jobs import rules

        args = {"job": obj.pk, "version": obj.version, "worker": owner, "margin": margin}
        qs = qs.filter(rules.to_q(rules.OWNER_FENCE, **args))
    if where is not None:
        qs = qs.filter(where)
    won = qs.update(version=F("version") + 1, updated_at=Now(), **changes) == 1
    if won:
        mirror(obj, changes)
    return won


def mirror(obj: models.Model, changes: dict) -> None:
    """``obj`` as a won swap leaves it: one version on, the plain values set (values
    the database computes, such as ``Now()``, are left to a reload)."""
    obj.version += 1
    for field, value in changes.items():
        if not hasattr(value, "resolve_expression"):
            setattr(obj, field, value)
