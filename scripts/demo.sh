#!/usr/bin/env bash
# The demo: SQLite (WAL) in var/, the supervised worker (jobs_worker runs qcluster), the
# dispatcher loop and the web server.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
PORT="${PORT:-8000}"
PROVIDER_PORT="${PROVIDER_PORT:-8025}"
unset DATABASE_URL
# The demo, and only the demo, runs with DEBUG on (its public SECRET_KEY is refused otherwise).
export DEBUG=1
mkdir -p var/log
# Webhook notices go to the loopback stand-in provider, which keeps its own record.
export NOTICE_PROVIDER_URL="http://127.0.0.1:${PROVIDER_PORT}"
export NOTICE_PROVIDER_TOKEN="demo-provider-token"

$PY manage.py migrate --noinput -v0
$PY manage.py seed_demo

pids=()
cleanup() {
  trap - EXIT INT TERM
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

$PY manage.py fake_provider --port "$PROVIDER_PORT" --token "$NOTICE_PROVIDER_TOKEN" \
  --record var/provider-record.sqlite3 --stall 0.2 --stall-seconds 15 >var/log/provider.log 2>&1 &
pids+=($!)
$PY manage.py jobs_worker >var/log/worker.log 2>&1 &
pids+=($!)
$PY manage.py jobs_dispatcher --interval 1 >var/log/dispatcher.log 2>&1 &
pids+=($!)

cat <<MSG

  Permit report jobs demo
  -----------------------
  Web:      http://127.0.0.1:${PORT}/
  Admin:    http://127.0.0.1:${PORT}/admin/   (operator / operator-demo)
  Logins:   reviewer47 / reviewer-demo   reviewer52 / reviewer-demo
  Provider: http://127.0.0.1:${PROVIDER_PORT} (stand-in; 20% of sends accepted then stalled)
  Worker:   var/log/worker.log    Dispatcher: var/log/dispatcher.log
  Figures:  .venv/bin/python manage.py jobs_stats
  Stop:     Ctrl-C

MSG
$PY manage.py runserver "127.0.0.1:${PORT}" --noreload &
pids+=($!)
# Wait in the background so a signal to this script runs the cleanup at once.
wait -n "${pids[@]}" || true
