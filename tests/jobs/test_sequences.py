"""Sequences (docs/app/sequences.md) on PostgreSQL with real threads: each thread has its
own connection and does what a worker does (the queue's next-job claim, then the
delivery: ``jobs.delivery.runner.run_claim``), so the claims race as hosts' do.

What is checked: one key's jobs start in request order, one at a time; a job does not
start while the job before it has an effect pending, sending or unknown; a dead job
holds its key (``on_failure="hold"``) until an operator's release, and ``"skip"`` goes on
by itself; the claim's look at the held heads reads one row per blocked key.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import pytest
from django.db import connections
from django.db.models import F
from django.db.models.functions import Now

import jobs
from jobs import sequences
from jobs.delivery.runner import run_claim
from jobs.models import SEQUENCE_HELD, Attempt, Effect, Job, JobEvent
from jobs.registry import EffectSpec, kinds, register_kind
from tests.jobs.helpers import claim_next, scans_of

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

KIND, SKIP_KIND, MAIL_KIND = "test.seq.run", "test.seq.skip", "test.seq.mail"
THREADS = 4

_running: dict[str, int] = {}
_overlaps: list[tuple[str, int, int]] = []
_guard = threading.Lock()


def _work(ctx) -> list:
    """A sequenced job's work: it fails when asked to, and notes overlapping starts."""
    key = ctx.params["key"]
    with _guard:
        if key in _running:
            _overlaps.append((key, _running[key], ctx.job.pk))
        _running[key] = ctx.job.pk
    time.sleep(0.01)
    with _guard:
        _running.pop(key, None)
    if ctx.params.get("boom"):
        raise RuntimeError("boom")
    return []


def _mail(ctx) -> list[EffectSpec]:
    return [EffectSpec("seq-mail", "email", str(ctx.params["to"]))]


def _key(params: dict, subject: tuple[str, str]) -> str:
    return params["key"]


OTHER_QUEUE, OTHER_QUEUE_KIND = "seq-other", "test.seq.other_queue"

if KIND not in kinds():
    register_kind(KIND, _work, max_attempts=1, sequence=_key)
    register_kind(OTHER_QUEUE_KIND, _work, max_attempts=1, sequence=_key, queue=OTHER_QUEUE)
    register_kind(SKIP_KIND, _work, max_attempts=1, sequence=_key, on_failure="skip")
    register_kind(MAIL_KIND, _mail, sequence=_key)


class Workers:
    """``THREADS`` threads claiming the default queue and running what they claim."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def _run(self, name: str) -> None:
        try:
            while not self.stop.is_set():
                claim = claim_next("default", name)
                if claim is None or not claim.won:
                    time.sleep(0.01)
                    continue
                with self.lock:
                    self.started.append(claim.job.pk)
                run_claim(claim, name)
        finally:
            connections["default"].close()

    def run_for(self, seconds: float, *, until=None) -> list[int]:
        """Claim for ``seconds`` (or until ``until()`` holds); the job ids started."""
        threads = [threading.Thread(target=self._run, args=(f"w{i}",)) for i in range(THREADS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not (until and until()):
            time.sleep(0.05)
        self.stop.set()
        for t in threads:
            t.join(60)
        return list(self.started)


def _ask(kind: str, subject: str, key: str, **params) -> Job:
    return jobs.request(kind, ("seq", subject), params={"key": key, **params}).job


def test_sequence__one_keys_jobs_start_in_request_order_one_at_a_time():
    _overlaps.clear()
    made = defaultdict(list)
    for i in range(6):  # 5 keys x 6 jobs, asked for key after key
        for k in range(5):
            made[f"k{k}"].append(_ask(KIND, f"{k}-{i}", f"k{k}").pk)
    total = sum(len(v) for v in made.values())
    finished = Job.objects.filter(kind=KIND, state=Job.State.SUCCEEDED)
    started = Workers().run_for(60, until=lambda: finished.count() == total)
    assert finished.count() == total
    assert _overlaps == [], "two jobs of one key ran at once"
    assert len(started) == total and len(set(started)) == total
    for key, ids in made.items():
        assert [j for j in started if j in ids] == ids, f"{key} started out of request order"
        # By the server's clock: each job started after the one before it finished.
        rows = Job.objects.filter(pk__in=ids).order_by("pk").values_list("pk", "finished_at")
        starts = dict(Attempt.objects.filter(job_id__in=ids).values_list("job_id", "started_at"))
        previous = None
        for pk, finished_at in rows:
            assert previous is None or starts[pk] >= previous, key
            previous = finished_at


def test_sequence__an_unsettled_effect_holds_the_next_job(django_user_model):
    user = django_user_model.objects.create_user(username="seq-mail")
    first = _ask(MAIL_KIND, "m-1", "mail", to=user.pk)
    second = _ask(MAIL_KIND, "m-2", "mail", to=user.pk)
    assert Job.objects.get(pk=second.pk).held_by == SEQUENCE_HELD
    ran = Workers().run_for(30, until=lambda: Effect.objects.filter(job=first).exists())
    assert ran == [first.pk]
    effect = Effect.objects.get(job=first)
    for state in (Effect.State.PENDING, Effect.State.SENDING, Effect.State.UNKNOWN):
        Effect.objects.filter(pk=effect.pk).update(state=state, version=F("version") + 1)
        assert Workers().run_for(1.5) == [], f"started while the effect was {state}"
        assert Job.objects.get(pk=second.pk).state == Job.State.QUEUED
    (blocked,) = sequences.blocked()
    assert (blocked.holder.pk, blocked.head.pk, blocked.releasable) == (first.pk, second.pk, False)
    Effect.objects.filter(pk=effect.pk).update(state=Effect.State.APPLIED, applied_at=Now())
    assert Workers().run_for(30, until=lambda: Effect.objects.filter(job=second).exists()) == [
        second.pk
    ]


def test_sequence__a_dead_job_holds_its_key_until_an_operator_releases_it():
    a = _ask(KIND, "h-a", "hold", boom=True)
    b, c = _ask(KIND, "h-b", "hold"), _ask(KIND, "h-c", "hold")
    other = _ask(KIND, "h-x", "other")
    dead = Job.objects.filter(pk=a.pk, state=Job.State.DEAD)
    started = Workers().run_for(30, until=lambda: dead.exists())
    started += Workers().run_for(1.5)
    assert sorted(started) == sorted([a.pk, other.pk]), "b started behind a dead job"
    (blocked,) = sequences.blocked()
    assert (blocked.key, blocked.holder.pk, blocked.head.pk) == ("hold", a.pk, b.pk)
    assert blocked.releasable and blocked.waiting == 2
    assert sequences.release(dead.get(), operator="op1")
    assert not sequences.release(dead.get(), operator="op2"), "released once"
    done = Job.objects.filter(pk__in=[b.pk, c.pk], state=Job.State.SUCCEEDED)
    assert Workers().run_for(30, until=lambda: done.count() == 2) == [b.pk, c.pk]
    event = JobEvent.objects.get(job=a, action="release_sequence")
    assert (event.actor, event.from_state, event.to_state) == ("operator:op1", "dead", "dead")
    assert Job.objects.get(pk=a.pk).sequence_released_by == "operator:op1"
    assert sequences.blocked() == []


def test_sequence__skip_lets_a_failed_job_go_on_by_itself():
    a = _ask(SKIP_KIND, "s-a", "skip", boom=True)
    b = _ask(SKIP_KIND, "s-b", "skip")
    done = Job.objects.filter(pk=b.pk, state=Job.State.SUCCEEDED)
    assert Workers().run_for(30, until=done.exists) == [a.pk, b.pk]
    assert Job.objects.get(pk=a.pk).state == Job.State.DEAD


def test_sequence__concurrent_requests_of_one_key_keep_request_order():
    """Three threads ask for jobs of one key at once: each job's id (its place) is handed
    out under the key's lock, so the first job is the head and the others are held."""
    barrier = threading.Barrier(3)

    def ask(n: int) -> None:
        try:
            barrier.wait(10)
            for i in range(5):
                _ask(KIND, f"c-{n}-{i}", "concurrent")
        finally:
            connections["default"].close()

    threads = [threading.Thread(target=ask, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    rows = list(Job.objects.filter(sequence_key="concurrent").order_by("pk"))
    assert len(rows) == 15
    assert [r.held_by for r in rows] == [""] + [SEQUENCE_HELD] * 14


def test_release_heads__reads_one_row_per_blocked_key_not_its_backlog():
    from jobs.executors import pgclaim

    head = _ask(KIND, "b-0", "busy")
    Job.objects.filter(pk=head.pk).update(
        state=Job.State.RUNNING, lease_owner="w", attempts=1, lease_expires_at=Now()
    )
    for i in range(1, 400):
        _ask(KIND, f"b-{i}", "busy")
    _ask(KIND, "z-0", "zeta")
    with connections["default"].cursor() as cursor:
        cursor.execute("ANALYZE jobs_job")

    scans = scans_of(pgclaim._heads_statement(), pgclaim.heads_params())
    assert scans and max(rows for _, _, rows in scans) <= 2, scans
    with pytest.raises(ValueError, match="sequenced"):
        jobs.request_many([{"kind": KIND, "subject": ("seq", "many"), "params": {"key": "m"}}])


def _job_reads(plan: dict) -> list[tuple[str, str, int]]:
    """(node, index, rows read: produced and removed by its filter) of every jobs_job scan."""
    found = []
    if plan.get("Relation Name") == "jobs_job":
        read = plan["Actual Rows"] + plan.get("Rows Removed by Filter", 0)
        found.append((plan["Node Type"], plan.get("Index Name", ""), read * plan["Actual Loops"]))
    for child in plan.get("Plans", []):
        found += _job_reads(child)
    return found


def test_release_heads__finds_the_job_before_a_head_by_the_sequence_index():
    """Many jobs between a head and the job before it (other kinds, other keys, years of
    history): the release reads the one before through the sequence index, not the table."""
    from jobs.executors import pgclaim

    before = _ask(KIND, "k-0", "k")
    Job.objects.filter(pk=before.pk).update(
        state=Job.State.RUNNING, lease_owner="w", attempts=1, lease_expires_at=Now()
    )
    jobs.request_many([{"kind": "test.short", "subject": ("other", str(i))} for i in range(300)])
    head = _ask(KIND, "k-1", "k")
    assert head.held_by == SEQUENCE_HELD
    with connections["default"].cursor() as cursor:
        cursor.execute("ANALYZE jobs_job")
        cursor.execute("BEGIN")
        # With sequential scans priced out, a scan of the table means no index could do.
        cursor.execute("SET LOCAL enable_seqscan = off")
        sql = pgclaim._heads_statement(one_key=True)
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, pgclaim.heads_params("k"))
        [[plan]] = cursor.fetchone()
        cursor.execute("ROLLBACK")
    reads = _job_reads(plan["Plan"])
    assert all(node != "Seq Scan" for node, _, _ in reads), reads
    assert sum(rows for _, _, rows in reads) <= 4, reads


def test_release_heads__a_burst_not_yet_analyzed_is_read_once_not_per_held_job():
    """Right after a burst of requests the planner has no statistics: the look over every
    key still reads each held job a bounded number of times, not once per held job (the
    released rows' filter ran the whole look again for each: 2.4 s at 256 held)."""
    from jobs.executors import pgclaim

    keys, items = 40, 10
    jobs_ = [_ask(KIND, f"s-{k}-{i}", f"burst-{k}") for i in range(items) for k in range(keys)]
    Job.objects.filter(pk__in=[j.pk for j in jobs_[:keys]]).update(
        state=Job.State.RUNNING, lease_owner="w", attempts=1, lease_expires_at=Now()
    )
    held = keys * (items - 1)
    assert Job.objects.filter(held_by=SEQUENCE_HELD).count() == held
    with connections["default"].cursor() as cursor:
        cursor.execute("BEGIN")
        sql = pgclaim._heads_statement()
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, pgclaim.heads_params())
        [[plan]] = cursor.fetchone()
        cursor.execute("ROLLBACK")
    # Analyzed, a key costs its two probes. Not yet, the planner may walk the held jobs
    # for each key's probes (about 2 x keys x held here); the look run again for every
    # held job read 5,328,760.
    read = sum(rows for _, _, rows in _job_reads(plan["Plan"]))
    assert read <= 3 * keys * held, (read, _job_reads(plan["Plan"]))


def test_release_heads__one_key_probes_its_head_when_the_plan_thinks_nothing_is_held():
    """A plan made while the held index looked empty (analyzed before a burst, kept for a
    worker's connection): the one-key look still updates its head by a probe. By id
    alone the update walked every held job of every key after each send (1,986 rows a
    job in a bench drain of 2,000 held jobs)."""
    from jobs.executors import pgclaim

    jobs.request_many([{"kind": "test.short", "subject": ("other", str(i))} for i in range(20)])
    with connections["default"].cursor() as cursor:
        cursor.execute("ANALYZE jobs_job")  # nothing held: the held index looks empty
    keys, items = 30, 10
    made = [_ask(KIND, f"p-{k}-{i}", f"probe-{k}") for i in range(items) for k in range(keys)]
    Job.objects.filter(pk=made[0].pk).update(state=Job.State.SUCCEEDED, finished_at=Now())
    Job.objects.filter(pk=made[keys].pk).update(held_by=SEQUENCE_HELD)  # key 0's head again
    held = Job.objects.filter(held_by=SEQUENCE_HELD).count()
    assert held > 250
    with connections["default"].cursor() as cursor:
        cursor.execute("BEGIN")
        sql = pgclaim._heads_statement(one_key=True)
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, pgclaim.heads_params("probe-0"))
        [[plan]] = cursor.fetchone()
        cursor.execute("ROLLBACK")
    reads = _job_reads(plan["Plan"])
    assert plan["Plan"]["Actual Rows"] == 1, "key 0's head is released"
    assert max(rows for _, _, rows in reads) <= 3, (held, reads)


def _run_first(job: Job):
    claim = claim_next("default", "w1")
    assert claim is not None and claim.won and claim.job.pk == job.pk
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as delivery:
        run_claim(claim, "w1")
    return [q["sql"] for q in delivery]


def test_publish__releases_the_next_job_of_its_sequence_in_its_own_statement(monkeypatch):
    """The publish that lets the next job start releases it itself: the release commits
    with the outcome, and the delivery sends no look after it. Its text stays within
    psycopg's parse cache (longer, it was parsed again on every publish)."""
    from psycopg._queries import MAX_CACHED_STATEMENT_LENGTH

    from jobs.executors import postgres

    texts = []
    statement = postgres._publish_statement

    def recorded(*args):
        texts.append(statement(*args)[0])
        return statement(*args)

    monkeypatch.setattr(postgres, "_publish_statement", recorded)
    first, second = _ask(KIND, "p-1", "pub"), _ask(KIND, "p-2", "pub")
    third = _ask(KIND, "p-3", "pub")
    sent = _run_first(first)
    assert Job.objects.get(pk=first.pk).state == Job.State.SUCCEEDED
    assert Job.objects.get(pk=second.pk).held_by == ""
    assert Job.objects.get(pk=third.pk).held_by == SEQUENCE_HELD
    assert not [sql for sql in sent if "WITH keys" in sql], "a look after the publish"
    (text,) = texts
    assert "released AS" in text and len(text) <= MAX_CACHED_STATEMENT_LENGTH, len(text)


def test_publish__wakes_the_queue_of_a_head_in_another_queue():
    """A key across kinds of two queues: the publish that releases a head of the other
    queue wakes that queue's clusters (its statement wakes the published job's own)."""
    import psycopg
    from django.db import connection

    from jobs import queue
    from jobs.testing.scratchdb import url_from_settings

    first, second = _ask(KIND, "q-1", "queues"), _ask(OTHER_QUEUE_KIND, "q-2", "queues")
    assert second.queue == OTHER_QUEUE and second.held_by == SEQUENCE_HELD
    with psycopg.connect(url_from_settings(connection.settings_dict), autocommit=True) as other:
        other.execute(f'LISTEN "{queue.channel_of(OTHER_QUEUE)}"')
        _run_first(first)
        woken = list(other.notifies(timeout=5, stop_after=1))
    assert Job.objects.get(pk=second.pk).held_by == ""
    assert len(woken) == 1, "the other queue's clusters were not woken"


@pytest.mark.parametrize("claimed_next_here", [False, True])
def test_publish__wakes_the_clusters_unless_its_own_claims_the_head_next(claimed_next_here):
    """A head released by a publish is announced to every cluster serving its queue,
    except when the publishing worker's cluster claims from that queue as soon as the
    delivery ends (a cluster worker's task): it starts the head itself, and the NOTIFY
    would only wake the other clusters' listening backends for a job already taken."""
    import contextlib

    import psycopg
    from django.db import connection

    from jobs import queue
    from jobs.testing.scratchdb import url_from_settings

    first, second = _ask(KIND, "w-1", "wake"), _ask(KIND, "w-2", "wake")
    scope = queue.claiming_next(["default"]) if claimed_next_here else contextlib.nullcontext()
    with psycopg.connect(url_from_settings(connection.settings_dict), autocommit=True) as other:
        other.execute(f'LISTEN "{queue.channel_of("default")}"')
        with scope:
            _run_first(first)
        # The head's own claim wakes nobody: a NOTIFY after it is the publish's or none.
        woken = list(other.notifies(timeout=2 if claimed_next_here else 30, stop_after=1))
    assert Job.objects.get(pk=second.pk).held_by == ""
    assert len(woken) == (0 if claimed_next_here else 1), woken
    assert not queue.claimed_next_here("default"), "the scope ended with the delivery"


def test_publish__leaves_a_head_whose_job_before_it_is_another():
    """The head's job before it is not the one publishing (an operator let it go on
    earlier): the publish releases nothing; the rule decides for that job."""
    first, second = _ask(KIND, "o-1", "other"), _ask(KIND, "o-2", "other")
    third = _ask(KIND, "o-3", "other")
    # Released by hand and still queued: third's job before it is second, not first.
    Job.objects.filter(pk=second.pk).update(held_by="")
    claim = claim_next("default", "w1")
    assert claim.job.pk == first.pk
    run_claim(claim, "w1")
    assert Job.objects.get(pk=first.pk).state == Job.State.SUCCEEDED
    assert Job.objects.get(pk=third.pk).held_by == SEQUENCE_HELD


def test_sequence__the_kinds_options_are_checked():
    with pytest.raises(ValueError, match="on_failure"):
        register_kind("test.seq.bad", _work, sequence=_key, on_failure="retry")
    with pytest.raises(ValueError, match="debounced"):
        register_kind("test.seq.bad", _work, sequence=_key, debounce=1)
    with pytest.raises(ValueError, match="non-empty"):
        jobs.request(KIND, ("seq", "empty"), params={"key": ""})
    assert "test.seq.bad" not in kinds()


def test_claim__without_sequences_a_claim_that_finds_a_job_sends_one_statement():
    """The plain claim's cost: one statement when it finds a job (the statement has no
    sequence in it); finding none, one more, the heads' look (an index probe)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from jobs.executors import pgclaim

    sql, _ = pgclaim.next_statement("default", "w1", lease=30.0, bound=4)
    assert "sequence" not in sql
    jobs.request("test.steps", ("seq", "plain"), params={"stages": 0})
    with CaptureQueriesContext(connection) as found:
        assert pgclaim.claim_next("default", "w1", lease=30.0, bound=4).won
    with CaptureQueriesContext(connection) as empty:
        assert pgclaim.claim_next("default", "w1", lease=30.0, bound=4) is None
    assert (len(found), len(empty)) == (1, 2), [q["sql"][:60] for q in empty]


@pytest.mark.parametrize("queue", ["default", "", "heavy", "q" * 70, "büro-ü" * 9])
def test_release_heads__its_notify_channel_is_the_queues_channel(queue):
    """The release statement NOTIFYs in SQL (``broker.channel_sql``): the same channel
    ``queue.notify_queues`` sends to, a long queue name's hashed one too."""
    from jobs import broker
    from jobs import queue as queue_mod

    with connections["default"].cursor() as cursor:
        sql = f"SELECT {broker.channel_sql('x.q')} FROM (SELECT %s::text AS q) x"
        cursor.execute(sql, [*broker.channel_params(), queue])
        (found,) = cursor.fetchone()
    from django_q.conf import Conf

    assert found == broker.channel_for(queue_mod.list_key(queue) or Conf.CLUSTER_NAME)


def test_release_heads__wakes_the_queue_and_leaves_a_callers_commit_durable():
    """One statement releases the head and NOTIFYs its queue's listeners; its own commit
    skips the disk wait (a lost release is made again), never a caller's transaction."""
    import psycopg
    from django.db import transaction

    from jobs import broker
    from jobs import queue as queue_mod
    from jobs.executors import pgclaim

    first = _ask(KIND, "w-0", "wake")
    second = _ask(KIND, "w-1", "wake")
    assert Job.objects.get(pk=second.pk).held_by == SEQUENCE_HELD
    Job.objects.filter(pk=first.pk).update(state=Job.State.SUCCEEDED, attempts=1)
    params = connections["default"].get_connection_params()
    with psycopg.connect(
        **{k: v for k, v in params.items() if k != "cursor_factory"}, autocommit=True
    ) as listener:
        from django_q.conf import Conf

        channel = broker.channel_for(queue_mod.list_key("default") or Conf.CLUSTER_NAME)
        listener.execute(f'LISTEN "{channel}"')
        with transaction.atomic():
            assert pgclaim.release_heads("wake") == 1
            with connections["default"].cursor() as cursor:
                cursor.execute("SHOW synchronous_commit")
                assert cursor.fetchone()[0] == "on", "the caller's commit waits for the disk"
        heard = [n.channel for n in listener.notifies(timeout=30, stop_after=1)]
    assert heard == [channel]
    assert Job.objects.get(pk=second.pk).held_by == ""


def test_release_heads__wakes_no_cluster_for_a_queue_its_own_claims_next():
    """A send that settles inside a cluster worker's task (``queue.claiming_next``) lets
    the key's next job go without a NOTIFY for the queues that cluster claims from next;
    a head of another queue still wakes its clusters."""
    import psycopg
    from django.db import connection

    from jobs import queue
    from jobs.executors import pgclaim
    from jobs.testing.scratchdb import url_from_settings

    first, second = _ask(KIND, "n-0", "nowake"), _ask(KIND, "n-1", "nowake")
    third = _ask(OTHER_QUEUE_KIND, "n-2", "nowake")
    Job.objects.filter(pk=first.pk).update(state=Job.State.SUCCEEDED, attempts=1)
    with psycopg.connect(url_from_settings(connection.settings_dict), autocommit=True) as other:
        for name in ("default", OTHER_QUEUE):
            other.execute(f'LISTEN "{queue.channel_of(name)}"')
        with queue.claiming_next(["default"]):
            assert pgclaim.release_heads("nowake") == 1
        assert Job.objects.get(pk=second.pk).held_by == ""
        Job.objects.filter(pk=second.pk).update(state=Job.State.SUCCEEDED, attempts=1)
        with queue.claiming_next(["default"]):
            assert pgclaim.release_heads("nowake") == 1
        heard = [n.channel for n in other.notifies(timeout=30, stop_after=1)]
    assert Job.objects.get(pk=third.pk).held_by == ""
    assert heard == [queue.channel_of(OTHER_QUEUE)], "only the other queue's head woke"
