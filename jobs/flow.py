"""Flow control stored in the database: pause, concurrency and rate per scope, live.

Rules are rows (``jobs.models.FlowRule``), one per scope: ``kind:<name>`` and
``tenant:<key>`` are enforced at the job's claim, ``provider:<name>`` and
``provider:<name>/tenant:<key>`` at the effect's slot acquisition. Settings
(``JOBS_TENANT_CONCURRENCY``, ``NOTICE_PROVIDER_MAX_IN_FLIGHT``, ...) are the
defaults; a row's value wins. Every process reads the same rows, so the accounting
is shared without a coordinator: concurrency counts live rows (jobs) or holds
advisory locks / ``flock`` slots (provider calls), and the rate is one UPDATE of
the rule's row by the database server's clock.

Rate: GCRA, a token bucket of burst 1. The row keeps the theoretical arrival time
``next_free_at`` (TAT); a start is allowed when ``TAT <= now`` and moves it to
``max(TAT, now) + period / rate``. Two starts are then at least ``period / rate``
apart, so any window of one period holds at most ``rate + 1`` starts (the +1 is
the window's edge), and an idle scope earns no burst to spend later. A rolling
window would let ``rate`` starts through at once after a quiet period; a bigger
bucket the same. Providers that sell "14 per second" measure it per second:
spacing is the safe reading.

Work held back is deferred, never failed, and spends no attempt: a job goes back
to ``retry_wait`` due later (``jobs.engine.job_machine.defer``), an effect to its prior
state (``jobs.engine.effect_machine.defer``). A rate hold is due at the rule's next
allowed start plus jitter within one interval (period / rate), a concurrency hold within
one second, so waiters do not come back together.

A change takes effect within ``JOBS_FLOW_CACHE_SECONDS`` (1 s) plus one defer:
the one-statement claim sees the rows in its own statement (``jobs.rules``), the
ORM claim reads them in its transaction, senders keep what they read for at most
that long, and the rate's UPDATE always reads the row itself.

Circuit breaker, per provider, on the provider's row: ``JOBS_CIRCUIT_FAILURES``
failed calls in a row (transport, temporary, provider timeout) open it; while
open, effects are deferred to the next probe time without spending an attempt;
one sender at a time probes (half-open, a locked read-and-write of the row), the
interval doubling per failed probe up to ``JOBS_CIRCUIT_PROBE_CAP_SECONDS``; the
first success closes it. Open longer than ``JOBS_OUTAGE_WINDOW_SECONDS``, the
waiting effects go to ``needs_review`` with the reason.
"""

from __future__ import annotations

import logging
import os
import random
import re
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import timedelta

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from jobs import clock, conf, fairness, rules
from jobs.engine import held
from jobs.engine.admission import interval_jitter, paused_delay, take
from jobs.engine.plan import Hold
from jobs.models import FlowRule, FlowRuleChange
from jobs.registry import QUEUE_NAME
from jobs.rules import partition_scope, provider_scope

log = logging.getLogger("jobs.flow")

Circuit = FlowRule.Circuit

_NAME = r"[A-Za-z0-9_.@:-]+"
# Python's ``$`` matches before a trailing newline: every check below is a ``fullmatch``,
# and no name has whitespace, so "kind:x\n" is no phantom twin of "kind:x".
QUEUE_PREFIX = getattr(rules, "FLOW_QUEUE_PREFIX", "queue:")
SCOPE_RE = re.compile(
    rf"provider:[A-Za-z0-9_.-]+(/tenant:{_NAME})?|tenant:{_NAME}|tenant:\*|kind:{_NAME}"
    rf"|{re.escape(QUEUE_PREFIX)}{QUEUE_NAME.pattern}"
)
SCOPE_FORMS = (
    "provider:<name>, provider:<name>/tenant:<key>, tenant:<key>, kind:<name> or queue:<name>"
)
_PERIODS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_RATE_RE = re.compile(r"(\d+)/(\d*(?:\.\d+)?(?:e[+-]?\d+)?)([smh])")

# The bounds of a rule (docs/app/flow.md): a period longer than a day is no rate, and
# values past these are typing mistakes that the database's columns (a 4-byte integer, an
# interval) would refuse at every claim of the scope instead of here.
PERIOD_MAX_SECONDS = 86_400.0
RATE_MAX = 1_000_000  # starts per period
CONCURRENCY_MAX = 100_000  # at once
NOTE_MAX = 120  # a change's note, kept in the audit row's 300 characters with the rule


class FlowError(ValueError):
    """Raised when a scope or a rate is not written the way ``jobs_limits`` expects."""


def scope_max_length() -> int:
    """The longest scope the rule's column holds (``FlowRule.scope``, 200 characters)."""
    return FlowRule._meta.get_field("scope").max_length or 200


def check_scope(scope: str) -> str:
    """``scope`` if it is one of the five forms, whole, without whitespace and no longer
    than its column, else ``FlowError``: the one check the console, the admin and
    ``jobs_limits`` share, so a bad scope never reaches the database as a ``DataError``."""
    if not isinstance(scope, str):
        raise FlowError(f"a scope must be text: {SCOPE_FORMS}")
    limit = scope_max_length()
    if len(scope) > limit:
        raise FlowError(
            f"a scope is at most {limit} characters, this one has {len(scope)} "
            f"(it starts {scope[:40]!r})"
        )
    if not SCOPE_RE.fullmatch(scope):
        shown = scope[:80]
        raise FlowError(f"{shown!r} is not a scope: {SCOPE_FORMS} (no spaces or newlines)")
    return scope


def check_note(note: object) -> str:
    """A change's note as text that fits the audit row beside the rule (at most 120
    characters), else ``FlowError``."""
    text = "" if note is None else str(note)
    if len(text) > NOTE_MAX:
        raise FlowError(f"a note is at most {NOTE_MAX} characters, this one has {len(text)}")
    return text


def _integer(value: object, what: str) -> int:
    if isinstance(value, bool):
        raise FlowError(f"{what} must be a whole number, not {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and re.fullmatch(r"[+-]?\d{1,30}", value.strip()):
        return int(value.strip())
    raise FlowError(f"{what} must be a whole number, not {str(value)[:40]!r}")


def check_rate(rate: object) -> int | None:
    """A rate (starts per period) within 1..``RATE_MAX``, or None (no rate)."""
    if rate is None:
        return None
    value = _integer(rate, "a rate")
    if not 1 <= value <= RATE_MAX:
        raise FlowError(
            f"a rate must be from 1 to {RATE_MAX:,} starts per period, not {value} "
            "(empty or 'off': no rate; pause the scope to stop it)"
        )
    return value


def check_period(period: object) -> float:
    """A rate's period in seconds, within (0, ``PERIOD_MAX_SECONDS``] (one day)."""
    try:
        value = float(period)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise FlowError(f"a period must be a number of seconds, not {str(period)[:40]!r}") from None
    if not (0.0 < value <= PERIOD_MAX_SECONDS):  # also refuses nan
        raise FlowError(
            f"a period must be more than 0 and at most {PERIOD_MAX_SECONDS:g} seconds "
            f"(one day), not {value:g}"
        )
    return value


def check_concurrency(concurrency: object) -> int | None:
    """At most this many at once, within 1..``CONCURRENCY_MAX``, or None (the default)."""
    if concurrency is None:
        return None
    value = _integer(concurrency, "a concurrency")
    if not 1 <= value <= CONCURRENCY_MAX:
        raise FlowError(
            f"a concurrency must be from 1 to {CONCURRENCY_MAX:,}, not {value} "
            "(pause the scope to stop it; 'default' for the settings' value)"
        )
    return value


def parse_rate(text: str) -> tuple[int | None, float]:
    """``3/s``, ``100/m``, ``5/10s``, ``1000/h`` → (rate, period seconds); ``off`` → (None, 1)."""
    cleaned = re.sub(r"\s+", "", text or "").lower()
    if cleaned in ("off", "none", "unlimited"):
        return None, 1.0
    if cleaned == "0":
        raise FlowError("a rate of 0 starts nothing: write 'off' for no rate, or pause the scope")
    match = _RATE_RE.fullmatch(cleaned)
    if not match:
        raise FlowError(
            f"{str(text)[:40]!r} is not a rate: N/s, N/m, N/h or N/<seconds>s, or off "
            f"(N from 1 to {RATE_MAX:,}, a period of at most one day)"
        )
    count, factor, unit = match.groups()
    period = (float(factor) if factor else 1.0) * _PERIODS[unit]
    return check_rate(int(count)), check_period(period)


# --- reading rules ----------------------------------------------------------------------

_cache: tuple[int, float, dict[str, FlowRule]] | None = None


def cached_rules() -> dict[str, FlowRule]:
    """Every rule by scope, as this process read them at most ``JOBS_FLOW_CACHE_SECONDS`` ago."""
    global _cache
    ttl = float(conf.get("JOBS_FLOW_CACHE_SECONDS"))
    pid, now = os.getpid(), time.monotonic()
    if _cache is None or _cache[0] != pid or now - _cache[1] > ttl:
        _cache = (pid, now, {r.scope: r for r in FlowRule.objects.all()})
    return _cache[2]


def forget() -> None:
    """Drop this process's copy of the rules (after a change, and in tests)."""
    global _cache
    _cache = None


# --- the effect's slot (provider: scopes) -------------------------------------------------


@dataclass
class Gate:
    """What a sender must respect for one provider call, read before the slot."""

    provider: str
    limits: list[tuple[str, int | None]]  # (slot name, in-flight limit) to hold, in order
    rated: list[FlowRule]  # rules whose rate the call takes from, in order
    hold: Hold | None = None
    probe: bool = False  # this call is the circuit's probe
    review: str = ""  # the circuit stayed open past the outage window


def provider_gate(
    provider: str, default_limit: int | None, tenant: Callable[[], str], worker: str
) -> Gate:
    """The provider's rules (cached at most ``JOBS_FLOW_CACHE_SECONDS``) and its circuit."""
    found = cached_rules()
    scope = provider_scope(provider)
    main = found.get(scope)
    if main is not None and (main.circuit_state != Circuit.CLOSED or main.circuit_failures):
        # Calls are failing: read the row itself, so a circuit another process just
        # opened holds this call back instead of costing it an attempt.
        main = FlowRule.objects.filter(pk=main.pk).first()
    chosen = [main]
    prefix = scope + "/tenant:"
    if any(s.startswith(prefix) for s in found):
        chosen.append(found.get(partition_scope(provider, tenant())))
    limit = main.concurrency if main is not None and main.concurrency is not None else None
    limit = default_limit if limit is None else limit
    gate = Gate(provider, [(provider, limit or None)], [])
    for rule in chosen[1:]:
        if rule is not None and rule.concurrency is not None:
            gate.limits.append((rule.scope, rule.concurrency or None))
    for rule in chosen:
        if rule is None:
            continue
        if rule.paused:
            gate.hold = Hold(rule.scope, "paused", paused_delay())
            return gate
        if rule.rate:
            gate.rated.append(rule)
    if main is not None and main.circuit_state != Circuit.CLOSED:
        _circuit_gate(gate, scope, worker)
    return gate


@contextmanager
def slots(gate: Gate, *, deadline: float) -> Iterator[bool]:
    """Hold one in-flight slot of each of the gate's limits; yields False if one stayed busy."""
    from jobs.providers import bounds

    with ExitStack() as stack:
        for name, limit in gate.limits:
            wait = max(0.0, deadline - time.monotonic())
            slot = stack.enter_context(bounds.in_flight(name, limit, wait=wait))
            if slot is None:
                yield False
                return
        yield True


# A start is used while fresh. Calls reach the provider as far apart as their starts
# were taken only if each call follows its take by about the same delay; a take whose
# answer came late (a slow commit, a process that waited for a CPU) leaves its start
# unused, which only spaces the calls further, and takes another. "Late" is measured
# against this process's quickest recent take, so a far database is not late.
STALE_FRACTION = 0.25  # of the rule's interval (the provider's window allows one edge)
_took: deque[float] = deque(maxlen=32)  # seconds this process's recent takes took


def fresh_for(rated: list[FlowRule]) -> float:
    """How long after it was asked for a start may still be used for a call: the
    quickest recent takes (none yet: 0) plus a quarter of the shortest interval."""
    interval = min(r.interval_seconds or 0.0 for r in rated)
    return min(_took, default=0.0) * len(rated) + interval * STALE_FRACTION


def take_within(
    gate: Gate, *, deadline: float, check: Callable[[], str] = lambda: ""
) -> tuple[Hold | None, str]:
    """Take a start from each rated rule, sleeping for it while the deadline allows.

    Called inside the slots: at most the in-flight limit of senders wait here, so
    they do not stampede, and one is ready when the next start is due. ``check``
    (the release policy: a reason to withhold, or "") is asked before each try, so
    the start taken is the last thing before the call: a sender that slept or asked
    the database is not holding a start from the past when it calls, and the calls
    reach the provider as far apart as they were taken. A start that came back late
    (``fresh_for``) is left unused and another taken. Returns (hold, reason).
    """
    pending = list(gate.rated)
    asked_first = None  # when the oldest start still held was asked for
    while True:
        reason = check()
        if reason:
            return None, reason
        took = []
        while pending:
            asked = time.monotonic()
            taken = take(pending[0].scope)
            took.append(time.monotonic() - asked)
            if not taken.ok:
                break
            asked_first = asked if asked_first is None else asked_first
            pending.pop(0)
        if not pending:
            late = time.monotonic() - asked_first if asked_first is not None else 0.0
            fresh = asked_first is None or late <= fresh_for(gate.rated)
            _took.extend(took)  # after judging: a slow take is not its own yardstick
            if fresh:
                return None, ""
            log.info(
                "flow scope=%s start left unused: it came back %.3f s after it was asked for",
                gate.rated[0].scope,
                late,
            )
            pending, asked_first = list(gate.rated), None
            continue
        _took.extend(took)
        rule = pending[0]
        if taken.reason == "rate" and time.monotonic() + taken.delay < deadline:
            time.sleep(taken.delay + random.uniform(0.0, 0.005))
            continue
        jitter = interval_jitter(rule) if taken.reason == "rate" else 0.0
        return Hold(rule.scope, taken.reason, taken.delay + jitter), ""


# --- circuit breaker ----------------------------------------------------------------------

CIRCUIT_CLASSES = frozenset({"transport", "temporary", "provider_timeout"})
CIRCUIT_SPREAD_SECONDS = 5.0


def _probe_interval(failed_probes: int) -> float:
    base = float(conf.get("JOBS_CIRCUIT_PROBE_SECONDS"))
    cap = float(conf.get("JOBS_CIRCUIT_PROBE_CAP_SECONDS"))
    return min(cap, base * 2 ** min(failed_probes, 30))


def _locked_row(scope: str, *, create: bool = False) -> FlowRule | None:
    if create:
        FlowRule.objects.get_or_create(scope=scope, defaults={"updated_by": "circuit"})
    return (
        FlowRule.objects.select_for_update()
        .annotate(db_now=clock.ServerNow())
        .filter(scope=scope)
        .first()
    )


def _audit(scope: str, actor: str, before: str, after: str, action: str = "circuit") -> None:
    FlowRuleChange.objects.create(
        scope=scope, action=action, actor=actor[:200], before=before[:300], after=after[:300]
    )
    log.info("flow scope=%s action=%s %s -> %s actor=%s", scope, action, before, after, actor)


def _circuit_gate(gate: Gate, scope: str, worker: str) -> None:
    """An open circuit (by this process's copy): ask the row, and probe if it is time."""
    with clock.worker_transaction():
        row = _locked_row(scope)
        if row is None or row.circuit_state == Circuit.CLOSED:
            return
        now = row.db_now
        opened = row.circuit_opened_at or now
        if (now - opened).total_seconds() > conf.outage_window_seconds():
            gate.review = (
                f"provider {gate.provider!r} unavailable: its circuit has been open since "
                f"{opened:%Y-%m-%d %H:%M:%S} UTC, longer than JOBS_OUTAGE_WINDOW_SECONDS"
            )
            return
        if row.circuit_probe_at is None or row.circuit_probe_at <= now:
            lease = float(conf.get("JOBS_EFFECT_LEASE_SECONDS"))
            FlowRule.objects.filter(pk=row.pk).update(
                circuit_state=Circuit.HALF_OPEN,
                circuit_prober=worker[:200],
                circuit_probe_at=now + timedelta(seconds=lease),
            )
            gate.probe = True
            return
        interval = _probe_interval(row.circuit_probes)
        if row.circuit_state == Circuit.HALF_OPEN:  # a probe is out: its answer comes soon
            delay = random.uniform(0.5, 1.5)
        else:
            # Waiters come back after the next probe, spread over a few seconds: when it
            # closes the circuit they follow soon, when it fails they wait again.
            spread = min(interval, CIRCUIT_SPREAD_SECONDS)
            delay = (row.circuit_probe_at - now).total_seconds() + random.uniform(0, spread)
        gate.hold = Hold(scope, "circuit_open", delay)


def circuit_failure(provider: str, worker: str, *, probe: bool) -> bool:
    """Count a failed call; True when the circuit was already open (not our probe):
    the failure belongs to the outage, and the effect gets its attempt back."""
    scope = provider_scope(provider)
    with clock.worker_transaction():
        row = _locked_row(scope, create=True)
        now = row.db_now
        if probe and row.circuit_state == Circuit.HALF_OPEN and row.circuit_prober == worker[:200]:
            interval = _probe_interval(row.circuit_probes + 1)
            FlowRule.objects.filter(pk=row.pk).update(
                circuit_state=Circuit.OPEN,
                circuit_probes=row.circuit_probes + 1,
                circuit_probe_at=now + timedelta(seconds=interval),
                circuit_prober="",
            )
            _audit(scope, worker, "half_open", f"open (probe failed; next in {interval:g}s)")
            return False
        if row.circuit_state != Circuit.CLOSED:
            return True
        failures = row.circuit_failures + 1
        changes = {"circuit_failures": failures}
        opens = failures >= int(conf.get("JOBS_CIRCUIT_FAILURES"))
        if opens:
            changes.update(
                circuit_state=Circuit.OPEN,
                circuit_opened_at=now,
                circuit_probes=0,
                circuit_prober="",
                circuit_probe_at=now + timedelta(seconds=_probe_interval(0)),
            )
        FlowRule.objects.filter(pk=row.pk).update(**changes)
        if opens:
            _audit(scope, worker, "closed", f"open ({failures} failed calls in a row)")
    forget()
    return False


def probe_abandoned(provider: str, worker: str) -> None:
    """The probe made no call (withheld, no slot, no start): the circuit is open again and
    the next sender may probe at once."""
    FlowRule.objects.filter(
        scope=provider_scope(provider), circuit_state=Circuit.HALF_OPEN, circuit_prober=worker[:200]
    ).update(circuit_state=Circuit.OPEN, circuit_prober="", circuit_probe_at=clock.ServerNow())


def circuit_success(provider: str, worker: str) -> None:
    """A call succeeded: the failure count restarts and an open circuit closes.

    One UPDATE that matches nothing while all is well."""
    scope = provider_scope(provider)
    closing = Q(scope=scope) & (Q(circuit_failures__gt=0) | ~Q(circuit_state=Circuit.CLOSED))
    if not FlowRule.objects.filter(closing).exists():
        return
    with clock.worker_transaction():
        row = _locked_row(scope)
        if row is None:
            return
        was = row.circuit_state
        FlowRule.objects.filter(pk=row.pk).update(
            circuit_state=Circuit.CLOSED,
            circuit_failures=0,
            circuit_opened_at=None,
            circuit_probe_at=None,
            circuit_probes=0,
            circuit_prober="",
        )
        if was != Circuit.CLOSED:
            _audit(scope, worker, was, "closed (a call succeeded)")
    forget()


# --- changing rules (jobs_limits, admin, console) -----------------------------------------

_UNSET = object()


def set_rule(
    scope: str,
    *,
    actor: str,
    rate=_UNSET,
    period_seconds=_UNSET,
    concurrency=_UNSET,
    paused=_UNSET,
    weight=_UNSET,
    note: str = "",
) -> FlowRule:
    """Create or change the rule of ``scope``; the change and its audit row commit together."""
    check_scope(scope)
    note = check_note(note)
    try:
        weight = weight if weight is _UNSET else fairness.check_weight(weight)
        fairness.check_weight_scope(
            scope,
            weighted=weight not in (_UNSET, None),
            other=any(v is not _UNSET for v in (rate, period_seconds, concurrency, paused)),
        )
    except ValueError as exc:
        raise FlowError(str(exc)) from None
    if concurrency is not _UNSET:
        concurrency = check_concurrency(concurrency)
    if rate is not _UNSET:
        rate = check_rate(rate)
    if period_seconds is not _UNSET:
        period_seconds = check_period(period_seconds)
    with transaction.atomic():
        FlowRule.objects.get_or_create(scope=scope)
        rule = FlowRule.objects.select_for_update().get(scope=scope)
        before, was = rule.describe(), held.limits(rule)
        if rate is not _UNSET:
            rule.rate = rate
            if rate is None:
                rule.next_free_at = None
        if period_seconds is not _UNSET:
            rule.period_seconds = float(period_seconds)
        if concurrency is not _UNSET:
            rule.concurrency = concurrency
        if weight is not _UNSET:
            rule.weight = weight
        if paused is not _UNSET:
            rule.paused = bool(paused)
            if rule.paused:
                held.hold(scope)
            else:
                held.release(scope)
        held.after_change(scope, was, rule)  # loosened: what it deferred is due now
        rule.updated_at = timezone.now()
        rule.updated_by = actor[:200]
        rule.save()
        only_pause = all(v is _UNSET for v in (rate, concurrency, period_seconds, weight))
        action = ("pause" if paused else "resume") if only_pause and paused is not _UNSET else "set"
        FlowRuleChange.objects.create(
            scope=scope,
            action=action,
            actor=actor[:200],
            before=before[:300],
            after=(rule.describe() + (f" ({note})" if note else ""))[:300],
        )
    log.info(
        "flow scope=%s action=%s %s -> %s actor=%s", scope, action, before, rule.describe(), actor
    )
    forget()
    return rule


def pause(scope: str, *, actor: str) -> FlowRule:
    return set_rule(scope, actor=actor, paused=True)


def resume(scope: str, *, actor: str) -> FlowRule:
    return set_rule(scope, actor=actor, paused=False)


def delete_rule(scope: str, *, actor: str) -> bool:
    """Remove the rule of ``scope`` (the settings' defaults apply again); audited."""
    with transaction.atomic():
        rule = FlowRule.objects.select_for_update().filter(scope=scope).first()
        if rule is None:
            return False
        before = rule.describe()
        rule.delete()
        held.release(scope)
        held.release_deferred(scope)
        FlowRuleChange.objects.create(
            scope=scope, action="delete", actor=actor[:200], before=before, after="(defaults)"
        )
    forget()
    return True


def defaults() -> dict[str, str]:
    """What applies where no row says otherwise (the settings)."""
    from jobs import registry

    out = {"tenant:*": f"concurrency {conf.tenant_concurrency()}, weight {conf.tenant_weight()}"}
    for name, provider in sorted(registry.providers().items()):
        if provider.transactional:
            continue
        limit = provider.in_flight_limit()
        out[provider_scope(name)] = f"concurrency {limit}" if limit else "unbounded"
    return out
