"""A job kind whose behaviour the test chooses through params (ids and flags only)."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request

from jobs.delivery.runner import JobContext
from jobs.exceptions import NotAuthorized, PayloadInvalid, TemporaryFailure
from jobs.registry import EffectSpec, ResultSpec, register_kind


def _error(mode: str) -> Exception:
    if mode == "temporary":
        return TemporaryFailure("test dependency unavailable", code="test_unavailable")
    if mode == "validation":
        return PayloadInvalid("params.fail asked for a validation error")
    if mode == "authorization":
        return NotAuthorized("test policy refused the read")
    return RuntimeError("test asked for an unexpected error")


def steps(ctx: JobContext) -> list[EffectSpec]:
    """Fail on chosen attempts, work in heartbeated stages, store an artifact, notify."""
    p = ctx.params
    if not isinstance(p.get("recipients", []), list):
        raise PayloadInvalid("params.recipients must be a list of user ids")
    fail = p.get("fail", {})
    mode = fail.get(str(ctx.job.attempts)) or fail.get("always")
    if mode:
        raise _error(mode)
    ctx.check_owner()
    for _ in range(int(p.get("stages", 0))):
        time.sleep(float(p.get("stage_sleep", 0)))
        ctx.heartbeat()
    body = f"artifact of job {ctx.job.pk} revision {ctx.job.output_revision}\n".encode()
    ctx.store_artifact(body, content_type="text/plain", extension="txt")
    for _ in range(int(p.get("after_stages", 0))):
        time.sleep(float(p.get("stage_sleep", 0)))
        ctx.heartbeat()
    return [
        EffectSpec("completion-notice", "inapp", str(r), {"title": f"job {ctx.job.pk} done"})
        for r in p.get("recipients", [])
    ]


def register() -> None:
    register_kind("test.steps", steps)
    register_kind("test.short", steps, max_attempts=3)
    register_effect_kinds()


def notify(ctx: JobContext) -> list[EffectSpec]:
    """Store a small artifact; notify ``params.recipient`` through each of ``params.providers``."""
    ctx.check_owner()
    ctx.store_artifact(b"notify", content_type="text/plain", extension="txt")
    recipient = str(ctx.params["recipient"])
    return [
        EffectSpec(f"notice-{name}", name, recipient, {"report_key": f"job-{ctx.job.pk}"})
        for name in ctx.params.get("providers", ["inapp"])
    ]


def _release_check_raises(effect) -> str | None:
    raise RuntimeError("the release policy service is unavailable")


def register_effect_kinds() -> None:
    register_kind("test.release_check_raises", notify, authorize_release=_release_check_raises)
    register_kind("test.notify_only", notify)


# --- durable steps under real processes (tests/e2e/test_steps_processes.py) ----------

DBOS_KIND = "test.dbos_steps"


def _append(path: str, line: str) -> None:
    """One line per fn run, in a file: the count survives a frozen or killed worker."""
    with open(path, "a") as f:
        f.write(line + "\n")


def _hold(go_file: str, runs_file: str) -> None:
    """Wait for the test's go. The suite's django-q2 alarm (Q_CLUSTER timeout 5 s, counted
    in wall time, frozen or not) may have fired while the test kept this worker frozen
    past its 2 s lease: it is swallowed here, once, so the worker goes on to its record as
    a paused worker does in production, where the lease is far below Q_CLUSTER timeout."""
    from django_q.exceptions import TimeoutException

    deadline = time.monotonic() + 60
    while not os.path.exists(go_file) and time.monotonic() < deadline:
        try:
            time.sleep(0.02)
        except TimeoutException:
            _append(runs_file, "alarm swallowed")


def dbos_steps(ctx: JobContext) -> list[EffectSpec]:
    """Step 1 renders; step 2 sends one request to the stand-in provider keyed by
    ``ctx.step_key("send")``. On attempt 1 it then stays inside step 2 until
    ``params.go_file`` exists, so the test can freeze it there (SIGSTOP) past its lease."""
    p = ctx.params

    def render() -> dict:
        _append(p["runs_file"], f"render attempt={ctx.job.attempts}")
        return {"pages": 2}

    def send() -> dict:
        from tests.e2e.processes import PROVIDER_TOKEN

        key = ctx.step_key("send")
        _append(p["runs_file"], f"send attempt={ctx.job.attempts}")
        body = {
            "effect_id": key,
            "recipient": str(p["recipient"]),
            "job": ctx.job.pk,
            "revision": ctx.job.output_revision,
            "report_key": f"job-{ctx.job.pk}",
            "kind": DBOS_KIND,
        }
        request = urllib.request.Request(
            f"{p['provider']}/notices",
            data=json.dumps(body).encode(),
            method="POST",
            headers={
                "Content-Type": "application/json",
                "Idempotency-Key": key,
                "Authorization": f"Bearer {PROVIDER_TOKEN}",
            },
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            sent = json.loads(answer.read())
        if ctx.job.attempts == 1:
            _hold(p["go_file"], p["runs_file"])
        return {"send_id": sent["id"]}

    def look_up() -> dict | None:
        """``GET /notices/{key}``: the send's id if the provider applied the key."""
        from tests.e2e.processes import PROVIDER_TOKEN

        _append(p["runs_file"], f"lookup attempt={ctx.job.attempts}")
        request = urllib.request.Request(
            f"{p['provider']}/notices/{ctx.step_key('send')}",
            headers={"Authorization": f"Bearer {PROVIDER_TOKEN}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return {"send_id": json.loads(answer.read())["id"]}
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    rendered = ctx.step("render", render)
    if p.get("lookup"):
        # ``ctx.step("send", send, lookup=look_up)`` once the runner passes it on.
        from jobs.delivery import steps

        sent = steps.run(ctx, "send", send, lookup=look_up)
    else:
        sent = ctx.step("send", send)
    body = f"pages={rendered['pages']} send={sent['send_id']}\n".encode()
    ctx.store_artifact(body, content_type="text/plain", extension="txt")
    return [EffectSpec("done", "inapp", str(p["recipient"]), {"title": "Report ready"})]


def register_durable_steps() -> None:
    register_kind(DBOS_KIND, dbos_steps, max_attempts=3)


# --- chains and groups under real processes (tests/e2e/test_chains_processes.py) --------

CHAIN_PARENT, CHAIN_CHILD, CHAIN_JOIN = "test.e2e_parent", "test.e2e_child", "test.e2e_join"
CHAIN_DYING_CHILD = "test.e2e_child_dies"  # its own kind: a budget of 2 runs out soon


def chain_parent(ctx: JobContext) -> list:
    """A group of ``params.modes`` children and a join; a line per run in the runs file."""
    import jobs

    p = ctx.params
    _append(p["runs_file"], f"parent job={ctx.job.pk} attempt={ctx.job.attempts}")
    time.sleep(p.get("sleep", 0.0))
    children = [
        jobs.then(
            CHAIN_DYING_CHILD if mode == "die" else CHAIN_CHILD,
            params={**p, "n": n, "mode": mode},
            name=f"c{n}",
        )
        for n, mode in enumerate(p["modes"])
    ]
    return [jobs.group(children, join=jobs.then(CHAIN_JOIN, params=p), name="g")]


def chain_child(ctx: JobContext) -> list:
    """Works ``params.sleep`` seconds in small heartbeated slices (a SIGKILL lands mid-work);
    mode ``die`` kills its own worker process on every attempt, so its budget runs out."""
    import jobs

    p = ctx.params
    _append(p["runs_file"], f"child job={ctx.job.pk} n={p['n']} attempt={ctx.job.attempts}")
    if p["mode"] == "die":
        os.kill(os.getpid(), 9)
    deadline = time.monotonic() + p.get("sleep", 0.0)
    while time.monotonic() < deadline:
        time.sleep(0.1)
        ctx.heartbeat()
    return [jobs.result({"n": p["n"], "square": p["n"] * p["n"]})]


def chain_join(ctx: JobContext) -> list:
    """Writes what ``ctx.joined()`` gave it (names, states, results) to the runs file."""
    import jobs

    seen = [[c.name, c.state, c.result] for c in ctx.joined()]
    _append(ctx.params["runs_file"], f"join job={ctx.job.pk} joined={json.dumps(seen)}")
    return [jobs.result({"squares": sum(c.result["square"] for c in ctx.joined() if c.result)})]


def register_chains() -> None:
    register_kind(CHAIN_PARENT, chain_parent, max_attempts=6)
    register_kind(CHAIN_CHILD, chain_child, max_attempts=6)
    register_kind(CHAIN_DYING_CHILD, chain_child, max_attempts=2)
    register_kind(CHAIN_JOIN, chain_join, max_attempts=6)  # on_child_failure "fail"


# Debounced kinds (docs/app/debounce.md): the result is the params the job ran with.
DEBOUNCED, DEBOUNCED_BY_KEY = "test.debounced", "test.debounced_by_key"


def debounced(ctx: JobContext) -> list:
    return [ResultSpec({"params": dict(ctx.params), "revision": ctx.job.output_revision})]


def register_debounced() -> None:
    register_kind(DEBOUNCED, debounced, debounce=1, debounce_max=5)
    register_kind(
        DEBOUNCED_BY_KEY,
        debounced,
        debounce=1,
        debounce_max=5,
        debounce_key=lambda params, subject: f"customer:{params.get('customer')}",
    )
