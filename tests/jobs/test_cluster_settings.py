"""``jobs.q_cluster``: django-q2's settings derived from the app's, in settings.py."""

from __future__ import annotations

import pytest

import jobs
from jobs.cluster import CLAIMING_BROKER, ORM_CLAIMING_BROKER

PG = {"default": {"ENGINE": "django.db.backends.postgresql", "NAME": "shop"}}
SQLITE = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": "db.sqlite3"}}


def test_q_cluster__postgresql_claims_from_the_jobs_table_with_the_lease_rule_held():
    q = jobs.q_cluster(PG, name="shop", lease_seconds=30)
    assert q["broker_class"] == CLAIMING_BROKER and q["orm"] == "default"
    assert 30 < q["timeout"] < q["retry"], "the lease < timeout < retry order (jobs.E002)"
    assert (q["save_limit"], q["max_attempts"], q["ack_failures"]) == (-1, 0, False)
    assert q["workers"] >= 2


def test_q_cluster__sqlite_claims_from_the_jobs_table_through_the_orm():
    q = jobs.q_cluster(SQLITE, name="shop")
    assert q["broker_class"] == ORM_CLAIMING_BROKER and q["orm"] == "default"


def test_q_cluster__the_users_own_keys_win():
    q = jobs.q_cluster(PG, name="shop", workers=3, timeout=500, broker_class="x.Y")
    assert (q["workers"], q["timeout"], q["broker_class"]) == (3, 500, "x.Y")


@pytest.mark.parametrize(
    "args, words",
    [({"database": "jobs"}, "no 'jobs' entry"), ({"lease_seconds": 0}, "lease_seconds")],
)
def test_q_cluster__a_wrong_argument_names_itself(args, words):
    with pytest.raises(ValueError, match=words):
        jobs.q_cluster(PG, **args)
