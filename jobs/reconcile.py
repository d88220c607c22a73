"""Find what a failover lost (issue 47, part 3; a start: the artifact storage's side).

After a failover to an asynchronous standby the database lacks the last jobs the old
primary acknowledged, while the bucket keeps their objects. An object's name carries its
job's uid (``jobs.identity``), so an object whose uid no job row has is a lost job's:
nothing else makes one (job rows are never deleted, ``jobs.retention``). Each lost job
is reported once, with its kind (as its folder names it), revision and, from the UUIDv7,
when it was asked for. Run it before ``jobs_prune`` removes orphans older than
``JOBS_ORPHAN_GRACE_SECONDS``: they are the evidence.

The provider's side, for any provider: ``unknown_keys`` takes the idempotency keys a
provider says it accepted (its export, one a line, optionally followed by the effect id
it recorded) and returns those the ledger has no effect for: notices of lost jobs.

Still to come (issue 47): asking a provider with a ``lookup`` for its keys, asking for the
lost jobs again where their subject still exists, and recording what the outside world
already has so no second notice goes out.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime

from django.db.models import Q

from jobs import artifacts, identity, retention
from jobs.models import Effect, Job


@dataclass(frozen=True)
class LostJob:
    """A job the database does not have, as its objects in the artifact storage show it."""

    job: str  # its uid (an id for a job made before migration 0024)
    kind_folder: str  # the kind as the object's folder names it ('.' as '-')
    revision: int
    made_at: datetime | None  # from the uid (UUIDv7); None for an id
    objects: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict:
        return {
            "job": self.job,
            "kind_folder": self.kind_folder,
            "revision": self.revision,
            "made_at": None if self.made_at is None else self.made_at.isoformat(),
            "objects": list(self.objects),
        }


def lost_jobs(names: list[str] | None = None) -> list[LostJob]:
    """The jobs whose objects are in the artifact storage and whose rows are not, oldest
    first. ``names``: the storage's file names (all of them when None)."""
    names = list(retention.stored_names()) if names is None else names
    found: dict[str, list[str]] = {}
    for name in names:
        key = identity.KEY_IN_NAME.search(name)
        if key is not None:
            found.setdefault(key.group("job"), []).append(name)
    known = _known(set(found))
    lost = []
    for token, objects in found.items():
        if token in known:
            continue
        first = sorted(objects)[0]
        key = identity.KEY_IN_NAME.search(first)
        assert key is not None
        within = first.removeprefix(f"{artifacts.FOLDER}/")
        lost.append(
            LostJob(
                job=token,
                kind_folder=within.split("/", 1)[0] if "/" in within else "",
                revision=int(key.group("revision")),
                made_at=None if token.isdigit() else identity.made_at(uuid.UUID(token)),
                objects=tuple(sorted(objects)),
            )
        )
    return sorted(lost, key=lambda j: (j.made_at is None, j.made_at or 0, j.job))


def _known(tokens: set[str]) -> set[str]:
    """The tokens (uids, or ids of jobs made before 0024) the database has a job for."""
    ids = {int(t) for t in tokens if t.isdigit()}
    uids = {uuid.UUID(t) for t in tokens if not t.isdigit()}
    if not tokens:
        return set()
    rows = Job.objects.filter(Q(pk__in=ids, keys_from_id=True) | Q(uid__in=uids))
    return {identity.job_key(job) for job in rows.only("pk", "uid", "keys_from_id")}


@dataclass(frozen=True)
class UnknownKey:
    """A key a provider accepted that no effect of the ledger has."""

    idempotency_key: str
    effect_id: str  # as the provider recorded it ("" when its export has none)
    job: str  # the job part of that effect id (its uid), or ""


def read_provider_keys(lines) -> list[tuple[str, str]]:
    """``(key, effect id)`` pairs from a provider's export: a key a line, optionally
    followed by whitespace and the effect id; blank lines and ``#`` comments skipped."""
    pairs = []
    for line in lines:
        parts = line.split(None, 1)
        if not parts or parts[0].startswith("#"):
            continue
        pairs.append((parts[0], parts[1].strip() if len(parts) > 1 else ""))
    return pairs


def unknown_keys(accepted: list[tuple[str, str]]) -> list[UnknownKey]:
    """The accepted ``(key, effect id)`` pairs whose key no effect of the ledger has."""
    keys = {key for key, _ in accepted}
    known: set[str] = set()
    for chunk in _chunks(sorted(keys), 1000):
        known.update(
            Effect.objects.filter(idempotency_key__in=chunk).values_list(
                "idempotency_key", flat=True
            )
        )
    out, seen = [], set()
    for key, effect_id in accepted:
        if key in known or key in seen:
            continue
        seen.add(key)
        out.append(UnknownKey(key, effect_id, effect_id.split(":", 1)[0] if effect_id else ""))
    return out


def _chunks(items: list[str], size: int):
    for start in range(0, len(items), size):
        yield items[start : start + size]
