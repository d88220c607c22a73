"""The stand-in provider itself: protocol answers, faults, and its durable record."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from jobs.testing.fakeprovider import Faults, Record, start_in_thread
from tests.providers.conftest import TOKEN, wait_for

ROOT = Path(__file__).resolve().parents[2]
BODY = {
    "effect_id": "7:1:completion-notice:3",
    "recipient": "3",
    "job": 7,
    "revision": 1,
    "report_key": "job-7-rev-1",
    "kind": "completion-notice",
}
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def post(server, body=BODY, key="k-1", headers=AUTH, timeout=5.0) -> httpx.Response:
    return httpx.post(
        f"{server.url}/notices",
        json=body,
        headers={**headers, "Idempotency-Key": key} if key else headers,
        timeout=timeout,
    )


def test_fake_provider__replay_answers_200_with_the_same_id(provider):
    first = post(provider)
    again = post(provider)
    assert first.status_code == 201 and again.status_code == 200
    assert first.json()["id"] == again.json()["id"]
    assert len(provider.record.sends()) == 1


def test_fake_provider__protocol_errors(provider):
    post(provider)
    assert post(provider, body={**BODY, "revision": 2}).status_code == 409, "key reuse"
    assert post(provider, key="").status_code == 400, "no key"
    assert post(provider, body={**BODY, "email": "x@example.org"}, key="k-2").status_code == 422
    assert post(provider, body={**BODY, "job": "7"}, key="k-3").status_code == 422
    assert post(provider, headers={"Authorization": "Bearer nope"}, key="k-4").status_code == 401
    assert post(provider, headers={}, key="k-5").status_code == 401
    assert len(provider.record.sends()) == 1
    outcomes = [r["outcome"] for r in provider.record.requests()]
    assert outcomes == [
        "applied",
        "conflict",
        "missing_key",
        "invalid",
        "invalid",
        "unauthorized",
        "unauthorized",
    ]


def test_fake_provider__503_carries_retry_after(provider):
    provider.faults.unavailable = 1.0
    provider.faults.retry_after = 12
    answer = post(provider)
    assert answer.status_code == 503 and answer.headers["Retry-After"] == "12"
    assert provider.record.sends() == []


def test_fake_provider__stall_applies_then_holds_the_answer_past_the_client_timeout(provider):
    provider.faults.stall = 1.0
    with pytest.raises(httpx.ReadTimeout):
        post(provider, timeout=0.3)
    assert len(provider.record.sends()) == 1, "applied before the stall"
    (stalled,) = wait_for(provider.record.requests, what="the stalled call to be recorded")
    assert stalled["outcome"] == "applied_stalled"
    assert stalled["answered_at"] - stalled["received_at"] < 5, "ends when the client hangs up"
    assert post(provider).status_code == 200, "a replay is answered"


def test_fake_provider__down_window_refuses_connections(provider):
    provider.set_down(True)
    wait_for(lambda: not provider.listening, what="the port to close")
    with pytest.raises(httpx.ConnectError):
        post(provider)
    provider.set_down(False)
    wait_for(lambda: provider.listening, what="the port to open")
    assert post(provider).status_code == 201
    assert [e["what"].split()[0] for e in provider.record.events()] == ["start", "down", "up"]


def test_fake_provider__timed_down_window(tmp_path):
    server = start_in_thread(tmp_path / "r.sqlite3", faults=Faults(down=[(0, 0.4)]))
    try:
        assert not server.listening
        wait_for(lambda: server.listening, what="the window to end")
        assert post(server).status_code == 201
    finally:
        server.stop()


def test_fake_provider__record_survives_a_restart(tmp_path):
    path = tmp_path / "record.sqlite3"
    first = start_in_thread(path, token=TOKEN)
    sent_id = post(first).json()["id"]
    first.stop()
    second = start_in_thread(path, token=TOKEN)
    try:
        again = post(second)
        assert again.status_code == 200 and again.json()["id"] == sent_id
    finally:
        second.stop()
    assert len(Record(path).sends()) == 1
    assert len(Record(path).requests()) == 2


def test_fake_provider__counts_calls_in_flight(provider):
    provider.faults.delay = 0.4
    barrier = threading.Barrier(3)

    def call(i):
        barrier.wait()
        post(provider, key=f"k-{i}", body={**BODY, "effect_id": f"7:1:n:{i}"})

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert provider.record.max_in_flight() == 3
    post(provider, key="k-late", body={**BODY, "effect_id": "7:1:n:late"})
    assert provider.record.max_in_flight() == 3, "a later call does not overlap"


def test_fake_provider_command__serves_records_and_stops_on_sigterm(tmp_path):
    record = tmp_path / "cmd.sqlite3"
    proc = subprocess.Popen(
        [sys.executable, "manage.py", "fake_provider", "--port", "0", "--record", str(record)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        line = proc.stdout.readline().decode()
        assert "listening on http://127.0.0.1:" in line, line
        url = line.split("listening on ", 1)[1].split()[0]
        answer = httpx.post(
            f"{url}/notices", json=BODY, headers={"Idempotency-Key": "k-cmd"}, timeout=5
        )
        assert answer.status_code == 201
        proc.send_signal(signal.SIGUSR1)
        wait_for(lambda: "down" in [e["what"] for e in Record(record).events()], what="down")
        with pytest.raises(httpx.ConnectError):
            httpx.post(f"{url}/notices", json=BODY, headers={"Idempotency-Key": "k2"}, timeout=5)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0, proc.stderr.read().decode()
    assert [s["idempotency_key"] for s in Record(record).sends()] == ["k-cmd"]


def test_fake_provider__a_body_cut_short_by_a_dying_sender_is_recorded_not_judged(provider):
    """A sender SIGKILLed mid-write leaves half a body: no 4xx is held against it."""
    import socket

    head = (
        "POST /notices HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {TOKEN}\r\nIdempotency-Key: k-cut\r\nContent-Length: 200\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", provider.port), timeout=5) as sock:
        sock.sendall(head.encode() + b'{"effect_id": "7:1:comp')
    wait_for(lambda: provider.record.requests(), timeout=5, what="the cut request recorded")
    [row] = provider.record.requests()
    assert (row["status"], row["outcome"], row["idempotency_key"]) == (0, "truncated", "k-cut")
    assert provider.record.sends() == []
