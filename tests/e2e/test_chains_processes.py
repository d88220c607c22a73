"""A group and its join under real ``qcluster`` processes killed at random (issue 31,
acceptance 2).

Two parents (tests/testapp/kinds.py ``test.e2e_parent``) each return a group of three
children and a join. Group A's children all work about a second in heartbeated slices;
in group B one child kills its own worker on every attempt (its own kind, a budget of 2),
so it ends ``dead`` and the join kind's rule (``fail``) makes B's join born failed.
While they run, a chaos thread SIGKILLs the worker process of a random running job
every half second or so, at most twice per job so every budget (6) outlasts it
(django-q2's sentinel starts another worker; the 2 s lease runs out; the dispatcher
re-drives the job).

Checked from outside the workers' memory: every child and each join exists once (by
identity), every job ended once (one succeeded attempt at most, never two outcomes),
the join's input (written by it to a file) has all three children's results, and B's
join never ran.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import threading
from collections import Counter

import pytest

from jobs.models import Attempt, Job, JobGroup
from tests.e2e.processes import job_table, wait_until
from tests.jobs.helpers import request_job
from tests.testapp.kinds import CHAIN_JOIN, CHAIN_PARENT

pytestmark = [
    pytest.mark.drill,  # about 16 s of real processes: in `make drills`
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
]


KILLS_PER_JOB = 2


def _pid(worker: str) -> int | None:
    host, pid, _nonce = worker.rsplit(":", 2)
    return int(pid) if host == socket.gethostname() else None


class Chaos(threading.Thread):
    """SIGKILL the worker of a random running job now and then; count the kills."""

    def __init__(self, procs, clusters, rng: random.Random):
        super().__init__(daemon=True)
        self.procs, self.clusters, self.rng = procs, clusters, rng
        self.stop = threading.Event()
        self.kills: list[tuple[int, str]] = []  # (job id, kind) whose worker was killed

    def run(self) -> None:
        from django.db import connection

        try:
            while not self.stop.wait(self.rng.uniform(0.3, 0.8)):
                running = list(
                    Attempt.objects.filter(
                        outcome="", number__gt=0, job__state="running"
                    ).values_list("job_id", "job__kind", "worker")
                )
                if not running:
                    continue
                job_id, kind, worker = self.rng.choice(running)
                if sum(k == job_id for k, _ in self.kills) >= KILLS_PER_JOB:
                    continue  # the budget (6) must outlast the chaos
                pid = _pid(worker)
                owner = self.procs.owner_of(pid) if pid else None
                if owner in self.clusters and pid != owner.pid:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        self.kills.append((job_id, kind))
                    except ProcessLookupError:
                        pass
        finally:
            connection.close()


def test_group__three_children_and_a_join_under_random_sigkills(procs, tmp_path):
    runs_file = tmp_path / "runs.txt"
    clusters = [procs.start(f"qcluster-{n}", "qcluster") for n in "abc"]
    procs.start("dispatcher", "jobs_dispatcher", "--interval", "0.2")
    common = {"runs_file": str(runs_file), "sleep": 1.0}
    a, _ = request_job(
        CHAIN_PARENT, subject_type="test", subject_id="A", params={**common, "modes": ["ok"] * 3}
    )
    b, _ = request_job(
        CHAIN_PARENT,
        subject_type="test",
        subject_id="B",
        params={**common, "modes": ["ok", "die", "ok"]},
    )
    chaos = Chaos(procs, clusters, random.Random(int(os.environ.get("CHAOS_SEED", "31"))))
    chaos.start()

    def both_joined() -> bool:
        joins = Job.objects.filter(kind=CHAIN_JOIN, parent__in=[a, b])
        return joins.count() == 2 and all(j.is_terminal for j in joins)

    try:
        wait_until(procs, "both joins to end", both_joined, timeout=240, interval=0.2)
    finally:
        chaos.stop.set()
        chaos.join(10)
    print(f"\n{len(chaos.kills)} workers SIGKILLed: {Counter(k for _, k in chaos.kills)}")
    print(job_table())

    lines = runs_file.read_text().splitlines()
    for parent, states in ((a, ["succeeded"] * 3), (b, ["succeeded", "dead", "succeeded"])):
        group = JobGroup.objects.get(parent=parent)  # one group per parent and name
        children = list(Job.objects.filter(group=group).order_by("pk"))
        assert [c.subject_id for c in children] == [f"{parent.pk}.g.c{n}" for n in range(3)]
        assert [c.state for c in children] == states
        assert (group.ended, group.version) == (3, 3), "each child's end counted once"
        joins = Job.objects.filter(subject_type="jobs.group", subject_id=str(group.pk))
        assert joins.count() == 1 and group.join_id == joins[0].pk
        for job in [Job.objects.get(pk=parent.pk), *children, group.join]:
            won = Attempt.objects.filter(job=job, outcome=Attempt.Outcome.SUCCEEDED).count()
            assert won == (1 if job.state == Job.State.SUCCEEDED else 0), (job, won)
        assert Job.objects.filter(parent=parent).count() == 4  # three children and a join

    join_a = JobGroup.objects.get(parent=a).join
    assert join_a.state == Job.State.SUCCEEDED
    ran = [json.loads(x.split("joined=", 1)[1]) for x in lines if f"join job={join_a.pk} " in x]
    assert ran, "the join wrote what it read"
    assert ran[-1] == [
        ["c0", "succeeded", {"n": 0, "square": 0}],
        ["c1", "succeeded", {"n": 1, "square": 1}],
        ["c2", "succeeded", {"n": 2, "square": 4}],
    ]
    assert join_a.result == {"squares": 5}

    join_b = JobGroup.objects.get(parent=b).join
    assert join_b.state == Job.State.FAILED and join_b.last_error_code == "children_failed"
    assert "1 of 3 children did not succeed (c1 dead)" in join_b.last_error_detail
    assert not [x for x in lines if f"join job={join_b.pk} " in x], "B's join never ran"
    assert not Attempt.objects.filter(job=join_b).exists()
    print(
        f"A: children {[c.state for c in Job.objects.filter(group__parent=a)]}, join "
        f"{join_a.state} with {ran[-1]}; B: join {join_b.state} ({join_b.last_error_detail}); "
        f"handler runs: {Counter(x.split()[0] for x in lines)}"
    )
