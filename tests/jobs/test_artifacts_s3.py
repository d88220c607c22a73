"""Artifacts on a real S3-compatible server (issue 23): moto's server over HTTP on loopback.

The same promises as on the filesystem: an exclusive create refuses a name that is
taken and keeps the first bytes; every read is verified (streamed, never an
unverified byte out); a stale worker adds an orphan, never a rewrite; a restore puts
back the published bytes; a corrupted object is refused. Plus the server itself: it
must answer 412 to a second ``If-None-Match: *`` create, or the store is refused at
start-up (jobs.E031).
"""

from __future__ import annotations

import ast
import hashlib
import secrets
from pathlib import Path

import pytest
from django.contrib.auth.models import Group
from django.test import Client

from jobs import artifacts, manifests, registry, retention
from jobs.delivery.runner import run_delivery
from jobs.exceptions import ArtifactCorrupt
from jobs.models import Artifact
from jobs.restore import restore_artifact
from jobs.storage_s3 import S3Storage
from jobs.testing.s3server import honours_conditional_create, threaded_moto_server
from permits.services import report_request
from tests.jobs import test_artifacts_write_once as write_once
from tests.jobs.helpers import new_job
from tests.permits import factories


@pytest.fixture(scope="session")
def s3_server():
    with threaded_moto_server() as server:
        yield server


@pytest.fixture
def bucket(s3_server, settings):
    """A fresh bucket on the server, configured as the artifact storage.

    Deliveries get a 15 s lease: at the test settings' 2 s a worker's own lease can run
    out on a loaded machine while it uploads over HTTP (stale workers time-travel).
    """
    settings.JOBS_LEASE_SECONDS = 15
    name = s3_server.create_bucket(f"artifacts-{secrets.token_hex(4)}")
    settings.STORAGES = {**settings.STORAGES, "artifacts": s3_server.storage_options(name)}
    artifacts._probed.clear()
    return name


def object_bytes(s3_server, bucket: str, name: str) -> bytes:
    return s3_server.client().get_object(Bucket=bucket, Key=name)["Body"].read()


def overwrite(s3_server, bucket: str, name: str, data: bytes) -> None:
    """What a disk fault or a careless operator does: other bytes under the name."""
    s3_server.client().put_object(Bucket=bucket, Key=name, Body=data)


def test_server__a_second_conditional_create_is_refused_with_412(s3_server, bucket):
    honoured, status = honours_conditional_create(s3_server, bucket)
    assert (honoured, status) == (True, 412)


def test_create_exclusive__second_create_of_a_name_refused_first_bytes_kept(s3_server, bucket):
    storage = artifacts.get_storage()
    assert isinstance(storage, S3Storage)
    assert storage.create_exclusive("jobs/x/one.txt", b"first") is True
    assert storage.create_exclusive("jobs/x/one.txt", b"second") is False
    assert object_bytes(s3_server, bucket, "jobs/x/one.txt") == b"first"
    assert storage.stored_sha256("jobs/x/one.txt") == hashlib.sha256(b"first").hexdigest()


def test_check__bucket_honours_conditional_creates__no_error(bucket):
    assert artifacts.check_exclusive_create() == []


def test_check__store_that_overwrites_silently__refused(bucket, monkeypatch):
    put = S3Storage._put

    def ignores_conditions(self, name, data, **conditions):  # a store without If-None-Match
        return put(self, name, data)

    monkeypatch.setattr(S3Storage, "_put", ignores_conditions)
    (error,) = artifacts.check_exclusive_create()
    assert error.id == "jobs.E031" and "overwrites silently" in error.msg


def test_check__unreachable_bucket__a_warning_the_outage_rule_covers(s3_server, settings):
    """A store away at start-up does not stop a host from starting: jobs wait it out."""
    options = s3_server.storage_options("no-such-bucket")
    options["OPTIONS"]["endpoint_url"] = "http://127.0.0.1:9"  # nothing listens there
    settings.STORAGES = {**settings.STORAGES, "artifacts": options}
    artifacts._probed.clear()
    (error,) = artifacts.check_exclusive_create()
    assert error.id == "jobs.W017" and "did not answer" in error.msg


@pytest.mark.django_db
def test_store__identical_bytes_reused_other_bytes_never_overwrite(s3_server, bucket):
    job = new_job(kind="test.steps")
    first = artifacts.store(job, b"one", content_type="text/plain", extension="txt")
    name = first.artifact.storage_name
    again = artifacts.store(job, b"one", content_type="text/plain", extension="txt")
    assert (again.artifact.storage_name, again.reused) == (name, True)

    overwrite(s3_server, bucket, name, b"torn")
    third = artifacts.store(job, b"one", content_type="text/plain", extension="txt")
    assert third.artifact.storage_name != name and not third.reused
    assert object_bytes(s3_server, bucket, name) == b"torn", "never overwritten"
    assert artifacts.read_verified(third.artifact) == b"one"


@pytest.mark.django_db
def test_store__the_jobs_identity_rides_in_the_objects_put_no_manifest_object(s3_server, bucket):
    job = new_job(kind="test.steps")
    stored = artifacts.store(job, b"one", content_type="text/plain", extension="txt")
    storage = artifacts.get_storage()
    data = artifacts.read_identity(storage, stored.artifact.storage_name)
    assert data == manifests.body_for(job)
    assert manifests.parse_attached(data, str(job.uid), job.output_revision).kind == "test.steps"
    keys = {o["Key"] for o in s3_server.client().list_objects_v2(Bucket=bucket).get("Contents", [])}
    assert not any(manifests.is_manifest(k) for k in keys), "one PUT a job, not two"
    assert artifacts.read_identity(storage, "jobs/no-such-object") is None


@pytest.mark.django_db
def test_open_verified__streams_large_object_through_a_spool(bucket):
    job = new_job(kind="test.steps")
    data = secrets.token_bytes(3 * artifacts.SPOOL_MEMORY + 17)
    stored = artifacts.store(job, data, content_type="application/octet-stream", extension="bin")
    with artifacts.open_verified(stored.artifact) as fh:
        assert fh._rolled, "past SPOOL_MEMORY the spool is a temporary file, not memory"
        assert hashlib.sha256(fh.read()).hexdigest() == stored.artifact.sha256


@pytest.mark.django_db
def test_open_verified__corrupted_or_missing_object__refused(s3_server, bucket):
    job = new_job(kind="test.steps")
    stored = artifacts.store(job, b"published", content_type="text/plain", extension="txt")
    artifact = stored.artifact
    overwrite(s3_server, bucket, artifact.storage_name, b"forged!!!")
    with pytest.raises(ArtifactCorrupt):
        artifacts.open_verified(artifact)
    assert not artifacts.is_intact(artifact)
    s3_server.client().delete_object(Bucket=bucket, Key=artifact.storage_name)
    with pytest.raises(ArtifactCorrupt):
        artifacts.read_verified(artifact)


# --- the stale worker of issue 18, on S3 -------------------------------------------------


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("pause_at", ["rendered", "artifact_stored"])
def test_stale_worker__published_bytes_stay_the_winners_on_s3(
    s3_server, bucket, pause_at, settings
):
    registry.register_kind(write_once.KIND, write_once.per_worker)
    job, seen = write_once.stale_worker_race(pause_at)
    assert seen["A"].outcome == "lease_lost"
    (row,) = Artifact.objects.filter(job=job)
    expected = write_once.bytes_of("B", job)
    assert row.storage_name == seen["names"]["B"] != seen["names"]["A"]
    assert row.sha256 == artifacts.sha256_hex(expected)
    assert artifacts.read_verified(row) == expected
    assert object_bytes(s3_server, bucket, row.storage_name) == expected
    # A's bytes went to their own object (an orphan), never over B's.
    assert object_bytes(s3_server, bucket, seen["names"]["A"]) == write_once.bytes_of("A", job)
    # The orphan is pruned through the Storage API (listing the bucket); B's object stays.
    settings.JOBS_ORPHAN_GRACE_SECONDS = 0
    assert retention.prune_orphans() == 1
    keys = {o["Key"] for o in s3_server.client().list_objects_v2(Bucket=bucket).get("Contents", [])}
    keys = {k for k in keys if not manifests.is_manifest(k)}  # the job's identity stays
    assert keys == {row.storage_name}


# --- a report: corrupted, refused at download, restored, downloaded (streamed) -------------


@pytest.mark.django_db
def test_report__corrupted_object_refused_then_restored_and_streamed(s3_server, bucket, make_user):
    reviewer = make_user(username="s3-reviewer")
    reviewer.groups.add(Group.objects.get(name="reviewers"))
    permit = factories.permit(reviewer=reviewer)
    job, _ = report_request(permit)
    assert run_delivery(job.pk).outcome == "succeeded"
    artifact = Artifact.objects.get(job=job)
    published = object_bytes(s3_server, bucket, artifact.storage_name)
    assert hashlib.sha256(published).hexdigest() == artifact.sha256

    client = Client()
    client.force_login(reviewer)
    overwrite(s3_server, bucket, artifact.storage_name, b"%PDF-1.4 forged")
    response = client.get(f"/requests/{permit.pk}/report/")
    assert response.status_code == 503 and b"forged" not in response.content

    assert restore_artifact(artifact.pk) == "restored"
    assert object_bytes(s3_server, bucket, artifact.storage_name) == published
    artifact.refresh_from_db()
    assert artifact.state == Artifact.State.STORED and artifact.rewrites == 1

    response = client.get(f"/requests/{permit.pk}/report/")
    assert response.status_code == 200 and response.streaming
    assert b"".join(response.streaming_content) == published


# --- boto3 stays out of the engine unless S3 is configured ---------------------------------


def test_imports__only_storage_s3_imports_boto3_or_storages():
    jobs_dir = Path(artifacts.__file__).resolve().parent
    offenders = []
    for path in jobs_dir.rglob("*.py"):
        if path.name == "storage_s3.py" or "testing" in path.parts:
            continue
        for node in ast.parse(path.read_text()).body:  # module level only
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            offenders += [
                f"{path.name}: {n}"
                for n in names
                if n.split(".")[0] in ("boto3", "botocore", "storages", "moto")
                or n == "jobs.storage_s3"
            ]
    assert offenders == []


@pytest.mark.django_db
def test_report__object_store_down_at_download__503_and_no_restore_asked(
    s3_server, bucket, settings, make_user
):
    from django_q.models import OrmQ

    reviewer = make_user(username="s3-down-reviewer")
    reviewer.groups.add(Group.objects.get(name="reviewers"))
    permit = factories.permit(reviewer=reviewer)
    job, _ = report_request(permit)
    assert run_delivery(job.pk).outcome == "succeeded"
    OrmQ.objects.all().delete()
    down = s3_server.storage_options(bucket)
    down["OPTIONS"]["endpoint_url"] = "http://127.0.0.1:9"  # the store stopped answering
    settings.STORAGES = {**settings.STORAGES, "artifacts": down}

    client = Client()
    client.force_login(reviewer)
    response = client.get(f"/requests/{permit.pk}/report/")
    assert response.status_code == 503 and response["Retry-After"] == "60"
    assert not any("restore" in m.func() for m in OrmQ.objects.all()), "nothing is corrupt"


@pytest.mark.django_db
def test_report__object_store_breaks_off_mid_read__503_and_no_restore_asked(
    s3_server, bucket, make_user, monkeypatch, caplog
):
    """The connection drops after the first chunk: the store's failure, not a corrupt file."""
    import urllib3
    from django_q.models import OrmQ

    reviewer = make_user(username="s3-midread-reviewer")
    reviewer.groups.add(Group.objects.get(name="reviewers"))
    permit = factories.permit(reviewer=reviewer)
    job, _ = report_request(permit)
    assert run_delivery(job.pk).outcome == "succeeded"
    OrmQ.objects.all().delete()
    real_read = urllib3.response.HTTPResponse.read
    reads = []

    def breaks_off(self, *args, **kwargs):
        reads.append(1)
        if len(reads) > 1:
            raise urllib3.exceptions.ProtocolError("Connection broken: reset by peer")
        return real_read(self, *args, **kwargs)

    monkeypatch.setattr(urllib3.response.HTTPResponse, "read", breaks_off)
    monkeypatch.setattr(artifacts, "CHUNK", 64)  # the report is read in several chunks
    client = Client()
    client.force_login(reviewer)
    response = client.get(f"/requests/{permit.pk}/report/")
    assert len(reads) > 1, "the read broke off after its first chunk"
    assert response.status_code == 503 and response["Retry-After"] == "60"
    assert not any("restore" in m.func() for m in OrmQ.objects.all()), "nothing is corrupt"
    assert Artifact.objects.get(job=job).state == Artifact.State.STORED
    assert "storage unavailable at download" in caplog.text
    assert "failed its sha256 check" not in caplog.text


# --- the store away: every failure is StorageUnavailable, an outage the job waits out ----


@pytest.fixture
def relayed(s3_server, bucket, settings):
    """The artifact storage reached through a TCP relay in front of the server (down, stall),
    with boto3's own retries and timeouts short so a test sees each failure at once."""
    from botocore.config import Config

    from tests.chaos.dbproxy import DatabaseProxy

    host, port = s3_server.endpoint.removeprefix("http://").split(":")
    relay = DatabaseProxy(host, int(port)).start()
    options = s3_server.storage_options(bucket)
    options["OPTIONS"]["endpoint_url"] = f"http://127.0.0.1:{relay.port}"
    options["OPTIONS"]["client_config"] = Config(
        connect_timeout=1,
        read_timeout=1,
        retries={"max_attempts": 1, "mode": "standard"},
        s3={"addressing_style": "path"},
    )
    settings.STORAGES = {**settings.STORAGES, "artifacts": options}
    yield relay
    relay.close()


def _outage_of(call) -> str:
    from jobs.exceptions import StorageUnavailable
    from jobs.retry import classify

    with pytest.raises(StorageUnavailable) as raised:
        call()
    c = classify(raised.value)
    assert c.outage and c.code == "storage_unavailable", c
    assert "127.0.0.1" not in str(raised.value), "no endpoint, bucket or key in the text"
    return str(raised.value)


@pytest.mark.parametrize("fault", ["refused", "hung"])
def test_store_away__create_and_read_are_storage_unavailable_then_work_again(relayed, fault):
    storage = artifacts.get_storage()
    assert storage.create_exclusive("jobs/x/before.txt", b"before") is True
    relayed.down() if fault == "refused" else relayed.stall()
    created = _outage_of(lambda: storage.create_exclusive("jobs/x/during.txt", b"during"))
    read = _outage_of(lambda: storage.open_stream("jobs/x/before.txt").read())
    _outage_of(lambda: storage.stored_sha256("jobs/x/before.txt"))
    expected = "EndpointConnectionError" if fault == "refused" else "ReadTimeoutError"
    assert expected in created and expected in read, (created, read)
    relayed.up() if fault == "refused" else relayed.flow()
    assert storage.create_exclusive("jobs/x/during.txt", b"during") in (True, False)
    with storage.open_stream("jobs/x/before.txt") as body:
        assert body.read() == b"before"


@pytest.mark.parametrize("status", [500, 503])
def test_store_away__a_5xx_answer_is_storage_unavailable(bucket, monkeypatch, status):
    from botocore.exceptions import ClientError

    def answers_5xx(self, name, data, **conditions):
        code = {500: "InternalError", 503: "SlowDown"}[status]
        raise ClientError(
            {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
            "PutObject",
        )

    monkeypatch.setattr(S3Storage, "_put", answers_5xx)
    storage = artifacts.get_storage()
    text = _outage_of(lambda: storage.create_exclusive("jobs/x/five.txt", b"x"))
    assert text in (
        "object storage create failed (InternalError)",
        "object storage create failed (SlowDown)",
    )


@pytest.mark.django_db
def test_store_away__a_delivery_waits_without_spending_an_attempt_then_succeeds(relayed):
    """One process, no workers: the delivery meets the store refusing, waits, then publishes."""
    from jobs.models import Job

    job = new_job(kind="test.short")
    relayed.down()
    for _ in range(job.max_attempts + 1):  # more tries than the whole budget
        assert run_delivery(job.pk, worker="w1").outcome == "retry"
        job.refresh_from_db()
        assert job.state == Job.State.RETRY_WAIT and job.last_error_code == "storage_unavailable"
        Job.objects.filter(pk=job.pk).update(next_attempt_at=job.created_at)
    assert job.max_attempts == 3 + 4, "the budget grew by every attempt the outage cost"
    relayed.up()
    assert run_delivery(job.pk, worker="w1").outcome == "succeeded"
    job.refresh_from_db()
    assert job.state == Job.State.SUCCEEDED and (job.attempts, job.max_attempts) == (5, 7)
