"""Groups exist after migrate: ``reviewers`` (object permissions only) and ``operators``.

Operators run jobs; reading applicant contacts (``view_applicant_contact``) is a separate
duty that is granted to people one by one, never through the ``operators`` group.
"""

from __future__ import annotations

from django.contrib.auth.models import Group, Permission

OPERATOR_MODELS = {
    "jobs": ["job", "attempt", "artifact", "effect", "notice"],
    "permits": ["tenant", "permitrequest", "reviewdecision"],
    "guardian": ["userobjectpermission", "groupobjectpermission"],
    "axes": ["accessattempt"],  # deleting a lockout's row unlocks that login
}
NOT_FOR_OPERATORS = {"view_applicant_contact"}


def create_groups(sender=None, **kwargs) -> None:
    # Reviewers get no model-wide permission: what they see comes from the
    # per-request `review_permitrequest` object permission alone.
    Group.objects.get_or_create(name="reviewers")
    operators, _ = Group.objects.get_or_create(name="operators")
    perms = Permission.objects.filter(
        content_type__app_label__in=OPERATOR_MODELS.keys()
    ).select_related("content_type")
    wanted = [
        p
        for p in perms
        if p.content_type.model in OPERATOR_MODELS[p.content_type.app_label]
        and p.codename not in NOT_FOR_OPERATORS
    ]
    operators.permissions.add(*wanted)
