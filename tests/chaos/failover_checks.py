"""The failover drill's verdict (issue 47): one small function per promise, each returning
what it found. They read the servers (the promoted one and the old primary, restarted on
its own after the drill as the record of what it had), the bucket and the stand-in
provider's record, never the engine's counters.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from tests.chaos.pgcluster import Server

FOLDER = "jobs/"
NOT_ARTIFACTS = ("jobs/.identity/", "jobs/.probe/")  # identity manifests, the probe


@dataclass
class Rows:
    """A server's jobs, effects and artifacts, keyed by the identities that leave it."""

    jobs: dict[str, tuple]  # uid -> (id, kind, subject_type, subject_id, revision, state, rec)
    effects: dict[str, tuple]  # effect id -> (key, job uid, state, provider, ref)
    artifacts: dict[str, tuple]  # artifact key -> (storage name, job uid)

    def identity(self, uid: str) -> tuple | None:
        job = self.jobs.get(uid)
        return None if job is None else job[1:5]


def read_rows(server: Server) -> Rows:
    jobs = {
        r[0]: r[1:]
        for r in server.query(
            "SELECT uid::text, id, kind, subject_type, subject_id, output_revision, state,"
            " reconciled_at IS NOT NULL FROM jobs_job"
        )
    }
    effects = {
        r[0]: r[1:]
        for r in server.query(
            "SELECT e.effect_id, e.idempotency_key, j.uid::text, e.state, e.provider,"
            " e.provider_ref FROM jobs_effect e JOIN jobs_job j ON j.id = e.job_id"
        )
    }
    artifacts = {
        r[0]: r[1:]
        for r in server.query(
            "SELECT a.key, a.storage_name, j.uid::text FROM jobs_artifact a"
            " JOIN jobs_job j ON j.id = a.job_id"
        )
    }
    return Rows(jobs, effects, artifacts)


@dataclass
class Verdict:
    failures: list[str] = field(default_factory=list)
    figures: dict = field(default_factory=dict)

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(what)


def _uid_of(effect_id: str) -> str:
    return effect_id.split(":", 1)[0]


def reused_identities(old: Rows, new: Rows, provider_requests: list[dict]) -> list[str]:
    """Identities (uid, effect id, key, artifact key, object name) that name one job's
    output on the old primary and another's on the promoted one, and keys the provider
    saw with two bodies (409)."""
    found = []
    for uid in old.jobs.keys() & new.jobs.keys():
        if old.identity(uid) != new.identity(uid):
            found.append(f"uid {uid}")
    both = {**old.effects}
    for effect_id, row in new.effects.items():
        before = both.get(effect_id)
        if before is not None and old.identity(before[1]) != new.identity(row[1]):
            found.append(f"effect {effect_id}")
    old_keys = {row[0]: row[1] for row in old.effects.values()}
    for row in new.effects.values():
        if row[0] in old_keys and old.identity(old_keys[row[0]]) != new.identity(row[1]):
            found.append(f"key of {row[1]}")
    old_names = {row[0]: row[1] for row in old.artifacts.values()}
    for key, row in new.artifacts.items():
        if key in old.artifacts and old.identity(old.artifacts[key][1]) != new.identity(row[1]):
            found.append(f"artifact key {key}")
        if row[0] in old_names and old.identity(old_names[row[0]]) != new.identity(row[1]):
            found.append(f"object {row[0]}")
    found += [
        f"key answered 409 ({r['effect_id']})" for r in provider_requests if r["status"] == 409
    ]
    return found


def repeated_row_ids(old: Rows, new: Rows) -> int:
    """Row ids the promoted server gave to another job than the old primary did (expected
    after an asynchronous failover: ids are handles, not identities)."""
    old_ids = {row[0]: uid for uid, row in old.jobs.items()}
    return sum(1 for uid, row in new.jobs.items() if old_ids.get(row[0], uid) != uid)


def lost_acknowledged(acknowledged: set[str], sent_uids: set[str], new: Rows) -> set[str]:
    """Jobs acknowledged to the outside (a request that returned, a notice the provider
    got: released only after the publish committed) that the promoted server lacks."""
    return (acknowledged | sent_uids) - new.jobs.keys()


def duplicate_notices(sends: list[dict], rows: list[Rows]) -> int:
    """Notices the provider applied more than once for one business outcome: one effect
    id under two keys, or one (kind, subject, revision, recipient) under two effect ids."""
    by_effect = Counter(s["effect_id"] for s in sends)
    twice = sum(n - 1 for n in by_effect.values() if n > 1)
    outcomes: Counter = Counter()
    for effect_id in by_effect:
        uid = _uid_of(effect_id)
        ident = next((r.identity(uid) for r in rows if r.identity(uid) is not None), None)
        outcomes[(ident or uid, effect_id.split(":", 2)[-1])] += 1
    return twice + sum(n - 1 for n in outcomes.values() if n > 1)


def orphans(objects: set[str], new: Rows) -> list[str]:
    """Objects under ``jobs/`` no artifact row of the promoted server names."""
    named = {row[0] for row in new.artifacts.values()}
    return sorted(o for o in objects if o not in named and not o.startswith(NOT_ARTIFACTS))


def unsettled(new: Rows) -> list[str]:
    """Jobs not succeeded and effects not applied, on the promoted server."""
    jobs = [f"job {row[0]} {row[5]}" for row in new.jobs.values() if row[5] != "succeeded"]
    effects = [f"effect {e} {row[2]}" for e, row in new.effects.items() if row[2] != "applied"]
    return jobs + effects


def with_evidence(lost: set[str], objects: set[str], sends: list[dict]) -> set[str]:
    """The lost jobs the outside world has something of: an object (or manifest) in the
    bucket, a notice at the provider. The others left nothing outside to find."""
    seen = {_uid_of(s["effect_id"]) for s in sends}
    seen |= {u for u in lost if any(f"job-{u}-rev-" in o for o in objects)}
    return lost & seen


def second_sends(sends: list[dict], requests: list[dict], *, before: float) -> tuple[int, int]:
    """(second sends, replays) for keys the provider applied before ``before``: a POST
    after it under such a key that applied anew or was refused as another body (409)
    is a second send; one answered 200 (a replay, same body, same id) is a replay."""
    accepted = {s["idempotency_key"] for s in sends if s["applied_at"] < before}
    later = [r for r in requests if r["received_at"] >= before and r["idempotency_key"] in accepted]
    second = sum(1 for r in later if r["status"] in (201, 409))
    replays = sum(1 for r in later if r["status"] == 200)
    return second, replays
