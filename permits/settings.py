"""Site settings, read from environment variables with safe demo defaults.

Production sets DEBUG=0, SECRET_KEY, ALLOWED_HOSTS and DATABASE_URL; a missing
required value stops start-up with the variable's name.
"""

from __future__ import annotations

import os
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

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
    raise ImproperlyConfigured(f"{name} must be a boolean (1/0, true/false), got {raw!r}")


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer, got {raw!r}") from None


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number, got {raw!r}") from None


DEBUG = env_bool("DEBUG", True)

SECRET_KEY = os.environ.get("SECRET_KEY", "")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured("SECRET_KEY must be set when DEBUG is off")
    SECRET_KEY = "demo-only-insecure-key-do-not-use-in-production"

ALLOWED_HOSTS = [h for h in os.environ.get("ALLOWED_HOSTS", "").split(",") if h]
if not ALLOWED_HOSTS:
    if not DEBUG:
        raise ImproperlyConfigured("ALLOWED_HOSTS must be set when DEBUG is off")
    ALLOWED_HOSTS = ["localhost", "127.0.0.1", "[::1]"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "guardian",
    "django_q",
    "jobs",
    "permits.apps.PermitsConfig",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
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

STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    # Report artifacts: write-once, atomic. Swap for an S3-compatible backend to scale out.
    "artifacts": {
        "BACKEND": os.environ.get(
            "ARTIFACT_STORAGE_BACKEND", "jobs.artifacts.AtomicFileSystemStorage"
        ),
        "OPTIONS": {"location": str(Path(os.environ.get("ARTIFACT_ROOT", VAR_DIR / "artifacts")))},
    },
}

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "queue"
LOGOUT_REDIRECT_URL = "login"

# --- Production hardening (manage.py check --deploy is clean with DEBUG=0) ------
if not DEBUG:
    SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31536000)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

# Prometheus scrapes /metrics with "Authorization: Bearer $METRICS_TOKEN"; operators too.
METRICS_TOKEN = os.environ.get("METRICS_TOKEN", "")

# --- Notice providers (docs/providers.md) -------------------------------------------
# The webhook provider is used only when NOTICE_PROVIDER_URL is set; `make demo` points it
# at the loopback stand-in (manage.py fake_provider).
NOTICE_PROVIDER_URL = os.environ.get("NOTICE_PROVIDER_URL", "")
NOTICE_PROVIDER_TOKEN = os.environ.get("NOTICE_PROVIDER_TOKEN", "")
if NOTICE_PROVIDER_URL and not NOTICE_PROVIDER_TOKEN and not DEBUG:
    raise ImproperlyConfigured("NOTICE_PROVIDER_TOKEN must be set when NOTICE_PROVIDER_URL is")
NOTICE_PROVIDER_CONNECT_TIMEOUT = env_float("NOTICE_PROVIDER_CONNECT_TIMEOUT", 3.0)
NOTICE_PROVIDER_READ_TIMEOUT = env_float("NOTICE_PROVIDER_READ_TIMEOUT", 10.0)
NOTICE_PROVIDER_MAX_IN_FLIGHT = env_int("NOTICE_PROVIDER_MAX_IN_FLIGHT", 4)
NOTICE_EMAIL_MAX_IN_FLIGHT = env_int("NOTICE_EMAIL_MAX_IN_FLIGHT", 2)

# --- Jobs engine ------------------------------------------------------------------
# Lease < Q_CLUSTER timeout < Q_CLUSTER retry (checked at start-up by jobs.checks).
JOBS_LEASE_SECONDS = env_float("JOBS_LEASE_SECONDS", 60)
JOBS_MAX_ATTEMPTS = env_int("JOBS_MAX_ATTEMPTS", 5)
JOBS_TENANT_CONCURRENCY = env_int("JOBS_TENANT_CONCURRENCY", 4)
JOBS_BACKOFF_FLOOR_SECONDS = env_float("JOBS_BACKOFF_FLOOR_SECONDS", 1.0)
JOBS_BACKOFF_BASE_SECONDS = env_float("JOBS_BACKOFF_BASE_SECONDS", 2.0)
JOBS_BACKOFF_CAP_SECONDS = env_float("JOBS_BACKOFF_CAP_SECONDS", 300.0)

Q_CLUSTER = {
    "name": "permits",
    "orm": "default",  # ORM broker on the same database: enqueue commits with the job row
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

LOG_LEVEL = os.environ.get("LOG_LEVEL", "INFO")
LOG_FORMAT = os.environ.get("LOG_FORMAT", "plain")
if LOG_FORMAT not in ("plain", "json"):
    raise ImproperlyConfigured(f"LOG_FORMAT must be 'plain' or 'json', got {LOG_FORMAT!r}")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
        "json": {"()": "jobs.logformat.JsonFormatter"},
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": LOG_FORMAT}},
    "loggers": {
        "jobs": {"handlers": ["console"], "level": LOG_LEVEL, "propagate": True},
        "permits": {"handlers": ["console"], "level": LOG_LEVEL, "propagate": True},
        "django-q": {"handlers": ["console"], "level": os.environ.get("Q_LOG_LEVEL", "WARNING")},
    },
}
