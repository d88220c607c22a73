"""Redrive a group at once: dead jobs, or failed and needs_review effects, by kind,
provider and error class (the console's Redrive page and ``manage.py jobs_redrive``).

A redrive makes rows due again through the engine's own arrows; it sends nothing
itself. For each effect of the group, oldest first, at most ``JOBS_REDRIVE_MAX``:

- a row the ledger moved on since the group was counted (applied, or already pending
  again) is skipped: the compare-and-swap finds its version changed;
- an unknown outcome (``needs_review``) at a provider that can say what became of a key
  (``supports_lookup``) is looked up first, holding one of the provider's in-flight
  slots like a send: found is recorded as applied with the provider's reference (no
  send); never seen is redriven; no answer (an error, no free slot) leaves it for the
  next redrive: never a send the provider said nothing about;
- every other row goes back to pending under the same key, with a fresh send budget
  (``effect_machine.redrive``): a worker claims it through the ledger's claim, in due
  order, under the provider's flow rules and in-flight bound, and rechecks the
  recipient's authorization inside the slot, as for every release.

Dead jobs are requeued (``services.requeue_job``), except those whose cause is their own
parameters (``causes.requeue_helps``): they would fail the same way. One admin
``LogEntry`` records the redrive: who, when, the filter and the counts; each row keeps its
own event naming the operator. A dry run asks the lookups (questions, no sends) and
writes nothing.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field

from django.db.models import Count, QuerySet

from jobs import conf, registry, rules, services, telemetry
from jobs.engine import effect_machine
from jobs.exceptions import JobError
from jobs.models import Effect, Job
from jobs.ops import causes

log = logging.getLogger("jobs.redrive")

JOB, EFFECT = "job", "effect"
TARGET_STATES = rules.REDRIVE_SOURCES


class RedriveError(ValueError):
    """Raised when a redrive's filter names no group a redrive applies to."""


@dataclass(frozen=True)
class Filter:
    """One group: jobs (``provider`` empty) or effects, by kind, error class and state."""

    target: str
    kind: str
    state: str
    error_class: str = ""
    provider: str = ""

    def __post_init__(self) -> None:
        if self.target not in TARGET_STATES:
            raise RedriveError(f"target must be {JOB!r} or {EFFECT!r}")
        if self.state not in TARGET_STATES[self.target]:
            states = ", ".join(TARGET_STATES[self.target])
            raise RedriveError(f"a redrive of {self.target}s takes state {states}")
        if self.target == JOB and self.provider:
            raise RedriveError("jobs have no provider: leave it out")
        if not self.kind or (self.target == EFFECT and not self.provider):
            raise RedriveError("a group names its kind (and an effect group its provider)")

    def words(self) -> str:
        """The filter as an operator reads it (the audit record's words)."""
        parts = [f"{self.target}s", f"kind={self.kind}"]
        if self.provider:
            parts.append(f"provider={self.provider}")
        parts += [f"error_class={self.error_class or '-'}", f"state={self.state}"]
        return " ".join(parts)

    def rows(self) -> QuerySet:
        """The group's rows now, oldest first."""
        if self.target == JOB:
            found = Job.objects.filter(kind=self.kind, state=self.state)
        else:
            found = Effect.objects.filter(
                job__kind=self.kind, provider=self.provider, state=self.state
            ).select_related("job")
        return found.filter(last_error_class=self.error_class).order_by("pk")


@dataclass(frozen=True)
class Group:
    filter: Filter
    count: int


@dataclass
class Result:
    """What a redrive did (or, dry, would do) to its group."""

    filter: Filter
    dry_run: bool
    matched: int = 0  # rows in the group when it started
    taken: int = 0  # of them, the ones this redrive looked at (the cap)
    redriven: int = 0
    skipped: int = 0
    found_applied: int = 0
    unanswered: int = 0  # lookups with no answer: left for the next redrive
    audit_id: int | None = None
    effects: list[int] = field(default_factory=list, repr=False)  # the ids redriven

    @property
    def left(self) -> int:
        """Rows beyond the cap, for the next redrive."""
        return self.matched - self.taken

    def counts(self) -> dict[str, int]:
        names = ("matched", "taken", "redriven", "skipped", "found_applied", "unanswered")
        return {name: getattr(self, name) for name in names} | {"left": self.left}

    def words(self) -> str:
        c = self.counts()
        verb = "would redrive" if self.dry_run else "redriven"
        return (
            f"{c['taken']} of {c['matched']} {self.filter.target}s: {c['redriven']} {verb}, "
            f"{c['found_applied']} found applied at the provider, {c['skipped']} skipped "
            f"(the ledger already moved them), {c['unanswered']} unanswered lookups, "
            f"{c['left']} left beyond the cap"
        )


def groups() -> list[Group]:
    """Dead jobs and failed / needs_review effects, by kind, provider and error class."""
    jobs = (
        Job.objects.filter(state__in=TARGET_STATES[JOB])
        .values_list("kind", "state", "last_error_class")
        .annotate(n=Count("id"))
        .order_by()
    )
    effects = (
        Effect.objects.filter(state__in=TARGET_STATES[EFFECT])
        .values_list("job__kind", "provider", "state", "last_error_class")
        .annotate(n=Count("id"))
        .order_by()
    )
    found = [
        Group(Filter(JOB, kind, state, error_class), n) for kind, state, error_class, n in jobs
    ]
    found += [
        Group(Filter(EFFECT, kind, state, error_class, provider), n)
        for kind, provider, state, error_class, n in effects
    ]
    return sorted(found, key=lambda g: (-g.count, g.filter.target, g.filter.words()))


def cap() -> int:
    """``JOBS_REDRIVE_MAX``: the most rows one redrive takes."""
    return max(1, int(conf.get("JOBS_REDRIVE_MAX")))


def redrive(
    f: Filter, *, operator: str, user_id: int | None = None, dry_run: bool = False
) -> Result:
    """Redrive the group ``f`` (at most ``cap()`` rows) as ``operator``; see the module."""
    result = Result(f, dry_run, matched=f.rows().count())
    rows = list(f.rows()[: cap()])
    result.taken = len(rows)
    note = f"redrive by {operator}: {f.words()}"[:300]
    for row in rows:
        outcome = (_job if f.target == JOB else _effect)(row, operator, note, dry_run)
        setattr(result, outcome, getattr(result, outcome) + 1)
        if outcome == "redriven" and f.target == EFFECT:
            result.effects.append(row.pk)
    log.info(
        "redrive operator=%s %s dry_run=%s %s",
        operator,
        f.words(),
        dry_run,
        " ".join(f"{k}={v}" for k, v in result.counts().items()),
    )
    if not dry_run:
        result.audit_id = _audit(result, operator, user_id)
        telemetry.redrive_done(
            {k: result.counts()[k] for k in ("redriven", "skipped", "found_applied")},
            target=f.target,
        )
    return result


def _job(job: Job, operator: str, note: str, dry_run: bool) -> str:
    if not causes.requeue_helps(job):
        return "skipped"  # its own parameters are its cause: it would fail the same way
    if dry_run:
        return "redriven"
    return "redriven" if services.requeue_job(job, operator=operator) else "skipped"


def _effect(effect: Effect, operator: str, note: str, dry_run: bool) -> str:
    try:
        provider = registry.get_provider(effect.provider)
    except JobError:  # a provider no longer registered: nobody could send it
        return "skipped"
    if (
        effect.state == Effect.State.NEEDS_REVIEW
        and provider.supports_lookup
        and not provider.transactional
    ):
        asked, ref = _look_up(provider, effect)
        if not asked:
            return "unanswered"
        if ref is not None:
            if dry_run:
                return "found_applied"
            found = effect_machine.found_by_operator(effect, operator=operator, ref=ref, note=note)
            return "found_applied" if found else "skipped"
    if dry_run:
        return "redriven"
    return "redriven" if effect_machine.redrive(effect, operator=operator, note=note) else "skipped"


def _look_up(provider, effect: Effect) -> tuple[bool, str | None]:
    """(answered, the provider's reference or None for never seen), asked inside one of
    the provider's in-flight slots, as a worker's lookup is."""
    from jobs.providers import ProviderLookupUnsupported
    from jobs.providers.bounds import in_flight

    wait = float(conf.get("JOBS_PROVIDER_SLOT_WAIT_SECONDS"))
    try:
        with in_flight(provider.name, provider.in_flight_limit(), wait=wait) as slot:
            if provider.in_flight_limit() and slot is None:
                return False, None  # every slot busy: asked next time
            return True, provider.lookup(effect.idempotency_key)
    except ProviderLookupUnsupported:
        return True, None
    except Exception as exc:  # no answer: the effect waits for the next redrive
        log.warning(
            "redrive effect=%s provider=%s lookup failed error=%s",
            effect.pk,
            effect.provider,
            type(exc).__qualname__,
        )
        return False, None


def _audit(result: Result, operator: str, user_id: int | None) -> int | None:
    """The redrive's audit record: one admin ``LogEntry`` (who, when, the filter, counts).
    A shell redrive without a user is in the log line only."""
    if user_id is None:
        return None
    from django.contrib.admin.models import CHANGE, LogEntry
    from django.contrib.contenttypes.models import ContentType

    model = Job if result.filter.target == JOB else Effect
    # The lists' "Recent bulk actions" show the repr: the counts first, then the group.
    words = (
        f"Redrive: {result.redriven} redriven, {result.found_applied} found applied, "
        f"{result.skipped} skipped of {result.filter.words()}"
    )
    entry = LogEntry.objects.create(
        user_id=user_id,
        content_type=ContentType.objects.get_for_model(model, for_concrete_model=False),
        object_id=None,
        object_repr=words[:200],
        action_flag=CHANGE,
        change_message=json.dumps(
            {"redrive": {"filter": asdict(result.filter), **result.counts(), "by": operator}}
        ),
    )
    return entry.pk


def audit_records(limit: int = 10) -> list:
    """The last redrives' audit records, newest first, with their counts read back."""
    from django.contrib.admin.models import LogEntry

    entries = (
        LogEntry.objects.filter(object_id=None, change_message__startswith='{"redrive"')
        .select_related("user")
        .order_by("-action_time", "-id")[:limit]
    )
    out = []
    for entry in entries:
        try:
            entry.redrive = json.loads(entry.change_message)["redrive"]
        except (ValueError, KeyError):
            continue
        out.append(entry)
    return out
