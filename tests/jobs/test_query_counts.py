"""Pinned query counts of the hot path: a regression (or an improvement) fails here first.

Django logs transaction control too, so every count below includes BEGIN and
COMMIT (or, inside the test's own transaction, SAVEPOINT and RELEASE: the same
number of entries). Each entry is one round trip to the database. When a change
to the engine moves a number on purpose, update it here together with the
comment that says which statement went away or came in, and the figures in
docs/benchmarks.md.

PostgreSQL takes one statement more in the claim: the per-tenant advisory lock
(SQLite serializes writers with ``BEGIN IMMEDIATE`` instead).
"""

from __future__ import annotations

import pytest
from django.db import connection

from jobs.models import Attempt, Effect, Job, Notice
from jobs.runner import run_delivery
from tests.jobs.helpers import new_job

pytestmark = pytest.mark.django_db

# request_job: create the job and its queue message in one transaction.
#   BEGIN
#   SELECT jobs_job by (kind, subject, revision)   -- get_or_create: is it there?
#   SAVEPOINT                                      -- get_or_create's create
#   INSERT jobs_job
#   RELEASE SAVEPOINT
#   INSERT django_q_ormq                           -- the message, same transaction
#   SELECT next_attempt_at, enqueued_for           -- written by the server's clock (issue 10)
#   COMMIT
REQUEST_JOB = 8

# run_delivery of a test.steps job (no stages) with one in-app recipient.
#   claim (one transaction):
#     BEGIN
#     SELECT jobs_job by id
#     SELECT pg_advisory_xact_lock(tenant)         -- PostgreSQL only
#     SELECT COUNT(*) live running jobs of the tenant
#     UPDATE jobs_job CAS queued → running (version, lease, attempts+1)
#     INSERT jobs_attempt
#     COMMIT
#   handler:
#     SELECT 1 jobs_job still owned                -- check_owner before the private read
#     SELECT 1 jobs_job still owned                -- store_artifact checks again
#     SELECT jobs_artifact by key                  -- a row from an earlier worker?
#     BEGIN; INSERT jobs_artifact; COMMIT
#   publish (one transaction): completion, the ledger row and the in-app notice
#     BEGIN
#     UPDATE jobs_job CAS running → succeeded (version, owner)
#     SELECT auth_user recipient                   -- policy recheck, right before release
#     INSERT jobs_effect (born applied)            -- the ledger row(s), bulk_create
#     SAVEPOINT; INSERT jobs_notice; RELEASE       -- the in-app provider's effect
#     UPDATE jobs_effect provider_ref              -- bulk_update
#     INSERT jobs_effectevent                      -- the send's history
#     UPDATE jobs_attempt outcome = succeeded
#     COMMIT
#   (before the in-app release moved into publish this was 13 round trips and 3 commits:
#    SELECT pending effects, an autocommit UPDATE to sending, a second transaction.)
RUN_DELIVERY = {"postgresql": 24, "sqlite": 23}

# A second delivery of a finished job: recorded, nothing else happens.
#   BEGIN; SELECT jobs_job by id; INSERT jobs_attempt (duplicate_delivery); COMMIT
DUPLICATE_DELIVERY = 4


def test_request_job__queries(make_user, django_assert_num_queries):
    user = make_user()
    with django_assert_num_queries(REQUEST_JOB):
        job = new_job(user)
    assert job.state == Job.State.QUEUED


def test_run_delivery__queries(make_user, django_assert_num_queries):
    user = make_user()
    job = new_job(user)
    with django_assert_num_queries(RUN_DELIVERY[connection.vendor]):
        result = run_delivery(job.pk, worker="w1")
    assert result.outcome == Attempt.Outcome.SUCCEEDED
    assert Effect.objects.get(job=job).state == Effect.State.APPLIED
    assert Notice.objects.filter(effect__job=job, recipient=user).count() == 1


def test_run_delivery__duplicate_queries(make_user, django_assert_num_queries):
    user = make_user()
    job = new_job(user)
    run_delivery(job.pk, worker="w1")
    with django_assert_num_queries(DUPLICATE_DELIVERY):
        result = run_delivery(job.pk, worker="w2")
    assert result.outcome == "duplicate"
    assert Attempt.objects.filter(job=job, outcome=Attempt.Outcome.DUPLICATE_DELIVERY).count() == 1
