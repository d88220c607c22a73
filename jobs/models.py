"""Jobs, the deliveries that reached a worker, artifacts and the effect ledger.

The arrows of ``Job.state`` are defined in ``jobs.engine.job_machine``; the
PostgreSQL executor's two statements (``jobs.executors.postgres``: claim and publish)
write the same arrows with the same fences (``jobs.rules``, which also holds every
filter on these rows: due, expired, releasable). Only ``jobs.engine.effect_machine``
writes ``Effect.state``, apart from the effects born with the publish (the
executors). Every such write is a compare-and-swap on ``version``.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import F, Q
from django.utils import timezone

from jobs import identity

JOB_STATES = ["queued", "running", "retry_wait", "succeeded", "failed", "dead", "cancelled"]
EFFECT_STATES = ["pending", "sending", "applied", "unknown", "withheld", "failed", "needs_review"]
# A debounced job's window: queued, never claimed (the unique index, ``jobs.debounce``).
DEBOUNCE_OPEN = Q(state="queued", attempts=0)
# A sequenced job waits with this ``held_by`` (out of the claim's indexes) until it is its
# key's head and the item before it has passed (``jobs.sequences``).
SEQUENCE_HELD = "sequence"


class Job(models.Model):
    class State(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        RETRY_WAIT = "retry_wait"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        DEAD = "dead"
        CANCELLED = "cancelled"

    assert sorted(State.values) == sorted(JOB_STATES)
    TERMINAL = (State.SUCCEEDED, State.FAILED, State.DEAD, State.CANCELLED)

    kind = models.CharField(max_length=64)
    # A failover's rewound sequence can hand an id out again, never a uid: every key and
    # object name of the job derives from it (jobs.identity).
    uid = models.UUIDField(
        unique=True,
        default=identity.new_uid,
        editable=False,
        help_text="unique forever, failovers included; keys and object names derive from it",
    )
    keys_from_id = models.BooleanField(
        default=False,
        db_default=False,
        editable=False,
        help_text="made before migration 0024: its keys derive from its id, as they did",
    )
    # Indexed by (tenant_key, state) below; no index of its own.
    tenant_key = models.CharField(max_length=64, default="", blank=True)
    subject_type = models.CharField(
        max_length=100, help_text="what the job is about, e.g. app_label.model_name"
    )
    subject_id = models.CharField(max_length=64)
    output_revision = models.PositiveIntegerField(default=1)
    # References only (ids, flags). Private data is read by the handler, never stored here.
    params = models.JSONField(default=dict, blank=True)

    state = models.CharField(max_length=16, choices=State.choices, default=State.QUEUED)
    version = models.PositiveBigIntegerField(default=0, help_text="bumped by every transition")
    attempts = models.PositiveIntegerField(default=0, help_text="claims so far, crashes included")
    max_attempts = models.PositiveIntegerField(default=5)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    lease_owner = models.CharField(max_length=200, blank=True, default="")
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    last_error_class = models.CharField(max_length=32, blank=True, default="")
    last_error_code = models.CharField(max_length=64, blank=True, default="")
    last_error_detail = models.CharField(max_length=300, blank=True, default="")
    # The last failure as operators read it (``jobs.failures``): behind view_error_detail.
    last_error_type = models.CharField(
        max_length=200, blank=True, default="", db_default="", help_text="exception class path"
    )
    last_error_message = models.TextField(
        blank=True,
        default="",
        db_default="",
        help_text="bounded; empty when the kind redacts errors",
    )
    last_error_traceback = models.TextField(
        blank=True, default="", db_default="", help_text="bounded, no locals"
    )
    outage_since = models.DateTimeField(
        null=True, blank=True, help_text="a dependency outage has held this job up since"
    )
    cancel_requested_at = models.DateTimeField(
        null=True, blank=True, help_text="a cancel was asked for while the job ran"
    )
    cancel_requested_by = models.CharField(max_length=200, blank=True, default="", db_default="")
    # Scheduling (docs/app/scheduling.md): the claim takes higher priority first (Django's
    # tasks range, -100..100), and a worker serves the queues it was started for.
    priority = models.SmallIntegerField(default=0, db_default=0)
    queue = models.CharField(max_length=64, default="default", db_default="default")
    # A waiting job of a paused scope is held (docs/app/flow.md): out of the claim's
    # indexes until the scope is resumed, so a claim never scans a paused backlog.
    held_by = models.CharField(
        max_length=200,
        blank=True,
        default="",
        db_default="",
        help_text="the paused scope holding this waiting job; empty when none",
    )
    # A claim that defers the job (a rule, its tenant's bound) counts the look here, not in
    # an attempt row; the scope is kept so that its rule's change frees it (docs/app/flow.md).
    held_looks = models.PositiveIntegerField(
        default=0, db_default=0, help_text="claims that found it held back (no attempt spent)"
    )
    deferred_by = models.CharField(
        max_length=200,
        blank=True,
        default="",
        db_default="",
        help_text="the scope whose rule last deferred this waiting job; empty once it starts",
    )
    # What the handler last said of its progress (ctx.progress): counts and a short
    # note, never private data; written at most about once a second.
    progress_done = models.PositiveBigIntegerField(null=True, blank=True)
    progress_total = models.PositiveBigIntegerField(null=True, blank=True)
    progress_note = models.CharField(max_length=120, blank=True, default="", db_default="")
    progress_at = models.DateTimeField(null=True, blank=True)

    # Follow-up work (docs/app/chains.md): the job whose publish requested this one, its
    # group, how it counted there (once, by its first end), and the result a join reads.
    parent = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="follow_ups",
        help_text="the job whose publish requested this one",
    )
    group = models.ForeignKey(
        "JobGroup",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="children",
        help_text="the group this job is a child of",
    )
    group_outcome = models.CharField(
        max_length=16,
        blank=True,
        default="",
        db_default="",
        help_text="how this child counted in its group ('' until it ended)",
    )
    result = models.JSONField(null=True, blank=True, help_text="small JSON; references only")
    # W3C traceparents: the request's span and the last attempt's (jobs.telemetry).
    trace_context = models.CharField(max_length=120, blank=True, default="", db_default="")
    # Set by jobs_reconcile (issue 47): a failover may have lost this job's rows while the
    # outside world kept its sends, so each external effect is looked up before it is sent.
    reconciled_at = models.DateTimeField(
        null=True,
        blank=True,
        help_text="jobs_reconcile found the outside world may have its effects: looked up first",
    )

    # Debounce (docs/app/debounce.md): before its first claim, a request under the same key
    # replaces its params and pushes its due time, never past ``debounce_until``.
    debounce_key = models.CharField(
        max_length=200,
        blank=True,
        default="",
        db_default="",
        help_text="the debounce window this job belongs to; empty when not debounced",
    )
    debounce_until = models.DateTimeField(
        null=True, blank=True, help_text="the latest due time requests may push it to"
    )
    debounce_replaced = models.PositiveIntegerField(
        default=0, db_default=0, help_text="requests whose params replaced the waiting job's"
    )

    # Sequences (docs/app/sequences.md): the jobs of one key start one at a time, in request
    # order (id order), each once the one before has ended and its effects settled.
    sequence_key = models.CharField(max_length=200, blank=True, default="", db_default="")
    sequence_skip = models.BooleanField(default=False, db_default=False)  # on_failure="skip"
    sequence_released_by = models.CharField(max_length=200, blank=True, default="", db_default="")

    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["kind", "subject_type", "subject_id", "output_revision"],
                name="jobs_job_one_per_subject_revision",
            ),
            models.CheckConstraint(condition=Q(state__in=JOB_STATES), name="jobs_job_state_valid"),
            models.CheckConstraint(
                condition=~Q(state="running")
                | (Q(lease_expires_at__isnull=False) & ~Q(lease_owner="")),
                name="jobs_job_running_has_lease",
            ),
            # A claim past the budget is impossible, so no job runs forever.
            models.CheckConstraint(
                condition=Q(attempts__lte=F("max_attempts")), name="jobs_job_attempts_bounded"
            ),
            # One open debounce window per key: concurrent requests cannot make a second.
            models.UniqueConstraint(
                fields=["debounce_key"],
                condition=DEBOUNCE_OPEN & ~Q(debounce_key=""),
                name="jobs_job_one_open_debounce_window",
            ),
        ]
        indexes = [
            models.Index(fields=["state", "next_attempt_at"], name="jobs_job_due_idx"),
            models.Index(fields=["state", "lease_expires_at"], name="jobs_job_lease_idx"),
            models.Index(fields=["tenant_key", "state"], name="jobs_job_tenant_state_idx"),
            models.Index(  # a pause's holds; a sequence's: jobs_job_sequence_held_idx (0038)
                fields=["held_by"],
                name="jobs_job_held_idx",
                condition=~Q(held_by="") & ~Q(held_by=SEQUENCE_HELD),
            ),
            # A sequence's items in request order, and the heads its claim looks at.
            models.Index(
                fields=["sequence_key", "id"],
                name="jobs_job_sequence_idx",
                condition=~Q(sequence_key=""),
            ),
            models.Index(
                fields=["sequence_key", "id"],
                name="jobs_job_sequence_held_idx",
                condition=Q(held_by=SEQUENCE_HELD, state="queued"),
            ),
            models.Index(
                fields=["deferred_by"], name="jobs_job_deferred_idx", condition=~Q(deferred_by="")
            ),
            # The dispatcher's backstop: group children that ended and were not counted.
            models.Index(
                fields=["group"],
                name="jobs_job_group_uncounted_idx",
                condition=Q(group__isnull=False, group_outcome=""),
            ),
            # The archive's walk, oldest first (jobs.archive); built CONCURRENTLY (0037).
            models.Index(
                fields=["finished_at", "id"],
                name="jobs_job_finished_idx",
                condition=Q(state__in=["succeeded", "failed", "dead", "cancelled"]),
            ),
        ]
        ordering = ["-id"]
        permissions = [
            ("view_error_detail", "Can view error messages and tracebacks of failed attempts")
        ]

    def __str__(self) -> str:
        subject = f"{self.subject_type}:{self.subject_id}"
        return f"job {self.pk} {self.kind} {subject} r{self.output_revision}"

    @property
    def is_terminal(self) -> bool:
        return self.state in self.TERMINAL


class Attempt(models.Model):
    class Outcome(models.TextChoices):
        SUCCEEDED = "succeeded"
        RETRY = "retry"
        FAILED = "failed"
        DEAD = "dead"
        LEASE_LOST = "lease_lost"
        DUPLICATE_DELIVERY = "duplicate_delivery"
        CRASHED = "crashed"
        DEFERRED = "deferred"  # tenant bound reached; the job waits, no attempt counted
        CANCELLED = "cancelled"  # a cancel was asked for: the worker stopped, published nothing

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="attempt_set")
    number = models.PositiveIntegerField(
        default=0, help_text="Job.attempts after the claim; 0 if none"
    )
    worker = models.CharField(max_length=200)
    started_at = models.DateTimeField(default=timezone.now)
    due_at = models.DateTimeField(null=True, blank=True, help_text="due since: its wait")
    finished_at = models.DateTimeField(null=True, blank=True)
    outcome = models.CharField(max_length=24, choices=Outcome.choices, blank=True, default="")
    error_class = models.CharField(max_length=32, blank=True, default="")
    error_code = models.CharField(max_length=64, blank=True, default="")
    error_type = models.CharField(
        max_length=200, blank=True, default="", db_default="", help_text="exception class path"
    )
    error_message = models.TextField(
        blank=True,
        default="",
        db_default="",
        help_text="bounded; empty when the kind redacts errors",
    )
    error_traceback = models.TextField(
        blank=True, default="", db_default="", help_text="bounded, no locals"
    )
    retry_delay_seconds = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["job", "started_at", "id"]
        indexes = [models.Index(fields=["outcome"], name="jobs_attempt_outcome_idx")]

    def __str__(self) -> str:
        return f"attempt {self.number} of job {self.job_id}: {self.outcome or 'running'}"


class JobEvent(models.Model):
    """An operator's arrow on a job (cancel, requeue, retry now), written in the CAS's
    transaction: who acted, from which state to which, at which version."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="events")
    action = models.CharField(max_length=32)
    actor = models.CharField(max_length=200)
    from_state = models.CharField(max_length=16)
    to_state = models.CharField(max_length=16)
    version = models.PositiveBigIntegerField()
    note = models.CharField(max_length=300, blank=True, default="")
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["job", "id"]

    def __str__(self) -> str:
        return f"{self.action} of job {self.job_id} by {self.actor}"


class JobStep(models.Model):
    """A durable step's output (``ctx.step``): written once, by the attempt that completed
    the step while it still held the job; later attempts read it instead of running it.

    A step with a ``lookup`` is first recorded as begun (``finished_at`` empty) before its
    ``fn`` runs, so a later attempt knows an outside call may have happened and asks."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="steps")
    name = models.CharField(max_length=64)
    output = models.JSONField(null=True, blank=True, help_text="small JSON; references only")
    attempt = models.PositiveIntegerField(help_text="Job.attempts of the attempt that ran it")
    worker = models.CharField(max_length=200)
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(
        null=True, blank=True, default=timezone.now, help_text="empty: begun, not finished"
    )

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["job", "name"], name="jobs_step_once_per_job"),
        ]
        ordering = ["job", "id"]

    def __str__(self) -> str:
        return f"step {self.name} of job {self.job_id}"


class Artifact(models.Model):
    """A published artifact: the row names the winner's file and its sha256, never changed.

    The file (``storage_name`` includes the content hash) is created exclusively and
    never replaced by a delivery; a restore may only put back bytes with this sha256,
    else the artifact is ``lost`` (``jobs.restore``).
    """

    class State(models.TextChoices):
        STORED = "stored"
        LOST = "lost"  # the published bytes cannot be read or produced again

    job = models.ForeignKey(Job, on_delete=models.PROTECT, related_name="artifacts")
    key = models.CharField(
        max_length=200, unique=True, help_text="derived from the job's uid and revision"
    )
    storage_name = models.CharField(max_length=300, help_text="includes the content hash")
    sha256 = models.CharField(max_length=64)
    size = models.PositiveBigIntegerField()
    content_type = models.CharField(max_length=100)
    created_at = models.DateTimeField(default=timezone.now)
    verified_at = models.DateTimeField(null=True, blank=True)
    rewrites = models.PositiveIntegerField(
        default=0, help_text="times a restore put the recorded bytes back"
    )
    state = models.CharField(max_length=16, choices=State.choices, default=State.STORED)
    lost_reason = models.CharField(
        max_length=300, blank=True, default="", help_text="why lost (ids and hashes only)"
    )
    restore_requested_at = models.DateTimeField(
        null=True, blank=True, help_text="a restore is in flight since (cleared when it ends)"
    )

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return self.key


class Effect(models.Model):
    """One business outcome (a notice) with a stable identity: the ledger row."""

    class State(models.TextChoices):
        PENDING = "pending"
        SENDING = "sending"
        APPLIED = "applied"
        UNKNOWN = "unknown"
        WITHHELD = "withheld"
        FAILED = "failed"
        NEEDS_REVIEW = "needs_review"

    assert sorted(State.values) == sorted(EFFECT_STATES)
    FINAL = (State.APPLIED, State.WITHHELD, State.FAILED, State.NEEDS_REVIEW)

    # Unique by constraints below (no LIKE-pattern twin index on PostgreSQL).
    effect_id = models.CharField(max_length=200)
    job = models.ForeignKey(Job, on_delete=models.PROTECT, related_name="effects")
    name = models.CharField(max_length=64)
    provider = models.CharField(max_length=64)
    recipient = models.CharField(max_length=64, help_text="a reference (user id), never an address")
    idempotency_key = models.CharField(max_length=80)
    data = models.JSONField(default=dict, blank=True, help_text="references only")
    state = models.CharField(max_length=16, choices=State.choices, default=State.PENDING)
    version = models.PositiveBigIntegerField(default=0)
    attempts = models.PositiveIntegerField(default=0, help_text="sends claimed so far")
    max_attempts = models.PositiveIntegerField(default=8, help_text="the send budget")
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    lease_owner = models.CharField(max_length=200, blank=True, default="")
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    provider_ref = models.CharField(max_length=200, blank=True, default="")
    reason = models.CharField(
        max_length=300, blank=True, default="", help_text="why withheld/failed"
    )
    last_error_class = models.CharField(max_length=32, blank=True, default="")
    last_error_code = models.CharField(max_length=64, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    applied_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=Q(state__in=EFFECT_STATES), name="jobs_effect_state_valid"
            ),
            models.CheckConstraint(
                condition=Q(attempts__lte=F("max_attempts")), name="jobs_effect_attempts_bounded"
            ),
            models.UniqueConstraint(fields=["effect_id"], name="jobs_effect_one_per_identity"),
            models.UniqueConstraint(fields=["idempotency_key"], name="jobs_effect_one_per_key"),
        ]
        indexes = [models.Index(fields=["state", "next_attempt_at"], name="jobs_effect_due_idx")]
        ordering = ["-id"]

    def __str__(self) -> str:
        return self.effect_id


class EffectEvent(models.Model):
    """One send attempt or operator action on an effect: the effect's own history.

    Effects are counted by identity; sends are counted here, so resends under the
    same key (expected under faults) and duplicate effects (never) stay apart.
    """

    class Action(models.TextChoices):
        CLAIM = "claim"  # a sender took the effect (its sending lease)
        SEND = "send"  # one call to the provider (or a failure on the way to it)
        LOOKUP = "lookup"  # asked the provider what became of the key (no send)
        DEFER = "defer"  # no in-flight slot freed in time: handed back, no attempt spent
        CHECK = "check"  # the release check before the call failed (nothing was sent)
        STOP = "stop"  # the send budget was spent, or a sender was lost mid-send
        WITHHOLD = "withhold"  # policy refused the release right before the call
        MARK_SENT = "mark_sent"  # operator confirmed delivery out of band
        SEND_AGAIN = "send_again"  # operator asked for another send
        RECHECK = "recheck"  # operator put a withheld effect back for a policy recheck

    effect = models.ForeignKey(Effect, on_delete=models.CASCADE, related_name="events")
    provider = models.CharField(max_length=64)
    action = models.CharField(max_length=16, choices=Action.choices)
    attempt = models.PositiveIntegerField(default=0, help_text="Effect.attempts at the time")
    version = models.PositiveBigIntegerField(
        default=0, help_text="Effect.version this event recorded (0: born with the publish)"
    )
    actor = models.CharField(max_length=200, help_text="worker identity or operator:<username>")
    outcome = models.CharField(max_length=16, blank=True, default="", help_text="state after")
    error_class = models.CharField(max_length=32, blank=True, default="")
    error_code = models.CharField(max_length=64, blank=True, default="")
    note = models.CharField(max_length=300, blank=True, default="")
    at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["effect", "at", "id"]
        indexes = [
            models.Index(fields=["provider", "action", "outcome"], name="jobs_effectevent_prov_idx")
        ]

    def __str__(self) -> str:
        return f"{self.action} {self.effect_id}: {self.outcome}"


class Notice(models.Model):
    """An in-app notice; the one-to-one on the effect makes a second copy impossible. An
    archived job's notices stay without their effect (``effect`` None, ``jobs.archive``)."""

    effect = models.OneToOneField(Effect, models.PROTECT, null=True, related_name="notice")
    recipient = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="job_notices"
    )
    title = models.CharField(max_length=200)
    link = models.CharField(max_length=300, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    read_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        # The engine's neutral word: a project names its own (the permit site: notices).
        verbose_name = "in-app message"
        verbose_name_plural = "in-app messages"

    def __str__(self) -> str:
        return self.title


class FlowRule(models.Model):
    """A flow-control rule for one scope, changed live (``manage.py jobs_limits``, admin,
    console); ``jobs.flow`` enforces it where work starts. Settings are the defaults; a
    row wins. Scopes: ``provider:<name>``, ``tenant:<key>``, ``kind:<name>`` and
    ``provider:<name>/tenant:<key>`` (a provider's partition per tenant).

    The rate is a GCRA (a token bucket of burst 1): ``next_free_at`` is the theoretical
    arrival time of the next start, advanced by ``period_seconds / rate`` in one UPDATE
    by the server's clock (``jobs.engine.admission.take``). A provider's row also carries its
    circuit breaker.
    """

    class Circuit(models.TextChoices):
        CLOSED = "closed"
        OPEN = "open"
        HALF_OPEN = "half_open"

    scope = models.CharField(max_length=200, unique=True)
    concurrency = models.PositiveIntegerField(
        null=True, blank=True, help_text="most running at once (empty: the settings' default)"
    )
    rate = models.PositiveIntegerField(
        null=True, blank=True, help_text="most starts per period (empty: no rate limit)"
    )
    period_seconds = models.FloatField(default=1.0)
    paused = models.BooleanField(default=False)
    # A tenant's share of the claims (docs/app/fairness.md): holds nothing back.
    weight = models.PositiveIntegerField(
        null=True, blank=True, help_text="tenant: its weight in the fair share (empty: default)"
    )
    next_free_at = models.DateTimeField(
        null=True, blank=True, help_text="GCRA: when the next start may happen (server clock)"
    )
    circuit_state = models.CharField(max_length=16, choices=Circuit.choices, default=Circuit.CLOSED)
    circuit_failures = models.PositiveIntegerField(
        default=0, help_text="consecutive failed calls (transport, temporary, timeout)"
    )
    circuit_opened_at = models.DateTimeField(null=True, blank=True)
    circuit_probe_at = models.DateTimeField(
        null=True, blank=True, help_text="open: when the next probe may go; half-open: its lease"
    )
    circuit_probes = models.PositiveIntegerField(default=0, help_text="failed probes so far")
    circuit_prober = models.CharField(max_length=200, blank=True, default="")
    updated_at = models.DateTimeField(default=timezone.now)
    updated_by = models.CharField(max_length=200, blank=True, default="")

    class Meta:
        ordering = ["scope"]
        constraints = [
            models.CheckConstraint(
                condition=Q(period_seconds__gt=0), name="jobs_flowrule_period_positive"
            ),
        ]

    def __str__(self) -> str:
        return self.scope

    @property
    def interval_seconds(self) -> float | None:
        """Seconds between two starts under the rate (None: no rate)."""
        return self.period_seconds / self.rate if self.rate else None

    def describe(self) -> str:
        parts = []
        if self.paused:
            parts.append("paused")
        if self.concurrency is not None:
            parts.append(f"concurrency {self.concurrency}")
        if self.rate:
            parts.append(f"rate {self.rate}/{self.period_seconds:g}s")
        if self.weight is not None:
            parts.append(f"weight {self.weight}")
        return ", ".join(parts) or "no limit (defaults)"


# Models kept beside (bookkeeping, groups, archived identities, audit), registered here.
from jobs.archived import ArchivedJob  # noqa: E402, F401
from jobs.flowaudit import FlowRuleChange  # noqa: E402, F401
from jobs.jobgroups import JobGroup  # noqa: E402, F401
from jobs.marks import ReconcileMark, ScheduleState, TenantShare  # noqa: E402, F401
