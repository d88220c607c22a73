"""A stand-in notice provider: the HTTP protocol of DESIGN.md on loopback, with faults.

It is an independent witness. Every request and every applied send goes to its
own SQLite file (``--record``), never to the Django database under test, and
each write is committed (``synchronous=FULL``) before the answer leaves. Tests,
``manage.py burst`` and operators read that file to learn what the provider
really saw: calls in flight at once, calls per second, sends applied per effect.

Protocol (``POST /notices``, ``Idempotency-Key``, ``Authorization: Bearer``):
``201 {"id"}`` a new send is applied; ``200 {"id"}`` a known key with the same
body (same id); ``409`` a known key with another body; ``400`` no key; ``422`` a
body that is not exactly the six reference fields; ``401`` a wrong token.
Lookup (``GET /notices/{key}``, same token): ``200 {"id", "outcome": "applied"}`` for a
key it applied, ``404`` for a key it never applied. Lookups are recorded apart from
sends (path ``/notices/{key}``), so a test counts POSTs and lookups per key separately.
Listing (``GET /notices?since=T[&after=C]``, same token, issue 47): ``200 {"notices":
[{"key", "id", "effect_id", "applied_at"}], "next"}``, the sends applied from ``T`` (Unix
seconds) on, ``LIST_PAGE`` a page; recorded under path ``/notices?list``.

Fault switches (``Faults``): a fraction of new sends *accepted then stalled*
(applied, then no answer until the client hangs up or ``stall_seconds`` pass);
a fraction answered ``503`` with ``Retry-After``; a fraction answered with a
chosen status (e.g. 422); a fixed latency per answer; down windows during
which the port refuses connections (also ``set_down()``, and SIGUSR1/SIGUSR2
in ``manage.py fake_provider``).

Arrival, as recorded (``received_at``): when the request's first bytes reached this
host's kernel (a socket receive timestamp, on Linux), not when a thread of this
busy process got round to reading them: that lag is recorded apart (``read_at``),
so a late handler cannot move two calls closer together in the record.

In flight, as recorded: from the request's arrival to the moment just before the
answer was written. A client holds its call open at least that
long, so the provider's figure never overstates the client's concurrency. A
stalled send counts until the provider notices the client hung up.
"""

from __future__ import annotations

import contextlib
import json
import random
import select
import socket
import socketserver
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from jobs.testing.provider_record import LIST_PATH, LOOKUP_PATH, Record, _connect, body_sha256

LIST_PAGE = 500  # sends per page of the listing

__all__ = [
    "LIST_PATH",
    "LOOKUP_PATH",
    "FakeProviderServer",
    "Faults",
    "Record",
    "body_sha256",
    "start_in_thread",
]


BODY_TYPES = {
    "effect_id": str,
    "recipient": str,
    "job": int,
    "revision": int,
    "report_key": str,
    "kind": str,
}


@dataclass
class Faults:
    """What the stand-in does wrong, and how often (fractions of eligible requests)."""

    stall: float = 0.0  # new sends applied, then not answered (past the client's timeout)
    stall_seconds: float = 30.0
    unavailable: float = 0.0  # answered 503 with Retry-After
    retry_after: float = 1.0
    reject: float = 0.0  # answered reject_status (a validation or auth failure on demand)
    reject_status: int = 422
    lookup_unavailable: float = 0.0  # lookups answered 503 (the provider cannot say now)
    no_lookup: bool = False  # lookups answered 405: a provider without the capability
    delay: float = 0.0  # latency added to every answer, in seconds
    down: list[tuple[float, float]] = field(default_factory=list)  # seconds after start
    seed: int | None = None
    # After this many sends arrived, every send is answered 500 for ``error_seconds``.
    error_after: int = 0
    error_seconds: float = 0.0


class _Writer:
    """The server's single connection to its record; one lock orders every decision."""

    def __init__(self, path: Path | str):
        self.conn = _connect(path)
        self.lock = threading.Lock()
        self.closed = False

    def event(self, what: str) -> None:
        with self.lock:
            if self.closed:
                return
            self.conn.execute("INSERT INTO events (at, what) VALUES (?, ?)", [time.time(), what])

    def apply(self, key: str, body: dict, sha: str) -> tuple[int, str, str]:
        """(status, outcome, id): apply a new key, replay a known one, refuse a changed body."""
        with self.lock:
            if self.closed:
                return 503, "stopping", ""
            row = self.conn.execute(
                "SELECT send_id, body_sha256 FROM sends WHERE idempotency_key = ?", [key]
            ).fetchone()
            if row is not None:
                if row[1] == sha:
                    return 200, "replay", row[0]
                return 409, "conflict", ""
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                (n,) = self.conn.execute("SELECT COALESCE(MAX(n), 0) + 1 FROM sends").fetchone()
                send_id = f"ntc_{n}"
                self.conn.execute(
                    "INSERT INTO sends (n, idempotency_key, send_id, effect_id, recipient,"
                    " body_sha256, body, applied_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [
                        n,
                        key,
                        send_id,
                        body["effect_id"],
                        body["recipient"],
                        sha,
                        json.dumps(body, sort_keys=True),
                        time.time(),
                    ],
                )
                self.conn.execute("COMMIT")
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            return 201, "applied", send_id

    def applied_id(self, key: str) -> str | None:
        """The id of the send applied under ``key``, or None."""
        with self.lock:
            if self.closed:
                return None
            row = self.conn.execute(
                "SELECT send_id FROM sends WHERE idempotency_key = ?", [key]
            ).fetchone()
            return row[0] if row else None

    def applied_since(self, since: float, after: int, limit: int) -> list[tuple]:
        """(n, key, send id, effect id, applied at) of the sends applied from ``since`` on
        and after row ``after``, oldest first."""
        with self.lock:
            if self.closed:
                return []
            return self.conn.execute(
                "SELECT n, idempotency_key, send_id, effect_id, applied_at FROM sends"
                " WHERE applied_at >= ? AND n > ? ORDER BY n LIMIT ?",
                [since, after, limit],
            ).fetchall()

    def request(self, **row) -> None:
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        with self.lock:
            if self.closed:  # a straggler answered after stop(): the record is final
                return
            self.conn.execute(f"INSERT INTO requests ({cols}) VALUES ({marks})", list(row.values()))

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.conn.close()


# --- the server -------------------------------------------------------------------


def validate(body) -> str | None:
    """Why the body is not exactly the protocol's six reference fields, or None."""
    if not isinstance(body, dict):
        return "body must be a JSON object"
    extra = sorted(set(body) - set(BODY_TYPES))
    if extra:
        return f"unexpected fields: {', '.join(extra)}"
    for name, kind in BODY_TYPES.items():
        value = body.get(name)
        if not isinstance(value, kind) or isinstance(value, bool) or value == "":
            return f"{name} must be a non-empty {kind.__name__}"
    return None


# SO_TIMESTAMPNS (Linux; Python names it only on some builds): the kernel stamps each
# received segment, and recvmsg hands the stamp over as ancillary data.
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35 if sys.platform == "linux" else None)
_STAMP = struct.Struct("qq")  # struct timespec


def kernel_arrival(sock: socket.socket) -> float | None:
    """When the bytes waiting on ``sock`` reached this host (None: no stamp, or none waiting).

    Peeks one byte, so the request is left for the handler to read.
    """
    try:
        data, ancillary, _flags, _addr = sock.recvmsg(1, 64, socket.MSG_PEEK)
    except OSError:
        return None
    for level, kind, payload in ancillary:
        if data and level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
            seconds, nanoseconds = _STAMP.unpack(payload[: _STAMP.size])
            return seconds + nanoseconds / 1e9
    return None


class _Handler(BaseHTTPRequestHandler):
    server: FakeProviderServer
    protocol_version = "HTTP/1.1"
    arrived: float | None = None

    def handle_one_request(self):
        # Before the first read: the peek waits for the request like the read would.
        self.arrived = kernel_arrival(self.connection)
        super().handle_one_request()

    def received(self) -> tuple[float, float]:
        """(arrival, now): the kernel's stamp when there is one, else now for both."""
        read = time.time()
        return (self.arrived or read), read

    def log_message(self, format, *args):  # the record is the log
        pass

    def _answer(self, status: int, payload: dict, headers: dict | None = None) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")  # one call, one connection
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
        except OSError:  # the client already hung up
            pass
        self.close_connection = True

    def do_GET(self):
        if self.path.startswith("/notices/"):
            self._lookup()
            return
        if urlsplit(self.path).path == "/notices":
            self._list()
            return
        received, read = self.received()
        status = 200 if self.path == "/health" else 404
        self.server.writer.request(
            method="GET",
            path=self.path[:200],
            received_at=received,
            read_at=read,
            answered_at=time.time(),
            status=status,
            outcome="health" if status == 200 else "not_found",
        )
        self._answer(status, {"ok": status == 200})

    def _lookup(self) -> None:
        """``GET /notices/{key}``: what became of a key, recorded as a lookup (not a send)."""
        received, read = self.received()
        server = self.server
        key = unquote(self.path[len("/notices/") :])[:200]
        send_id, headers = "", {}
        if server.token and self.headers.get("Authorization") != f"Bearer {server.token}":
            status, outcome = 401, "unauthorized"
        elif server.faults.no_lookup:
            status, outcome = 405, "no_lookup"
        elif server.roll("lookup_unavailable"):
            status, outcome = 503, "lookup_unavailable"
            headers["Retry-After"] = f"{server.faults.retry_after:g}"
        else:
            send_id = server.writer.applied_id(key) or ""
            status, outcome = (200, "lookup_found") if send_id else (404, "lookup_not_found")
        if server.faults.delay:
            time.sleep(server.faults.delay)
        server.writer.request(
            method="GET",
            path=LOOKUP_PATH,
            received_at=received,
            read_at=read,
            answered_at=time.time(),
            idempotency_key=key,
            status=status,
            outcome=outcome,
            send_id=send_id,
        )
        payload = {"id": send_id, "outcome": "applied"} if status == 200 else {"error": outcome}
        self._answer(status, payload, headers)

    def _list(self) -> None:
        """``GET /notices?since=T``: the sends applied from ``T`` on, a page at a time."""
        received, read = self.received()
        server = self.server
        query = parse_qs(urlsplit(self.path).query)
        payload: dict = {"error": "bad_query"}
        if server.token and self.headers.get("Authorization") != f"Bearer {server.token}":
            status, outcome, payload = 401, "unauthorized", {"error": "unauthorized"}
        elif server.faults.no_lookup:  # a provider without lookups has no listing either
            status, outcome, payload = 405, "no_listing", {"error": "no_listing"}
        else:
            try:
                since = float(query.get("since", ["0"])[0])
                after = int(query.get("after", ["0"])[0])
            except ValueError:
                status, outcome = 400, "bad_query"
            else:
                rows = server.writer.applied_since(since, after, LIST_PAGE)
                notices = [
                    {"key": k, "id": i, "effect_id": e, "applied_at": at}
                    for _n, k, i, e, at in rows
                ]
                more = len(rows) == LIST_PAGE
                payload = {"notices": notices, "next": str(rows[-1][0]) if more else None}
                status, outcome = 200, "listed"
        server.writer.request(
            method="GET",
            path=LIST_PATH,
            received_at=received,
            read_at=read,
            answered_at=time.time(),
            status=status,
            outcome=outcome,
        )
        self._answer(status, payload)

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        received, read = self.received()
        server = self.server
        key = self.headers.get("Idempotency-Key", "")[:200]
        status, outcome, send_id, effect_id, sha = 404, "not_found", "", "", ""
        stall = False
        headers: dict[str, str] = {}
        # A body shorter than announced: the sender died while writing (a SIGKILL
        # mid-send). Recorded, not answered, never held against it as a protocol error.
        truncated = len(raw) < length
        if truncated:
            status, outcome = 0, "truncated"
        elif self.path == "/notices":
            try:
                body = json.loads(raw or b"null")
            except ValueError:
                body = None
            if isinstance(body, dict):
                effect_id = str(body.get("effect_id", ""))[:200]
            problem = validate(body)
            if server.token and self.headers.get("Authorization") != f"Bearer {server.token}":
                status, outcome = 401, "unauthorized"
            elif not key:
                status, outcome = 400, "missing_key"
            elif problem:
                status, outcome = 422, "invalid"
            elif server.erring():
                status, outcome = 500, "error"
            elif server.roll("unavailable"):
                status, outcome = 503, "unavailable"
                headers["Retry-After"] = f"{server.faults.retry_after:g}"
            elif server.roll("reject"):
                status, outcome = server.faults.reject_status, "rejected"
            else:
                sha = body_sha256(body)
                status, outcome, send_id = server.writer.apply(key, body, sha)
                stall = outcome == "applied" and server.roll("stall")
        if server.faults.delay:
            time.sleep(server.faults.delay)
        if stall:
            self._stall()
            outcome = "applied_stalled"
        server.writer.request(
            method="POST",
            path=self.path[:200],
            received_at=received,
            read_at=read,
            answered_at=time.time(),
            idempotency_key=key,
            effect_id=effect_id,
            body_sha256=sha,
            status=status,
            outcome=outcome,
            send_id=send_id,
        )
        if truncated:
            self.close_connection = True
            return
        payload = {"id": send_id} if status in (200, 201) else {"error": outcome}
        self._answer(status, payload, headers)

    def _stall(self) -> None:
        """Hold the answer until the client hangs up, the stall ends or the server stops."""
        deadline = time.monotonic() + self.server.faults.stall_seconds
        conn = self.connection
        while not self.server.stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            readable, _, _ = select.select([conn], [], [], min(left, 0.2))
            if readable:
                try:
                    if not conn.recv(1, socket.MSG_PEEK):
                        return  # orderly hang-up
                except OSError:
                    return  # reset
                return  # unexpected bytes: stop stalling rather than spin


class FakeProviderServer(ThreadingHTTPServer):
    """The stand-in; ``serve_forever`` also opens and closes the port for down windows."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        *,
        record_path: Path | str,
        faults: Faults | None = None,
        token: str = "",
        start_down: bool = False,
    ):
        self.faults = faults or Faults()
        self.token = token
        self.writer = _Writer(record_path)
        self.record = Record(record_path)
        self.stopping = threading.Event()
        self._stopped = threading.Event()
        self._rng = random.Random(self.faults.seed)
        self._rng_lock = threading.Lock()
        self._forced: bool | None = True if start_down else None
        self._sends, self._error_from = 0, None
        super().__init__(address, _Handler)
        self.started = time.monotonic()
        self.listening = True
        self.writer.event(f"start port={self.port}")
        if self.is_down():
            self._close_listener()

    # socketserver's HTTPServer.server_bind looks up the FQDN: slow, and loopback only here.
    def server_bind(self):
        if SO_TIMESTAMPNS is not None:  # accepted connections inherit it
            with contextlib.suppress(OSError):
                self.socket.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = host, port

    @property
    def port(self) -> int:
        return self.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self.server_address[0]}:{self.port}"

    def roll(self, fault: str) -> bool:
        fraction = float(getattr(self.faults, fault))
        if fraction <= 0:
            return False
        with self._rng_lock:
            return self._rng.random() < fraction

    def erring(self) -> bool:
        """Whether this send falls in the error window (``error_after``, ``error_seconds``)."""
        with self._rng_lock:
            self._sends += 1
            due = self._sends > self.faults.error_after and self.faults.error_seconds > 0
            if self._error_from is None and due:
                self._error_from = time.monotonic()
                self.writer.event(f"erring for {self.faults.error_seconds:g}s")
            since = self._error_from
        return since is not None and time.monotonic() - since < self.faults.error_seconds

    def set_down(self, down: bool | None) -> None:
        """Force the port closed (True) or open (False); None follows the down windows."""
        self._forced = down

    def is_down(self) -> bool:
        if self._forced is not None:
            return self._forced
        elapsed = time.monotonic() - self.started
        return any(start <= elapsed < end for start, end in self.faults.down)

    def _close_listener(self) -> None:
        self.socket.close()
        self.listening = False
        self.writer.event("down")

    def _open_listener(self) -> None:
        self.socket = socket.socket(self.address_family, self.socket_type)
        self.server_bind()
        self.server_activate()
        self.listening = True
        self.writer.event("up")

    def serve_forever(self, poll_interval: float = 0.02) -> None:
        try:
            while not self.stopping.is_set():
                down = self.is_down()
                if down and self.listening:
                    self._close_listener()
                elif not down and not self.listening:
                    self._open_listener()
                if not self.listening:
                    time.sleep(poll_interval)
                    continue
                readable, _, _ = select.select([self.socket], [], [], poll_interval)
                if readable:
                    self._handle_request_noblock()
        finally:
            self._stopped.set()

    def stop(self) -> None:
        """Stop serving, wait for the loop, close the port and the record."""
        self.stopping.set()
        self._stopped.wait(5)
        if self.listening:
            with contextlib.suppress(OSError):
                self.socket.close()
            self.listening = False
        self.writer.event("stop")
        self.writer.close()


def start_in_thread(
    record_path: Path | str,
    *,
    faults: Faults | None = None,
    token: str = "",
    port: int = 0,
    start_down: bool = False,
) -> FakeProviderServer:
    """Start the stand-in on loopback in a daemon thread; call ``.stop()`` when done."""
    server = FakeProviderServer(
        ("127.0.0.1", port),
        record_path=record_path,
        faults=faults,
        token=token,
        start_down=start_down,
    )
    threading.Thread(target=server.serve_forever, name="fake-provider", daemon=True).start()
    return server
