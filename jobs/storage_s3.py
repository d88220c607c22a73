"""Artifacts on S3-compatible object storage: exclusive create by ``If-None-Match: *``.

``jobs.artifacts`` asks its storage for ``create_exclusive(name, data)``. On S3 that
is one ``PutObject`` with ``If-None-Match: *`` (the object is created only if no
object has that key; S3 answers 412 ``PreconditionFailed`` otherwise) and the
SHA-256 object checksum of the bytes (``x-amz-checksum-sha256``: the server refuses
bytes that arrive different from the ones hashed here). A 412 means "someone already
created this name", which write-once-by-name makes safe: the caller compares the
object's bytes with its own.

Reads stream (``open_stream``: the ``GetObject`` body, never the whole object in
memory), so a verified read hashes while it copies.

Only imported when ``STORAGES['artifacts']`` names it (``pip install
django-jobs-ledger[s3]``): nothing else in the engine imports boto3.

    STORAGES["artifacts"] = {
        "BACKEND": "jobs.storage_s3.S3Storage",
        "OPTIONS": {"bucket_name": "reports", "endpoint_url": "https://s3.example.org",
                    "region_name": "eu-west-1"},
    }

Credentials come from boto3's own chain (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` in the environment, an instance role, ...), never from
settings files. ``jobs.checks`` (jobs.E030) probes at start-up that the bucket
answers and that a second conditional create is refused: a store that silently
overwrites is refused.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import mimetypes
import secrets

from botocore.exceptions import BotoCoreError, ClientError
from storages.backends.s3 import S3Storage as _S3Storage
from storages.utils import clean_name
from urllib3.exceptions import HTTPError as Urllib3Error

from jobs import conf, manifests
from jobs.exceptions import StorageUnavailable

PROBE_FOLDER = "jobs/.probe"
# Answers meaning "the name is taken": 412 from S3 and MinIO; 409 ConditionalRequestConflict
# when two conditional creates of one key race (the loser may retry, and gets 412).
_TAKEN = {"PreconditionFailed", "ConditionalRequestConflict"}
_MISSING = {"NoSuchKey", "404", "NotFound"}


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


# What the store being away raises, besides an answer (ClientError): botocore's own
# errors (EndpointConnectionError for a refused connection, ConnectTimeoutError,
# ReadTimeoutError, ConnectionClosedError, ...), urllib3's when botocore lets one
# through, and the socket's (a reset mid-request).
_AWAY = (BotoCoreError, Urllib3Error, OSError)


def _unavailable(exc: Exception, what: str) -> StorageUnavailable:
    """The store's failure as ``StorageUnavailable``: an outage the job waits out.

    Every failure that is not a verdict (412 "taken", 404 "missing") lands here: a
    refused connection, a timeout, a 5xx or a throttling answer; an access or bucket
    refusal too, which an operator fixes while the job waits (the outage window bounds
    the wait). The class and code only: an error text may carry the bucket or key.
    """
    if isinstance(exc, ClientError):
        code = _error_code(exc) or str(_status(exc))
    else:
        code = type(exc).__name__
    return StorageUnavailable(f"object storage {what} failed ({code[:64]})")


class _Body:
    """An object's body whose read failing mid-stream is the store's failure, not a file's.

    A connection reset or timeout half-way through is ``StorageUnavailable`` (retry, the
    reader gets a 503): were it an ``OSError``, the verified read would take the file for
    corrupt and ask for a restore of bytes that are intact.
    """

    def __init__(self, body) -> None:
        self._body = body

    def read(self, size: int = -1) -> bytes:
        try:
            return self._body.read(size if size >= 0 else None)
        except _AWAY as exc:
            raise _unavailable(exc, "read") from exc

    def close(self) -> None:
        self._body.close()

    def __enter__(self) -> _Body:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class S3Storage(_S3Storage):
    """django-storages' S3 storage with the exclusive create the artifact store needs."""

    def _key(self, name: str) -> str:
        return self._normalize_name(clean_name(name))

    @property
    def client(self):
        return self.connection.meta.client

    def _put(self, name: str, data: bytes, metadata: dict | None = None, **conditions) -> None:
        digest = base64.b64encode(hashlib.sha256(data).digest()).decode()
        params = dict(self.get_object_parameters(name))
        params.setdefault("ContentType", mimetypes.guess_type(name)[0] or self.default_content_type)
        if metadata:  # beside the project's own (AWS_S3_OBJECT_PARAMETERS)
            params["Metadata"] = {**(params.get("Metadata") or {}), **metadata}
        self.client.put_object(
            Bucket=self.bucket_name,
            Key=self._key(name),
            Body=data,
            ChecksumAlgorithm="SHA256",
            ChecksumSHA256=digest,
            **conditions,
            **params,
        )

    def create_exclusive(self, name: str, data: bytes, identity: bytes | None = None) -> bool:
        """Store ``data`` under exactly ``name``; False if an object has that name already.

        ``identity`` (``jobs.manifests``) rides in the same PUT as the object's user metadata.
        """
        metadata = None
        if identity is not None:
            metadata = {manifests.METADATA: base64.b64encode(identity).decode()}
        try:
            self._put(name, data, metadata=metadata, IfNoneMatch="*")
        except ClientError as exc:
            if _error_code(exc) in _TAKEN or _status(exc) in (409, 412):
                return False
            raise _unavailable(exc, "create") from exc
        except _AWAY as exc:
            raise _unavailable(exc, "create") from exc
        return True

    def replace(self, name: str, data: bytes) -> None:
        """Put ``data`` under ``name`` whatever is there (a restore of checked bytes only)."""
        try:
            self._put(name, data)
        except (ClientError, *_AWAY) as exc:
            raise _unavailable(exc, "restore") from exc

    def open_stream(self, name: str) -> _Body:
        """The object's body as a stream (``read(n)``); FileNotFoundError if there is none."""
        try:
            return _Body(
                self.client.get_object(Bucket=self.bucket_name, Key=self._key(name))["Body"]
            )
        except ClientError as exc:
            if _error_code(exc) in _MISSING or _status(exc) == 404:
                raise FileNotFoundError(name) from None
            raise _unavailable(exc, "read") from exc
        except _AWAY as exc:
            raise _unavailable(exc, "read") from exc

    def attaches_identity(self) -> bool:
        """An object's user metadata carries its job's identity (2 KB a PUT)."""
        return True

    def read_identity(self, name: str) -> bytes | None:
        """The identity the object carries, or None (none, no such object, unreadable)."""
        try:
            head = self.client.head_object(Bucket=self.bucket_name, Key=self._key(name))
            value = (head.get("Metadata") or {}).get(manifests.METADATA)
            return base64.b64decode(value) if value else None
        except (ClientError, ValueError, *_AWAY):
            return None

    def stored_sha256(self, name: str) -> str | None:
        """The SHA-256 the store recorded at upload (hex), or None if it has none.

        FileNotFoundError if there is no such object; ``StorageUnavailable`` when the
        store cannot answer now.
        """
        try:
            head = self.client.head_object(
                Bucket=self.bucket_name, Key=self._key(name), ChecksumMode="ENABLED"
            )
        except ClientError as exc:
            if _error_code(exc) in _MISSING or _status(exc) == 404:
                raise FileNotFoundError(name) from None
            raise _unavailable(exc, "read") from exc
        except _AWAY as exc:
            raise _unavailable(exc, "read") from exc
        value = head.get("ChecksumSHA256")
        if not value or "-" in value:  # a multipart composite checksum is not the object's
            return None
        return base64.b64decode(value).hex()

    def probe_exclusive_create(self) -> str | None:
        """Create a probe object twice; what is wrong, or None if the second was refused.

        The probe key is unique per call (host and a random part), so probes from several
        hosts starting at once do not meet; it is deleted afterwards.
        """
        name = f"{PROBE_FOLDER}/{conf.host_name()}-{secrets.token_hex(8)}"
        try:
            if not self.create_exclusive(name, b"first"):
                return "a conditional create of a new key was refused"
            if self.create_exclusive(name, b"second"):
                return (
                    "a second conditional create (If-None-Match: *) of one key was accepted: "
                    "the store overwrites silently"
                )
            with self.open_stream(name) as body:
                if body.read() != b"first":
                    return "the first bytes of the probe were not kept"
            return None
        finally:
            with contextlib.suppress(ClientError, BotoCoreError):
                self.client.delete_object(Bucket=self.bucket_name, Key=self._key(name))
