"""The storage's side of a failover: the jobs whose objects are stored and whose rows are not.

An object's name carries its job's uid (``jobs.identity``), so an object whose uid no job
row has is a lost job's: nothing else makes one (job rows are never deleted,
``jobs.retention``). Its identity (``jobs.manifests``: carried by the object itself, or a
manifest file written before its first object) says what the job was about, so it can be
asked for again. Each lost job is
reported once, with its kind, revision and, from the UUIDv7, when it was asked for.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime

from django.db.models import Q

from jobs import archived, artifacts, identity, manifests, retention
from jobs.manifests import Manifest
from jobs.models import Effect, Job


@dataclass(frozen=True)
class LostJob:
    """A job the database does not have, as the artifact storage shows it."""

    job: str  # its uid (an id for a job made before migration 0024)
    kind_folder: str  # the kind as the object's folder names it ('.' as '-')
    revision: int
    made_at: datetime | None  # from the uid (UUIDv7); None for an id
    objects: tuple[str, ...] = field(default=())  # its artifact objects (not the manifest)
    manifest: Manifest | None = None  # its identity, when an object or manifest carries it

    def as_dict(self) -> dict:
        return {
            "job": self.job,
            "kind_folder": self.kind_folder,
            "revision": self.revision,
            "made_at": None if self.made_at is None else self.made_at.isoformat(),
            "objects": list(self.objects),
            "identity": None if self.manifest is None else self.manifest.as_dict(),
        }


@dataclass(frozen=True)
class Scan:
    """What the storage holds, by job token (uid, or id before 0024)."""

    objects: dict[str, list[str]]
    manifests: dict[str, str]  # token -> manifest name

    def tokens(self) -> set[str]:
        return set(self.objects) | set(self.manifests)


def scan(names: list[str] | None = None) -> Scan:
    """The job tokens the storage's names carry (all names under the folder when None)."""
    names = list(retention.stored_names()) if names is None else names
    objects: dict[str, list[str]] = {}
    found_manifests: dict[str, str] = {}
    for name in names:
        key = identity.KEY_IN_NAME.search(name)
        if key is None:
            continue
        if manifests.is_manifest(name):
            found_manifests[key.group("job")] = name
        else:
            objects.setdefault(key.group("job"), []).append(name)
    return Scan(objects, found_manifests)


def lost_jobs(names: list[str] | None = None, *, found: Scan | None = None) -> list[LostJob]:
    """The jobs whose objects (or manifest) are in the artifact storage and whose rows are
    not, oldest first. ``names``: the storage's file names (all of them when None)."""
    found = scan(names) if found is None else found
    known = known_tokens(found.tokens())
    lost = []
    for token in found.tokens() - known:
        objects = sorted(found.objects.get(token, []))
        first = objects[0] if objects else found.manifests[token]
        key = identity.KEY_IN_NAME.search(first)
        assert key is not None
        revision = int(key.group("revision"))
        manifest = _read_manifest(found.manifests.get(token)) or _read_attached(
            objects, token, revision
        )
        within = first.removeprefix(f"{artifacts.FOLDER}/")
        folder = within.split("/", 1)[0] if "/" in within and objects else ""
        if manifest is not None and not folder:
            folder = manifest.kind.replace(".", "-")
        lost.append(
            LostJob(
                job=token,
                kind_folder=folder,
                revision=revision,
                made_at=None if token.isdigit() else identity.made_at(uuid.UUID(token)),
                objects=tuple(objects),
                manifest=manifest,
            )
        )
    return sorted(lost, key=lambda j: (j.made_at is None, j.made_at or 0, j.job))


def _read_manifest(name: str | None) -> Manifest | None:
    if name is None:
        return None
    try:
        with artifacts.get_storage().open(name, "rb") as fh:
            return manifests.parse(name, fh.read())
    except (FileNotFoundError, OSError):
        return None


def _read_attached(objects: list[str], token: str, revision: int) -> Manifest | None:
    """The identity one of the lost job's objects carries (the first that reads)."""
    storage = artifacts.get_storage()
    for name in objects:
        found = manifests.parse_attached(artifacts.read_identity(storage, name), token, revision)
        if found is not None:
            return found
    return None


def known_tokens(tokens: set[str]) -> set[str]:
    """The tokens (uids, or ids of jobs made before 0024) the database has a job for."""
    known: set[str] = set()
    for chunk in _chunked(tokens):
        rows = _jobs_of(chunk).only("pk", "uid", "keys_from_id")
        known.update(identity.job_key(job) for job in rows)
        known |= archived.known_tokens(chunk)  # archived: its files are kept, it is not lost
    return known


def _chunked(tokens: set[str], size: int = 1000):
    """A bucket of many jobs is asked about a thousand tokens a query."""
    ordered = sorted(tokens)
    for start in range(0, len(ordered), size):
        yield set(ordered[start : start + size])


def _jobs_of(tokens: set[str]):
    named = identity.tokens_lookup(tokens)
    return Job.objects.none() if named is None else Job.objects.filter(named)


def unsettled_jobs(tokens: set[str]) -> list[int]:
    """Ids of the jobs named by ``tokens`` that may have lost a publish or a ledger arrow:
    not finished, or with an effect not final. Their sends are looked up before any send
    (``Job.reconciled_at``): the provider may have had them before the failover."""
    found: list[int] = []
    open_effects = Effect.objects.exclude(state__in=Effect.FINAL).values("job_id")
    for chunk in _chunked(tokens):
        rows = _jobs_of(chunk).filter(reconciled_at__isnull=True)
        rows = rows.filter(~Q(state__in=Job.TERMINAL) | Q(pk__in=open_effects))
        found += rows.values_list("pk", flat=True)
    return found
