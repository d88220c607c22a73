"""Offices: whose duties are bound to which permit office, in one place.

An office admin (``permits.assign_reviewer``) and a reviewer each belong to one or more
offices (``Tenant.members``). An office admin sees, and assigns on, only the requests of
their offices, and may assign only reviewers of the request's office. A superuser belongs
to no office and is bound by none. Every path asks here: the admin's changelist, change
page and assign page, the service that grants review, and the last line in
``permits.signals`` (guardian's row itself), whatever screen wrote it.
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core import checks
from django.core.exceptions import PermissionDenied
from django.db import DatabaseError
from django.db.models import Q, QuerySet

from permits.models import ASSIGN_PERM, PermitRequest, Tenant

REVIEWERS = "reviewers"
OFFICE_ADMINS = "office-admins"


class OutsideOffice(PermissionDenied):
    """Raised when a grant crosses offices: the request or the reviewer is not the actor's."""

    def __init__(self) -> None:
        super().__init__(
            "Only reviewers of the request's office can be assigned, by an office admin of "
            "that office."
        )


def is_global(user) -> bool:
    """Whether ``user`` is bound by no office (an active superuser)."""
    return bool(user.is_active and user.is_superuser)


def is_office_admin(user) -> bool:
    """Whether ``user`` holds the assigning duty (bound to their offices unless global)."""
    return bool(user.is_active and user.has_perm(ASSIGN_PERM))


def office_ids(user) -> set[int]:
    """The offices ``user`` belongs to (ids)."""
    if not user.is_authenticated:
        return set()
    rows = Tenant.members.through.objects.filter(user_id=user.pk)
    return set(rows.values_list("tenant_id", flat=True))


def administers(user, permit: PermitRequest) -> bool:
    """Whether ``user`` may see and assign on ``permit`` as an office admin."""
    if is_global(user):
        return True
    return is_office_admin(user) and permit.tenant_id in office_ids(user)


def administered(user, queryset: QuerySet | None = None) -> QuerySet:
    """The requests ``user`` administers (all for a superuser, none without the duty)."""
    queryset = PermitRequest.objects.all() if queryset is None else queryset
    if is_global(user):
        return queryset
    if not is_office_admin(user):
        return queryset.none()
    return queryset.filter(tenant__members=user)


def assignable_reviewers(permit: PermitRequest, by) -> QuerySet:
    """Whom ``by`` may assign to ``permit``: active reviewers of its office (a superuser:
    any active reviewer), never ``by`` themselves."""
    users = get_user_model().objects.filter(is_active=True, groups__name=REVIEWERS)
    if not is_global(by):
        users = users.filter(offices=permit.tenant_id)
    return users.exclude(pk=by.pk).distinct().order_by("username")


def belongs(user_id: int, tenant_id: int) -> bool:
    return Tenant.members.through.objects.filter(user_id=user_id, tenant_id=tenant_id).exists()


def check_grant(permit: PermitRequest, grantee_id: int, by) -> None:
    """Refuse (``OutsideOffice``) a grant by ``by`` that crosses offices; the system
    (``by`` None: seed, shell, migrations) and superusers are not bound."""
    if by is None or is_global(by):
        return
    if not administers(by, permit) or not belongs(grantee_id, permit.tenant_id):
        raise OutsideOffice


# --- the system check: people whose duty is bound to an office they do not have -------


def unplaced_people() -> list[str]:
    """Usernames of active office admins and reviewers who belong to no office."""
    User = get_user_model()
    duty = Q(groups__name__in=[REVIEWERS, OFFICE_ADMINS]) | Q(
        user_permissions__codename=ASSIGN_PERM.split(".", 1)[1],
        user_permissions__content_type__app_label="permits",
    )
    return sorted(
        User.objects.filter(duty, is_active=True, is_superuser=False, offices__isnull=True)
        .values_list(User.USERNAME_FIELD, flat=True)
        .distinct()
    )


def check_offices(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """permits.W001: office admins and reviewers without an office (they see and are
    offered nothing until they have one)."""
    try:
        names = unplaced_people()
    except DatabaseError:  # before migrate (no tables yet): nothing to say
        return []
    if not names:
        return []
    shown = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
    return [
        checks.Warning(
            f"{len(names)} office admin(s) or reviewer(s) belong to no office: {shown}.",
            hint="Add each to their offices (admin: Permit review, Tenants, Members). Until "
            "then an office admin sees no request and a reviewer is offered for none.",
            id="permits.W001",
        )
    ]
