"""Settings of the contract project: Django 6.x, ``jobs`` installed as a package, PostgreSQL.

Run by ``test_contract.py`` in its own Python 3.12 virtualenv. The database is named by
``CONTRACT_DB_NAME`` (the test database the runner creates; its workers use the same one).
"""

import os
from pathlib import Path

SECRET_KEY = "tasks-contract-only"
DEBUG = False
USE_TZ = True
BASE_DIR = Path(os.environ.get("CONTRACT_DIR", "."))
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django_q",
    "jobs",
]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("CONTRACT_DB_NAME", "tasks_contract"),
        "HOST": os.environ.get("PGHOST", "127.0.0.1"),
        "PORT": os.environ.get("PGPORT", "5432"),
        "USER": os.environ.get("PGUSER", "root"),
        "PASSWORD": os.environ.get("PGPASSWORD", ""),
        "CONN_MAX_AGE": 60,
        "CONN_HEALTH_CHECKS": True,
        "TEST": {"NAME": os.environ.get("CONTRACT_DB_NAME", "test_tasks_contract")},
    }
}
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "artifacts": {
        "BACKEND": "jobs.artifacts.AtomicFileSystemStorage",
        "OPTIONS": {"location": BASE_DIR / "artifacts"},
    },
}
# Tasks fail at once (one attempt), as the reference backends do; the second alias accepts
# any queue name. Both are JobsBackend.
TASKS = {
    "default": {
        "BACKEND": "jobs.backends.JobsBackend",
        "QUEUES": [],
        "OPTIONS": {"MAX_ATTEMPTS": 1},
    },
}
JOBS_LEASE_SECONDS = 4
JOBS_BACKOFF_FLOOR_SECONDS = 0.2
JOBS_BACKOFF_BASE_SECONDS = 0.2
JOBS_BACKOFF_CAP_SECONDS = 1.0
Q_CLUSTER = {
    "name": "tasks_contract",
    "orm": "default",
    "broker_class": "jobs.claiming.ClaimingBroker",  # the jobs table is the queue
    "workers": 2,
    "timeout": 8,
    "retry": 10,
    "max_attempts": 0,
    "save_limit": -1,
    "poll": 0.05,
    "catch_up": False,
    "ack_failures": False,
    "log_level": "WARNING",  # no "Enqueued" line per task in the test runner's output
}
# django.tasks lines of the tests (enqueued) and of the worker (started, finished) in one
# file, read back by the tests.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(levelname)s:%(name)s:%(message)s"}},
    "handlers": {
        "tasks_file": {
            "class": "logging.FileHandler",
            "filename": str(BASE_DIR / "worker-tasks.log"),
            "formatter": "plain",
        }
    },
    "loggers": {"django.tasks": {"handlers": ["tasks_file"], "level": "DEBUG"}},
}
TEST_RUNNER = "tasks_contract.runner.WorkerRunner"
