"""A job's identity, kept beside its artifact in the storage (issue 47).

A failover to an asynchronous standby can lose a job's row while the bucket keeps its
object. The object's name says which job (its uid), kind and revision, not what the job
was about, so nothing could ask for it again. Before a job's first object is stored, a
small manifest goes under ``jobs/.identity/job-<uid>-rev-<n>.json``: the kind, the
subject's type and id, the revision, the tenant key, the params (references only by
contract), priority and queue. Ids and keys only, never private data: what ``jobs.request``
needs to ask for the same job again.

The manifest is a pure function of the job's identity, so a retry, a second worker or
the job asked for again under its uid writes the same bytes under the same name (an
exclusive create that finds it there is done). ``jobs.reconcile`` reads them; pruning
(``jobs.retention``) removes those of finished jobs after the orphan grace, like orphans.

Where the storage can carry it, the same bytes ride on the artifact object itself instead
of a file of their own: a user extended attribute (``XATTR``) of the file, set before its
fsync, on a filesystem that keeps them; the object's user metadata (``METADATA``) in the
same PUT on S3. The identity is then stored atomically with the object (no window with an
object and no identity) and costs no write, fsync or PUT of its own: a manifest file cost
the minimal kind a quarter of its throughput (two more fsyncs a job, docs/benchmarks.md).
A storage that cannot, or an identity over ``ATTACHED_MAX`` bytes, keeps the file.

This module imports nothing from the app but ``identity``: ``artifacts`` writes through
it, ``reconcile`` and ``retention`` read through it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from jobs import identity

FOLDER = "jobs/.identity"  # under the artifact storage's folder (``artifacts.FOLDER``)
VERSION = 1
XATTR = "user.jobs.identity"  # the file's extended attribute holding the identity
METADATA = "jobs-identity"  # the S3 object's user metadata key (base64 of the identity)
# An identity larger than this goes to a manifest file: S3 allows 2 KB of user metadata
# an object (base64 adds a third), and ext4 keeps extended attributes in one block.
ATTACHED_MAX = 1024
_NAME = re.compile(
    rf"^{re.escape(FOLDER)}/job-(?P<job>[0-9a-f-]{{36}}|\d+)-rev-(?P<rev>\d+)\.json$"
)


@dataclass(frozen=True)
class Manifest:
    """What ``jobs.request`` needs to ask for a job again: its identity, no private data."""

    uid: str  # ``identity.job_key``: the uid (an id for a job made before 0024)
    kind: str
    subject_type: str
    subject_id: str
    revision: int
    tenant: str = ""
    params: dict | None = None
    priority: int = 0
    queue: str = "default"

    def as_dict(self) -> dict[str, Any]:
        return {
            "v": VERSION,
            "uid": self.uid,
            "kind": self.kind,
            "subject_type": self.subject_type,
            "subject_id": self.subject_id,
            "revision": self.revision,
            "tenant": self.tenant,
            "params": self.params or {},
            "priority": self.priority,
            "queue": self.queue,
        }


def name_for(job: Any) -> str:
    """The manifest's name: ``jobs/.identity/job-<uid>-rev-<n>.json``."""
    return f"{FOLDER}/job-{identity.job_key(job)}-rev-{job.output_revision}.json"


def is_manifest(name: str) -> bool:
    return name.startswith(f"{FOLDER}/")


def of_job(job: Any) -> Manifest:
    return Manifest(
        uid=identity.job_key(job),
        kind=job.kind,
        subject_type=job.subject_type,
        subject_id=str(job.subject_id),
        revision=int(job.output_revision),
        tenant=job.tenant_key or "",
        params=dict(job.params or {}),
        priority=int(job.priority or 0),
        queue=job.queue or "default",
    )


def body_for(job: Any) -> bytes:
    """The manifest's bytes: sorted keys, so every writer writes the same."""
    return json.dumps(of_job(job).as_dict(), sort_keys=True, separators=(",", ":")).encode()


def parse(name: str, data: bytes) -> Manifest | None:
    """The manifest stored under ``name``, or None when it is not one this version reads
    or does not match its name (a torn or foreign file is evidence, not an identity)."""
    found = _NAME.match(name)
    if found is None:
        return None
    return parse_attached(data, found["job"], int(found["rev"]))


def parse_attached(data: bytes | None, uid: str, revision: int) -> Manifest | None:
    """An identity carried by an object of job ``uid``'s ``revision``, or None when there is
    none, this version does not read it, or it names another job (a copied object)."""
    if not data:
        return None
    try:
        d = json.loads(data)
        m = Manifest(
            uid=str(d["uid"]),
            kind=str(d["kind"]),
            subject_type=str(d["subject_type"]),
            subject_id=str(d["subject_id"]),
            revision=int(d["revision"]),
            tenant=str(d.get("tenant") or ""),
            params=dict(d.get("params") or {}),
            priority=int(d.get("priority") or 0),
            queue=str(d.get("queue") or "default"),
        )
    except (ValueError, KeyError, TypeError):
        return None
    if d.get("v") != VERSION or (m.uid, m.revision) != (uid, revision):
        return None
    return m
