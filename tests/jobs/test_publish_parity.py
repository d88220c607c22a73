"""Both executors of one publish plan write the same rows.

Each scenario runs one delivery with the one-statement executor and one with the
ORM executor (two jobs of the same kind with the same inputs), then compares every
row the deliveries wrote: the job, its attempts, the artifact, the effects, their
events and notices, and the queue messages. Ids, foreign keys and timestamps are
compared by meaning (the same reference, a timestamp set or not), everything else
by value.
"""

from __future__ import annotations

import re

import pytest
from django.contrib.auth import get_user_model
from django.db import models
from django_q.models import OrmQ

from jobs import ledger, publish, rules
from jobs.models import Artifact, Attempt, Effect, EffectEvent, Job, Notice
from jobs.registry import EffectSpec, kinds, register_kind
from jobs.runner import JobContext, run_delivery
from jobs.services import request_job

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

KIND = "test.parity"


def _parity_report(ctx: JobContext) -> list[EffectSpec]:
    ctx.check_owner()
    ctx.store_artifact(b"parity report\n", content_type="text/plain", extension="txt")
    specs = [
        EffectSpec("report-ready", "inapp", str(r), {"title": "Report ready", "link": "/r/"})
        for r in ctx.params["recipients"]
    ]
    specs += [EffectSpec("report-mail", "email", str(r)) for r in ctx.params.get("mail", [])]
    return specs


def _kind_says_no(effect: Effect) -> str | None:
    user = ledger.recipient_user(effect)
    return "no longer assigned" if user.username.startswith("gone") else None


if KIND not in kinds():
    register_kind(KIND, _parity_report, authorize_release=_kind_says_no)


def _plain(value, pk: int):
    if isinstance(value, str):
        value = value.replace(f"job-{pk}-", "job-J-")
        return re.sub(rf"^{pk}:", "J:", value)
    return value


def _row(obj: models.Model, pk: int, **special) -> dict:
    out = {}
    for f in obj._meta.concrete_fields:
        if f.primary_key or f.is_relation:
            continue
        value = getattr(obj, f.attname)
        if f.name in special:
            out[f.name] = special[f.name](value)
        elif isinstance(f, models.DateTimeField):
            out[f.name] = value is not None
        else:
            out[f.name] = _plain(value, pk)
    return out


def snapshot(job: Job) -> dict:
    job.refresh_from_db()
    pk = job.pk
    notices = {n.effect_id: n for n in Notice.objects.filter(effect__job=job)}
    effects = []
    for e in Effect.objects.filter(job=job).order_by("effect_id"):
        assert e.idempotency_key == ledger.idempotency_key(e.effect_id)
        notice = notices.get(e.pk)
        if notice is not None:
            assert e.provider_ref == rules.notice_reference(notice.pk)
        events = [_row(ev, pk) for ev in EffectEvent.objects.filter(effect=e).order_by("id")]
        effects.append(
            {
                "row": _row(
                    e,
                    pk,
                    idempotency_key=lambda v: "derived",
                    provider_ref=lambda v: "notice:N" if v.startswith("notice:") else v,
                ),
                "events": events,
                "notice": None if notice is None else _row(notice, pk),
                "messages": sum(
                    1
                    for m in OrmQ.objects.all()
                    if m.func() == "jobs.tasks.release_effect" and m.args() == (e.pk,)
                ),
            }
        )
    return {
        "job": _row(job, pk, subject_id=lambda v: "S", lease_owner=lambda v: v),
        "attempts": [_row(a, pk) for a in Attempt.objects.filter(job=job).order_by("id")],
        "artifacts": [_row(a, pk) for a in Artifact.objects.filter(job=job)],
        "effects": effects,
    }


SCENARIOS = {
    # name: (recipients as username prefixes, mail to the first, deactivate the last before publish)
    "success": (["keep", "keep"], False, False),
    "withheld_by_the_kind": (["keep", "gone"], False, False),
    "deactivated_before_publish": (["keep", "keep"], False, True),
    "external_effect": (["keep"], True, False),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_publish_parity__both_executors_write_the_same_rows(scenario, monkeypatch):
    prefixes, mail, deactivate_last = SCENARIOS[scenario]
    user_model = get_user_model()
    users = [
        user_model.objects.create_user(username=f"{p}-{scenario}-{i}")
        for i, p in enumerate(prefixes)
    ]
    real_carry_out = publish.carry_out
    snapshots, executors = {}, {}
    for n, forced in enumerate(("statement", "orm")):
        user_model.objects.filter(pk__in=[u.pk for u in users]).update(is_active=True)
        used: list[str] = []

        def carry_out(plan, executor=None, _forced=forced, _used=used):
            result = real_carry_out(plan, executor=_forced)
            _used.append(f"{result.executor}:{result.status.value}")
            return result

        def before_publish(stage, ctx):
            if stage == "before_publish" and deactivate_last:
                user_model.objects.filter(pk=users[-1].pk).update(is_active=False)

        monkeypatch.setattr(publish, "carry_out", carry_out)
        job, _ = request_job(
            KIND,
            subject_type="parity",
            subject_id=f"{scenario}-{n}",
            params={
                "recipients": [u.pk for u in users],
                "mail": [users[0].pk] if mail else [],
            },
        )
        assert run_delivery(job.pk, worker="w-parity", on_stage=before_publish).outcome == (
            "succeeded"
        )
        snapshots[forced], executors[forced] = snapshot(job), used
    assert snapshots["statement"] == snapshots["orm"]
    assert executors["orm"][-1] == "orm:won"
    if mail:  # a queue message is not something the statement writes
        assert executors["statement"] == ["orm:won"]
    elif deactivate_last:  # refused in the statement, then built again and published there
        assert executors["statement"] == ["statement:accounts_refused", "statement:won"]
        assert executors["orm"] == ["orm:accounts_refused", "orm:won"]
    else:
        assert executors["statement"] == ["statement:won"]
    by_user = {u.pk: i for i, u in enumerate(users)}
    states = sorted(
        (by_user[int(e["row"]["recipient"])], e["row"]["name"], e["row"]["state"])
        for e in snapshots["orm"]["effects"]
    )
    expected = {
        "success": [(0, "report-ready", "applied"), (1, "report-ready", "applied")],
        "withheld_by_the_kind": [(0, "report-ready", "applied"), (1, "report-ready", "withheld")],
        "deactivated_before_publish": [
            (0, "report-ready", "applied"),
            (1, "report-ready", "withheld"),
        ],
        "external_effect": [(0, "report-mail", "pending"), (0, "report-ready", "applied")],
    }[scenario]
    assert states == expected


def test_refusal__only_the_meant_refusals_make_the_statement_give_way():
    """A row locked elsewhere or a recipient deleted mid-publish: the ORM executor takes
    over. A lost connection is an error, never a refusal (it propagates)."""
    from django.db import OperationalError
    from psycopg import errors

    from jobs import sql

    def wrapped(cause):
        exc = OperationalError(str(cause))
        exc.__cause__ = cause
        return exc

    assert sql.refusal(wrapped(errors.LockNotAvailable("locked"))) == "lock_not_available"
    assert sql.refusal(wrapped(errors.ForeignKeyViolation("gone"))) == "foreign_key_violation"
    assert sql.refusal(wrapped(errors.AdminShutdown("terminating connection"))) is None
    assert sql.refusal(OperationalError("server closed the connection unexpectedly")) is None


def test_carry_out__a_lost_connection_propagates(monkeypatch, django_user_model):
    from django.db import OperationalError

    from jobs import sql

    def lost(plan):
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(sql, "publish", lost)
    user = django_user_model.objects.create_user(username="lost-connection")
    job, _ = request_job(
        KIND, subject_type="parity", subject_id="lost", params={"recipients": [user.pk]}
    )
    with pytest.raises(OperationalError):
        run_delivery(job.pk, worker="w-lost")
    job.refresh_from_db()
    assert job.state == Job.State.RUNNING, "nothing published; the lease runs out, then a reclaim"
    assert not Effect.objects.filter(job=job).exists()
