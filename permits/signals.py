"""Groups exist after migrate: ``reviewers`` (object permissions only) and ``operators``.

Operators run jobs; reading applicant contacts (``view_applicant_contact``) is a separate
duty that is granted to people one by one, never through the ``operators`` group.
"""

from __future__ import annotations

from django.contrib.auth.models import Group, Permission

OPERATOR_MODELS = {
    "jobs": ["job", "attempt", "artifact", "effect", "effectevent", "notice"],
    "permits": ["tenant", "permitrequest", "reviewdecision"],
    "guardian": ["userobjectpermission", "groupobjectpermission"],
    "axes": ["accessattempt"],  # deleting a lockout's row unlocks that login
}
NOT_FOR_OPERATORS = {"view_applicant_contact"}
# Read-only for operators: django-q2's queue and task pages (evidence, not controls).
OPERATOR_VIEW_ONLY = {"django_q": ["ormq", "success", "failure", "schedule"]}


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
