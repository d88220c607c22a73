"""System checks name what is missing; settings have one documented home (``jobs.conf``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.db import connection

from jobs import checks, executors, queue
from jobs.providers import email

ROOT = Path(__file__).resolve().parents[2]
# The claiming broker of the test database (the jobs table is the queue, jobs.E021).
GOOD_BROKER = (
    queue.CLAIMING_BROKER if connection.vendor == "postgresql" else queue.ORM_CLAIMING_BROKER
)
GOOD_Q = {"orm": "default", "timeout": 5, "retry": 7, "broker_class": GOOD_BROKER}


def _ids(messages) -> list[str]:
    return [m.id for m in messages]


def test_check_django_q__missing_app_is_named(settings):
    settings.INSTALLED_APPS = [a for a in settings.INSTALLED_APPS if a != "django_q"]
    [error] = queue.check_django_q()
    assert error.id == "jobs.E020" and "'django_q' must be in INSTALLED_APPS" in error.msg


def test_check_broker__the_claiming_broker_on_the_jobs_database(settings):
    settings.Q_CLUSTER = {**GOOD_Q}
    assert queue.check_broker() == []
    settings.Q_CLUSTER = {"timeout": 5, "retry": 7, "broker_class": GOOD_BROKER}
    [error] = queue.check_broker()
    assert error.id == "jobs.E021" and "Q_CLUSTER['orm']" in error.msg
    settings.Q_CLUSTER = {**GOOD_Q, "orm": "other"}
    [error] = queue.check_broker()
    assert error.id == "jobs.E022" and "'other'" in error.msg and "'default'" in error.msg


def test_check_broker__a_message_broker_is_refused_the_postgres_claimer_needs_postgresql(
    settings,
):
    """A job has no message: a cluster on any broker but a claiming one would never run it
    (django-q2's ORM broker, left unset, included); under ``sync`` nothing is claimed."""
    for other in (
        "django_q.brokers.redis_broker.Redis",
        "jobs.broker.PostgresBroker",
        None,
    ):
        settings.Q_CLUSTER = {**GOOD_Q, "broker_class": other}
        [error] = queue.check_broker()
        assert error.id == "jobs.E021", other
        assert (other or "unset") in error.msg and GOOD_BROKER in error.hint, error
    settings.Q_CLUSTER = {**GOOD_Q, "broker_class": None, "sync": True}
    assert queue.check_broker() == []
    settings.Q_CLUSTER = {**GOOD_Q, "broker_class": queue.ORM_CLAIMING_BROKER}
    assert queue.check_broker() == [], "the ORM's claiming broker serves any database"
    settings.Q_CLUSTER = {**GOOD_Q, "broker_class": queue.CLAIMING_BROKER}
    if connection.vendor == "postgresql":
        assert queue.check_broker() == []
    else:
        [error] = queue.check_broker()
        assert error.id == "jobs.E023" and connection.vendor in error.msg


@pytest.mark.parametrize(
    ("lease", "q", "ids"),
    [
        (2, GOOD_Q, []),
        (2, {"orm": "default"}, ["jobs.E001"]),
        (6, GOOD_Q, ["jobs.E002"]),
        (2, {**GOOD_Q, "retry": 5}, ["jobs.E002"]),
    ],
)
def test_check_timing__lease_below_timeout_below_retry(settings, lease, q, ids):
    settings.JOBS_LEASE_SECONDS, settings.Q_CLUSTER = lease, q
    assert _ids(checks.check_timing()) == ids


def test_check_webhook__url_token_and_form(settings):
    settings.NOTICE_PROVIDER_URL = ""
    assert checks.check_webhook() == []
    settings.NOTICE_PROVIDER_URL, settings.NOTICE_PROVIDER_TOKEN = "127.0.0.1:9", "t"
    assert _ids(checks.check_webhook()) == ["jobs.E012"]
    settings.NOTICE_PROVIDER_URL, settings.NOTICE_PROVIDER_TOKEN = "http://127.0.0.1:9", ""
    [warning] = checks.check_webhook()
    assert warning.id == "jobs.W011" and "NOTICE_PROVIDER_TOKEN" in warning.msg
    settings.NOTICE_PROVIDER_TOKEN = "t"
    assert checks.check_webhook() == []


def test_check_email_and_inline_release__sends_fit_their_leases(settings):
    settings.EMAIL_TIMEOUT, settings.JOBS_PROVIDER_SLOT_WAIT_SECONDS = 5, 1
    settings.JOBS_EFFECT_LEASE_SECONDS = 30
    settings.JOBS_LEASE_SECONDS, settings.Q_CLUSTER = 10, {**GOOD_Q, "timeout": 20, "retry": 30}
    settings.NOTICE_PROVIDER_URL = ""
    assert email.check_email_timing() == [] and checks.check_inline_release() == []
    settings.JOBS_EFFECT_LEASE_SECONDS = 6
    assert _ids(email.check_email_timing()) == ["jobs.W012"]
    settings.EMAIL_TIMEOUT = 19
    [warning] = checks.check_inline_release()
    assert warning.id == "jobs.W013" and "email send (20)" in warning.msg


def test_check_fences__margin_within_two_thirds_and_lock_wait_below_the_lease(settings):
    settings.JOBS_LEASE_SECONDS = 60
    settings.JOBS_TRANSACTION_IDLE_SECONDS, settings.JOBS_LOCK_TIMEOUT_SECONDS = 40, 30
    assert checks.check_fences() == []
    settings.JOBS_TRANSACTION_IDLE_SECONDS, settings.JOBS_LOCK_TIMEOUT_SECONDS = 41, 60
    errors = checks.check_fences()
    assert _ids(errors) == ["jobs.E005", "jobs.E006"]
    assert "JOBS_TRANSACTION_IDLE_SECONDS" in errors[0].msg
    assert "JOBS_LOCK_TIMEOUT_SECONDS" in errors[1].msg


def test_check_hot_path__names_the_path_and_why():
    [info] = executors.check_hot_path(databases=["default"])
    assert info.id == "jobs.I001"
    if connection.vendor == "postgresql":
        assert "psycopg 3" in info.msg
    else:
        assert "ORM path" in info.msg


def test_check_setting_values__a_typo_is_named(settings):
    assert checks.check_setting_values() == []
    settings.JOBS_LEASE_SECONDS = "sixty"
    settings.JOBS_MAX_ATTEMPTS = 0
    assert [m.msg.split()[0] for m in checks.check_setting_values()] == [
        "JOBS_LEASE_SECONDS",
        "JOBS_MAX_ATTEMPTS",
    ]


def test_check_setting_values__a_switch_turned_off_is_no_error(settings):
    """docs/deployment.md: JOBS_PREPARED_STATEMENTS=0 behind PgBouncer in transaction mode."""
    settings.JOBS_PREPARED_STATEMENTS = False
    assert checks.check_setting_values() == []


def test_conf__no_engine_module_reads_a_jobs_setting_around_conf():
    """Every default lives once, in jobs.conf: nobody else calls getattr(settings, NAME, ...)."""
    pattern = re.compile(r"getattr\(settings,\s*\"(JOBS_|NOTICE_|METRICS_)")
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "jobs").rglob("*.py")
        if path.name != "conf.py" and pattern.search(path.read_text())
    ]
    assert offenders == []


class _FakeConnection:
    vendor = "sqlite"

    def __init__(self, name, options):
        self.settings_dict = {"NAME": name, "OPTIONS": options}


SQLITE_SAFE = {
    "transaction_mode": "IMMEDIATE",
    "init_command": "PRAGMA journal_mode=WAL; PRAGMA busy_timeout=5000;",
}


@pytest.mark.parametrize(
    ("name", "options", "missing"),
    [
        ("db.sqlite3", SQLITE_SAFE, []),
        ("db.sqlite3", {}, ["transaction_mode", "journal_mode=WAL"]),
        ("db.sqlite3", {"transaction_mode": "IMMEDIATE"}, ["journal_mode=WAL"]),
        ("db.sqlite3", {"init_command": "PRAGMA journal_mode = wal"}, ["transaction_mode"]),
        (":memory:", {"transaction_mode": "immediate"}, []),  # WAL means nothing in memory
    ],
)
def test_check_sqlite__names_the_options_to_add(monkeypatch, name, options, missing):
    monkeypatch.setattr(checks, "connections", {"default": _FakeConnection(name, options)})
    found = checks.check_sqlite()
    if not missing:
        assert found == []
        return
    [warning] = found
    assert warning.id == "jobs.W015" and warning.level == checks.Warning("").level
    assert all(word in warning.msg for word in missing), warning.msg
    # The hint is the snippet to paste.
    assert "'transaction_mode': 'IMMEDIATE'" in warning.hint
    assert "journal_mode=WAL" in warning.hint


def test_check_sqlite__silent_on_other_databases_and_on_this_sites_settings():
    """The site's own SQLite settings (the demo) and PostgreSQL pass without a word."""
    assert checks.check_sqlite() == []


urlpatterns: list = []  # a URLconf without the metrics view (ROOT_URLCONF = __name__)


def test_check_metrics__routed_without_prometheus_client_warns(settings, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "prometheus_client" else real(name, *a),
    )
    [warning] = checks.check_metrics()  # the site routes jobs.urls
    assert warning.id == "jobs.W016" and "django-jobs-ledger[metrics]" in warning.hint
    settings.ROOT_URLCONF = __name__
    assert checks.check_metrics() == []


def test_check_metrics__silent_with_the_extra_installed():
    pytest.importorskip("prometheus_client")
    assert checks.check_metrics() == []


def test_check_setting_values__follow_on_zero_turns_it_off_a_negative_is_named(settings):
    settings.JOBS_FOLLOW_ON_SECONDS = 0
    assert checks.check_setting_values() == []
    settings.JOBS_FOLLOW_ON_SECONDS = -1
    [error] = checks.check_setting_values()
    assert error.id == "jobs.E004"
    assert error.msg == "JOBS_FOLLOW_ON_SECONDS must be a number >= 0 (0 turns it off), got -1"
    settings.JOBS_LEASE_SECONDS = 0
    assert "JOBS_LEASE_SECONDS must be a positive number" in _ids_msgs(
        checks.check_setting_values()
    )


def _ids_msgs(messages) -> str:
    return " | ".join(m.msg for m in messages)
