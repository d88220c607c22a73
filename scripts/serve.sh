#!/usr/bin/env bash
# Production web process (docs/production.md): DEBUG off, migrate, collect static files
# (hashed names, compressed), then gunicorn with whitenoise serving /static/.
# Needs SECRET_KEY, ALLOWED_HOSTS and DATABASE_URL in the environment; the django-q2
# cluster (manage.py jobs_worker) and the dispatcher (manage.py jobs_dispatcher) run as
# their own processes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
export DEBUG=0
export DJANGO_SETTINGS_MODULE="${DJANGO_SETTINGS_MODULE:-permits.settings}"

$PY manage.py migrate --noinput
$PY manage.py collectstatic --noinput -v0
exec $PY -m gunicorn -c python:permits.gunicorn_conf permits.wsgi:application
