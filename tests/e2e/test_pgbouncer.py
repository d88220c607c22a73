"""A real PgBouncer in transaction mode in front of PostgreSQL, as docs/deployment.md says.

The deployment page puts web processes and dispatchers behind a transaction pool with
``JOBS_PREPARED_STATEMENTS=0`` and workers on direct (or session-pooled) connections,
because provider slots are session advisory locks. Here Debian's ``pgbouncer`` runs on
loopback (``pool_mode = transaction``, a pool of 3 server connections) and:

- ``jobs.W014`` warns through the pooler while prepared statements are on, and is silent
  with them off or on a direct connection (the check asks the server for its port);
- the dispatcher and a web process (the admin's jobs list and console, through Django's
  test client) run through the pooler; the qcluster connects directly;
- jobs asked for through the pooler all succeed once, with one artifact each.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model

from jobs.models import Artifact, Job
from jobs.testing.proctree import stop
from jobs.testing.s3server import free_port
from tests.e2e.processes import database_address, subprocess_env, wait_until

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


@pytest.fixture
def pgbouncer():
    """PgBouncer on a free loopback port, transaction pooling to the test's server."""
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
        "pool_mode = transaction\ndefault_pool_size = 3\nmax_client_conn = 100\n"
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
