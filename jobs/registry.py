"""Job kinds and providers, registered by the apps that own them.

Projects declare kinds with ``@jobs.kind`` in a ``jobkinds.py`` module (loaded
at start-up) or call ``register_kind`` from ``AppConfig.ready()``; the engine
looks them up by name, so ``jobs`` never imports the project.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jobs import asyncctx
from jobs.exceptions import PayloadInvalid, UnknownKind

if TYPE_CHECKING:
    from jobs.models import Effect
    from jobs.providers import Provider

# A kind's handler takes a ``jobs.JobContext`` (defined above this module, in the
# delivery, which imports the registry) and returns its effects; an ``async def`` one
# takes a ``jobs.AsyncJobContext`` (``jobs.asyncctx``) and is wrapped at registration.
Handler = Callable[[Any], object]  # effects, or a declared result (see declared_result)


@dataclass(frozen=True)
class EffectSpec:
    """A business outcome the job asks for; it becomes a ledger row at publish."""

    name: str  # e.g. "completion-notice"
    provider: str  # a registered provider name
    recipient: str  # a reference (user id), never an address
    data: dict[str, Any] = field(default_factory=dict)  # references only

    def validate(self) -> None:
        """Raise PayloadInvalid unless this can become a ledger row; no database query.

        Called on what a handler returns, before publish: a bad effect fails the
        job once as ``validation`` with a reason an operator can read, instead of
        failing inside the publish transaction on every redelivery. The reason
        names the field, never its value (it could be an address).
        """
        from django.contrib.auth import get_user_model
        from django.core.exceptions import ValidationError

        where = f"effect {self.name!r}" if isinstance(self.name, str) else "an effect"
        if not isinstance(self.name, str) or not self.name or len(self.name) > 64:
            raise PayloadInvalid(f"{where}: name must be a non-empty string of at most 64 chars")
        if self.provider not in _providers:
            known = ", ".join(sorted(_providers)) or "none"
            raise PayloadInvalid(
                f"{where}: provider {str(self.provider)[:64]!r} is not registered (known: {known})"
            )
        recipient = str(self.recipient) if self.recipient is not None else ""
        user_pk = get_user_model()._meta.pk
        try:
            if not recipient or len(recipient) > 64:
                raise ValidationError("empty or too long")
            user_pk.to_python(recipient)
        except ValidationError:
            raise PayloadInvalid(
                f"{where}: recipient must be a user id (the primary key of "
                f"{get_user_model()._meta.label}), not an address or a name"
            ) from None
        if not isinstance(self.data, dict):
            raise PayloadInvalid(f"{where}: data must be a dict of references")
        try:
            json.dumps(self.data)
        except (TypeError, ValueError):
            raise PayloadInvalid(f"{where}: data must be JSON-serialisable") from None


@dataclass(frozen=True)
class FollowUp:
    """A job to request when this one succeeds (``jobs.then``): it is written in the
    publish's transaction, so it exists exactly when the parent succeeded, once."""

    kind: str
    params: dict[str, Any] = field(default_factory=dict)  # references only
    name: str = ""  # unique among the parent's follow-ups ("" : its position)
    priority: int | None = None  # None: the kind's
    queue: str | None = None


@dataclass(frozen=True)
class GroupSpec:
    """Children run side by side; the join is requested once, when the last one ended
    (``jobs.group``). The join kind's ``on_child_failure`` rule decides what a child that
    did not succeed does to the join."""

    children: tuple[FollowUp, ...]
    join: FollowUp
    name: str = ""


@dataclass(frozen=True)
class ResultSpec:
    """The job's small JSON result (``jobs.result``): stored with the publish; a join reads
    its children's (``ctx.joined()``). References and counts, never private data."""

    value: Any


@dataclass
class Output:
    """What a handler returned, sorted and validated before the publish."""

    effects: list[EffectSpec] = field(default_factory=list)
    follow_ups: list[FollowUp] = field(default_factory=list)  # named
    groups: list[GroupSpec] = field(default_factory=list)  # named, children named
    result: Any = None
    has_result: bool = False


ON_CHILD_FAILURE = ("fail", "skip", "run")
FOLLOW_UP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,23}")
RESULT_MAX_BYTES = 32 * 1024
GROUP_MAX_CHILDREN = 1000


def validate_output(produced: object) -> Output:
    """Sort what a handler returned into effects, follow-ups, groups and its result, and
    raise PayloadInvalid (the job fails once, as ``validation``) for anything that could
    not be published. Reasons name fields and kinds, never values."""
    if produced is None:
        return Output()
    asyncctx.refuse_coroutine(produced)  # a def handler that returned a coroutine: say so
    if isinstance(produced, str | bytes | dict) or not hasattr(produced, "__iter__"):
        raise PayloadInvalid(
            f"a job handler returns a list (effects, jobs.then, jobs.group, jobs.result), "
            f"not {type(produced).__name__}"
        )
    out = Output()
    for item in list(produced):
        if isinstance(item, EffectSpec):
            out.effects.append(item)
        elif isinstance(item, FollowUp):
            out.follow_ups.append(item)
        elif isinstance(item, GroupSpec):
            out.groups.append(item)
        elif isinstance(item, ResultSpec):
            if out.has_result:
                raise PayloadInvalid("a job handler returned jobs.result twice")
            out.result, out.has_result = _checked_result(item.value), True
        else:
            raise PayloadInvalid(
                f"a job handler must return EffectSpec, jobs.then, jobs.group or jobs.result "
                f"objects, not {type(item).__name__}"
            )
    validate_effects(out.effects)
    out.follow_ups = _named(out.follow_ups, "then", "a follow-up")
    groups = []
    for position, group in enumerate(out.groups):
        name = group.name or f"group-{position}"
        _check_name(name, "a group")
        children = tuple(_named(list(group.children), "", f"group {name!r}'s child"))
        if not children:
            raise PayloadInvalid(f"group {name!r} has no children: a join needs at least one")
        if len(children) > GROUP_MAX_CHILDREN:
            raise PayloadInvalid(f"group {name!r} has more than {GROUP_MAX_CHILDREN} children")
        if not isinstance(group.join, FollowUp):
            raise PayloadInvalid(f"group {name!r}: join must be a jobs.then(...)")
        _check_follow_up(group.join, f"group {name!r}'s join")
        groups.append(GroupSpec(children, group.join, name))
    names = [g.name for g in groups]
    if len(set(names)) != len(names):
        raise PayloadInvalid("two groups of one job have the same name")
    out.groups = groups
    return out


def _named(items: list[FollowUp], prefix: str, where: str) -> list[FollowUp]:
    named = []
    for position, item in enumerate(items):
        if not isinstance(item, FollowUp):
            raise PayloadInvalid(f"{where} must be a jobs.then(...), not {type(item).__name__}")
        name = item.name or (f"{prefix}-{position}" if prefix else str(position))
        _check_name(name, where)
        _check_follow_up(item, f"{where} {name!r}")
        named.append(FollowUp(item.kind, item.params, name, item.priority, item.queue))
    names = [item.name for item in named]
    for name in names:
        if names.count(name) > 1:
            raise PayloadInvalid(f"{where}: two have the name {name!r}")
    return named


def _check_name(name: object, where: str) -> None:
    if not isinstance(name, str) or not FOLLOW_UP_NAME.fullmatch(name):
        raise PayloadInvalid(
            f"{where}: a name is 1-24 letters, digits, '_' or '-' (starting with a letter or digit)"
        )


def _check_follow_up(item: FollowUp, where: str) -> None:
    if item.kind not in _kinds:
        raise PayloadInvalid(f"{where}: job kind {str(item.kind)[:64]!r} is not registered")
    if not isinstance(item.params, dict):
        raise PayloadInvalid(f"{where}: params must be a dict of references")
    try:
        json.dumps(item.params, allow_nan=False)
        if item.priority is not None:
            check_priority(item.priority)
        if item.queue is not None:
            check_queue(item.queue)
    except (TypeError, ValueError) as exc:
        what = "params must be JSON-serialisable" if isinstance(exc, TypeError) else str(exc)
        raise PayloadInvalid(f"{where}: {what}") from None


def _checked_result(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)  # a typed result (docs/app/kinds.md): stored as JSON
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        raise PayloadInvalid("jobs.result: the value must be JSON-serialisable") from None
    if len(text.encode()) > RESULT_MAX_BYTES:
        raise PayloadInvalid(
            f"jobs.result: at most {RESULT_MAX_BYTES} bytes of JSON (this one has "
            f"{len(text.encode())}); store a large output as the job's artifact"
        )
    return json.loads(text)


def validate_effects(specs: list[EffectSpec]) -> list[EffectSpec]:
    """Validate what a handler returned (see ``EffectSpec.validate``); returns it."""
    for spec in specs:
        if not isinstance(spec, EffectSpec):
            raise PayloadInvalid(
                f"a job handler must return EffectSpec objects, not {type(spec).__name__}"
            )
        spec.validate()
    return specs


@dataclass(frozen=True)
class JobKind:
    name: str
    handler: Handler
    # Current policy for releasing an effect: a reason to withhold it, or None to send.
    authorize_release: Callable[[Effect], str | None] | None = None
    max_attempts: int | None = None
    # True, or a predicate on the exception: keep only its class and frames, no message.
    redact_errors: bool | Callable[[BaseException], bool] = False
    # Scheduling defaults for its jobs (docs/app/scheduling.md); a request may override.
    priority: int = 0
    queue: str = "default"
    # Seconds one attempt may run (None: the lease and Q_CLUSTER['timeout'] only).
    timeout: float | None = None
    # A periodic kind (docs/app/schedules.md): a cron expression or an interval, the cron's
    # time zone (None: TIME_ZONE) and which ticks missed while down to request.
    schedule: str | datetime.timedelta | None = None
    schedule_tz: str | None = None
    catch_up: str = "latest"
    # As the join of a group (docs/app/chains.md): what a child that did not succeed does
    # to this join: "fail" or "skip" it (it never runs), or "run" it anyway.
    on_child_failure: str = "fail"
    # The handler's declared result (``-> MyResult``: a dataclass or a TypedDict), or None.
    result_type: type | None = None
    # What people call its job, result and effects, and its job states (``LABEL_KEYS``):
    # the console and the project's own pages read them (``jobs.ops.words``).
    labels: dict[str, str] = field(default_factory=dict)
    # Debounce (docs/app/debounce.md): seconds a request waits for a later one to replace
    # it, the most seconds after a window's first request, and the key of requests that
    # share a window (None: the kind and the subject).
    debounce: float | None = None
    debounce_max: float | None = None
    debounce_key: Callable[[dict, tuple[str, str]], str] | None = None
    # Sequences (docs/app/sequences.md): the key of (params, subject) its jobs start in order
    # under, and whether a failed one lets its key go on (``on_failure="skip"``).
    sequence: Callable[[dict, tuple[str, str]], str] | None = None
    sequence_skip: bool = False


def declared_result(handler: object) -> type | None:
    """The dataclass or TypedDict a handler's return annotation names, else None.

    Other annotations (``list[EffectSpec]``, none at all, a name only importable for type
    checkers) leave the handler as it is."""
    func = getattr(handler, "func", handler)  # an async handler's own function
    try:
        hints = typing.get_type_hints(func)
    except Exception:  # a forward reference to a TYPE_CHECKING import: not declared here
        return None
    declared = hints.get("return")
    if isinstance(declared, type) and (
        dataclasses.is_dataclass(declared) or typing.is_typeddict(declared)
    ):
        return declared
    return None


class TypedResultHandler:
    """A handler that returns its declared result type: the worker stores the value as
    the job's ``jobs.result`` (JSON); a list (effects, follow-ups) passes unchanged."""

    def __init__(self, handler: Handler, result_type: type):
        self.handler = handler
        self.result_type = result_type
        functools.update_wrapper(self, handler)

    def __call__(self, ctx: Any) -> Any:
        produced = self.handler(ctx)
        if isinstance(
            produced, self.result_type if not typing.is_typeddict(self.result_type) else dict
        ):
            return [ResultSpec(produced)]
        return produced


def load_result(kind: str, value: Any) -> Any:
    """A stored result as its kind declared it: the dataclass built again from its JSON
    (top-level fields), a TypedDict's dict as it is; anything else unchanged."""
    result_type = _kinds[kind].result_type if kind in _kinds else None
    if value is None or result_type is None or not dataclasses.is_dataclass(result_type):
        return value
    if not isinstance(value, dict):
        return value
    names = {f.name for f in dataclasses.fields(result_type) if f.init}
    return result_type(**{k: v for k, v in value.items() if k in names})


# The words a kind may give (``labels=``): its nouns, then a word per job state (the
# engine's states, ``jobs.models.JOB_STATES``; a test keeps the two lists equal).
LABEL_NOUNS = ("job", "result", "effect")
LABEL_STATES = ("queued", "running", "retry_wait", "succeeded", "failed", "dead", "cancelled")
LABEL_KEYS = LABEL_NOUNS + LABEL_STATES


def check_labels(labels: object) -> dict[str, str]:
    """Raise ValueError unless ``labels`` maps label keys (``LABEL_KEYS``) to short words."""
    if labels is None:
        return {}
    if not isinstance(labels, dict):
        raise ValueError(f"labels must be a dict of words, not {type(labels).__name__}")
    for key, word in labels.items():
        if key not in LABEL_KEYS:
            raise ValueError(
                f"labels: {str(key)[:40]!r} is not a label key (one of {', '.join(LABEL_KEYS)})"
            )
        if not isinstance(word, str) or not word.strip() or len(word) > 64:
            raise ValueError(f"labels[{key!r}] must be a word of 1 to 64 characters")
    return dict(labels)


CATCH_UP = ("latest", "all")  # a periodic kind's ticks missed while down: the newest, or each
PRIORITY_RANGE = (-100, 100)  # Django's tasks contract: higher runs first
QUEUE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def check_priority(priority: object) -> int:
    """Raise ValueError unless ``priority`` is an int in Django's range (-100..100)."""
    low, high = PRIORITY_RANGE
    if isinstance(priority, bool) or not isinstance(priority, int) or not low <= priority <= high:
        raise ValueError(f"priority must be an integer from {low} to {high}, not {priority!r}")
    return priority


def check_queue(queue: object) -> str:
    """Raise ValueError unless ``queue`` is a queue name (letters, digits, ``_.-``; 64 max)."""
    if not isinstance(queue, str) or not QUEUE_NAME.fullmatch(queue):
        raise ValueError(
            f"queue must be 1-64 letters, digits, '_', '.' or '-' (starting with a letter "
            f"or digit), not {str(queue)[:70]!r}"
        )
    return queue


# A debounced kind without ``debounce_max``: its window's first request waits at most
# this many windows.
DEBOUNCE_MAX_WINDOWS = 10


def check_debounce(
    debounce: object, debounce_max: object, key: object, schedule: object
) -> tuple[float | None, float | None]:
    """(window, cap) in seconds, or ValueError: a window needs a cap it fits in, or it
    could push a busy key's job back forever."""
    if debounce is None:
        if debounce_max is not None or key is not None:
            raise ValueError("debounce_max and debounce_key need debounce (the window)")
        return None, None
    if isinstance(debounce, bool) or not isinstance(debounce, int | float) or debounce <= 0:
        raise ValueError(f"debounce must be a positive number of seconds, not {debounce!r}")
    if debounce_max is None:
        debounce_max = DEBOUNCE_MAX_WINDOWS * debounce
    if (
        isinstance(debounce_max, bool)
        or not isinstance(debounce_max, int | float)
        or debounce_max < debounce
    ):
        raise ValueError(
            f"debounce_max must be a number of seconds at least debounce's, not {debounce_max!r}"
        )
    if key is not None and not callable(key):
        raise ValueError("debounce_key must be a function of (params, subject)")
    if schedule is not None:
        raise ValueError("a periodic kind is not debounced: each tick is its own job")
    return float(debounce), float(debounce_max)


_kinds: dict[str, JobKind] = {}
_providers: dict[str, Provider] = {}


def check_on_failure(on_failure: object, sequence: object, debounce: object) -> bool:
    """A sequenced kind's ``on_failure``: "hold" (the default) or "skip"; True for skip."""
    if on_failure not in ("hold", "skip"):
        raise ValueError(f"on_failure must be 'hold' or 'skip', not {on_failure!r}")
    if sequence is not None and not callable(sequence):
        raise ValueError("sequence must be a function of (params, subject) returning a key")
    if sequence is not None and debounce is not None:
        raise ValueError("a debounced kind is not sequenced: its window's job has no place")
    return on_failure == "skip"


def register_kind(
    name: str,
    handler: Handler,
    *,
    authorize_release: Callable[[Effect], str | None] | None = None,
    max_attempts: int | None = None,
    redact_errors: bool | Callable[[BaseException], bool] = False,
    priority: int = 0,
    queue: str = "default",
    timeout: float | None = None,
    schedule: str | datetime.timedelta | None = None,
    schedule_tz: str | None = None,
    catch_up: str = "latest",
    on_child_failure: str = "fail",
    labels: dict[str, str] | None = None,
    debounce: float | None = None,
    debounce_max: float | None = None,
    debounce_key: Callable[[dict, tuple[str, str]], str] | None = None,
    sequence: Callable[[dict, tuple[str, str]], str] | None = None,
    on_failure: str = "hold",
) -> JobKind:
    """Register a job kind (idempotent, so ``ready()`` may run twice in tests).

    ``redact_errors``: the kind's exception messages may carry private values;
    True (or a predicate returning True for an exception) keeps only the class
    and the traceback's frames of its failures. ``schedule`` makes it periodic
    (``jobs.schedules``; its cron and time zone are read by check jobs.E040 at start-up).
    An ``async def`` handler is wrapped here so the worker runs it in an event loop of
    its own (``jobs.asyncctx``); one it could only fail on (a def wrapping an async def,
    an async generator) raises TypeError now rather than at every run. ``labels``: what
    people call its job, result and effect, and its job states (``LABEL_KEYS``), e.g.
    ``{"job": "invoice", "effect": "receipt", "succeeded": "Sent"}``; the console and the
    project's pages show them (``jobs.ops.words``), the engine never reads them.
    ``debounce``/``debounce_max``/``debounce_key``: latest wins (``check_debounce``).
    ``sequence``/``on_failure``: its jobs of one key start in order (``jobs.sequences``).
    """
    asyncctx.refuse_unrunnable(name, handler)
    checked_labels = check_labels(labels)
    if asyncctx.is_async_handler(handler) and not isinstance(handler, asyncctx.AsyncHandler):
        handler = asyncctx.AsyncHandler(handler)
    # ``-> MyResult`` (a dataclass or TypedDict): the returned value is the job's result.
    result_type = declared_result(handler)
    if result_type is not None and not isinstance(handler, TypedResultHandler):
        handler = TypedResultHandler(handler, result_type)
    if schedule is not None and not isinstance(schedule, str | datetime.timedelta):
        raise ValueError(f"schedule must be a cron string or a timedelta, not {schedule!r}")
    if catch_up not in CATCH_UP:
        raise ValueError(f"catch_up must be one of {', '.join(CATCH_UP)}, not {catch_up!r}")
    if on_child_failure not in ON_CHILD_FAILURE:
        raise ValueError(
            f"on_child_failure must be one of {', '.join(ON_CHILD_FAILURE)}, "
            f"not {on_child_failure!r}"
        )
    if timeout is not None and not (isinstance(timeout, int | float) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
    debounce, debounce_max = check_debounce(debounce, debounce_max, debounce_key, schedule)
    sequence_skip = check_on_failure(on_failure, sequence, debounce)
    kind = JobKind(
        name,
        handler,
        authorize_release,
        max_attempts,
        redact_errors,
        priority=check_priority(priority),
        queue=check_queue(queue),
        timeout=None if timeout is None else float(timeout),
        schedule=schedule,
        schedule_tz=schedule_tz,
        catch_up=catch_up,
        on_child_failure=on_child_failure,
        result_type=result_type,
        labels=checked_labels,
        debounce=debounce,
        debounce_max=debounce_max,
        debounce_key=debounce_key,
        sequence=sequence,
        sequence_skip=sequence_skip,
    )
    _kinds[name] = kind
    return kind


def get_kind(name: str) -> JobKind:
    try:
        return _kinds[name]
    except KeyError:
        raise UnknownKind(f"no job kind named {name!r} is registered") from None


def kinds() -> dict[str, JobKind]:
    return dict(_kinds)


def register_provider(provider: Provider) -> Provider:
    _providers[provider.name] = provider
    return provider


def get_provider(name: str) -> Provider:
    try:
        return _providers[name]
    except KeyError:
        raise UnknownKind(f"no provider named {name!r} is registered") from None


def providers() -> dict[str, Provider]:
    return dict(_providers)


def register_builtin_providers() -> None:
    """Register ``inapp``, ``email`` and, where httpx is installed, ``webhook``."""
    from jobs.providers.email import EmailProvider
    from jobs.providers.inapp import InAppProvider

    register_provider(InAppProvider())
    register_provider(EmailProvider())
    try:  # the extra django-jobs-ledger[webhook]; jobs.checks names it when it is missing
        from jobs.providers.webhook import WebhookProvider
    except ModuleNotFoundError as exc:
        if exc.name != "httpx":
            raise
        return
    register_provider(WebhookProvider())
