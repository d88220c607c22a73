"""A real PgBouncer in transaction mode in front of PostgreSQL, as docs/deployment.md says.

The deployment page puts web processes and dispatchers behind a transaction pool with
``JOBS_PREPARED_STATEMENTS=0`` and workers on direct (or session-pooled) connections,
because provider slots are session advisory locks. Here Debian's ``pgbouncer`` runs on
loopback (``pool_mode = transaction``, a pool of 3 server connections) and:

- ``jobs.W014`` warns through the pooler while prepared statements are on, and is silent
  with them off or on a direct connection (the check asks the server for its port);
- the dispatcher and a web process (the admin's jobs list and console, through Django's
  test client) run through the pooler; the qcluster connects directly;
- jobs asked for through the pooler all succeed once, with one artifact each;
- in a second pooler in session mode, two ``jobs_worker`` trees (and the dispatcher)
  connect only through it with prepared statements on, and the provider's in-flight
  bound (session advisory locks) holds: peak 1 at the provider. The same test with the
  pooler switched to transaction mode saw 4 calls at once: the bound leaks there, as
  the deployment page says.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model

from jobs.models import Artifact, Effect, EffectEvent, Job
from jobs.testing.proctree import stop
from jobs.testing.s3server import free_port
from tests.e2e.processes import PROVIDER_TOKEN, database_address, subprocess_env, wait_until
from tests.e2e.test_flow import pending_webhook_effects

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

PGBOUNCER = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"

ASK = """
from django.contrib.auth import get_user_model
from tests.e2e.processes import request_steps_job
user = get_user_model().objects.get(username="pooled-reviewer")
for n in range(1, 7):
    request_steps_job(user, n, tenant_key="pooled")
print("ASKED")
"""

PAGES = """
from django.contrib.auth import get_user_model
from django.test import Client
from django.test.utils import setup_test_environment
setup_test_environment()
client = Client()
client.force_login(get_user_model().objects.get(username="pooled-operator"))
pages = ("/admin/jobs/job/", "/admin/jobs/job/dashboard/")
print("PAGES", [client.get(u).status_code for u in pages])
"""


@contextlib.contextmanager
def running_pgbouncer(mode: str, pool_size: int) -> Iterator[tuple[int, Path]]:
    """PgBouncer on a free loopback port, pooling ``mode`` to the test's server."""
    if not os.path.exists(PGBOUNCER):
        if os.environ.get("CI"):
            pytest.fail("pgbouncer is missing: .ci/run installs it (apt-get install pgbouncer)")
        pytest.skip("needs pgbouncer (apt-get install pgbouncer); never skipped in CI")
    host, port = database_address()
    listen = free_port()
    # PgBouncer refuses to run as root: as root it runs as postgres, so its folder is
    # one that user can read and write (pytest's own tmp folders are root's alone).
    folder = Path(tempfile.mkdtemp(prefix="jobs-pgbouncer-"))
    folder.chmod(0o777)
    user = os.environ.get("PGUSER") or "root"
    (folder / "users.txt").write_text(f'"{user}" ""\n')
    (folder / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"* = host={host} port={port}\n"
        "[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {listen}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {folder / 'users.txt'}\n"
        f"pool_mode = {mode}\ndefault_pool_size = {pool_size}\nmax_client_conn = 100\n"
        f"logfile = {folder / 'pgbouncer.log'}\npidfile = {folder / 'pgbouncer.pid'}\n"
        "ignore_startup_parameters = extra_float_digits,options\n"
    )
    for path in folder.iterdir():
        path.chmod(0o666)
    command = [PGBOUNCER, str(folder / "pgbouncer.ini")]
    if os.geteuid() == 0:
        command = ["runuser", "-u", "postgres", "--", *command]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 15
    while True:
        try:
            socket.create_connection(("127.0.0.1", listen), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                log = folder / "pgbouncer.log"
                said = log.read_text() if log.exists() else ""
                pytest.fail(f"pgbouncer did not start:\n{proc.stdout.read()}\n{said}")
            time.sleep(0.1)
    try:
        yield listen, folder
    finally:
        stop(proc)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def pgbouncer():
    """A transaction pool of 3 server connections, as for web processes and dispatchers."""
    with running_pgbouncer("transaction", 3) as pooler:
        yield pooler


def _manage(env: dict, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"manage.py {args[0]} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def test_pgbouncer__transaction_pool_for_web_and_dispatcher__w014_and_jobs_finish(pgbouncer, procs):
    port, folder = pgbouncer
    pooled = subprocess_env(port=port)
    direct = subprocess_env()

    # The check sees the pooler (the server listens on another port than the client
    # dialled) while prepared statements are on; off, or direct, it is silent.
    on = _manage({**pooled, "JOBS_PREPARED_STATEMENTS": "1"}, "check", "--database", "default")
    off = _manage({**pooled, "JOBS_PREPARED_STATEMENTS": "0"}, "check", "--database", "default")
    plain = _manage({**direct, "JOBS_PREPARED_STATEMENTS": "1"}, "check", "--database", "default")
    assert "jobs.W014" in on and f"connects to port {port}" in on, on
    assert "jobs.W014" not in off and "jobs.W014" not in plain
    # The PostgreSQL broker (the site's default here) would listen through the pool.
    assert "jobs.W019" in on and "jobs.W019" in off and "jobs.W019" not in plain, on

    # As deployment.md has it: web and dispatcher through the pool, the worker direct.
    users = get_user_model().objects
    users.create_user(username="pooled-reviewer")
    users.create_superuser(username="pooled-operator", email="", password="x")
    pooled["JOBS_PREPARED_STATEMENTS"] = "0"
    procs.start("dispatcher", "jobs_dispatcher", "--interval", "0.2", env=pooled)
    procs.start("qcluster", "qcluster", env=direct)
    assert "ASKED" in _manage(pooled, "shell", "-c", ASK)
    wait_until(
        procs,
        "the six jobs asked for through the pool to succeed",
        lambda: Job.objects.filter(tenant_key="pooled", state=Job.State.SUCCEEDED).count() == 6,
        timeout=90,
    )
    assert Job.objects.filter(tenant_key="pooled").count() == 6
    assert Artifact.objects.filter(job__tenant_key="pooled").count() == 6
    assert "PAGES [200, 200]" in _manage(pooled, "shell", "-c", PAGES)
    # The pooler really carried the traffic: its log shows the clients it served.
    log = (folder / "pgbouncer.log").read_text()
    logins = log.count("login attempt")
    [warning] = [line for line in on.splitlines() if "jobs.W014" in line]
    print(f"PGBOUNCER: {logins} client logins through the transaction pool; {warning}")
    # two checks, the request, the pages, and the dispatcher (at least once)
    assert logins >= 5, log[-2000:]


def test_pgbouncer__workers_through_a_session_pool__provider_bound_and_every_notice_once(
    procs, provider
):
    """Workers behind a session pool, as docs/deployment.md says: prepared statements on,
    the provider's in-flight slots (session advisory locks) still bound the calls.

    Two ``jobs_worker`` trees of two workers each (four senders) and the dispatcher
    connect only through the pooler; the provider answers after 0.3 s, so senders meet
    at its bound of 1. The pool is sized for every client (a session pool gives each
    client connection a server connection of its own until it disconnects).
    """
    with contextlib.ExitStack() as stack:
        port, folder = stack.enter_context(running_pgbouncer("session", 20))
        stack.callback(procs.stop_all)  # before the pooler goes: no reconnects in the logs
        pooled = {
            **subprocess_env(port=port),
            "JOBS_PREPARED_STATEMENTS": "1",
            "TEST_Q_WORKERS": "2",
            "NOTICE_PROVIDER_URL": provider.url,
            "NOTICE_PROVIDER_TOKEN": PROVIDER_TOKEN,
            "NOTICE_PROVIDER_MAX_IN_FLIGHT": "1",
            "NOTICE_PROVIDER_CONNECT_TIMEOUT": "0.5",
            "NOTICE_PROVIDER_READ_TIMEOUT": "1",
            "JOBS_EFFECT_LEASE_SECONDS": "4",
            "JOBS_PROVIDER_SLOT_WAIT_SECONDS": "2",
        }
        provider.faults.delay = 0.3
        effects = pending_webhook_effects(12, subject="session-pool")
        ids = [e.pk for e in effects]
        started = time.monotonic()
        for name in ("worker-1", "worker-2"):
            procs.start(name, "jobs_worker", env=pooled)
        procs.start("dispatcher", "jobs_dispatcher", "--interval", "0.2", env=pooled)
        wait_until(
            procs,
            "every notice sent through workers on the session pool",
            lambda: (
                Effect.objects.filter(pk__in=ids, state=Effect.State.APPLIED).count() == len(ids)
            ),
            timeout=120,
        )
        took = time.monotonic() - started
        record = provider.record
        peak = record.max_in_flight()
        logins = (folder / "pgbouncer.log").read_text().count("login attempt")
        deferred = EffectEvent.objects.filter(
            effect_id__in=ids, action=EffectEvent.Action.DEFER
        ).count()
        print(
            f"SESSION POOL: {len(ids)} notices applied in {took:.1f} s by 2 jobs_worker trees "
            f"through the pooler; provider peak in flight {peak} (bound 1); "
            f"{deferred} deferrals; {logins} client logins"
        )
        assert peak == 1, f"the provider's bound leaked through the pool: {peak} at once"
        assert record.duplicate_effects() == {} and len(record.sends()) == len(ids)
        # Every process connected through the pooler: 2 x (supervisor, sentinel, pusher,
        # monitor, 2 workers) and the dispatcher, at least.
        assert logins >= 13, (folder / "pgbouncer.log").read_text()[-2000:]
