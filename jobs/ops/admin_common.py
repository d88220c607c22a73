"""What every engine screen in the admin shares: read-only pages, filters, state tags, times.

Nobody edits engine fields by hand: ``EngineAdmin`` refuses add, change and delete, and
state changes only through the operations of ``jobs.ops.operations``.
"""

from __future__ import annotations

from datetime import datetime

from django.contrib import admin
from django.db.models import JSONField, Model
from django.utils import formats, timezone
from django.utils.safestring import SafeString

from jobs.models import Effect
from jobs.ops import words
from jobs.ops.operations import OperableAdmin


def shown_time(at: datetime | None) -> str:
    """A compact local time with seconds: lists and history rows compare instants."""
    return "—" if at is None else formats.date_format(timezone.localtime(at), "Y-m-d H:i:s")


def state_tag_of(obj: Model) -> SafeString:
    """The job's or effect's state as the admin's status tag ("Stopped · dead"); a job's in
    its kind's words."""
    if isinstance(obj, Effect):
        return words.state_tag(obj.state, effect=True)
    return words.state_tag(obj.state, kind=getattr(obj, "kind", ""))


# --- list filters ------------------------------------------------------------------------


def value_filter(field: str, title: str) -> type[admin.SimpleListFilter]:
    """A filter on ``field``'s values, the empty value listed as "none" (never as an empty link)."""

    class ValueFilter(admin.SimpleListFilter):
        parameter_name = field

        def lookups(self, request, model_admin):
            values = (
                model_admin.get_queryset(request)
                .exclude(**{field: ""})
                .values_list(field, flat=True)
                .distinct()
                .order_by(field)
            )
            return [(v, v.replace("_", " ")) for v in values] + [("-", "none")]

        def queryset(self, request, queryset):
            value = self.value()
            if value is None:
                return queryset
            return queryset.filter(**{field: "" if value == "-" else value})

    ValueFilter.title = title
    ValueFilter.__name__ = f"{field.title().replace('_', '')}Filter"
    return ValueFilter


def state_filter(model: type[Model]) -> type[admin.SimpleListFilter]:
    """The state filter in the shared words with the engine's name ("Stopped · dead"); the
    URL keeps the engine's value (``?state__exact=dead``), as links and bookmarks use it."""
    table = words.EFFECT_STATE_WORDS if model is Effect else words.JOB_STATE_WORDS

    class StateFilter(admin.SimpleListFilter):
        title = "state"
        parameter_name = "state__exact"

        def lookups(self, request, model_admin):
            return [(s, f"{w.word} · {s.replace('_', ' ')}") for s, w in table.items()]

        def queryset(self, request, queryset):
            value = self.value()
            return queryset if value is None else queryset.filter(state=value)

    return StateFilter


# --- inlines -----------------------------------------------------------------------------


class ReadOnlyInline(admin.TabularInline):
    """History rows of the object on the page; left out when there are none (an empty
    table says nothing, and on a phone it is a scroll box with nothing to focus)."""

    extra = 0
    can_delete = False
    show_change_link = True
    template = "admin/jobs/readonly_tabular.html"  # a focusable region (scrolls on a phone)

    def has_rows(self, obj) -> bool:
        return self.model._default_manager.filter(**{self.fk_name: obj}).exists()


class EngineAdmin(OperableAdmin):
    """Everything read-only: state changes only through operations."""

    class Media:
        css = {"all": ["jobs/admin.css"]}
        js = ["jobs/follow.js", "jobs/live.js"]

    def get_inline_instances(self, request, obj=None):
        inlines = super().get_inline_instances(request, obj)
        if obj is None:
            return inlines
        return [i for i in inlines if not isinstance(i, ReadOnlyInline) or i.has_rows(obj)]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    def lookup_allowed(self, lookup, value, request):
        # Params and effect data are a kind's free-form payload: the engine cannot tell
        # what is private in them, so a URL may not filter on them (?params__x__startswith=
        # would answer yes or no per prefix). Refused with 400 like any disallowed lookup.
        payloads = {f.name for f in self.opts.get_fields() if isinstance(f, JSONField)}
        if lookup.split("__", 1)[0] in payloads:
            return False
        return super().lookup_allowed(lookup, value, request)


class LastErrorColumn:
    """A list column for rows with ``last_error_class``/``last_error_code``."""

    @admin.display(description="last error", ordering="last_error_class")
    def last_error(self, obj):
        if not obj.last_error_class:
            return "—"
        return " · ".join(x for x in (obj.last_error_class, obj.last_error_code) if x)
