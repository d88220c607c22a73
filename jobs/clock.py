"""One clock: the database server's.

Every lease, due time and expiry is written and compared inside the SQL
statement with the server's ``now()``, never with a worker's clock, so workers
on machines whose clocks disagree still agree on who holds what. (Timestamps
that are only shown to people may come from anywhere.)
"""

from __future__ import annotations

from datetime import timedelta

from django.db.models import DateTimeField, ExpressionWrapper
from django.db.models.functions import Now

__all__ = ["Now", "after"]


def after(seconds: float) -> ExpressionWrapper:
    """The server's clock plus ``seconds``, evaluated in the statement that writes it."""
    return ExpressionWrapper(Now() + timedelta(seconds=seconds), output_field=DateTimeField())


def before(seconds: float) -> ExpressionWrapper:
    """The server's clock minus ``seconds``, evaluated in the statement that compares it."""
    return ExpressionWrapper(Now() - timedelta(seconds=seconds), output_field=DateTimeField())
