"""``rq_mutex.mutex_job`` against a real Redis (127.0.0.1:6379, db 12).

In-process ``SimpleWorker`` and forking ``Worker`` in burst mode for single behaviours;
real ``rq worker --with-scheduler`` subprocesses for busy retries under contention and for
a work horse killed with SIGKILL. A missing Redis fails these tests; it never skips them.
Every wait is bounded in time.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import redis
from rq import Retry
from rq.command import send_stop_job_command
from rq.cron import CronJob
from rq.job import Job, JobStatus
from rq.registry import ScheduledJobRegistry
from rq_support import jobs
from rq_support.workers import SimpleWorker, Worker  # RQ's, but a shutdown never waits a minute
from workers import BIN, ENV, ROOT, ReleaseLater, start, stop, wait_until

# isort: split
from rq_mutex import Queue, current_lease, first_run_of_tick, is_skipped, mutex_job
from rq_mutex import Worker as RQMutexWorker
from rq_mutex.cron import _registration
from rq_mutex.job import NO_SCHEDULER_FLAG
from simple_mutex import ConstraintError, Mutex, Semaphore
from simple_mutex.admin import live_locks
from simple_mutex.caches import RedisCache

pytestmark = pytest.mark.integrations


@pytest.fixture(scope="module")
def conn() -> redis.Redis:
    """The Redis every test uses; a missing server is an error, not a skip."""
    client = redis.Redis.from_url(jobs.REDIS_URL, socket_connect_timeout=2)
    client.ping()
    return client


@pytest.fixture
def run() -> str:
    """An id no other test uses: part of every lock key and record name."""
    return uuid.uuid4().hex[:10]


@pytest.fixture
def queue(conn: redis.Redis, run: str) -> Queue:
    return Queue(f"rqt-{run}", connection=conn)


@pytest.fixture
def locks(conn: redis.Redis) -> Mutex:
    """The test's own view of the locks the jobs take (same cache, same prefix)."""
    return Mutex(RedisCache(conn), lease=30)


def records(conn: redis.Redis, run: str, what: str = "log") -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in conn.lrange(f"rqt:{run}:{what}", 0, -1)]


def burst(queue: Queue, worker_class: type[Worker] = SimpleWorker, **kwargs: Any) -> None:
    worker_class([queue], connection=queue.connection).work(burst=True, **kwargs)


def exc_text(job: Job) -> str:
    result = job.latest_result()
    return (result.exc_string or "") if result is not None else ""


@pytest.fixture
def rq_workers(queue: Queue) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start real ``rq worker`` processes on the test's queue; all stopped at the end."""
    started: list[subprocess.Popen[bytes]] = []

    def start_worker(*options: str) -> subprocess.Popen[bytes]:
        started.append(start(["rq", "worker", "-u", jobs.REDIS_URL, *options, queue.name]))
        return started[-1]

    yield start_worker
    stop(started)  # a warm shutdown frees the scheduler lock


# -- contention: 20 jobs over 2 keys, busy -> rq.Retry -> scheduler -> run ---------------


@pytest.mark.parametrize("work", [jobs.serialized, jobs.serialized_async], ids=["def", "async"])
def test_retry_twenty_jobs_two_keys_never_overlap(conn, run, queue, rq_workers, work):
    """Two real workers (a SimpleWorker and a forking Worker, both with the scheduler)
    run 20 jobs over 2 keys with on_busy="retry", as plain and as ``async def`` jobs:
    every job finishes with its own result, the critical sections of a key never
    overlap, fences grow in run order, and busy jobs were retried under their own id
    (contention really happened)."""
    simple = rq_workers("--with-scheduler", "-w", "rq_support.workers.SimpleWorker")
    rq_workers("--with-scheduler", "-w", "rq_support.workers.Worker")
    enqueued = []
    for item in range(20):
        entity = "a" if (item // 2) % 2 == 0 else "b"  # a a b b a a ...: neighbours clash
        enqueued.append(queue.enqueue(work, run, entity, item, hold=0.2))

    def all_ended() -> bool:
        statuses = [j.get_status(refresh=True) for j in enqueued]
        return all(s in (JobStatus.FINISHED, JobStatus.FAILED) for s in statuses)

    wait_until(all_ended, 50, "20 jobs to end")
    assert [j.get_status() for j in enqueued] == [JobStatus.FINISHED] * 20
    assert [j.return_value() for j in enqueued] == list(range(20))
    log = records(conn, run)
    assert sorted(r["item"] for r in log) == list(range(20))  # each ran exactly once
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in log:
        by_key[r["name"]].append(r)
    assert set(by_key) == {"a", "b"}
    overlaps = 0
    for sections in by_key.values():
        sections.sort(key=lambda r: r["start"])
        assert all(r["inside"] == 1 for r in sections)
        for before, after in itertools.pairwise(sections):
            overlaps += after["start"] < before["end"]
            assert after["fence"] > before["fence"]
    assert overlaps == 0
    for job in enqueued:
        job.refresh()
    retried = sum(j.number_of_retries or 0 for j in enqueued)
    assert retried > 0, "no job was ever busy: the test did not exercise contention"
    pids = {r["pid"] for r in log}
    assert simple.pid in pids  # the SimpleWorker ran jobs in its own process
    assert pids - {simple.pid}  # and the forking worker's horses ran others


def test_busy_retry_in_burst_without_then_with_scheduler(conn, run, queue, locks):
    """Busy with no scheduler anywhere: the job returns rq.Retry and waits SCHEDULED under
    its own id, with a loud warning; a later burst with the scheduler runs it."""
    conn.delete(NO_SCHEDULER_FLAG + queue.name)
    held = locks.acquire(f"retry.{run}")
    job = queue.enqueue(jobs.retrier, run)
    with pytest.warns(RuntimeWarning, match="no worker on that queue runs the scheduler"):
        burst(queue)
    job.refresh()
    assert job.get_status() == JobStatus.SCHEDULED
    assert job.id in ScheduledJobRegistry(queue=queue).get_job_ids()
    assert job.number_of_retries == 1
    assert records(conn, run) == []
    held.release()
    # RQ schedules by the second: move the retry into the past instead of sleeping.
    ScheduledJobRegistry(queue=queue).schedule(job, datetime.now(timezone.utc) - timedelta(1))
    burst(queue, with_scheduler=True)
    assert job.get_status(refresh=True) == JobStatus.FINISHED
    assert job.return_value() == "ran"
    assert [r["key"] for r in records(conn, run)] == [f"retry.{run}"]


# -- skip, raise, wait ---------------------------------------------------------------------


@pytest.mark.parametrize("worker_class", [SimpleWorker, Worker], ids=["simple", "fork"])
def test_skip_finishes_with_marker(conn, run, queue, locks, worker_class):
    """A busy skip job finishes at once with the documented marker; a free one runs."""
    held = locks.acquire(f"skip.{run}")
    skipped = queue.enqueue(jobs.skipper, run)
    burst(queue, worker_class)
    held.release()
    ran = queue.enqueue(jobs.skipper, run)
    burst(queue, worker_class)
    assert skipped.get_status(refresh=True) == JobStatus.FINISHED
    assert is_skipped(skipped.return_value())
    assert skipped.return_value() == {"rq_mutex": "skipped", "key": f"skip.{run}"}
    assert ran.return_value() == "ran"
    assert not is_skipped(ran.return_value())
    assert len(records(conn, run)) == 1


def test_raise_and_exhausted_retries_fail_the_job(conn, run, queue, locks):
    """on_busy="raise", and "retry" with max=0, fail a busy job at once with
    SimpleMutexAcquireTimeoutError; neither body ran."""
    with locks.acquire(f"raise.{run}"), locks.acquire(f"ser.{run}.x"):
        raised = queue.enqueue(jobs.raiser, run)
        exhausted = queue.enqueue(jobs.serialized_no_retry, run, "x", 1)
        burst(queue)
    for job in (raised, exhausted):
        assert job.get_status(refresh=True) == JobStatus.FAILED
        assert "SimpleMutexAcquireTimeoutError" in exc_text(job)
    assert "after 0 busy retries" in exc_text(exhausted)
    assert records(conn, run) == []


def test_wait_blocks_until_free(conn, run, queue, locks):
    """on_busy="wait": the job runs once the holder lets go, half a second later."""
    timer = ReleaseLater(0.5, locks.acquire(f"wait.{run}").release)
    job = queue.enqueue(jobs.waiter, run)
    started = time.monotonic()
    burst(queue)
    timer.join()
    assert job.get_status(refresh=True) == JobStatus.FINISHED
    assert time.monotonic() - started >= 0.45


# -- holding: lease loss, fixed leases, current_lease ----------------------------------


@pytest.mark.parametrize("worker_class", [SimpleWorker, Worker], ids=["simple", "fork"])
@pytest.mark.parametrize("work", [jobs.lose_lease, jobs.lose_lease_async], ids=["def", "async"])
def test_lease_lost_mid_job_fails_and_interrupts(conn, run, queue, worker_class, work):
    """The job deletes its own lock record; the next renewal (a third of the 1 s lease)
    finds it gone, interrupts the busy loop (cancels the coroutine) and fails the job."""
    job = queue.enqueue(work, run)
    started = time.monotonic()
    burst(queue, worker_class)
    assert time.monotonic() - started < 5  # the 8 s loop was cut short
    assert job.get_status(refresh=True) == JobStatus.FAILED
    assert "SimpleMutexLeaseExpiredError" in exc_text(job)
    assert [r["stage"] for r in records(conn, run)] == ["deleting"]  # never "finished"


def test_fixed_lease_refuses_longer_job_timeout(conn, run, queue):
    """renew=False, lease=5: job_timeout 10, the queue default (180), a call by name and a
    scheduled call are refused as they are enqueued, naming the fix, and nothing is
    enqueued; a job built without Queue.create_job meets the same check when it starts;
    job_timeout 2 runs."""
    refused = [
        lambda: queue.enqueue(jobs.fixed_lease, run, job_timeout=10),
        lambda: queue.enqueue(jobs.fixed_lease, run),
        lambda: queue.enqueue("rq_support.jobs.fixed_lease", run, job_timeout=5),
        lambda: queue.enqueue_in(timedelta(seconds=30), jobs.fixed_lease, run),
    ]
    for enqueue in refused:
        with pytest.raises(ConstraintError, match=r"not shorter than the lease \(5 s\)"):
            enqueue()
    assert len(queue) == 0
    assert len(ScheduledJobRegistry(queue=queue)) == 0
    by_hand = Job.create(jobs.fixed_lease, args=(run,), timeout=10, connection=conn)
    queue.enqueue_job(by_hand)
    fits = queue.enqueue(jobs.fixed_lease, run, job_timeout=2)
    burst(queue)
    assert by_hand.get_status(refresh=True) == JobStatus.FAILED
    assert "ConstraintValueError" in exc_text(by_hand)
    assert "shorter job_timeout" in exc_text(by_hand)
    assert fits.get_status(refresh=True) == JobStatus.FINISHED
    assert len(records(conn, run)) == 1


def test_arguments_name_one_key_and_the_job_reads_its_lease(conn, run, queue, locks):
    """f(1), f(a=1), f(run=..., a=1, b=2) and f(1, 2) lock one key (skipped while it is
    held); f(3) runs, sees its key and fence through current_lease(), and frees the lock
    (the next grant's fence is larger). Outside a job there is no lease."""
    with locks.acquire(f"kw.{run}.1.2"):
        calls = [
            queue.enqueue(jobs.keyed, run, 1),
            queue.enqueue(jobs.keyed, run, a=1),
            queue.enqueue(jobs.keyed, run=run, a=1, b=2),
            queue.enqueue(jobs.keyed, run, 1, 2),
            queue.enqueue(jobs.keyed, run, 3),  # another key: runs
        ]
        burst(queue)
    results = [job.return_value() for job in calls]
    assert all(is_skipped(r) and r["key"] == f"kw.{run}.1.2" for r in results[:4])
    assert results[4] == 5
    (seen,) = records(conn, run)
    assert seen["key"] == f"kw.{run}.3.2"
    assert seen["fence"] >= 1
    assert not locks.locked(f"kw.{run}.3.2")
    after = locks.acquire(f"kw.{run}.3.2", timeout=0)
    assert after.fence > seen["fence"]
    after.release()
    assert current_lease() is None
    assert jobs.keyed(run, 1) == 3  # a direct call is a plain call


def test_rq_job_timeout_fails_the_job_and_releases(conn, run, queue, locks):
    """RQ's own timeout (SIGALRM, untouched by rq_mutex) ends the body; the lock is freed
    when the job fails, not when its lease lapses."""
    job = queue.enqueue(jobs.sleeper, run, 5, job_timeout=1)
    started = time.monotonic()
    burst(queue)
    assert time.monotonic() - started < 4
    assert job.get_status(refresh=True) == JobStatus.FAILED
    assert "JobTimeoutException" in exc_text(job)
    assert [r["stage"] for r in records(conn, run)] == ["started"]
    assert not locks.locked(f"sleep.{run}")


def test_permits_allow_that_many_runs_per_key(conn, run, queue):
    """permits=2: one permit held elsewhere, the job runs; both held, it is skipped."""
    permits = Semaphore(RedisCache(conn), permits=2, lease=30)
    first = permits.acquire(f"sem.{run}")
    one_free = queue.enqueue(jobs.two_at_a_time, run)
    burst(queue)
    second = permits.acquire(f"sem.{run}")
    none_free = queue.enqueue(jobs.two_at_a_time, run)
    burst(queue)
    first.release()
    second.release()
    assert one_free.return_value() == "ran"
    assert is_skipped(none_free.return_value())
    assert len(records(conn, run)) == 1


# -- synchronous queues ----------------------------------------------------------------


def test_sync_queue_busy_retry_waits_then_fails_and_raise_raises(conn, run, locks):
    """Queue(is_async=False) would store a returned Retry as the result: a busy retry
    waits for the holder instead, and fails once its retries' budget (0.3 s) is spent;
    on_busy="raise" fails at once."""
    sync = Queue(f"rqt-sync-{run}", connection=conn, is_async=False)
    held = locks.acquire(f"retry.{run}")
    timer = ReleaseLater(0.5, held.release)
    started = time.monotonic()
    job = sync.enqueue(jobs.retrier, run)
    timer.join()
    assert time.monotonic() - started >= 0.45
    assert job.get_status() == JobStatus.FINISHED
    assert job.return_value() == "ran"
    assert not isinstance(job.return_value(), Retry)
    with locks.acquire(f"retry.{run}"), locks.acquire(f"raise.{run}"):
        started = time.monotonic()
        brief = sync.enqueue(jobs.retry_briefly, run)
        assert 0.25 <= time.monotonic() - started < 3
        refused = sync.enqueue(jobs.raiser, run)
    assert "synchronous call cannot be re-queued" in exc_text(brief)
    for job in (brief, refused):
        assert job.get_status() == JobStatus.FAILED
        assert "SimpleMutexAcquireTimeoutError" in exc_text(job)


# -- stacking with @rq.decorators.job --------------------------------------------------


def test_stacks_with_rq_job_decorator_in_either_order(conn, run, locks):
    """``.delay`` from @job enqueues; the worker imports the wrapper by name either way,
    so the lock applies (a held key makes the run skip)."""
    queue = Queue("rqt-stacked", connection=conn)
    queue.empty()
    held = [locks.acquire(f"st1.{run}"), locks.acquire(f"st2.{run}")]
    busy = [jobs.stacked_job_outer.delay(run), jobs.stacked_mutex_outer.delay(run)]
    burst(queue)
    for lease in held:
        lease.release()
    free = [jobs.stacked_job_outer.delay(run), jobs.stacked_mutex_outer.delay(run)]
    burst(queue)
    assert all(is_skipped(job.return_value()) for job in busy)
    assert [job.return_value() for job in free] == ["ran", "ran"]
    assert sorted(r["which"] for r in records(conn, run)) == ["job-outer", "mutex-outer"]


# -- a killed work horse ----------------------------------------------------------------


def test_sigkilled_work_horse_frees_lock_within_lease(conn, run, queue, locks, rq_workers):
    """A real ``rq worker``; its horse holds a renewed 2 s lease; SIGKILL the horse: the
    lock is free again within the lease, and the next grant has a larger fence. Then the
    same through ``send_stop_job_command``."""
    worker = rq_workers()
    job = queue.enqueue(jobs.hold_forever, run)
    wait_until(lambda: bool(records(conn, run, "held")), 20, "the job to hold its lock")
    (held,) = records(conn, run, "held")
    assert held["pid"] != worker.pid  # the work horse, not the worker
    time.sleep(1.0)  # past a renewal: the lock outlives the first third of its lease
    assert locks.locked(f"hold.{run}")
    os.kill(held["pid"], signal.SIGKILL)
    killed = time.monotonic()
    wait_until(lambda: not locks.locked(f"hold.{run}"), 4, "the lock to be freed")
    assert time.monotonic() - killed <= 2.2
    taken = locks.acquire(f"hold.{run}", timeout=0)
    assert taken.fence > held["fence"]
    taken.release()
    wait_until(lambda: job.get_status(refresh=True) == JobStatus.FAILED, 10, "job failed")

    # A stop-job command kills the horse too: same outcome, the job ends STOPPED.
    again = queue.enqueue(jobs.hold_forever, run)
    wait_until(lambda: len(records(conn, run, "held")) == 2, 20, "the second job to hold")
    send_stop_job_command(conn, again.id)
    stopped = time.monotonic()
    wait_until(lambda: not locks.locked(f"hold.{run}"), 4, "the lock to be freed")
    assert time.monotonic() - stopped <= 2.2
    wait_until(lambda: again.get_status(refresh=True) == JobStatus.STOPPED, 10, "stopped")


# -- options are checked when decorating -------------------------------------------------


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"key": "k.{missing}"}, "missing"),
        ({"key": ""}, "key must be"),
        ({"key": "k", "cache": "not-a-url"}, "unknown cache URL scheme ''; supported: memory://"),
        ({"key": "k", "cache": "http://x"}, "unknown cache URL scheme 'http'"),  # as Celery's
    ],
)
def test_bad_options_raise_when_decorating(options, match):
    """What only mutex_job takes is checked when decorating (the shared options, for
    Celery and RQ at once, in test_busy.py); generator job functions are refused."""

    def work(order_id: int) -> None: ...

    def generator_work(order_id: int) -> Iterator[int]:
        yield order_id

    with pytest.raises(ConstraintError, match=match) as info:
        mutex_job(**options)(work)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ConstraintError, match="generator") as info:
        mutex_job(key="k.{order_id}")(generator_work)
    assert isinstance(info.value, TypeError)


def test_mutex_job_without_its_parentheses_names_the_fix():
    """``@mutex_job`` bare (or without a key) is a ConstraintError that shows the call to
    write, not Python's "takes 0 positional arguments but 1 was given"."""

    def work(order_id: int) -> None: ...

    for wrong in (lambda: mutex_job(work), lambda: mutex_job()(work)):
        with pytest.raises(ConstraintError, match=r"@mutex_job\(key=") as info:
            wrong()
        assert isinstance(info.value, TypeError)


# -- rq cron: once per tick ---------------------------------------------------------------


def run_rq_cron(
    seconds: float,
    *environments: dict[str, str],
    before_stop: Callable[[], Any] = lambda: None,
    started: Callable[[], bool] = lambda: True,
) -> Any:
    """One ``rq cron tests/rq_support/cron_config.py`` process per environment, for
    ``seconds`` after ``started()`` first holds (``rq cron`` can take seconds to import on
    a loaded machine; at most 60 s for that); all stopped at the end. Returns what
    ``before_stop`` read while they still ran (a claim of an interval's window lives less
    than the interval)."""
    config = str(ROOT / "tests" / "rq_support" / "cron_config.py")
    procs = [start(["rq", "cron", "-u", jobs.REDIS_URL, config], **env) for env in environments]
    try:
        deadline = time.monotonic() + 60
        while not started() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(seconds)
        return before_stop()
    finally:
        stop(procs)


def test_three_rq_cron_processes_enqueue_each_tick_once(conn, run):
    """Three guarded ``rq cron`` processes (one job every second) enqueue each tick once;
    three unguarded ones, as a control, enqueue duplicates. A second copy of a tick that
    reaches a worker anyway is dropped at run time."""
    guarded = Queue(f"rqt-cron-g-{run}", connection=conn)
    control = Queue(f"rqt-cron-c-{run}", connection=conn)
    run_rq_cron(
        6,
        *[
            {"RQT_GUARD": guard, "RQT_QUEUE": queue.name, "RQT_NAME": f"{run}-{guard}"}
            for guard, queue in (("1", guarded), ("0", control))
            for _ in range(3)
        ],
        started=lambda: len(control) > 0,
    )
    enqueued = guarded.get_jobs()
    ticks = [job.meta.get("rq_mutex_tick") for job in enqueued]
    assert len(ticks) >= 3
    assert len(set(ticks)) == len(ticks)  # each tick once
    assert all(isinstance(t, str) and t.startswith(f"{run}-1~") for t in ticks)
    assert len(control) >= len(ticks) + 3  # the control enqueued duplicates

    burst(guarded)
    ran = records(conn, f"{run}-1", "ticks")
    assert sorted(r["tick"] for r in ran) == sorted(ticks)
    # A duplicate of a tick that already ran (as an unguarded producer would send it):
    duplicate = guarded.enqueue(jobs.ticked, f"{run}-1", meta={"rq_mutex_tick": ticks[0]})
    burst(guarded)
    assert first_run_of_tick(enqueued[0])  # its own tick again (a retry): still first
    assert not first_run_of_tick(duplicate)
    assert duplicate.return_value()["reason"] == "duplicate tick"
    assert is_skipped(duplicate.return_value())
    duplicate.refresh()
    assert duplicate.meta["rq_mutex_skipped"] is True  # what a dashboard sees
    assert duplicate.meta["rq_mutex_skip_reason"] == "duplicate tick"
    assert len(records(conn, f"{run}-1", "ticks")) == len(ticks)


def claims_seen(conn: Any, run: str, seconds: float) -> list[Any]:
    """Every tick claim of ``run`` live at some moment of ``seconds`` (a listing every
    0.1 s): a claim of an interval's window lives 90% of each interval."""
    seen: dict[str, Any] = {}
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        for claim in live_locks(RedisCache(conn), "rq_mutex:tick:"):
            if claim.key.startswith(run):
                seen[claim.key] = claim
        time.sleep(0.1)
    return list(seen.values())


def test_cron_jobs_sharing_a_name_each_run_once_per_tick(conn, run):
    """Two guarded ``rq cron`` processes, four ``cleanup`` registrations under one name
    (users and orders every second, sessions and carts every 2 s): every registration is
    enqueued once per tick, and each of its jobs runs. Before the fix the claim named only
    the cron job's name: one registration per tick won and the others were dropped as
    "already enqueued by another process", every tick."""
    queue = Queue(f"rqt-cron-s-{run}", connection=conn)
    shared = {"RQT_GUARD": "1", "RQT_SHARED": "1", "RQT_QUEUE": queue.name, "RQT_NAME": run}
    claims = run_rq_cron(
        8,
        shared,
        shared,
        before_stop=lambda: (
            {job.meta["rq_mutex_tick"] for job in queue.get_jobs()},  # enqueued by now
            claims_seen(conn, run, 2.5),
        ),
    )
    early, claims = claims
    enqueued = queue.get_jobs()
    by_table: dict[str, list[str]] = defaultdict(list)
    for job in enqueued:
        by_table[job.args[1]].append(job.meta["rq_mutex_tick"])
    assert set(by_table) == {"users", "orders", "sessions", "carts"}, by_table
    for table, ticks in by_table.items():
        assert len(set(ticks)) == len(ticks), (table, ticks)  # each tick once
    assert len(by_table["users"]) >= 4
    assert set(by_table["users"]) & set(by_table["orders"]) == set()  # ticks name the job
    users_at = sorted(t.rsplit("@", 1)[1] for t in by_table["users"])
    orders_at = sorted(t.rsplit("@", 1)[1] for t in by_table["orders"])
    assert len(set(users_at) ^ set(orders_at)) <= 2  # the same seconds (but the edges)
    for table in ("sessions", "carts"):
        assert 2 <= len(by_table[table]) <= 6, (table, by_table[table])  # one per 2 s window
    # What `simple-mutex list ... --prefix rq_mutex:tick:` shows (read while the cron
    # processes ran): the name, the tick, and which registration holds it.
    cron_ticks = {t for table in ("users", "orders") for t in by_table[table]} & early
    assert cron_ticks
    assert cron_ticks <= {c.key for c in claims}  # a cron tick's claim is named by it
    windows = {c.key.split("@")[0] for c in claims if c.key.endswith("@every-2000ms")}
    assert len(windows) == 2  # an interval claims a window: one per registration
    labels = {c.holder.label for c in claims}
    assert (
        f"rq cron rq_support.jobs.cleanup({run!r}, 'users') on {queue.name} cron '* * * * * *'"
        in labels
    )
    assert f"rq cron rq_support.jobs.cleanup({run!r}, 'carts') on {queue.name} every 2 s" in labels

    burst(queue)
    ran = Counter(row["table"] for row in records(conn, run, "cleanups"))
    assert ran == Counter({t: len(ticks) for t, ticks in by_table.items()})  # none dropped
    assert all(job.return_value() == job.args[1] for job in enqueued)


def test_a_registration_is_named_alike_in_every_process():
    """The digest a claim names a registration by is the same in processes with other
    hash seeds (set arguments iterate differently there), and differs when the function,
    an argument, the queue or the schedule does."""
    code = (
        "from rq.cron import CronJob; from rq_mutex.cron import _registration; "
        "print(_registration(CronJob('q', func_name='m.f', args=({'users', 'orders', 'x'},), "
        "kwargs={'only': frozenset('abc')}, cron='0 3 * * *')))"
    )
    digests = {
        subprocess.run(
            [str(BIN / "python"), "-c", code],
            env={**ENV, "PYTHONHASHSEED": seed},
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout.strip()
        for seed in ("1", "2", "3")
    }  # fmt: skip
    assert len(digests) == 1
    base = {"queue_name": "q", "func_name": "m.f", "args": ("users",), "cron": "0 3 * * *"}
    variants = [
        base,
        {**base, "func_name": "m.g"},
        {**base, "args": ("orders",)},
        {**base, "queue_name": "r"},
        {**base, "cron": "0 4 * * *"},
        {**{k: v for k, v in base.items() if k != "cron"}, "interval": 60},
        {**base, "kwargs": {"dry_run": True}},
    ]
    assert len({_registration(CronJob(**v)) for v in variants}) == len(variants)


def test_a_worker_shuts_down_at_once_whatever_its_pubsub_thread_was_doing(conn, run):
    """Every shutdown, warm or cold, unsubscribes from the worker's command channel: RQ's
    pubsub thread waits up to 60 s for a message, and redis-py 8.2's ``stop()`` waits for
    the thread. rq_mutex.Worker waits a second at most, here in the case that took a
    minute: the thread had read the last reply and waited again before the stop came."""
    worker = RQMutexWorker([Queue(f"rqt-{run}", connection=conn)], connection=conn)
    for _ in range(3):
        worker.subscribe()
        wait_until(lambda: worker.pubsub.subscribed, 5, "the subscription")
        worker.pubsub.unsubscribe()  # its reply reaches the thread, which waits again
        wait_until(lambda: not worker.pubsub.subscribed, 5, "the unsubscribe's reply")
        started = time.monotonic()
        worker.unsubscribe()
        assert time.monotonic() - started < 5, "the shutdown waited for the pubsub thread"
