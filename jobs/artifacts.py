"""Artifacts: files written once under names that include their content hash; every read verified.

The stable key (``job-<uid>-rev-29``, ``jobs.identity``) is the business identity: one
row per key, committed with the job's publish. The file is the bytes of one delivery, created
exclusively under ``jobs/<kind>/<key>-<sha12>.<ext>`` and never replaced or deleted
by a delivery. Two workers that render the same bytes meet at the same name (the
second reuses the first's file); a worker whose bytes differ writes its own file,
and only the publish decides which one the row names. A late writer's file is an
orphan that ``jobs.retention.prune_orphans`` collects after a grace period.

Every read goes through ``open_verified`` (``read_verified`` for small ones), which
streams the bytes into a spool while it hashes them and raises ``ArtifactCorrupt``
(or ``ArtifactLost``) instead of handing out bytes that do not match the row. A storage
that cannot be read now (a disk error, a permission, an object store away) raises
``StorageUnavailable`` instead: no verdict on the bytes, so no restore is asked.

The storage is any Django storage that can create a name exclusively
(``create_exclusive``): this module's ``AtomicFileSystemStorage`` (``O_EXCL`` by
hard link) on one host, ``jobs.storage_s3.S3Storage`` (``If-None-Match: *``) on
several. A restore (``jobs.restore``) may only put back
bytes whose sha256 equals the row's.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import secrets
import tempfile
from dataclasses import dataclass
from typing import IO

from django.conf import settings
from django.core.checks import Error, Warning
from django.core.files.base import ContentFile
from django.core.files.storage import FileSystemStorage, Storage, storages
from django.utils import timezone

from jobs import conf, identity, manifests
from jobs.exceptions import ArtifactCorrupt, ArtifactLost, StorageUnavailable
from jobs.models import Artifact, Job

log = logging.getLogger("jobs.artifacts")

FOLDER = "jobs"  # every artifact file lives under this folder of the storage
CHUNK = 64 * 1024
SPOOL_MEMORY = 1024 * 1024  # a verified read keeps this much in memory, the rest on disk


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

    def _write_temp(self, name: str, data: bytes, identity: bytes | None = None) -> tuple[str, str]:
        path = self.path(name)
        folder = os.path.dirname(path)
        self._make_folder(folder)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                if identity is not None:  # inode metadata: the fsync below covers it
                    os.setxattr(fh.fileno(), manifests.XATTR, identity)
                os.fsync(fh.fileno())
        except BaseException:
            os.unlink(tmp)
            raise
        return path, tmp

    def create_exclusive(self, name: str, data: bytes, identity: bytes | None = None) -> bool:
        """Store ``data`` under exactly ``name``; False if the name already exists.

        ``identity`` (``attaches_identity``) goes with the file as its extended attribute.
        The folder is fsynced after the link: the new name is on disk before the
        publish names it (a crash after the publish cannot lose a published file's name).
        """
        path, tmp = self._write_temp(name, data, identity)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        _fsync_folder(os.path.dirname(path))
        return True

    def attaches_identity(self) -> bool:
        """Whether this folder's filesystem keeps a file's user extended attributes
        (ext4, xfs, btrfs, tmpfs on Linux do; probed once a storage, on a scratch file)."""
        known = getattr(self, "_attaches", None)
        if known is None:
            known = self._attaches = _keeps_xattrs(self.location)
        return known

    def read_identity(self, name: str) -> bytes | None:
        """The identity the file carries, or None (none, or no such file)."""
        try:
            return os.getxattr(self.path(name), manifests.XATTR)
        except (OSError, AttributeError):  # no attribute, no file, no xattr support
            return None

    def replace(self, name: str, data: bytes) -> None:
        """Atomically put ``data`` under ``name``.

        Only ``put_back`` calls this, with bytes already checked against the row's sha256:
        a delivery never replaces a file.
        """
        path, tmp = self._write_temp(name, data)
        os.replace(tmp, path)
        _fsync_folder(os.path.dirname(path))


def _keeps_xattrs(location: str | os.PathLike[str]) -> bool:
    if not hasattr(os, "setxattr"):
        return False
    try:
        os.makedirs(location, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=location, prefix=".tmp-xattr-") as fh:
            os.setxattr(fh.fileno(), manifests.XATTR, b"{}")
            return os.getxattr(fh.fileno(), manifests.XATTR) == b"{}"
    except OSError:
        return False


def _fsync_folder(folder: str) -> None:
    """Make the folder's entries durable (a new name is in the folder, not only the inode)."""
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def get_storage() -> Storage:
    return storages[conf.get("JOBS_ARTIFACT_STORAGE")]


def get_replica_storage() -> Storage | None:
    """The second copy's storage (``JOBS_ARTIFACT_REPLICA_STORAGE``), or None."""
    alias = conf.get("JOBS_ARTIFACT_REPLICA_STORAGE")
    return storages[alias] if alias else None


def artifact_key(job: Job) -> str:
    """The stable key: the same job and revision always name the same artifact.

    Derived from the job's uid (``jobs.identity``), never its id: after a failover a new
    job may get a lost job's id, and its key and object names must still be its own.
    ``identity.display_name`` is the readable ``job-84-rev-29``.
    """
    return f"job-{identity.job_key(job)}-rev-{job.output_revision}"


def storage_name_for(job: Job, extension: str, sha256: str, *, suffix: str = "") -> str:
    """The file name of these bytes: the key, the first 12 hex digits of their sha256."""
    tail = f"-{suffix}" if suffix else ""
    return (
        f"{FOLDER}/{job.kind.replace('.', '-')}/{artifact_key(job)}-{sha256[:12]}{tail}"
        f".{extension.lstrip('.')}"
    )


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _open_read(storage: Storage, name: str) -> IO[bytes]:
    """A stream of the stored bytes: the storage's own stream if it has one (S3's body)."""
    if hasattr(storage, "open_stream"):
        return storage.open_stream(name)
    return storage.open(name, "rb")


# Errors of the storage rather than of the file: the same read may succeed later, and
# the bytes may well be intact (a failing disk sector, an NFS server away, a permission
# an operator changed). Any other OSError (no such file, a directory in its place, ...)
# means there is no readable file under the name.
UNAVAILABLE_ERRNOS = frozenset(
    getattr(errno, name)
    for name in (
        "EIO", "EACCES", "EPERM", "ESTALE", "ETIMEDOUT", "EAGAIN", "EINTR", "EMFILE",
        "ENFILE", "ENOMEM", "ENOTCONN", "ECONNRESET", "EHOSTDOWN", "EHOSTUNREACH", "ENOLINK",
        "EREMOTEIO",
    )
    if hasattr(errno, name)
)  # fmt: skip


def _unavailable(exc: OSError, what: str) -> StorageUnavailable | None:
    """The storage's own failure (``UNAVAILABLE_ERRNOS``) as ``StorageUnavailable``, or None.

    The code names the errno (``storage_eio``): the retry table takes every
    ``storage_`` code for an outage. The class and errno only: the message may carry
    the file's path.
    """
    if exc.errno not in UNAVAILABLE_ERRNOS:
        return None
    name = errno.errorcode.get(exc.errno, "OSError")
    return StorageUnavailable(f"artifact storage {what} failed ({name})", code=_code(name))


def _code(errno_name: str) -> str:
    return f"storage_{errno_name.lower()}"


def _copy_hashed(storage: Storage, name: str, sink: IO[bytes] | None) -> str | None:
    """Stream the file in chunks into ``sink`` (if any); its sha256, or None if there is no
    readable file. A storage that fails to read (``UNAVAILABLE_ERRNOS``; an object store's
    own ``StorageUnavailable``) raises ``StorageUnavailable``: no verdict on the bytes."""
    digest = hashlib.sha256()
    try:
        with _open_read(storage, name) as fh:
            while chunk := fh.read(CHUNK):
                digest.update(chunk)
                if sink is not None:
                    sink.write(chunk)
    except OSError as exc:
        unavailable = _unavailable(exc, "read")
        if unavailable is not None:
            raise unavailable from exc
        return None
    return digest.hexdigest()


def _digest_of(storage: Storage, name: str) -> str | None:
    """The stored file's sha256 (streamed, nothing kept), or None if unreadable."""
    return _copy_hashed(storage, name, None)


def _create(storage: Storage, name: str, data: bytes, identity: bytes | None = None) -> bool:
    """Create ``name`` exclusively; False if the name is taken (nothing is overwritten).

    A storage that cannot be written now (a disk error, a stale NFS handle, a
    permission; an object store away) raises ``StorageUnavailable``: an outage the
    job waits out. A full or read-only disk stays the ``OSError`` it is (the retry
    table names it by errno: ``storage_enospc``, an outage as well).
    """
    try:
        return _create_now(storage, name, data, identity)
    except OSError as exc:
        unavailable = _unavailable(exc, "write")
        if unavailable is None:
            raise
        raise unavailable from exc


def _create_now(storage: Storage, name: str, data: bytes, identity: bytes | None) -> bool:
    if identity is not None:  # only where ``_attaches`` said the storage carries one
        return storage.create_exclusive(name, data, identity=identity)  # type: ignore[attr-defined]
    if hasattr(storage, "create_exclusive"):
        return storage.create_exclusive(name, data)
    # A generic Storage offers exists-then-save; ``save`` never overwrites (it renames),
    # and an object store with conditional writes (If-None-Match: *) closes the gap.
    if storage.exists(name):
        return False
    saved = storage.save(name, ContentFile(data))
    if saved != name:  # pragma: no cover - another writer took the name meanwhile
        storage.delete(saved)  # our own fresh copy under a name nothing refers to
        return False
    return True


def _put(
    storage: Storage,
    name: str,
    data: bytes,
    digest: str,
    job: Job,
    ext: str,
    identity: bytes | None = None,
) -> tuple:
    """Create ``data`` exclusively under ``name``, or reuse an identical file there.

    A file under that name with other bytes (a torn write, a collision of the short
    hash) is left alone: the bytes go under another unique name. Returns
    ``(name, reused)``.
    """
    for _ in range(8):
        if _create(storage, name, data, identity):
            return name, False
        if _digest_of(storage, name) == digest:
            return name, True  # identical bytes: not rewritten
        log.warning("job=%s name=%s holds other bytes; writing under another name", job.pk, name)
        name = storage_name_for(job, ext, digest, suffix=secrets.token_hex(3))
    raise OSError(f"job {job.pk}: no free artifact name after 8 tries")  # pragma: no cover


def _attaches(storage: Storage, identity: bytes | None) -> bool:
    """Whether ``storage`` carries ``identity`` on the object itself (``jobs.manifests``)."""
    attaches = getattr(storage, "attaches_identity", None)
    return (
        bool(identity) and len(identity) <= manifests.ATTACHED_MAX and bool(attaches and attaches())
    )


def read_identity(storage: Storage, name: str) -> bytes | None:
    """The identity an object carries (``jobs.manifests``), or None."""
    read = getattr(storage, "read_identity", None)
    return read(name) if read is not None else None


@dataclass
class Stored:
    artifact: Artifact  # unsaved: its row goes in with the publish
    reused: bool  # a file with these very bytes was already there (not rewritten)


def store(job: Job, data: bytes, *, content_type: str, extension: str) -> Stored:
    """Create the job's artifact file exclusively under a name that includes its hash.

    The row is not written here: it commits with the job's publish, so a job has
    an artifact row exactly when it succeeded, and the row names the publishing
    worker's file. Nothing here replaces or deletes a file: a worker whose lease
    ran out can add an orphan, never change published bytes. With a replica
    storage configured the same bytes are also created there (restores read it).
    """
    digest = sha256_hex(data)
    storage = get_storage()
    # The job's identity goes with its object (issue 47): any object of it in the storage
    # can then be asked for again after a failover lost its row (``jobs.manifests``).
    # Carried by the object itself where the storage can, else a manifest file first.
    identity: bytes | None = manifests.body_for(job)
    if not _attaches(storage, identity):
        _create(storage, manifests.name_for(job), identity)
        identity = None
    name, reused = _put(
        storage, storage_name_for(job, extension, digest), data, digest, job, extension, identity
    )
    replica = get_replica_storage()
    if (
        replica is not None
        and not _create(replica, name, data)
        and _digest_of(replica, name) != digest
    ):
        log.warning("job=%s name=%s replica holds other bytes; left alone", job.pk, name)
    artifact = Artifact(
        job=job,
        key=artifact_key(job),
        storage_name=name,
        sha256=digest,
        size=len(data),
        content_type=content_type,
    )
    return Stored(artifact, reused)


def open_verified(artifact: Artifact, *, storage: Storage | None = None) -> IO[bytes]:
    """The one read of an artifact: a file of its bytes, only if their sha256 equals the row's.

    The bytes stream from the storage into a spool (memory up to ``SPOOL_MEMORY``, then
    a temporary file of this host) while they are hashed; the file is handed out only
    after the whole of it matched, so memory stays flat however large the artifact and
    no unverified byte is ever served. Raises ``ArtifactLost`` for an artifact marked
    lost, ``ArtifactCorrupt`` for a missing or mismatching file, ``StorageUnavailable``
    when the storage could not be read now. The caller closes it.
    """
    if artifact.state == Artifact.State.LOST:
        raise ArtifactLost(f"artifact {artifact.pk} ({artifact.key}) is lost")
    # Handed to the caller open (it closes it): not a with block.
    spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_MEMORY, prefix="jobs-artifact-")  # noqa: SIM115
    try:
        digest = _copy_hashed(storage or get_storage(), artifact.storage_name, spool)
        if digest != artifact.sha256:
            raise ArtifactCorrupt(f"artifact {artifact.pk} ({artifact.key}) is missing or corrupt")
    except BaseException:
        spool.close()
        raise
    spool.seek(0)
    return spool


def read_verified(artifact: Artifact, *, storage: Storage | None = None) -> bytes:
    """The verified bytes in memory (small artifacts; ``open_verified`` streams).

    Raises ``ArtifactLost`` for an artifact marked lost, ``ArtifactCorrupt`` for a
    missing or mismatching file (nothing unverified is ever returned).
    """
    with open_verified(artifact, storage=storage) as fh:
        return fh.read()


def is_intact(artifact: Artifact) -> bool:
    """Whether the stored bytes match the recorded sha256 (no repair)."""
    if artifact.state == Artifact.State.LOST:
        return False
    return _digest_of(get_storage(), artifact.storage_name) == artifact.sha256


def verify(artifact: Artifact) -> None:
    """An operator's check: record when the bytes were last found intact, or raise.

    A lost artifact whose file an operator has put back (bytes with the row's sha256)
    is stored again.
    """
    if artifact.state == Artifact.State.LOST:
        if _digest_of(get_storage(), artifact.storage_name) != artifact.sha256:
            raise ArtifactLost(f"artifact {artifact.pk} ({artifact.key}) is lost")
        Artifact.objects.filter(pk=artifact.pk).update(
            state=Artifact.State.STORED, lost_reason="", verified_at=timezone.now()
        )
        return
    if _digest_of(get_storage(), artifact.storage_name) != artifact.sha256:
        raise ArtifactCorrupt(f"artifact {artifact.pk} ({artifact.key}) is missing or corrupt")
    Artifact.objects.filter(pk=artifact.pk).update(verified_at=timezone.now())


def put_back(artifact: Artifact, data: bytes, *, storage: Storage | None = None) -> None:
    """Put the recorded bytes back under the row's name (a restore; never other bytes)."""
    if sha256_hex(data) != artifact.sha256:
        raise ValueError(f"artifact {artifact.pk}: refusing bytes of another sha256")
    storage = storage or get_storage()
    if hasattr(storage, "replace"):
        storage.replace(artifact.storage_name, data)
        return
    if not _create(storage, artifact.storage_name, data):
        storage.delete(artifact.storage_name)  # the bad copy; the good one goes in next
        _create(storage, artifact.storage_name, data)


def open_artifact(artifact: Artifact) -> IO[bytes]:
    """The verified bytes as a file object (callers check permission first)."""
    return open_verified(artifact)


# --- system checks (registered by jobs.checks) -------------------------------------------


def check_storage(app_configs=None, **kwargs):
    alias = conf.get("JOBS_ARTIFACT_STORAGE")
    if alias not in getattr(settings, "STORAGES", {}):
        return [
            Error(
                f"STORAGES has no {alias!r} entry (JOBS_ARTIFACT_STORAGE)",
                hint="e.g. STORAGES['artifacts'] = {'BACKEND': "
                "'jobs.artifacts.AtomicFileSystemStorage', 'OPTIONS': {'location': ...}}",
                id="jobs.E003",
            )
        ]
    return []


UNREACHABLE = "the bucket did not answer"
_probed: dict[str, str | None] = {}


def check_exclusive_create(app_configs=None, **kwargs):
    """Refuse an object store that overwrites a conditional create; warn when it is away.

    Only storages that offer ``probe_exclusive_create`` (``jobs.storage_s3.S3Storage``)
    are probed, once per process: a probe object is created, created again with
    ``If-None-Match: *`` (which must be refused, the first bytes kept), then deleted.
    """
    alias = conf.get("JOBS_ARTIFACT_STORAGE")
    if alias not in getattr(settings, "STORAGES", {}):
        return []  # jobs.E003 says so
    storage = storages[alias]
    if not hasattr(storage, "probe_exclusive_create"):
        return []
    if alias not in _probed:
        try:
            _probed[alias] = storage.probe_exclusive_create()
        except Exception as exc:  # unreachable, no such bucket, refused credentials
            _probed[alias] = f"{UNREACHABLE} ({type(exc).__name__})"
    problem = _probed[alias]
    if problem is None:
        return []
    if problem.startswith(UNREACHABLE):
        # A store away at start-up is an outage like any other: the workers wait it out
        # (jobs.retry), so a host that starts during one must start.
        return [
            Warning(
                f"artifact storage {alias!r}: {problem}",
                hint="Jobs that store or read artifacts wait while it is away, without "
                "spending attempts (within JOBS_OUTAGE_WINDOW_SECONDS). If it stays away, "
                f"check the endpoint, bucket and credentials in STORAGES[{alias!r}].",
                id="jobs.W017",
            )
        ]
    return [
        Error(
            f"artifact storage {alias!r}: {problem}",
            hint="Artifacts are written once by conditional create (If-None-Match: *). Check "
            f"the bucket, endpoint, region and credentials in STORAGES[{alias!r}]['OPTIONS'] "
            "(and the AWS_* environment boto3 reads), and use a store that honours "
            "conditional writes (S3, MinIO, Ceph RGW, R2, B2).",
            id="jobs.E031",
        )
    ]
