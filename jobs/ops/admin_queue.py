"""django-q2's own pages: operators read them; changing takes the change permission."""

from __future__ import annotations

from django.contrib import admin


def _guard_resubmit() -> None:
    """django-q2's "resubmit" list action has no permission of its own: require "change"."""
    from django_q import admin as q_admin
    from django_q.models import Failure, Success

    for model, base in ((Success, q_admin.TaskAdmin), (Failure, q_admin.FailAdmin)):

        class Guarded(base):
            def get_actions(self, request):
                found = super().get_actions(request)
                if not self.has_change_permission(request):
                    found.pop("resubmit_task", None)
                return found

        if admin.site.is_registered(model):
            admin.site.unregister(model)
            admin.site.register(model, Guarded)


_guard_resubmit()
