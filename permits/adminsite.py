"""The site's admin: Django's, with one rule for object ids in every admin URL.

A malformed id (``abc`` where the key is a number) answers 404 in every admin view —
the change, history and delete views of every registered model, guardian's
object-permission screens, the user password screen — instead of reaching a query
that raises (a 500) or the admin's "does not exist" redirect. Each view is checked
once here, where ``AdminSite.admin_view`` wraps it, rather than patched one by one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from django.contrib import admin
from django.contrib.admin.options import TO_FIELD_VAR
from django.contrib.admin.utils import unquote
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.exceptions import FieldDoesNotExist, ValidationError
from django.db.models import Field, Model
from django.http import Http404, HttpRequest

# URL keyword → which model's key it names (None: the model admin's own model).
OBJECT_KWARGS = ("object_id", "object_pk", "id")  # Django's views; guardian's; the password view
OTHER_MODEL_KWARGS: dict[str, Callable[[], type[Model]]] = {
    "user_id": get_user_model,  # guardian's per-user permission screen
    "group_id": lambda: Group,  # guardian's per-group permission screen
}


def _id_field(model: type[Model], kwarg: str, request: HttpRequest) -> Field | None:
    if kwarg in OTHER_MODEL_KWARGS:
        return OTHER_MODEL_KWARGS[kwarg]()._meta.pk
    if kwarg not in OBJECT_KWARGS:
        return None
    to_field = request.POST.get(TO_FIELD_VAR, request.GET.get(TO_FIELD_VAR))
    if to_field:
        try:
            return model._meta.get_field(to_field)
        except FieldDoesNotExist:
            return None  # the view itself refuses an unknown to_field (400)
    return model._meta.pk


def well_formed(field: Field, raw: str) -> bool:
    """Whether ``raw`` (as quoted in an admin URL) is a possible value of ``field``."""
    try:
        field.to_python(unquote(raw))
    except (ValidationError, ValueError, TypeError):
        return False
    return True


def reject_malformed_ids(view: Callable) -> Callable:
    """Wrap a model admin's view: 404 before it runs when an id in its URL is malformed."""
    model = getattr(getattr(view, "__self__", None), "model", None)
    if model is None:  # the site's own views (index, login, app lists) take no object ids
        return view

    @functools.wraps(view)
    def checked(request: HttpRequest, *args, **kwargs):
        for kwarg, raw in kwargs.items():
            field = _id_field(model, kwarg, request)
            if field is not None and not well_formed(field, raw):
                raise Http404(f"No {model._meta.verbose_name} with that id")
        return view(request, *args, **kwargs)

    return checked


class SiteAdmin(admin.AdminSite):
    # One product: the admin carries the reviewer site's name (and colours, see
    # templates/admin/base_site.html and static/admin-theme.css).
    site_header = "Permit review · operations"
    site_title = "Permit review operations"
    index_title = "Operations"

    def admin_view(self, view, cacheable=False):
        # The id check runs inside the login and permission check, so an anonymous
        # visitor is sent to the login page as before, whatever the URL.
        return super().admin_view(reject_malformed_ids(view), cacheable)
