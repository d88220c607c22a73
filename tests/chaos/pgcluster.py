"""A PostgreSQL primary and a streaming standby of the drill's own, on loopback (issue 47).

Started from the server's own binaries (``initdb``, ``pg_basebackup``, ``pg_ctl``), in a
temporary folder, never the shared server: the primary listens on ``127.0.0.1`` and the
standby on ``127.0.0.2``, both on one free port, so one libpq multi-host URL
(``postgres://drill@127.0.0.1,127.0.0.2:PORT/drill?target_session_attrs=read-write``)
reaches whichever takes writes. PostgreSQL refuses to run as root: as root, every server
command runs as the ``postgres`` OS user (``runuser``), which owns the folder.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

BIN = Path(os.environ.get("PG_BIN", "/usr/lib/postgresql/15/bin"))
ROLE = "drill"  # the superuser initdb makes; trust auth on loopback only
DATABASE = "drill"
SYNC_NAME = "standby1"  # the standby's application_name


def free_port() -> int:
    """A port free on every loopback address the drill uses."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            for host in ("127.0.0.2", "127.0.0.3"):
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port on 127.0.0.1-3")


def _os_user() -> str | None:
    """The OS user servers run as: ``postgres`` when we are root, else ourselves (None)."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise RuntimeError("running as root and no 'postgres' OS user to run servers as") from None
    return "postgres"


def _run(args: list[str], *, timeout: float = 120, check: bool = True) -> str:
    user = _os_user()
    cmd = (["runuser", "-u", user, "--"] if user else []) + args
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(args[:2])} failed: {done.stderr[-2000:]}")
    return done.stdout


def workdir(prefix: str) -> Path:
    """A temporary folder the servers' OS user owns."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    user = _os_user()
    if user:
        shutil.chown(folder, user, user)
    return folder


@dataclass
class Server:
    name: str
    data: Path
    host: str
    port: int

    @property
    def log(self) -> Path:
        return self.data.parent / f"{self.name}.log"

    @property
    def sockets(self) -> Path:
        return self.data.parent / f"{self.name}-sock"

    def dsn(self, dbname: str = DATABASE) -> str:
        return f"host={self.host} port={self.port} user={ROLE} dbname={dbname} connect_timeout=3"

    def start(self, *extra: str) -> None:
        if not self.sockets.exists():
            self.sockets.mkdir()
            if _os_user():
                shutil.chown(self.sockets, "postgres", "postgres")
        options = " ".join(
            [
                f"-c listen_addresses={self.host}",
                f"-p {self.port}",
                f"-c unix_socket_directories={self.sockets}",
                *extra,
            ]
        )
        _run(
            [
                str(BIN / "pg_ctl"),
                "-D",
                str(self.data),
                "-l",
                str(self.log),
                "-w",
                "-t",
                "60",
                "-o",
                options,
                "start",
            ]
        )

    def crash(self) -> None:
        """Stop at once, as a crash: no shutdown checkpoint, clients cut off."""
        _run([str(BIN / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"], check=False)

    def stop(self) -> None:
        _run([str(BIN / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"], check=False)

    def promote(self) -> None:
        _run([str(BIN / "pg_ctl"), "-D", str(self.data), "-w", "-t", "60", "promote"])

    def query(self, sql: str, params=(), *, dbname: str = DATABASE) -> list[tuple]:
        import psycopg

        with psycopg.connect(self.dsn(dbname), autocommit=True) as conn:
            cur = conn.execute(sql, params)
            return cur.fetchall() if cur.description else []

    def wait_ready(self, *, writable: bool, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(Exception):
                (recovering,) = self.query("SELECT pg_is_in_recovery()", dbname="postgres")[0]
                if recovering is not writable:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} not {'writable' if writable else 'a standby'}")
            time.sleep(0.2)


def _conf(server: Server, lines: list[str], *, auto: bool = False) -> None:
    path = server.data / ("postgresql.auto.conf" if auto else "postgresql.conf")
    with path.open("a") as fh:
        fh.write("\n# the failover drill\n" + "\n".join(lines) + "\n")


def initdb(server: Server) -> None:
    """A new data folder for ``server``: superuser ``ROLE``, trust auth, UTF8."""
    _run(
        [
            str(BIN / "initdb"),
            "-D",
            str(server.data),
            "-U",
            ROLE,
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
        ]
    )


def make_pair(folder: Path, *, synchronous: bool) -> tuple[Server, Server]:
    """initdb a primary, start it, pg_basebackup a standby from it, start the standby."""
    port = free_port()
    primary = Server("primary", folder / "primary", "127.0.0.1", port)
    standby = Server("standby", folder / "standby", "127.0.0.2", port)
    initdb(primary)
    _conf(
        primary,
        [
            "fsync = off",  # a process crash, not an OS crash: the page cache survives it
            "max_connections = 150",
            "shared_buffers = 64MB",
            "wal_keep_size = 512MB",
            "max_wal_senders = 5",
            "synchronous_commit = on",
            "synchronous_standby_names = ''",  # named once the standby runs (set_synchronous)
            "log_min_messages = warning",
        ],
    )
    with (primary.data / "pg_hba.conf").open("a") as fh:
        fh.write("host all all 127.0.0.0/8 trust\nhost replication all 127.0.0.0/8 trust\n")
    primary.start()
    primary.wait_ready(writable=True)
    primary.query(f"CREATE DATABASE {DATABASE}", dbname="postgres")
    _run(
        [
            str(BIN / "pg_basebackup"),
            "-h",
            primary.host,
            "-p",
            str(port),
            "-U",
            ROLE,
            "-D",
            str(standby.data),
            "-X",
            "stream",
            "-R",
            "--checkpoint=fast",
            "--no-sync",
        ]
    )
    _conf(
        standby,
        [
            f"primary_conninfo = '{upstream(primary)}'",
            # Ignored while a standby; once promoted it must not wait for a standby of its own.
            "synchronous_standby_names = ''",
        ],
        auto=True,
    )
    standby.start()
    standby.wait_ready(writable=False)
    if synchronous:
        primary.query(
            f"ALTER SYSTEM SET synchronous_standby_names = 'FIRST 1 ({SYNC_NAME})'",
            dbname="postgres",
        )
        primary.query("SELECT pg_reload_conf()", dbname="postgres")
        wait_for_sync(primary)
    return primary, standby


def upstream(primary: Server, *, port: int | None = None) -> str:
    return (
        f"host={primary.host} port={port or primary.port} user={ROLE} application_name={SYNC_NAME}"
    )


def wait_for_sync(primary: Server, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = primary.query("SELECT sync_state FROM pg_stat_replication", dbname="postgres")
        if any(r[0] == "sync" for r in rows):
            return
        time.sleep(0.2)
    raise RuntimeError("the standby never became synchronous")


def caught_up(primary: Server, standby: Server, timeout: float = 60) -> None:
    """Wait until the standby replayed everything the primary wrote so far."""
    (target,) = primary.query("SELECT pg_current_wal_lsn()::text", dbname="postgres")[0]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        (done,) = standby.query(
            "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", [target], dbname="postgres"
        )[0]
        if done:
            return
        time.sleep(0.2)
    raise RuntimeError("the standby did not catch up")


def hold_behind(primary: Server, standby: Server, timeout: float = 30) -> None:
    """Cut the standby off its primary: it keeps what it has and receives nothing more,
    as a replica seconds behind. (Pausing replay would not do: a promotion replays
    everything received.)"""
    # A conninfo of ours (no quotes in it); ALTER SYSTEM takes no parameters.
    standby.query(
        f"ALTER SYSTEM SET primary_conninfo = '{upstream(primary, port=1)}'", dbname="postgres"
    )
    standby.query("SELECT pg_reload_conf()", dbname="postgres")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not primary.query("SELECT 1 FROM pg_stat_replication", dbname="postgres"):
            return
        time.sleep(0.2)
    raise RuntimeError("the standby kept streaming")


def timeline(server: Server) -> int:
    """The timeline the server writes on now (``pg_control_checkpoint()`` lags a promotion
    until the next checkpoint)."""
    (name,) = server.query("SELECT pg_walfile_name(pg_current_wal_lsn())", dbname="postgres")[0]
    return int(name[:8], 16)


def remove(folder: Path, servers: list[Server]) -> None:
    for server in servers:
        server.crash()
    shutil.rmtree(folder, ignore_errors=True)
