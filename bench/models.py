"""The same-work baselines' one table: an in-app notice with no engine behind it.

``jobs.Notice`` hangs off an ``Effect`` (one-to-one), and the plain tasks make
no engine rows, so they write here instead: the same columns minus the effect.
``bench`` is an app only under ``bench.settings`` and has no migrations; the
table is created once when the benchmark database is prepared.
"""

from __future__ import annotations

from django.conf import settings
from django.db import connection, models
from django.utils import timezone


class PlainNotice(models.Model):
    """An in-app notice written by a plain django-q2 task (``jobs.Notice`` without its effect)."""

    recipient = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+"
    )
    title = models.CharField(max_length=200)
    link = models.CharField(max_length=300, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    read_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "bench_plain_notice"

    def __str__(self) -> str:
        return self.title


def ensure_table() -> None:
    """Create ``bench_plain_notice`` if this database lacks it (``bench`` has no migrations)."""
    if PlainNotice._meta.db_table in connection.introspection.table_names():
        return
    with connection.schema_editor() as editor:
        editor.create_model(PlainNotice)
