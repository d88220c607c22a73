"""Fixtures for end-to-end tests with real processes."""

from __future__ import annotations

import pytest

from jobs.testing.fakeprovider import start_in_thread
from tests.e2e.processes import PROVIDER_TOKEN, site_processes, subprocess_env


@pytest.fixture
def procs(request, transactional_db, tmp_path):
    """Start processes through this; all are killed before the database is flushed."""
    failed_before = request.session.testsfailed
    processes = site_processes(subprocess_env(), tmp_path)
    try:
        yield processes
    finally:
        processes.stop_all()
        if request.session.testsfailed > failed_before:
            print(f"\n===== subprocess logs (in {tmp_path}) =====\n{processes.logs(tail=400)}")


@pytest.fixture
def provider(tmp_path):
    """The stand-in notice provider on loopback (token ``PROVIDER_TOKEN``); set its faults."""
    server = start_in_thread(tmp_path / "provider.sqlite3", token=PROVIDER_TOKEN)
    yield server
    server.stop()


# The engine's django-q2 entry points: none may ever have a ``django_q_ormq`` row (the
# jobs table and the ledger are the queue, issue 41). Plain tasks of other functions may.
ENGINE_TASKS = frozenset(
    {
        "jobs.tasks.run_job",
        "jobs.tasks.release_effect",
        "jobs.tasks.run_claimed",
        "jobs.tasks.release_claimed",
    }
)
_SEEN = "test_ormq_inserted"


class OrmqInserts:
    """Every row any process inserted into ``django_q_ormq`` while the test ran, copied by
    a trigger into a side table (a row deleted at once, an acknowledged message, is still
    seen here): so "no engine job has a message" holds at every point, not at the end."""

    def rows(self) -> list[tuple[int, str, str]]:
        """(message id, list key, func) of every insert so far, oldest first."""
        from django.db import connection
        from django_q.signing import BadSignature, SignedPackage

        with connection.cursor() as cursor:
            cursor.execute(f"SELECT id, key, payload FROM {_SEEN} ORDER BY seq")
            found = cursor.fetchall()
        out = []
        for pk, key, payload in found:
            try:
                func = SignedPackage.loads(payload).get("func")
            except BadSignature:
                func = "<undecodable>"
            out.append((pk, key, func if isinstance(func, str) else repr(func)))
        return out

    def engine_rows(self) -> list[tuple[int, str, str]]:
        return [row for row in self.rows() if row[2] in ENGINE_TASKS or row[2] == "<undecodable>"]

    def assert_no_engine_message(self) -> None:
        engine = self.engine_rows()
        assert not engine, f"an engine job or effect had a django_q_ormq row: {engine}"


@pytest.fixture
def no_engine_messages(transactional_db):
    """Watch ``django_q_ormq`` for the whole test: a trigger records every insert, and at
    the end no insert may have been of an engine task (``ENGINE_TASKS``). Request it before
    ``procs`` so that it sees the processes' first statement and checks after they stop."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE TABLE IF NOT EXISTS {_SEEN} (seq bigserial PRIMARY KEY, id integer, "
            "key varchar(100), payload text, seen_at timestamptz DEFAULT clock_timestamp())"
        )
        cursor.execute(f"TRUNCATE {_SEEN}")
        cursor.execute(
            f"CREATE OR REPLACE FUNCTION {_SEEN}_copy() RETURNS trigger LANGUAGE plpgsql AS "
            f"$$ BEGIN INSERT INTO {_SEEN} (id, key, payload) "
            "VALUES (NEW.id, NEW.key, NEW.payload); RETURN NEW; END $$"
        )
        cursor.execute(f"DROP TRIGGER IF EXISTS {_SEEN}_copy ON django_q_ormq")
        cursor.execute(
            f"CREATE TRIGGER {_SEEN}_copy AFTER INSERT ON django_q_ormq "
            f"FOR EACH ROW EXECUTE FUNCTION {_SEEN}_copy()"
        )
    watch = OrmqInserts()
    try:
        yield watch
        watch.assert_no_engine_message()
    finally:
        with connection.cursor() as cursor:
            cursor.execute(f"DROP TRIGGER IF EXISTS {_SEEN}_copy ON django_q_ormq")
            cursor.execute(f"DROP FUNCTION IF EXISTS {_SEEN}_copy()")
            cursor.execute(f"DROP TABLE IF EXISTS {_SEEN}")
