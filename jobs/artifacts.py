"""Artifacts under stable keys: written once, atomically, verified by sha256.

A second worker that produces the same job never makes a second artifact: the
file's name is the key, written exclusively; a file already there is compared
with the fresh bytes and rewritten only if it differs. The row (key, sha256)
commits with the job's publish, so there is one per key and only for a job that
succeeded; the operator's restore (``jobs.restore``) verifies against it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from dataclasses import dataclass

from django.core.files.base import ContentFile
from django.core.files.storage import FileSystemStorage, Storage, storages
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from jobs import conf
from jobs.exceptions import ArtifactCorrupt
from jobs.models import Artifact, Job

log = logging.getLogger("jobs.artifacts")


class AtomicFileSystemStorage(FileSystemStorage):
    """File storage with exclusive, atomic creation under an exact name.

    Bytes go to a temporary file in the target folder, are fsynced, then
    hard-linked into place: the link fails if the name exists (write-once) and
    readers never see a partial file.
    """

    def _make_folder(self, folder: str) -> None:
        """Create ``folder`` and missing parents with ``directory_permissions_mode``.

        The mode is set explicitly (``mkdir`` alone is filtered by the process umask, and
        a umask of 000 would leave folders world-writable).
        """
        mode = self.directory_permissions_mode
        if mode is None:
            os.makedirs(folder, exist_ok=True)
            return
        missing = []
        while not os.path.isdir(folder):
            missing.append(folder)
            folder = os.path.dirname(folder)
        for path in reversed(missing):
            try:
                os.mkdir(path, mode)
            except FileExistsError:
                continue
            os.chmod(path, mode)

    def _write_temp(self, name: str, data: bytes) -> tuple[str, str]:
        path = self.path(name)
        folder = os.path.dirname(path)
        self._make_folder(folder)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        except BaseException:
            os.unlink(tmp)
            raise
        return path, tmp

    def create_exclusive(self, name: str, data: bytes) -> bool:
        """Store ``data`` under exactly ``name``; False if the name already exists."""
        path, tmp = self._write_temp(name, data)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def replace(self, name: str, data: bytes) -> None:
        """Atomically put ``data`` under ``name`` (used only to restore a corrupt file)."""
        path, tmp = self._write_temp(name, data)
        os.replace(tmp, path)


def get_storage() -> Storage:
    return storages[conf.get("JOBS_ARTIFACT_STORAGE")]


def artifact_key(job: Job) -> str:
    """The stable key: the same job and revision always name the same artifact."""
    return f"job-{job.pk}-rev-{job.output_revision}"


def storage_name_for(job: Job, extension: str) -> str:
    return f"jobs/{job.kind.replace('.', '-')}/{artifact_key(job)}.{extension.lstrip('.')}"


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read(storage: Storage, name: str) -> bytes | None:
    try:
        with storage.open(name, "rb") as fh:
            return fh.read()
    except (FileNotFoundError, OSError):
        return None


def _create(storage: Storage, name: str, data: bytes) -> bool:
    if hasattr(storage, "create_exclusive"):
        return storage.create_exclusive(name, data)
    # Object stores (S3) put whole objects atomically; exists-then-save is the
    # best a generic Storage offers. Keys are per job, so the race is with a
    # fenced-out twin of this very job writing identical bytes.
    if storage.exists(name):
        return False
    saved = storage.save(name, ContentFile(data))
    if saved != name:  # pragma: no cover - a backend that renamed instead of overwriting
        storage.delete(saved)
        return False
    return True


def _replace(storage: Storage, name: str, data: bytes) -> None:
    if hasattr(storage, "replace"):
        storage.replace(name, data)
        return
    storage.delete(name)
    storage.save(name, ContentFile(data))


@dataclass
class Stored:
    artifact: Artifact  # unsaved: its row goes in with the publish
    restored: bool  # a file was there with other bytes and was written again


def store(job: Job, data: bytes, *, content_type: str, extension: str) -> Stored:
    """Write the job's artifact file under its stable key, or verify the one there.

    The row is not written here: it commits with the job's publish (``insert_row``
    or the one-statement publish), so a job has an artifact row exactly when it
    succeeded. A file already under the key was left by an earlier worker of this
    job that died before publishing; equal bytes are kept, others are replaced.
    """
    storage = get_storage()
    name = storage_name_for(job, extension)
    restored = False
    if not _create(storage, name, data) and _read(storage, name) != data:
        _replace(storage, name, data)
        restored = True
        log.warning("job=%s key=%s rewrote a file an earlier worker left", job.pk, name)
    artifact = Artifact(
        job=job,
        key=artifact_key(job),
        storage_name=name,
        sha256=sha256_hex(data),
        size=len(data),
        content_type=content_type,
        rewrites=int(restored),
    )
    return Stored(artifact, restored)


def insert_row(artifact: Artifact) -> Artifact:
    """Insert the row of a stored artifact (ORM publish path), or return the existing one.

    A row can exist only from before rows moved into the publish; the file under the
    key holds the fresh bytes, so a row with another digest takes theirs (one rewrite).
    """
    if artifact.pk is not None:
        return artifact
    try:
        with transaction.atomic():
            artifact.save(force_insert=True)
    except IntegrityError:
        existing = Artifact.objects.get(key=artifact.key)
        if existing.sha256 != artifact.sha256:  # the file under the key holds the new bytes
            existing.sha256, existing.size = artifact.sha256, artifact.size
            existing.rewrites += 1
            existing.save(update_fields=["sha256", "size", "rewrites"])
        return existing
    log.info(
        "job=%s artifact=%s key=%s size=%s stored",
        artifact.job_id,
        artifact.pk,
        artifact.key,
        artifact.size,
    )
    return artifact


def verify(
    artifact: Artifact, *, data: bytes | None = None, storage: Storage | None = None
) -> bool:
    """Check stored bytes against the row; restore from ``data`` if missing or corrupt.

    Returns True when the file had to be restored. Without ``data`` (an operator's
    check) a bad file is reported, not repaired.
    """
    storage = storage or get_storage()
    stored = _read(storage, artifact.storage_name)
    if stored is not None and sha256_hex(stored) == artifact.sha256:
        Artifact.objects.filter(pk=artifact.pk).update(verified_at=timezone.now())
        return False
    if data is None:
        raise ArtifactCorrupt(f"artifact {artifact.pk} ({artifact.key}) is missing or corrupt")
    _replace(storage, artifact.storage_name, data)
    Artifact.objects.filter(pk=artifact.pk).update(
        sha256=sha256_hex(data),
        size=len(data),
        rewrites=F("rewrites") + 1,
        verified_at=timezone.now(),
    )
    log.warning("artifact=%s key=%s restored missing or corrupt file", artifact.pk, artifact.key)
    return True


def read_verified(artifact: Artifact) -> bytes:
    """The stored bytes, only if they match the recorded sha256; else ArtifactCorrupt."""
    stored = _read(get_storage(), artifact.storage_name)
    if stored is None or sha256_hex(stored) != artifact.sha256:
        raise ArtifactCorrupt(f"artifact {artifact.pk} ({artifact.key}) is missing or corrupt")
    return stored


def is_intact(artifact: Artifact) -> bool:
    """Whether the stored bytes match the recorded sha256 (no repair)."""
    try:
        read_verified(artifact)
    except ArtifactCorrupt:
        return False
    return True


def open_artifact(artifact: Artifact):
    """Open the stored file for streaming (callers check permission first)."""
    return get_storage().open(artifact.storage_name, "rb")
