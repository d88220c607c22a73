"""Groups exist after migrate: ``reviewers`` (object permissions only), ``operators`` and
``office-admins``; and every grant or revocation of review is recorded.

Operators run jobs. Reading applicant contacts (``view_applicant_contact``) is a separate
duty granted to people one by one, never through a group. Assigning reviewers
(``assign_reviewer``) is the office admins' duty: they hold nothing else but the
assignment records and the login lockouts they may lift; which requests they see comes
from their offices (``permits.offices``), not from a model-wide view. Nobody but a
superuser holds guardian's own object-permission models or screens.

Every grant of review to a user, made by a person, asks for the reviewer's "New request
assigned to you" notice in the same transaction; every revocation turns the reviewer's
notices of that request into "No longer assigned" with no link (``permits.notices``).
"""

from __future__ import annotations

from django.contrib.auth.models import Group, Permission

OPERATOR_MODELS = {
    # flowrule: pause, resume and change limits are the duty of the people on call.
    "jobs": ["job", "attempt", "artifact", "effect", "effectevent", "notice", "flowrule"],
    "permits": ["tenant", "permitrequest", "reviewdecision"],
    "axes": ["accessattempt"],  # deleting a lockout's row unlocks that login
}
# Decisions are the reviewers' record: a superuser alone deletes one (issue 44), and
# a request with decisions cannot be deleted around that rule either.
NOT_FOR_OPERATORS = {"view_applicant_contact", "assign_reviewer", "delete_reviewdecision"}
# Read-only for operators: django-q2's queue and task pages (evidence, not controls), and
# the record of assignments.
OPERATOR_VIEW_ONLY = {
    "django_q": ["ormq", "success", "failure", "schedule"],
    "permits": ["reviewerassignment"],
    # What the engine records of a job beside its attempts (issue 44: without these the
    # job page hid its steps, its group and its history from operators).
    "jobs": ["jobstep", "jobgroup", "jobevent", "flowrulechange", "schedulestate", "archivedjob"],
}
OFFICE_ADMINS = "office-admins"
OFFICE_ADMIN_PERMS = [
    ("permits", "assign_reviewer"),
    ("permits", "view_reviewerassignment"),
    ("axes", "view_accessattempt"),
    ("axes", "delete_accessattempt"),  # unlock a login (or an address)
]


NO_LONGER_FOR_OFFICE_ADMINS = [("permits", "view_permitrequest")]


def _perms(pairs):
    return [
        p
        for p in Permission.objects.filter(codename__in=[c for _, c in pairs]).select_related(
            "content_type"
        )
        if (p.content_type.app_label, p.codename) in set(pairs)
    ]


def create_groups(sender=None, **kwargs) -> None:
    # Reviewers get no model-wide permission: what they see comes from the
    # per-request `review_permitrequest` object permission alone.
    Group.objects.get_or_create(name="reviewers")
    operators, _ = Group.objects.get_or_create(name="operators")
    apps = [*OPERATOR_MODELS, *OPERATOR_VIEW_ONLY]
    perms = Permission.objects.filter(content_type__app_label__in=apps).select_related(
        "content_type"
    )
    wanted = [
        p
        for p in perms
        if p.codename not in NOT_FOR_OPERATORS
        and (
            p.content_type.model in OPERATOR_MODELS.get(p.content_type.app_label, ())
            or (
                p.content_type.model in OPERATOR_VIEW_ONLY.get(p.content_type.app_label, ())
                and p.codename.startswith("view_")
            )
        )
    ]
    operators.permissions.add(*wanted)
    # What earlier versions gave operators and no longer do (a migrate takes it back).
    operators.permissions.remove(
        *Permission.objects.filter(content_type__app_label="guardian"),
        *Permission.objects.filter(
            content_type__app_label="permits", codename__in=NOT_FOR_OPERATORS
        ),
    )
    office, _ = Group.objects.get_or_create(name=OFFICE_ADMINS)
    office.permissions.add(*_perms(OFFICE_ADMIN_PERMS))
    # Earlier versions gave office admins every request to view (issue 33: an office
    # admin read other offices' requests); their offices decide now.
    office.permissions.remove(*_perms(NO_LONGER_FOR_OFFICE_ADMINS))


# --- grants and revocations of object permissions on requests: recorded, never to oneself ---


def _on_requests(instance) -> bool:
    from django.contrib.contenttypes.models import ContentType

    from permits.models import PermitRequest

    return instance.content_type_id == ContentType.objects.get_for_model(PermitRequest).pk


def refuse_self_grant(sender, instance, raw=False, **kwargs) -> None:
    """The last line of "nobody grants a permission to themselves": whatever screen or
    code path writes guardian's row, a known actor may not be its holder."""
    from permits.services import SelfGrantRefused, current_actor

    if raw or not instance._state.adding or not _on_requests(instance):
        return
    actor, _ = current_actor()
    if actor is None:
        return
    group_id = getattr(instance, "group_id", None)
    if getattr(instance, "user_id", None) == actor.pk or (
        group_id is not None and actor.groups.filter(pk=group_id).exists()
    ):
        raise SelfGrantRefused
    refuse_outside_office(instance, actor)


def refuse_outside_office(instance, actor) -> None:
    """The last line of the office rule: a known actor grants review on a request of their
    office to a reviewer of that office only (a superuser is bound by no office)."""
    from permits.models import PermitRequest
    from permits.offices import OutsideOffice, check_grant

    permit = PermitRequest.objects.filter(pk=instance.object_pk).first()
    if permit is None:
        return
    user_id = getattr(instance, "user_id", None)
    if user_id is None:  # a group: only superusers reach guardian's group screen
        if not (actor.is_active and actor.is_superuser):
            raise OutsideOffice
        return
    check_grant(permit, user_id, actor)


def _record(instance, action: str):
    from permits.models import ReviewerAssignment
    from permits.services import current_actor

    actor, via = current_actor()
    return ReviewerAssignment.objects.create(
        request_id=int(instance.object_pk),
        action=action,
        permission=instance.permission.codename,
        reviewer_id=getattr(instance, "user_id", None),
        group_id=getattr(instance, "group_id", None),
        actor=actor,
        via=via or "system",
    )


def _is_review(instance) -> bool:
    from permits.models import REVIEW_PERM

    return instance.permission.codename == REVIEW_PERM.split(".", 1)[1]


def record_grant(sender, instance, created=False, raw=False, **kwargs) -> None:
    if created and not raw and _on_requests(instance):
        record = _record(instance, "granted")
        # A person's grant tells the reviewer; the system's (seed, shell, migrations) is
        # setup and stays silent.
        if record.actor_id is not None and record.reviewer_id is not None and _is_review(instance):
            from permits.notices import ask_assigned_notice

            ask_assigned_notice(record)


def record_revocation(sender, instance, **kwargs) -> None:
    from permits.models import PermitRequest

    if _on_requests(instance) and PermitRequest.objects.filter(pk=instance.object_pk).exists():
        _record(instance, "revoked")
        user_id = getattr(instance, "user_id", None)
        if user_id is not None and _is_review(instance):
            from permits.notices import forget_request

            forget_request(int(instance.object_pk), user_id)


# --- offices that hold: leaving an office takes the grants on its requests -------------


def revoke_on_leaving(sender, instance, action, reverse, model, pk_set, **kwargs) -> None:
    """Whoever leaves an office loses their object grants on its requests, in the
    transaction that removes them (``Tenant.members``, from either side), recorded."""
    from permits.models import Tenant
    from permits.services import revoke_office_grants

    if action not in ("pre_remove", "pre_clear"):
        return
    if action == "pre_clear":
        # Django gives no pk_set for a clear: whom (or which offices) it is about to drop.
        if reverse:  # user.offices.clear()
            pk_set = set(instance.offices.values_list("pk", flat=True))
        else:  # tenant.members.clear()
            pk_set = set(instance.members.values_list("pk", flat=True))
    if not pk_set:
        return
    if isinstance(instance, Tenant):
        revoke_office_grants([instance.pk], pk_set)
    else:
        revoke_office_grants(pk_set, [instance.pk])


def refuse_decision_edit(sender, instance, raw=False, **kwargs) -> None:
    """A recorded decision is never edited in place: a change is a new row that names the
    one it replaces (``services.decide``), so the record of every change stays whole."""
    if raw or instance._state.adding or instance.pk is None:
        return
    from django.core.exceptions import PermissionDenied

    raise PermissionDenied("A recorded decision is not edited: record a change instead.")


def log_decision_deleted(sender, instance, **kwargs) -> None:
    """A deleted decision (a superuser's act, or its request's deletion) is logged by id."""
    import logging

    from permits.services import current_actor

    actor, via = current_actor()
    logging.getLogger("permits.decisions").warning(
        "decision deleted: decision=%s request=%s reviewer=%s revision=%s actor=%s via=%s",
        instance.pk,
        instance.request_id,
        instance.reviewer_id,
        instance.revision,
        getattr(actor, "pk", None),
        via or "-",
    )


def connect_assignment_audit() -> None:
    from django.db.models.signals import post_delete, post_save, pre_save
    from guardian.models import GroupObjectPermission, UserObjectPermission

    for model in (UserObjectPermission, GroupObjectPermission):
        uid = model.__name__
        pre_save.connect(refuse_self_grant, sender=model, dispatch_uid=f"permits.self.{uid}")
        post_save.connect(record_grant, sender=model, dispatch_uid=f"permits.grant.{uid}")
        post_delete.connect(record_revocation, sender=model, dispatch_uid=f"permits.revoke.{uid}")
    from django.db.models.signals import m2m_changed

    from permits.models import ReviewDecision, Tenant

    m2m_changed.connect(
        revoke_on_leaving, sender=Tenant.members.through, dispatch_uid="permits.leave_office"
    )
    pre_save.connect(refuse_decision_edit, sender=ReviewDecision, dispatch_uid="permits.decision")
    post_delete.connect(
        log_decision_deleted, sender=ReviewDecision, dispatch_uid="permits.decision_deleted"
    )
