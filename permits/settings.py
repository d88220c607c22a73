"""Site settings, read from environment variables; safe for production by default.

DEBUG is off unless DEBUG=1 (only ``make demo`` and the tests set it). With DEBUG
off, SECRET_KEY (strong, as ``check --deploy`` judges) and ALLOWED_HOSTS are
required: a missing or weak value stops start-up with the variable's name.
docs/production.md lists the rest.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import dj_database_url
from csp.constants import NONE, SELF
from django.core.checks.security.base import (
    SECRET_KEY_INSECURE_PREFIX,
    SECRET_KEY_MIN_LENGTH,
    SECRET_KEY_MIN_UNIQUE_CHARACTERS,
)
from django.core.exceptions import ImproperlyConfigured


class SettingError(ImproperlyConfigured):
    """A variable is missing or wrong: start-up stops with one paragraph, no traceback.

    Raised while the settings load; when nothing catches it (``manage.py``, a worker),
    the process ends with the message as an operator reads it. Every other exception
    keeps Python's own report.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        if sys.excepthook is not _report_setting_error:
            _previous_excepthook[0] = sys.excepthook
            sys.excepthook = _report_setting_error


_previous_excepthook = [sys.excepthook]


def _report_setting_error(kind, exc, tb) -> None:
    if not isinstance(exc, SettingError):
        _previous_excepthook[0](kind, exc, tb)
        return
    sys.stderr.write(
        f"ImproperlyConfigured: {exc}\n"
        "The site did not start. Production variables: docs/production.md.\n"
    )


BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("VAR_DIR", BASE_DIR / "var"))


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in {"1", "true", "yes", "on"}:
        return True
    if raw.lower() in {"0", "false", "no", "off"}:
        return False
    raise SettingError(f"{name} must be a boolean (1/0, true/false), got {raw!r}")


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise SettingError(f"{name} must be an integer, got {raw!r}") from None


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise SettingError(f"{name} must be a number, got {raw!r}") from None


DEBUG = env_bool("DEBUG", False)
# The demo (scripts/demo.sh sets DEMO=1 with DEBUG=1): the login page lists the seeded
# accounts. Never with DEBUG off, whatever DEMO says.
DEMO = DEBUG and env_bool("DEMO", False)
# (login, password, what they see), as manage.py seed_demo creates them.
DEMO_ACCOUNTS = (
    ("reviewer47", "reviewer-demo", "My queue, reports and notices"),
    ("reviewer52", "reviewer-demo", "another reviewer's queue"),
    ("operator", "operator-demo", "the admin and the operations console"),
    ("officeadmin", "officeadmin-demo", "assigns reviewers on each request"),
)


def demo_accounts(request) -> dict:
    """Template context: the demo's accounts on the login page, only in the demo."""
    from django.conf import settings

    return {"demo_accounts": DEMO_ACCOUNTS} if getattr(settings, "DEMO", False) else {}


DEMO_SECRET_KEY = "demo-only-insecure-key-do-not-use-in-production"
_DEMO_HINT = " (for the demo on this machine, set DEBUG=1 as `make demo` does)"


def secret_key_weakness(key: str) -> str | None:
    """Why ``key`` is too weak for production, by the rule ``check --deploy`` applies."""
    if key == DEMO_SECRET_KEY:
        return "is the public demo key"
    if key.startswith(SECRET_KEY_INSECURE_PREFIX):
        return f"starts with {SECRET_KEY_INSECURE_PREFIX!r}"
    if len(key) < SECRET_KEY_MIN_LENGTH:
        return f"is shorter than {SECRET_KEY_MIN_LENGTH} characters"
    if len(set(key)) < SECRET_KEY_MIN_UNIQUE_CHARACTERS:
        return f"has fewer than {SECRET_KEY_MIN_UNIQUE_CHARACTERS} different characters"
    return None


SECRET_KEY = os.environ.get("SECRET_KEY", "")
if DEBUG:
    SECRET_KEY = SECRET_KEY or DEMO_SECRET_KEY
elif not SECRET_KEY:
    raise SettingError("SECRET_KEY must be set when DEBUG is off" + _DEMO_HINT)
elif weakness := secret_key_weakness(SECRET_KEY):
    raise SettingError(
        f"SECRET_KEY {weakness}: use a random value of at least {SECRET_KEY_MIN_LENGTH} "
        "characters when DEBUG is off (docs/production.md)"
    )

ALLOWED_HOSTS = [h.strip() for h in os.environ.get("ALLOWED_HOSTS", "").split(",") if h.strip()]
if not ALLOWED_HOSTS:
    if not DEBUG:
        raise SettingError("ALLOWED_HOSTS must be set when DEBUG is off" + _DEMO_HINT)
    ALLOWED_HOSTS = ["localhost", "127.0.0.1", "[::1]"]
if not DEBUG and "*" in ALLOWED_HOSTS:
    # "*" turns off Django's Host header check: password-reset and notice links, caches and
    # logs would trust whatever host a client sends.
    raise SettingError(
        "ALLOWED_HOSTS must name the site's hosts when DEBUG is off, not '*' (docs/production.md)"
    )

# Set BEHIND_PROXY=1 only when a proxy that sets X-Forwarded-Proto (and appends the client
# to X-Forwarded-For) is the only way in: then, and only then, those headers are trusted.
BEHIND_PROXY = env_bool("BEHIND_PROXY", False)

INSTALLED_APPS = [
    "permits.apps.SiteAdminConfig",  # django.contrib.admin with the site's AdminSite
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "guardian",
    "axes",
    "csp",
    "django_q",
    "jobs",
    "jobs.contrib.drills",  # manage.py burst and fake_provider; the jobs.burst kind
    "permits.apps.PermitsConfig",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",  # static files, before anything else
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "permits.friendly.FriendlyNotFound",  # the site's 404 and 500 pages also with DEBUG on
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "csp.middleware.CSPMiddleware",
    "permits.security.PrivatePagesNotStored",
    "axes.middleware.AxesMiddleware",  # last, as django-axes requires
]

ROOT_URLCONF = "permits.urls"
WSGI_APPLICATION = "permits.wsgi.application"
ASGI_APPLICATION = "permits.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "permits.settings.demo_accounts",
            ],
        },
    },
]

# --- Database -----------------------------------------------------------------
# PostgreSQL in production and CI (DATABASE_URL); SQLite in var/ for the demo.
# Persistent connections: django-q2 reconnects per broker call otherwise (4-6x slower).
CONN_MAX_AGE = env_int("CONN_MAX_AGE", 600)
_database_url = os.environ.get("DATABASE_URL", "")
if _database_url:
    DATABASES = {
        "default": dj_database_url.parse(
            _database_url, conn_max_age=CONN_MAX_AGE, conn_health_checks=True
        )
    }
else:
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": VAR_DIR / "db.sqlite3",
            "CONN_MAX_AGE": CONN_MAX_AGE,
            "CONN_HEALTH_CHECKS": True,
            "OPTIONS": {
                # IMMEDIATE takes the write lock at BEGIN, so concurrent writers wait
                # (busy_timeout) instead of failing mid-transaction on lock upgrade.
                "transaction_mode": "IMMEDIATE",
                "timeout": 20,
                "init_command": (
                    "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL; PRAGMA busy_timeout=20000;"
                ),
            },
        }
    }

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",  # first: refuses locked-out logins before any check
    "django.contrib.auth.backends.ModelBackend",
    "guardian.backends.ObjectPermissionBackend",
]

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

# No guardian anonymous user: anonymous visitors never hold object permissions.
ANONYMOUS_USER_NAME = None

LANGUAGE_CODE = "en-us"
TIME_ZONE = os.environ.get("TIME_ZONE", "UTC")
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = Path(os.environ.get("STATIC_ROOT", VAR_DIR / "static"))
MEDIA_ROOT = Path(os.environ.get("MEDIA_ROOT", VAR_DIR / "media"))
MEDIA_URL = "media/"  # never served directly: downloads go through permission checks


def env_mode(name: str, default: int) -> int:
    """An octal permission mode that gives others no write access."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        mode = int(raw, 8)
    except ValueError:
        raise SettingError(f"{name} must be an octal file mode, got {raw!r}") from None
    if mode & 0o002 or not 0 <= mode <= 0o777:
        raise SettingError(f"{name} must be a mode nobody else may write, got {raw!r}")
    return mode


# Artifact folders get this mode whatever the process umask (never world-writable).
ARTIFACT_DIR_MODE = env_mode("ARTIFACT_DIR_MODE", 0o750)

STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    # collectstatic writes hashed, compressed copies that whitenoise serves with far-future
    # cache headers; with DEBUG on, templates name the unhashed files.
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"},
    # Report artifacts: write-once, atomic. Swap for an S3-compatible backend to scale out.
    "artifacts": {
        "BACKEND": os.environ.get(
            "ARTIFACT_STORAGE_BACKEND", "jobs.artifacts.AtomicFileSystemStorage"
        ),
        "OPTIONS": {
            "location": str(Path(os.environ.get("ARTIFACT_ROOT", VAR_DIR / "artifacts"))),
            "directory_permissions_mode": ARTIFACT_DIR_MODE,
        },
    },
}

# Artifacts on S3-compatible object storage (several hosts; docs/deployment.md): set
# ARTIFACT_S3_BUCKET. Credentials come from boto3's chain (AWS_ACCESS_KEY_ID and
# AWS_SECRET_ACCESS_KEY in the environment, an instance role), never from this file.
# jobs.E031 probes at start-up that the bucket answers and refuses a second
# conditional create (If-None-Match: *).
ARTIFACT_S3_BUCKET = os.environ.get("ARTIFACT_S3_BUCKET", "")
if ARTIFACT_S3_BUCKET:
    STORAGES["artifacts"] = {
        "BACKEND": "jobs.storage_s3.S3Storage",
        "OPTIONS": {
            "bucket_name": ARTIFACT_S3_BUCKET,
            "endpoint_url": os.environ.get("ARTIFACT_S3_ENDPOINT_URL") or None,
            "region_name": os.environ.get("ARTIFACT_S3_REGION") or None,
            "location": os.environ.get("ARTIFACT_S3_PREFIX", ""),
            # MinIO, Ceph and moto on a bare host name want path-style addressing.
            "addressing_style": os.environ.get("ARTIFACT_S3_ADDRESSING_STYLE") or None,
            "file_overwrite": False,
            "default_acl": None,
        },
    }

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "queue"
LOGOUT_REDIRECT_URL = "login"

# --- Production hardening (manage.py check --deploy is clean with DEBUG=0) ------
if BEHIND_PROXY:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
if not DEBUG:
    # TLS is required: at gunicorn itself, or at the proxy (BEHIND_PROXY=1).
    SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31536000)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", True)
    SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", True)

# Content-Security-Policy (django-csp 4): nothing inline, nothing from elsewhere, no framing.
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": [SELF],
        "script-src": [SELF],
        "style-src": [SELF],
        "img-src": [SELF, "data:"],  # the admin's icons include data: URLs
        "font-src": [SELF],
        "connect-src": [SELF],
        "object-src": [NONE],
        "base-uri": [NONE],
        "form-action": [SELF],
        "frame-ancestors": [NONE],
    },
}

# Login throttling (django-axes), on the site login and the admin login alike: a username
# is locked from one address after LOGIN_FAILURE_LIMIT failures, and an address after
# LOGIN_ADDRESS_FAILURE_LIMIT failures across usernames (password spraying), each for
# LOGIN_LOCKOUT_MINUTES (0: until an office admin or operator unlocks it: deleting the
# rows in the admin, or `manage.py axes_reset_username` / `axes_reset_ip`). docs/access.md.
AXES_FAILURE_LIMIT = env_int("LOGIN_FAILURE_LIMIT", 5)
if AXES_FAILURE_LIMIT < 1:
    raise SettingError(f"LOGIN_FAILURE_LIMIT must be at least 1, got {AXES_FAILURE_LIMIT}")
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
LOGIN_ADDRESS_FAILURE_LIMIT = env_int("LOGIN_ADDRESS_FAILURE_LIMIT", 20)
if LOGIN_ADDRESS_FAILURE_LIMIT < AXES_FAILURE_LIMIT:
    raise SettingError(
        "LOGIN_ADDRESS_FAILURE_LIMIT must be at least LOGIN_FAILURE_LIMIT "
        f"({AXES_FAILURE_LIMIT}), got {LOGIN_ADDRESS_FAILURE_LIMIT}"
    )
AXES_HANDLER = "permits.security.LoginLimitsHandler"
AXES_COOLOFF_TIME = timedelta(minutes=env_int("LOGIN_LOCKOUT_MINUTES", 30)) or None
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_TEMPLATE = "registration/lockout.html"
AXES_CLIENT_IP_CALLABLE = "permits.security.client_ip"

# Bounded work per user (permits.services.rebuild_report): rebuilds one user may start.
REBUILD_LIMIT = env_int("REBUILD_LIMIT", 5)
REBUILD_LIMIT_WINDOW_MINUTES = env_int("REBUILD_LIMIT_WINDOW_MINUTES", 60)

# Prometheus scrapes /metrics with "Authorization: Bearer $METRICS_TOKEN"; operators too.
METRICS_TOKEN = os.environ.get("METRICS_TOKEN", "")

# --- Notice providers (docs/providers.md) -------------------------------------------
# The webhook provider is used only when NOTICE_PROVIDER_URL is set; `make demo` points it
# at the loopback stand-in (manage.py fake_provider).
NOTICE_PROVIDER_URL = os.environ.get("NOTICE_PROVIDER_URL", "")
NOTICE_PROVIDER_TOKEN = os.environ.get("NOTICE_PROVIDER_TOKEN", "")
if NOTICE_PROVIDER_URL and not NOTICE_PROVIDER_TOKEN and not DEBUG:
    raise SettingError("NOTICE_PROVIDER_TOKEN must be set when NOTICE_PROVIDER_URL is")
NOTICE_PROVIDER_CONNECT_TIMEOUT = env_float("NOTICE_PROVIDER_CONNECT_TIMEOUT", 3.0)
NOTICE_PROVIDER_READ_TIMEOUT = env_float("NOTICE_PROVIDER_READ_TIMEOUT", 10.0)
NOTICE_PROVIDER_MAX_IN_FLIGHT = env_int("NOTICE_PROVIDER_MAX_IN_FLIGHT", 4)
NOTICE_EMAIL_MAX_IN_FLIGHT = env_int("NOTICE_EMAIL_MAX_IN_FLIGHT", 2)

# --- Jobs engine ------------------------------------------------------------------
# Lease < Q_CLUSTER timeout < Q_CLUSTER retry (checked at start-up by jobs.checks).
JOBS_LEASE_SECONDS = env_float("JOBS_LEASE_SECONDS", 60)
JOBS_MAX_ATTEMPTS = env_int("JOBS_MAX_ATTEMPTS", 5)
JOBS_TENANT_CONCURRENCY = env_int("JOBS_TENANT_CONCURRENCY", 4)
# On the PostgreSQL broker: how long a worker keeps taking its queue's next message itself
# (docs/broker.md); 0 turns it off.
JOBS_FOLLOW_ON_SECONDS = env_float("JOBS_FOLLOW_ON_SECONDS", 1.0)
JOBS_BACKOFF_FLOOR_SECONDS = env_float("JOBS_BACKOFF_FLOOR_SECONDS", 1.0)
JOBS_BACKOFF_BASE_SECONDS = env_float("JOBS_BACKOFF_BASE_SECONDS", 2.0)
JOBS_BACKOFF_CAP_SECONDS = env_float("JOBS_BACKOFF_CAP_SECONDS", 300.0)
# Off behind PgBouncer in transaction mode before 1.21 (docs/deployment.md, jobs.W014).
JOBS_PREPARED_STATEMENTS = env_bool("JOBS_PREPARED_STATEMENTS", True)
# A deployment that promises no loss on failover (docs/deployment.md, jobs.W020).
JOBS_REQUIRE_SYNC_REPLICATION = env_bool("JOBS_REQUIRE_SYNC_REPLICATION", False)
# Several simulated hosts on one machine (make scaleout) tell themselves apart by this.
JOBS_HOST_NAME = os.environ.get("JOBS_HOST_NAME", "")
# The reviewers' morning digest (``permits.digest``): a cron in TIME_ZONE; empty: no
# schedule (the kind stays registered). The demo runs it at 07:00 on weekdays; a deployment
# names its own time (docs/site.md), and the test settings none (engine tests count rounds
# of a dispatcher that has no periodic kind).
PERMITS_DIGEST_CRON = os.environ.get("PERMITS_DIGEST_CRON", "0 7 * * 1-5" if DEMO else "")
# Seconds the report waits between its stages (a stand-in for a heavy render, so a demo
# or a browser test sees its progress move); 0 in production.
PERMITS_REPORT_STAGE_SECONDS = env_float("PERMITS_REPORT_STAGE_SECONDS", 0.0)

Q_CLUSTER = {
    "name": "permits",
    "orm": "default",  # the queue's table is on the jobs' database: enqueue commits with the job
    "workers": env_int("Q_WORKERS", 2),
    "timeout": env_int("Q_TIMEOUT", 120),
    "retry": env_int("Q_RETRY", 180),
    "max_attempts": 0,  # our Job.attempts bounds work; django-q2 only redelivers
    "save_limit": -1,  # Attempt rows are the record; skipping results keeps throughput
    "poll": env_float("Q_POLL", 0.2),
    "bulk": env_int("Q_BULK", 1),
    "catch_up": False,
    "ack_failures": False,  # a task that raised is redelivered after `retry`
    "label": "Task queue",
}
# The task queue's broker (docs/broker.md): the jobs table is the queue. On PostgreSQL an
# enqueue NOTIFYs in the job's transaction and an idle pusher waits on LISTEN; on SQLite
# the pusher claims through the ORM and polls every `poll`. Q_BROKER=postgres and
# Q_BROKER=orm start a cluster of plain django-q2 tasks only, on django-q2's message
# table (the PostgreSQL broker, or django-q2's own ORM broker): no engine job is claimed
# there. The benchmarks compare plain tasks on them with the engine's jobs.
_on_postgres = DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql"
Q_BROKER = os.environ.get("Q_BROKER", "jobs")
if Q_BROKER not in ("jobs", "postgres", "orm"):
    raise SettingError(f"Q_BROKER must be 'jobs', 'postgres' or 'orm', got {Q_BROKER!r}")
if Q_BROKER == "postgres" and not _on_postgres:
    raise SettingError(
        f"Q_BROKER={Q_BROKER} needs a PostgreSQL database (DATABASE_URL); "
        "on SQLite leave it unset, or set Q_BROKER=orm or Q_BROKER=jobs"
    )
Q_CLUSTER["broker_class"] = {
    "jobs": "jobs.claiming.ClaimingBroker"
    if _on_postgres
    else "jobs.claiming_orm.OrmClaimingBroker",
    "postgres": "jobs.broker.PostgresBroker",
    "orm": None,
}[Q_BROKER]
# A plain-task cluster claims no job: the check that says so (jobs.E021) is meant.
SILENCED_SYSTEM_CHECKS = [] if Q_BROKER == "jobs" else ["jobs.E021"]

LOG_LEVEL = os.environ.get("LOG_LEVEL", "INFO")
LOG_FORMAT = os.environ.get("LOG_FORMAT", "plain")
if LOG_FORMAT not in ("plain", "json"):
    raise SettingError(f"LOG_FORMAT must be 'plain' or 'json', got {LOG_FORMAT!r}")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {
            "()": "permits.logs.PlainFormatter",
            "fmt": "%(asctime)s %(levelname)s %(name)s %(message)s",
        },
        "json": {"()": "jobs.logformat.JsonFormatter"},
    },
    # A server error's line ends with the reference its 500 page shows (permits.friendly).
    "filters": {"error_reference": {"()": "permits.friendly.ErrorReference"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": LOG_FORMAT}},
    "loggers": {
        "jobs": {"handlers": ["console"], "level": LOG_LEVEL, "propagate": True},
        "permits": {"handlers": ["console"], "level": LOG_LEVEL, "propagate": True},
        # Django's own errors through the site's handler, whatever DEBUG says (Django's
        # default prints them only with DEBUG on, with messages, and mails them otherwise).
        "django": {"handlers": ["console"], "level": "ERROR"},
        # A server error (500): one line with its traceback, messages redacted (the
        # handler is django's, above, so it is written once).
        "django.request": {"level": "ERROR", "propagate": True, "filters": ["error_reference"]},
        "django-q": {"handlers": ["console"], "level": os.environ.get("Q_LOG_LEVEL", "WARNING")},
    },
}
