"""On SQLite the PostgreSQL broker refuses to start: django-q2's ORM broker stays there."""

from __future__ import annotations

import pytest
from django.db import connection

from jobs.broker import PostgresBroker


@pytest.mark.django_db
def test_broker__refuses_sqlite_where_the_orm_broker_stays():
    if connection.vendor != "sqlite":
        pytest.skip("the SQLite leg's test")
    with pytest.raises(RuntimeError, match="ORM broker"):
        PostgresBroker(list_key="sqlite")
