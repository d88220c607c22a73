"""A TCP relay in front of PostgreSQL that can go down like a restarted server.

The processes under test connect to the relay's port; :meth:`DatabaseProxy.down`
closes the listening socket (new connections are refused, ``ECONNREFUSED``, as
when the server is stopped) and cuts every relayed connection in both directions
(the clients read EOF mid-session; the server ends those backends, rolling back
their transactions and releasing their locks), exactly what a restart does to its
clients. :meth:`DatabaseProxy.up` listens on the same port again.

:meth:`DatabaseProxy.stall` is the other kind of outage, a partition: the relay keeps
every connection open and accepts new ones, and forwards nothing in either direction
(no refusal, no reset, no EOF: the clients' packets are acknowledged and go nowhere,
as when a link, a NAT or a firewall drops them). :meth:`DatabaseProxy.flow` forwards
again what was held. The relay is plain TCP: it stands in front of any server (the
S3 tests put one in front of moto's).

Why a relay and not a second PostgreSQL cluster: the real server keeps running,
so the test's own connection (which observes and checks) and the other suites
sharing the server are untouched, no cluster has to be initialised (initdb refuses
root) and migrated, and the outage starts and ends within milliseconds of when the
test says. The database behind the relay is the same real PostgreSQL.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time


class DatabaseProxy:
    """Relay 127.0.0.1:``port`` to ``target``; ``down()`` / ``up()`` make an outage."""

    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, int(target_port))
        self.port = 0
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self.accepted = 0
        self.cut = 0
        self._flowing = threading.Event()  # cleared: a partition, nothing forwarded
        self._flowing.set()

    # --- lifecycle -------------------------------------------------------------------

    def start(self, *, listening: bool = True) -> DatabaseProxy:
        """Pick a free port outside the ephemeral range; listen on it unless ``listening=False``."""
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.randrange(20000, 30000)
            try:
                self._listen(port)
            except OSError:
                continue
            self.port = port
            if not listening:
                self._stop_listening()
            return self
        raise RuntimeError("no free port for the database proxy")

    def down(self) -> None:
        """Refuse new connections and cut every open one: the server is gone."""
        self._stop_listening()
        with self._lock:
            sockets, self._open = list(self._open), set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()
        self.cut += len(sockets) // 2

    def up(self) -> None:
        """Accept connections on the same port again: the server is back."""
        deadline = time.monotonic() + 10
        while True:
            try:
                self._listen(self.port)
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stall(self) -> None:
        """Forward nothing, keep every connection open, accept new ones: a partition."""
        self._flowing.clear()

    def flow(self) -> None:
        """Forward again, what was held first: the partition healed."""
        self._flowing.set()

    @property
    def stalled(self) -> bool:
        return not self._flowing.is_set()

    def close(self) -> None:
        self._flowing.set()
        self.down()

    @property
    def listening(self) -> bool:
        return self._listener is not None

    # --- internals -------------------------------------------------------------------

    def _listen(self, port: int) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(("127.0.0.1", port))
            listener.listen(128)
        except OSError:
            listener.close()
            raise
        listener.settimeout(0.1)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _stop_listening(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            # shutdown() first: close() alone leaves the socket listening while the
            # accept thread still polls it, and a connect would be accepted, then cut.
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()

    def _accept(self, listener: socket.socket) -> None:
        while self._listener is listener:
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._listener is not listener:  # went down meanwhile
                    client.close()
                    upstream.close()
                    return
                self._open |= {client, upstream}
                self.accepted += 1
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                # In a partition what arrived is held (an EOF too), not dropped: TCP
                # would deliver it once the path is back.
                self._flowing.wait()
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._open.discard(src)
                self._open.discard(dst)
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    sock.close()
