"""Jobs, the deliveries that reached a worker, artifacts and the effect ledger.

Only ``jobs.transitions`` writes ``Job.state``; only ``jobs.ledger`` writes
``Effect.state``. Every such write is a compare-and-swap on ``version``.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import F, Q
from django.db.models.functions import Now
from django.utils import timezone


class JobQuerySet(models.QuerySet):
    def due(self, now=None):
        """Queued or waiting jobs whose next attempt time has come (server clock by default)."""
        now = now or Now()
        return self.filter(
            state__in=[Job.State.QUEUED, Job.State.RETRY_WAIT], next_attempt_at__lte=now
        )

    def lease_expired(self, now=None):
        """Running jobs whose worker stopped extending its lease."""
        now = now or Now()
        return self.filter(state=Job.State.RUNNING, lease_expires_at__lte=now)

    def live_running(self, now=None):
        """Running jobs whose lease still holds: they count against the tenant bound."""
        now = now or Now()
        return self.filter(state=Job.State.RUNNING, lease_expires_at__gt=now)


class EffectQuerySet(models.QuerySet):
    def due_for_release(self, now=None):
        """Effects a sender may take now: due pending/unknown ones and expired sending leases."""
        now = now or Now()
        return self.filter(
            Q(state__in=[Effect.State.PENDING, Effect.State.UNKNOWN], next_attempt_at__lte=now)
            | Q(state=Effect.State.SENDING, lease_expires_at__lte=now)
        )


JOB_STATES = ["queued", "running", "retry_wait", "succeeded", "failed", "dead", "cancelled"]
EFFECT_STATES = ["pending", "sending", "applied", "unknown", "withheld", "failed", "needs_review"]


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
    # The due instant (next_attempt_at or lease expiry) the dispatcher last enqueued
    # a message for: one message per due time, never a flood.
    enqueued_for = models.DateTimeField(null=True, blank=True)
    lease_owner = models.CharField(max_length=200, blank=True, default="")
    lease_expires_at = models.DateTimeField(null=True, blank=True)
    last_error_class = models.CharField(max_length=32, blank=True, default="")
    last_error_code = models.CharField(max_length=64, blank=True, default="")
    last_error_detail = models.CharField(max_length=300, blank=True, default="")
    outage_since = models.DateTimeField(
        null=True, blank=True, help_text="a dependency outage has held this job up since"
    )

    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    objects = JobQuerySet.as_manager()

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
        ]
        indexes = [
            models.Index(fields=["state", "next_attempt_at"], name="jobs_job_due_idx"),
            models.Index(fields=["state", "lease_expires_at"], name="jobs_job_lease_idx"),
            models.Index(fields=["tenant_key", "state"], name="jobs_job_tenant_state_idx"),
        ]
        ordering = ["-id"]

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

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="attempt_set")
    number = models.PositiveIntegerField(
        default=0, help_text="Job.attempts after the claim; 0 if none"
    )
    worker = models.CharField(max_length=200)
    started_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)
    outcome = models.CharField(max_length=24, choices=Outcome.choices, blank=True, default="")
    error_class = models.CharField(max_length=32, blank=True, default="")
    error_code = models.CharField(max_length=64, blank=True, default="")
    retry_delay_seconds = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["job", "started_at", "id"]
        indexes = [models.Index(fields=["outcome"], name="jobs_attempt_outcome_idx")]

    def __str__(self) -> str:
        return f"attempt {self.number} of job {self.job_id}: {self.outcome or 'running'}"


class Artifact(models.Model):
    job = models.ForeignKey(Job, on_delete=models.PROTECT, related_name="artifacts")
    key = models.CharField(
        max_length=200, unique=True, help_text="derived from job id and revision"
    )
    storage_name = models.CharField(max_length=300)
    sha256 = models.CharField(max_length=64)
    size = models.PositiveBigIntegerField()
    content_type = models.CharField(max_length=100)
    created_at = models.DateTimeField(default=timezone.now)
    verified_at = models.DateTimeField(null=True, blank=True)
    rewrites = models.PositiveIntegerField(
        default=0, help_text="times a missing/corrupt file was restored"
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
    enqueued_for = models.DateTimeField(null=True, blank=True)
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

    objects = EffectQuerySet.as_manager()

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
    """An in-app notice; the one-to-one on the effect makes a second copy impossible."""

    effect = models.OneToOneField(Effect, on_delete=models.PROTECT, related_name="notice")
    recipient = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="job_notices"
    )
    title = models.CharField(max_length=200)
    link = models.CharField(max_length=300, blank=True, default="")
    created_at = models.DateTimeField(default=timezone.now)
    read_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return self.title
