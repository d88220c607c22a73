"""The release policy, asked right before an effect is released: the account rule, then
the kind's own check (``authorize_release``).

The same account rule (``jobs.rules.account_admits``) is checked by the executors in
the statement or transaction that commits a notice born with the publish.
"""

from __future__ import annotations

from contextvars import ContextVar

from django.contrib.auth import get_user_model

from jobs import registry, rules
from jobs.models import Effect

_checked_user: ContextVar = ContextVar("jobs_release_checked_user", default=None)


def withhold_reason(effect: Effect) -> str | None:
    """Current policy for this recipient, asked right before the send: the account rule
    (``jobs.rules.account_admits``, read by the database in one query), then the kind's
    own check. The publish checks the same rule in its executor (``jobs.executors``)."""
    user_model = get_user_model()
    user = (
        user_model._default_manager.filter(pk=effect.recipient)
        .annotate(jobs_admitted=rules.admitted(user_model))
        .first()
    )
    if user is None:
        return rules.ACCOUNT_MISSING
    if not user.jobs_admitted:
        return rules.ACCOUNT_REFUSED
    token = _checked_user.set(user)  # a kind's own check reads it (``recipient_user``)
    try:
        return kind_release_check(effect)
    finally:
        _checked_user.reset(token)


def kind_release_check(effect: Effect) -> str | None:
    """The kind's own part of the policy (``authorize_release``), if it has one."""
    kind = registry.get_kind(effect.job.kind)
    if kind.authorize_release is not None:
        return kind.authorize_release(effect)
    return None


def recipient_user(effect: Effect):
    """The recipient's user row for a kind's ``authorize_release``: the one the release
    check just read, or read now (the publish checks the account rule in its executor)."""
    user = _checked_user.get()
    if user is None or str(user.pk) != str(effect.recipient):
        user = get_user_model()._default_manager.get(pk=effect.recipient)
    return user
