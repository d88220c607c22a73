#!/usr/bin/env bash
# The demo: SQLite (WAL) in var/, the supervised workers (jobs_worker runs qcluster: one for
# the default queue, one for the heavy queue of the decision letters), the dispatcher loop
# and the web server.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
PORT="${PORT:-8000}"
PROVIDER_PORT="${PROVIDER_PORT:-8025}"
# The demo's data and logs (the settings put the SQLite database there too).
VAR="${VAR_DIR:-var}"
unset DATABASE_URL
# The demo, and only the demo, runs with DEBUG on (its public SECRET_KEY is refused otherwise).
export DEBUG=1
# The login page lists the demo accounts (only with DEBUG on: permits.settings.DEMO).
export DEMO=1
mkdir -p "$VAR/log"
# Webhook notices go to the loopback stand-in provider, which keeps its own record.
export NOTICE_PROVIDER_URL="http://127.0.0.1:${PROVIDER_PORT}"
export NOTICE_PROVIDER_TOKEN="demo-provider-token"

# A port already taken fails here, with its name, instead of in a log file later.
for pair in "PORT:$PORT" "PROVIDER_PORT:$PROVIDER_PORT"; do
  if ! $PY -c 'import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))' "${pair#*:}" 2>/dev/null; then
    echo "port ${pair#*:} is taken: choose another with ${pair%%:*}=... (e.g. make demo ${pair%%:*}=$(( ${pair#*:} + 1 )))" >&2
    exit 1
  fi
done

pids=()
cleanup() {
  trap - EXIT INT TERM
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT INT TERM

# Each manage.py start costs seconds (imports, checks): the web server and the stand-in
# provider start while the schema is migrated and seeded (one process for both); the
# worker and the dispatcher once the tables exist.
$PY manage.py fake_provider --port "$PROVIDER_PORT" --token "$NOTICE_PROVIDER_TOKEN" \
  --record "$VAR/provider-record.sqlite3" --stall 0.2 --stall-seconds 15 >"$VAR/log/provider.log" 2>&1 &
pids+=($!)
$PY manage.py runserver "127.0.0.1:${PORT}" --noreload >"$VAR/log/web.log" 2>&1 &
web=$!
pids+=("$web")
$PY -c 'import os, django
from django.core.management import call_command
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "permits.settings")
django.setup()
call_command("migrate", interactive=False, verbosity=0)
call_command("seed_demo")'
$PY manage.py jobs_worker >"$VAR/log/worker.log" 2>&1 &
pids+=($!)
# The second queue: heavy renders (the applicant's decision letter, permits.letters) have
# their own worker, so reports and notices never wait behind them.
$PY manage.py jobs_worker --queue heavy >"$VAR/log/worker-heavy.log" 2>&1 &
pids+=($!)
$PY manage.py jobs_dispatcher --interval 1 >"$VAR/log/dispatcher.log" 2>&1 &
pids+=($!)
# The URL is printed as soon as the login page answers (not before the server listens).
for _ in $(seq 1 600); do
  if $PY -c 'import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=1)' "http://127.0.0.1:${PORT}/accounts/login/" 2>/dev/null; then
    break
  fi
  kill -0 "$web" 2>/dev/null || { cat "$VAR/log/web.log" >&2; exit 1; }
  sleep 0.1
done

cat <<MSG

  Permit report jobs demo
  -----------------------
  Web:      http://127.0.0.1:${PORT}/   (reviewer pages; the login page lists the demo accounts)
  Logins:   reviewer47 / reviewer-demo   reviewer52 / reviewer-demo
  Admin:    http://127.0.0.1:${PORT}/admin/   (operator / operator-demo)
  Console:  http://127.0.0.1:${PORT}/admin/jobs/job/dashboard/   (operator)
  Assign:   officeadmin / officeadmin-demo (Assign reviewers, on a request's admin page)
  Provider: http://127.0.0.1:${PROVIDER_PORT} (stand-in; 20% of sends accepted then stalled)
  Logs:     $VAR/log/web.log  $VAR/log/worker.log  $VAR/log/worker-heavy.log
            $VAR/log/dispatcher.log  $VAR/log/provider.log
  Figures:  DEBUG=1 DATABASE_URL= .venv/bin/python manage.py jobs_stats
  Ports:    make demo PORT=8001 PROVIDER_PORT=8026
  Stop:     Ctrl-C (stops the web server, workers, dispatcher and provider)

MSG
# Wait in the background so a signal to this script runs the cleanup at once.
wait -n "${pids[@]}" || true
