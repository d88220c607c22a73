"""A real S3-compatible server on loopback for tests, drills and benchmarks: moto's server.

Not in-process patching: boto3 talks HTTP to ``http://127.0.0.1:PORT`` as it would to
S3 or MinIO. ``ThreadedMotoServer`` runs it in a thread of this process (tests);
``moto_server_process`` runs ``python -m moto.server`` as a process of its own
(drills, where several processes share it and this one must stay light).

``honours_conditional_create`` asks the server what the artifact store relies on: a
second ``PutObject`` with ``If-None-Match: *`` must be refused with 412.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from jobs.testing.proctree import stop

# Any non-empty credentials do for moto; real deployments take them from the environment.
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@dataclass(frozen=True)
class S3Server:
    endpoint: str

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2}),
        )

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def storage_options(self, bucket: str) -> dict:
        """``STORAGES['artifacts']`` for ``jobs.storage_s3.S3Storage`` on this server."""
        return {
            "BACKEND": "jobs.storage_s3.S3Storage",
            "OPTIONS": {
                "bucket_name": bucket,
                "endpoint_url": self.endpoint,
                "region_name": "us-east-1",
                "addressing_style": "path",
                "access_key": CREDENTIALS["AWS_ACCESS_KEY_ID"],
                "secret_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                "file_overwrite": False,
                "default_acl": None,
            },
        }

    def environment(self, bucket: str) -> dict[str, str]:
        """The environment that points ``permits.settings`` at this server's ``bucket``."""
        return {
            **CREDENTIALS,
            "ARTIFACT_S3_BUCKET": bucket,
            "ARTIFACT_S3_ENDPOINT_URL": self.endpoint,
            "ARTIFACT_S3_REGION": "us-east-1",
            "ARTIFACT_S3_ADDRESSING_STYLE": "path",
        }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_up(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.1)
    raise RuntimeError(f"the S3 server on port {port} did not start in {timeout:g} s")


@contextlib.contextmanager
def threaded_moto_server() -> Iterator[S3Server]:
    """moto's server on a loopback port, in a thread of this process."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        _wait_until_up(port)
        yield S3Server(f"http://127.0.0.1:{port}")
    finally:
        server.stop()


@contextlib.contextmanager
def moto_server_process(log_path: str | os.PathLike | None = None) -> Iterator[S3Server]:
    """``python -m moto.server`` on a loopback port, as a process group of its own."""
    port = free_port()
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    if log_path:
        log.close()
    try:
        _wait_until_up(port)
        yield S3Server(f"http://127.0.0.1:{port}")
    finally:
        stop(proc)


def honours_conditional_create(server: S3Server, bucket: str) -> tuple[bool, int]:
    """Whether a second ``If-None-Match: *`` create is refused; and the HTTP status seen."""
    from botocore.exceptions import ClientError

    client = server.client()
    key = f"probe/conditional-{time.monotonic_ns()}"
    client.put_object(Bucket=bucket, Key=key, Body=b"first", IfNoneMatch="*")
    try:
        client.put_object(Bucket=bucket, Key=key, Body=b"second", IfNoneMatch="*")
    except ClientError as exc:
        status = exc.response["ResponseMetadata"]["HTTPStatusCode"]
        kept = client.get_object(Bucket=bucket, Key=key)["Body"].read() == b"first"
        return status == 412 and kept, status
    finally:
        client.delete_object(Bucket=bucket, Key=key)
    return False, 200
