"""``mutex_job(on_busy="queue")``: jobs of one key run in enqueue order, one at a time,
each once, and a parked job holds no worker while it waits (``rq_mutex.line``).

Real ``rq worker -w rq_mutex.Worker`` processes (forking work horses) on a real Redis
(db 12); the jobs (``jobs.in_line``, a 6 s lease) record their sections, so order,
overlap and exactly-once are read back. Faults: a horse SIGKILLed mid-line (with and
without an RQ retry), a whole worker SIGKILLed, a job that raises, RQ's own retry.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
import test_rq
from rq import Retry
from rq.job import Job, JobStatus
from rq_support import jobs
from rq_support.workers import SimpleWorker  # RQ's, but a shutdown never waits a minute
from test_rq import records
from workers import start, stop, wait_until

# isort: split
from rq_mutex import Queue, is_skipped, mutex_job
from rq_mutex.job import NO_LINE_KEEPER_FLAG
from rq_mutex.line import META
from simple_mutex import ConstraintError, LineFullError
from simple_mutex.busy.line import Lines
from simple_mutex.caches import RedisCache

pytestmark = pytest.mark.integrations

# test_rq's fixtures: its Redis (db 12), a run id, the run's queue, real `rq worker`s.
conn, run, queue, rq_workers = test_rq.conn, test_rq.run, test_rq.queue, test_rq.rq_workers

WORKER = ("-w", "rq_mutex.Worker")  # reaps horses on the record, sweeps the lines
ENDED = (JobStatus.FINISHED, JobStatus.FAILED, JobStatus.STOPPED)


def ended(jobs_: list[Job]) -> bool:
    return all(j.get_status(refresh=True) in ENDED for j in jobs_)


def order(conn: redis.Redis, run: str) -> dict[str, list[int]]:
    """Each entity's items, in the order their sections started."""
    found: dict[str, list[int]] = {}
    for rec in sorted(records(conn, run), key=lambda r: r["start"]):
        found.setdefault(rec["name"], []).append(rec["item"])
    return found


def assert_one_at_a_time(conn: redis.Redis, run: str, killed: int = 0) -> None:
    """No two sections of one entity overlapped (by their counter and their times). A
    section ``killed`` with its horse never left the counter, so it counts as inside."""
    recs = records(conn, run)
    assert max(r["inside"] for r in recs) == 1 + killed
    by: dict[str, list[dict[str, Any]]] = {}
    for rec in recs:
        by.setdefault(rec["name"], []).append(rec)
    for sections in by.values():
        sections.sort(key=lambda r: r["start"])
        for before, after in itertools.pairwise(sections):
            assert before["end"] <= after["start"], (before, after)


def started(conn: redis.Redis, run: str, item: int, entity: str = "e") -> dict[str, Any]:
    wait_until(
        lambda: any(
            r["item"] == item and r["name"] == entity for r in records(conn, run, "started")
        ),
        60,
        f"item {item} to start",
    )
    return next(
        r for r in records(conn, run, "started") if r["item"] == item and r["name"] == entity
    )


def test_twenty_keys_run_in_enqueue_order_once_each(conn, run, queue, rq_workers):
    """20 keys x 10 jobs, sent interleaved, 4 workers: every key's jobs run in the order
    they were enqueued, never two at once, each exactly once."""
    for _ in range(4):
        rq_workers(*WORKER)
    sent = [
        queue.enqueue(jobs.in_line, run, f"e{e:02d}", item, hold=0.05)
        for item in range(10)
        for e in range(20)
    ]
    assert all(META in j.meta for j in sent), "a ticket is taken at the enqueue"
    wait_until(lambda: ended(sent), 180, "every job to end")
    assert Counter(j.get_status() for j in sent) == {JobStatus.FINISHED: 200}
    assert [j.return_value() for j in sent] == [item for item in range(10) for _ in range(20)]
    assert order(conn, run) == {f"e{e:02d}": list(range(10)) for e in range(20)}
    assert len(records(conn, run)) == 200  # once each
    assert_one_at_a_time(conn, run)


@pytest.fixture
def tier_workers(queue: Queue) -> Iterator[Callable[[str], None]]:
    """Real ``rq worker -w rq_mutex.Worker`` processes told to sweep a tier's lines too
    (``RQ_MUTEX_LINE_CACHES``)."""
    started: list[subprocess.Popen[bytes]] = []

    def start_workers(cache: str, count: int = 3) -> None:
        argv = ["rq", "worker", "-u", jobs.REDIS_URL, *WORKER, queue.name]
        started.extend(start(argv, RQ_MUTEX_LINE_CACHES=cache) for _ in range(count))

    yield start_workers
    stop(started)


@pytest.mark.parametrize("tier", ["postgres", "disk"])
def test_every_tier_keeps_the_line(conn, run, queue, tier_workers, tier):
    """10 keys x 6 jobs, each key's six enqueued together, the locks and lines in
    PostgreSQL or a DiskCache (RQ's own store stays Redis): enqueue order, once each."""
    tier_workers(jobs.PG_LINE if tier == "postgres" else jobs.DISK_LINE)
    job = jobs.in_pg_line if tier == "postgres" else jobs.in_disk_line
    sent = [queue.enqueue(job, run, f"e{e}", item) for e in range(10) for item in range(6)]
    wait_until(lambda: ended(sent), 120, "every job to end")
    assert Counter(j.get_status() for j in sent) == {JobStatus.FINISHED: 60}
    assert order(conn, run) == {f"e{e}": list(range(6)) for e in range(10)}
    assert_one_at_a_time(conn, run)


def test_a_dead_horse_in_a_tier_of_its_own_is_swept(conn, run, queue, tier_workers):
    """The locks and lines in PostgreSQL: item 1's horse is SIGKILLed holding; no job of
    the key arrives after it, so only the workers' sweep of that cache moves the line
    on (its lock lapses in 6 s), and items 2 and 3 run, in order."""
    tier_workers(jobs.PG_LINE, count=2)
    sent = [
        queue.enqueue(jobs.in_pg_line, run, "e", i, hold=8.0 if i == 1 else 0.05) for i in range(4)
    ]
    victim = started_pg(conn, run, 1)
    wait_until(lambda: {j.get_status(refresh=True) for j in sent[2:]} == {JobStatus.SCHEDULED},
               30, "items 2 and 3 to park")  # fmt: skip
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: ended(sent[2:]), 40, "the line to go on")
    assert order(conn, run)["e"] == [0, 2, 3]


def started_pg(conn: redis.Redis, run: str, item: int) -> int:
    """The pid of the horse running ``item`` (its section's counter is up)."""
    wait_until(lambda: conn.get(f"rqt:{run}:pid:e:{item}"), 30, f"item {item} to start")
    return int(conn.get(f"rqt:{run}:pid:e:{item}"))


def test_a_burst_parks_at_the_enqueue(conn, run, queue, rq_workers):
    """Ten jobs of one key enqueued together: all but the first are parked as they are
    enqueued (SCHEDULED at once, never pushed), so no horse runs for them before their
    turn: each has exactly one result, the run's."""
    sent = [queue.enqueue(jobs.in_line, run, "e", i) for i in range(10)]
    assert [j.get_status(refresh=True) for j in sent] == [JobStatus.QUEUED] + [
        JobStatus.SCHEDULED
    ] * 9
    assert queue.count == 1
    rq_workers(*WORKER)
    rq_workers(*WORKER)
    wait_until(lambda: ended(sent), 60, "the burst")
    assert order(conn, run) == {"e": list(range(10))}
    assert [len(j.results()) for j in sent] == [1] * 10


def test_a_plain_rq_queue_still_keeps_the_line(conn, run, queue, rq_workers):
    """Through RQ's own ``Queue`` (no ``rq_mutex.Queue``): nothing is checked or taken at
    the enqueue, each job takes its place in the line as it first reaches a worker, and
    a key's jobs still run one at a time, each once: with two workers the second parks
    behind the holder (off the queue) instead of running beside it. The order is the
    order of arrival, which two workers may swap."""
    import rq

    plain = rq.Queue(queue.name, connection=conn)
    sent = [plain.enqueue(jobs.in_line, run, "e", i, hold=0.5) for i in range(6)]
    assert not any(META in j.meta for j in sent), "no ticket at a plain enqueue"
    assert plain.count == 6  # nothing parked at the enqueue
    for _ in range(2):
        rq_workers(*WORKER)
    wait_until(lambda: ended(sent), 90, "every job to end")
    assert Counter(j.get_status() for j in sent) == {JobStatus.FINISHED: 6}
    assert sorted(order(conn, run)["e"]) == list(range(6))
    assert len(records(conn, run)) == 6  # once each
    assert all(META in Job.fetch(j.id, connection=conn).meta for j in sent), "placed on arrival"
    assert_one_at_a_time(conn, run)


@pytest.mark.parametrize("worker", ["rq_support.workers.Worker", "rq_mutex.Worker"])
def test_a_line_job_on_a_worker_that_cannot_sweep_says_so(conn, run, queue, worker, tmp_path):
    """A line job run by a plain RQ worker logs, once, that a dead horse would stall the
    key's line with no rq_mutex.Worker to sweep it, and names the fix; run by an
    rq_mutex.Worker it says nothing."""
    name = f"w-{run}"
    conn.delete(NO_LINE_KEEPER_FLAG + name)
    sent = [queue.enqueue(jobs.in_line, run, "e", i) for i in range(2)]
    log = tmp_path / "worker.log"
    worker_proc = start(["rq", "worker", "-u", jobs.REDIS_URL, "-w", worker, "-n", name,
                         "--burst", queue.name], log)  # fmt: skip
    try:
        worker_proc.wait(timeout=60)
    finally:
        stop([worker_proc])
    assert [j.get_status(refresh=True) for j in sent] == [JobStatus.FINISHED] * 2
    text = log.read_text(errors="replace")
    plain = worker != "rq_mutex.Worker"
    assert ("which is not an rq_mutex.Worker" in text) == plain, text[-2000:]
    assert sum(f"job {j.id} (on_busy in a line" in text for j in sent) == plain  # once
    assert ("rq worker -w rq_mutex.Worker" in text) == plain
    assert bool(conn.exists(NO_LINE_KEEPER_FLAG + name)) == plain


def test_enqueue_many_keeps_the_line(conn, run, queue):
    """``enqueue_many`` pushes in one pipeline through RQ's private ``_enqueue_job``: the
    jobs behind the first are still parked, and run in order."""
    sent = queue.enqueue_many([Queue.prepare_data(jobs.in_line, (run, "e", i)) for i in range(5)])
    assert queue.count == 1
    for _ in range(5):
        SimpleWorker([queue], connection=conn).work(burst=True)
    assert [j.get_status(refresh=True) for j in sent] == [JobStatus.FINISHED] * 5
    assert order(conn, run) == {"e": list(range(5))}


def test_a_parked_job_holds_no_worker(conn, run, queue, rq_workers):
    """Two workers; one key's holder runs 4 s with three more jobs of that key behind it.
    With on_busy="wait" both workers would sit on the key; here the ten jobs of other
    keys all run while the holder still holds it."""
    for _ in range(2):
        rq_workers(*WORKER)
    first = queue.enqueue(jobs.in_line, run, "busy", 0, hold=4.0)
    started(conn, run, 0, "busy")
    behind = [queue.enqueue(jobs.in_line, run, "busy", item, hold=0.05) for item in (1, 2, 3)]
    others = [queue.enqueue(jobs.in_line, run, f"o{i}", 0, hold=0.05) for i in range(10)]
    wait_until(lambda: ended(others), 30, "the other keys' jobs")
    assert first.get_status(refresh=True) == JobStatus.STARTED, "they ran during the hold"
    assert {j.get_status(refresh=True) for j in behind} == {JobStatus.SCHEDULED}, "parked"
    wait_until(lambda: ended([first, *behind]), 30, "the busy key's line")
    assert order(conn, run)["busy"] == [0, 1, 2, 3]
    assert_one_at_a_time(conn, run)


def test_a_job_that_raises_passes_the_turn_on(conn, run, queue, rq_workers):
    rq_workers(*WORKER)
    rq_workers(*WORKER)
    sent = [queue.enqueue(jobs.in_line, run, "e", i, fail=(i == 2)) for i in range(5)]
    wait_until(lambda: ended(sent), 60, "the line")
    assert [j.get_status() for j in sent] == [
        JobStatus.FINISHED, JobStatus.FINISHED, JobStatus.FAILED,
        JobStatus.FINISHED, JobStatus.FINISHED,
    ]  # fmt: skip
    assert order(conn, run) == {"e": [0, 1, 2, 3, 4]}
    assert_one_at_a_time(conn, run)


def test_rqs_own_retry_keeps_the_turn(conn, run, queue, rq_workers):
    """Item 1 fails its first attempt; RQ retries it (``retry=Retry(max=2)``) and the
    retry runs before item 2, though item 2 was waiting."""
    rq_workers(*WORKER, "--with-scheduler")
    rq_workers(*WORKER)
    sent = []
    for i in range(4):
        job, retry = (
            (jobs.in_line_flaky, Retry(max=2, interval=1)) if i == 1 else (jobs.in_line, None)
        )
        sent.append(queue.enqueue(job, run, "e", i, hold=0.2, retry=retry))
    wait_until(lambda: ended(sent), 60, "the line")
    assert [j.get_status() for j in sent] == [JobStatus.FINISHED] * 4
    assert order(conn, run) == {"e": [0, 1, 1, 2, 3]}
    assert_one_at_a_time(conn, run)


@pytest.mark.parametrize("retried", [False, True], ids=["no-retry", "rq-retry"])
def test_a_horse_sigkilled_mid_line(conn, run, queue, rq_workers, retried):
    """Item 2's horse is SIGKILLed while it holds the key. Without a retry it never runs
    again and the line goes on with item 3 once its lease (6 s) lapsed and a worker
    swept; with ``retry=Retry(max=1)`` it runs again in its own turn, before item 3
    (its dead attempt's lock is freed at once). The rest run once each, in order."""
    rq_workers(*WORKER, "--with-scheduler")
    rq_workers(*WORKER)
    retry = Retry(max=1, interval=1) if retried else None
    sent = [
        queue.enqueue(jobs.in_line, run, "e", i, hold=8.0 if i == 2 else 0.05, retry=retry)
        for i in range(6)
    ]
    victim = started(conn, run, 2)
    killed_at = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    wait_until(lambda: ended(sent), 90, "the line")
    got = order(conn, run)["e"]
    if retried:
        assert got == [0, 1, 2, 3, 4, 5]
        assert [r["item"] for r in records(conn, run, "started")].count(2) == 2
        assert [j.get_status() for j in sent] == [JobStatus.FINISHED] * 6
    else:
        assert got == [0, 1, 3, 4, 5]
        assert sent[2].get_status() == JobStatus.FAILED
        resumed = started(conn, run, 3)["at"] - killed_at
        print(f"the line went on {resumed:.1f} s after the kill")
        assert resumed < 6 + 2 * 5 + 3, f"the line stalled {resumed:.1f} s after the kill"
    assert_one_at_a_time(conn, run, killed=1)


def test_a_whole_worker_sigkilled_mid_line(conn, run, queue, rq_workers):
    """The worker running item 2 is SIGKILLed with its horse: nobody reaps it. Its lock
    lapses with the lease; the other worker's sweep then ends the dead turn and item 3
    runs; every other item runs once, in order."""
    doomed = rq_workers(*WORKER)
    sent = [
        queue.enqueue(jobs.in_line, run, "e", i, hold=8.0 if i == 2 else 0.05) for i in range(6)
    ]
    victim = started(conn, run, 2)
    rq_workers(*WORKER)  # the survivor, started once item 2 is held by the doomed one
    killed_at = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    doomed.kill()
    doomed.wait(timeout=10)
    wait_until(lambda: started_items(conn, run) >= {3, 4, 5}, 60, "the line to go on")
    resumed = started(conn, run, 3)["at"] - killed_at
    wait_until(lambda: ended(sent[3:]), 30, "the rest of the line")
    assert order(conn, run)["e"] == [0, 1, 3, 4, 5]
    print(f"the line went on {resumed:.1f} s after the kill")
    assert resumed < 6 + 2 * 5 + 3, f"the line stalled {resumed:.1f} s after the kill"
    assert_one_at_a_time(conn, run, killed=1)


def test_a_head_taken_by_a_worker_that_died_before_its_horse_runs_in_its_place(
    conn, run, queue, rq_workers
):
    """Item 0 is popped off its queue by a worker that dies before it forks a horse
    (done here as RQ's dequeue does it: LMOVE into the queue's intermediate list, and
    nothing after); items 1 and 2 wait parked behind it. RQ keeps item 0 QUEUED there
    until its maintenance fails it, minutes later. The line's sweep sends item 0 again
    in its place, from the line's copy: 0, 1, 2 run in order, each once. (Before, item 0
    was stepped over gap_for after items 1 and 2 began to wait: 1 and 2 ran, and 0 was
    failed by RQ's maintenance about 20 minutes later, never run.)"""
    sent = [queue.enqueue(jobs.in_line, run, "e", i, hold=0.05) for i in range(3)]
    assert queue.count == 1  # 1 and 2 parked at the send
    assert conn.lmove(queue.key, queue.intermediate_queue_key) == sent[0].id.encode()
    rq_workers(*WORKER)
    wait_until(lambda: ended(sent), 60, "the line to run")
    assert order(conn, run)["e"] == [0, 1, 2]
    assert [j.get_status() for j in sent] == [JobStatus.FINISHED] * 3
    assert conn.lpos(queue.intermediate_queue_key, sent[0].id) is None  # RQ fails nothing


def test_a_head_begun_by_a_horse_that_died_with_its_worker_runs_in_its_place(
    conn, run, queue, rq_workers
):
    """As above, one step later: the dead worker's horse had marked item 0 STARTED (with
    its execution in the started registry, heartbeated no more) before the line saw it
    run. Once that heartbeat lapsed, a sweep sends it again; 0, 1, 2 run in order, and
    the dead execution's entry is gone, so RQ's own cleanup never fails the job after
    its run. (Made by hand as RQ leaves it: a SIGKILL
    cannot be timed between a horse's first write and the line's.)"""
    sent = [queue.enqueue(jobs.in_line, run, "e", i, hold=0.05) for i in range(3)]
    assert conn.lmove(queue.key, queue.intermediate_queue_key) == sent[0].id.encode()
    sent[0].set_status(JobStatus.STARTED)
    dead = f"{sent[0].id}:dead-execution"
    # Its heartbeat lapses 10 s from now: after the worker's start-up maintenance, which
    # would fail a job abandoned already (RQ's own judgement; then it never runs).
    conn.zadd(queue.started_job_registry.key, {dead: time.time() + 10})
    rq_workers(*WORKER)
    wait_until(lambda: ended(sent), 60, "the line to run")
    assert order(conn, run)["e"] == [0, 1, 2]
    assert [j.get_status() for j in sent] == [JobStatus.FINISHED] * 3
    assert conn.zscore(queue.started_job_registry.key, dead) is None


def started_items(conn: redis.Redis, run: str) -> set[int]:
    return {r["item"] for r in records(conn, run, "started")}


def test_a_parked_job_cancelled_or_deleted_is_stepped_over(conn, run, queue, rq_workers):
    """Items 1 and 2 wait parked behind item 0; item 1 is cancelled and item 2 deleted
    while they wait. Neither will ever run, so neither may hold the line: item 3 runs
    as soon as item 0 ends."""
    rq_workers(*WORKER)
    rq_workers(*WORKER)
    sent = [
        queue.enqueue(jobs.in_line, run, "e", i, hold=3.0 if i == 0 else 0.05) for i in range(4)
    ]
    started(conn, run, 0)
    wait_until(
        lambda: all(j.get_status(refresh=True) == JobStatus.SCHEDULED for j in sent[1:]),
        30,
        "items 1 to 3 to park",
    )
    sent[1].cancel()
    sent[2].delete()
    wait_until(lambda: ended([sent[0], sent[3]]), 30, "item 3 to run")
    assert sent[3].get_status() == JobStatus.FINISHED
    assert order(conn, run) == {"e": [0, 3]}


# -- keep latest and debounce ----------------------------------------------------------------


def test_keep_latest_runs_the_first_and_the_last_of_a_burst(conn, run, queue, rq_workers):
    """50 jobs of one key enqueued at once: the first runs (until all were enqueued), the
    last runs after it with its own arguments, and the 48 between finish at once with the
    skip marker (reason superseded, naming the job that took their place); none runs
    twice."""
    rq_workers(*WORKER)
    rq_workers(*WORKER)
    conn.set(jobs.held(run), 1, ex=120)  # the first runs until all 50 were enqueued
    sent = [queue.enqueue(jobs.latest_of, run, "e", i, hold=0.5) for i in range(50)]
    conn.delete(jobs.held(run))
    wait_until(lambda: ended(sent), 90, "the burst")
    assert order(conn, run) == {"e": [0, 49]}
    assert [sent[0].return_value(), sent[49].return_value()] == [0, 49]
    between = [j.return_value() for j in sent[1:49]]
    assert all(is_skipped(m) and m["reason"] == "superseded" for m in between)
    # Each names a job enqueued after it: the one in its place when it finished.
    later = {j.id: i for i, j in enumerate(sent)}
    assert all(later[m["by"]] > i for i, m in enumerate(between, start=1))
    assert Counter(j.get_status() for j in sent) == {JobStatus.FINISHED: 50}


def test_keep_latest_loses_nothing_to_a_killed_holder(conn, run, queue, rq_workers):
    """The first job's horse is SIGKILLed while it holds, 20 more wait behind it: the last
    of them still runs, once, after the dead lease lapsed; the rest are superseded."""
    rq_workers(*WORKER)
    rq_workers(*WORKER)
    first = queue.enqueue(jobs.latest_of, run, "e", 0, hold=8.0)
    victim = started(conn, run, 0)
    rest = [queue.enqueue(jobs.latest_of, run, "e", i) for i in range(1, 21)]
    os.kill(victim["pid"], signal.SIGKILL)
    wait_until(lambda: ended([first, *rest]), 60, "the line")
    assert order(conn, run) == {"e": [20]}
    assert rest[-1].return_value() == 20
    assert all(is_skipped(j.return_value()) for j in rest[:-1])


def test_debounce_runs_once_per_burst_with_its_last_arguments(conn, run, queue, rq_workers):
    """Three bursts of ten enqueues 50 ms apart, 2.5 s between bursts (period 1 s,
    max_delay 3 s): one run per burst, with the burst's last arguments, no earlier than
    the period after its last enqueue and at most a few seconds past the due time (RQ's
    scheduler moves it, a sweep too)."""
    rq_workers(*WORKER, "--with-scheduler")
    rq_workers(*WORKER)
    bursts: list[list[tuple[float, Job]]] = []
    for b in range(3):
        bursts.append([])
        for i in range(10):
            bursts[-1].append((time.time(), queue.enqueue(jobs.debounced, run, "e", b * 10 + i)))
            time.sleep(0.05)
        time.sleep(2.5)
    every = [job for burst in bursts for _, job in burst]
    wait_until(lambda: ended(every), 60, "the bursts")
    assert order(conn, run) == {"e": [9, 19, 29]}
    starts = {r["item"]: r["wall"] for r in records(conn, run, "started")}
    for burst in bursts:
        (first_at, _), (last_at, last) = burst[0], burst[-1]
        due = min(last_at + jobs.DEBOUNCE["period"], first_at + jobs.DEBOUNCE["max_delay"])
        ran = starts[last.return_value()]
        print(f"burst ran {ran - due:+.2f} s from its due time")
        assert ran >= due - 0.05, "it ran before its burst was over"
        assert ran <= due + 3.0, f"it ran {ran - due:.2f} s late"
        assert all(is_skipped(job.return_value()) for _, job in burst[:-1])


def test_a_failed_job_requeued_runs_again_in_a_new_place(conn, run, queue):
    """``job.requeue()`` of a job whose run failed (what ``rq requeue`` does): its turn
    is over, but it is a re-run, not a copy: it takes a new place and its body runs
    again (it was dropped as a duplicate, its work lost)."""
    failing = queue.enqueue(jobs.in_line, run, "e", 0, fail=True)
    after = queue.enqueue(jobs.in_line, run, "e", 1)
    for _ in range(3):
        SimpleWorker([queue], connection=conn).work(burst=True)
    assert [failing.get_status(refresh=True), after.get_status(refresh=True)] == [
        JobStatus.FAILED, JobStatus.FINISHED,
    ]  # fmt: skip
    failing.requeue()
    SimpleWorker([queue], connection=conn).work(burst=True)
    assert [r["item"] for r in records(conn, run, "started")] == [0, 1, 0]
    assert failing.get_status(refresh=True) == JobStatus.FAILED  # it failed again, as told


def test_a_failed_enqueue_many_leaves_no_gap_in_the_line(conn, run, queue):
    """``enqueue_many`` whose fourth job has no key (its template's argument missing)
    raises before it pushes anything: the three places it took are given back, so the
    next job of the key runs at once instead of waiting gap_for behind them; and a full
    line's refusal in a batch does the same."""
    batch = [Queue.prepare_data(jobs.in_line, (run, "e", i)) for i in range(3)]
    batch.append(Queue.prepare_data(jobs.in_line, (run,), {"item": 3}))  # no entity
    with pytest.raises(ConstraintError):
        queue.enqueue_many(batch)
    assert queue.count == 0
    full = [Queue.prepare_data(jobs.in_short_line, (run, "f", i)) for i in range(5)]
    with pytest.raises(LineFullError):
        queue.enqueue_many(full)
    now = [queue.enqueue(jobs.in_line, run, "e", 9), queue.enqueue(jobs.in_short_line, run, "f", 9)]
    SimpleWorker([queue], connection=conn).work(burst=True)
    assert [j.get_status(refresh=True) for j in now] == [JobStatus.FINISHED] * 2


def test_one_meta_dict_for_several_enqueues_gives_each_its_own_place(conn, run, queue):
    """The caller's ``meta=`` dict is not written to: passed to two enqueues (the second
    for later), each job has its own place, and both run."""
    shared: dict[str, Any] = {"source": "import"}
    first = queue.enqueue(jobs.in_line, run, "e", 0, meta=shared)
    second = queue.enqueue(jobs.in_line, run, "e", 1, meta=shared)
    assert shared == {"source": "import"}
    assert first.meta[META] != second.meta[META]
    for _ in range(3):
        SimpleWorker([queue], connection=conn).work(burst=True)
    assert [first.return_value(), second.return_value()] == [0, 1]


def test_a_job_parked_at_a_worker_keeps_its_own_retries(conn, run, queue, rq_workers):
    """A job that parked at a worker (it took its place there: made with ``Job.create``)
    and then returns its own ``rq.Retry(max=1)`` is run once more: its park, which RQ
    counts as a retry, is not held against it (it failed, and the line then waited
    gap_for for a retry RQ would never make)."""
    rq_workers(*WORKER, "--with-scheduler")
    rq_workers(*WORKER)
    holder = queue.enqueue(jobs.in_line, run, "e", 0, hold=2.0)
    started(conn, run, 0)
    asks = Job.create(jobs.in_line_asks_again, args=(run, "e", 1), connection=conn)
    queue.enqueue_job(asks)
    wait_until(lambda: asks.get_status(refresh=True) == JobStatus.SCHEDULED, 30, "it to park")
    after = queue.enqueue(jobs.in_line, run, "e", 2)  # behind it (its place is taken)
    wait_until(lambda: ended([holder, asks, after]), 60, "the line")
    assert asks.get_status() == JobStatus.FINISHED
    assert asks.return_value() == 1
    assert [r["item"] for r in sorted(records(conn, run), key=lambda r: r["start"])] == [0, 1, 1, 2]


@pytest.mark.parametrize("overlap", ["skip", "buffer"])
def test_rq_cron_overlap_skip_or_buffer_one(conn, run, queue, rq_workers, overlap):
    """``rq cron`` enqueues a 2.5 s job every second. ``on_busy="skip"`` (Temporal's SKIP):
    the ticks that find it running are skipped (reason busy), so runs have gaps.
    ``on_busy="latest"`` (BUFFER_ONE): one tick waits and runs as soon as the last run
    ends, the ticks beyond it superseded. Never two runs at once either way."""
    rq_workers(*WORKER)
    rq_workers(*WORKER)
    env = {"RQT_GUARD": "1", "RQT_OVERLAP": overlap, "RQT_QUEUE": queue.name, "RQT_NAME": run}
    test_rq.run_rq_cron(7, env, started=lambda: bool(records(conn, run, "started")))

    def settled() -> bool:
        registries = (queue.started_job_registry, queue.scheduled_job_registry)
        return queue.count == 0 and not any(r.get_job_ids() for r in registries)

    wait_until(settled, 30, "the ticks' jobs to end")
    ticks = [Job.fetch(i, connection=conn) for i in queue.finished_job_registry.get_job_ids()]
    results = [t.return_value() for t in ticks]
    reasons = Counter(r.get("reason", "busy") for r in results if is_skipped(r))
    sections = sorted(records(conn, run), key=lambda r: r["start"])
    assert len(sections) >= 2
    assert len(sections) + sum(reasons.values()) == len(ticks)  # each tick ran or said why
    assert_one_at_a_time(conn, run)
    gaps = [b["start"] - a["end"] for a, b in itertools.pairwise(sections)]
    if overlap == "buffer":
        assert "busy" not in reasons  # none dropped as busy: one waits, newer replace it
        assert max(gaps) < 1.5, f"a buffered tick waited {max(gaps):.2f} s after a run"
    else:
        assert reasons["busy"] >= 1  # the ticks during a run were skipped
        assert "superseded" not in reasons


def test_a_full_line_raises_at_the_enqueue_or_skips(conn, run, queue):
    """``queue={"max": 3}``: the fourth enqueue of a key with nothing run yet raises
    LineFullError, naming the fix; with on_full="skip" the
    job is enqueued and finishes at once with the skip marker, its body never run."""
    for i in range(3):
        queue.enqueue(jobs.in_short_line, run, "e", i)
    with pytest.raises(LineFullError, match="queue_max=3"):
        queue.enqueue(jobs.in_short_line, run, "e", 3)
    kept = [queue.enqueue(jobs.in_line_or_skip, run, "s", i) for i in range(3)]
    SimpleWorker([queue], connection=conn).work(burst=True)
    assert [is_skipped(j.return_value()) for j in kept] == [False, False, True]
    assert kept[2].return_value()["reason"] == "line full"
    assert order(conn, run)["s"] == [0, 1]


def test_a_duplicate_delivery_runs_once(conn, run, queue):
    """The same job id enqueued again after it ran: the copy finishes with the skip
    marker (reason "duplicate"); the body ran once."""
    job = queue.enqueue(jobs.in_line, run, "e", 0)
    SimpleWorker([queue], connection=conn).work(burst=True)
    assert job.return_value() == 0
    queue.enqueue_job(Job.fetch(job.id, connection=conn))
    SimpleWorker([queue], connection=conn).work(burst=True)
    again = Job.fetch(job.id, connection=conn).return_value()
    assert is_skipped(again)
    assert again["reason"] == "duplicate"
    assert len(records(conn, run)) == 1


def test_a_scheduled_job_takes_its_place_when_it_arrives(conn, run, queue):
    """``enqueue_in`` sends it for later: it holds no place in the line meanwhile (the
    jobs sent after it run), and takes one when it reaches a worker."""
    later = queue.enqueue_in(timedelta(seconds=60), jobs.in_line, run, "e", 0)
    assert META not in later.meta
    now = queue.enqueue(jobs.in_line, run, "e", 1)
    SimpleWorker([queue], connection=conn).work(burst=True)
    assert now.return_value() == 1
    lines = Lines(RedisCache(conn), lease=6)
    line = lines.read(f"line.{run}.e")
    assert line is not None
    assert line.running is None
    assert not line.parked


def test_a_synchronous_queue_runs_it_at_once(conn, run):
    sync = Queue(f"rqt-sync-{run}", connection=conn, is_async=False)
    job = sync.enqueue(jobs.in_line, run, "e", 0)
    assert job.return_value() == 0
    assert META not in job.meta  # no line there: a ticket would be a gap in it


def test_queue_is_refused_for_an_async_job_function():
    with pytest.raises(ConstraintError, match="plain def"):

        @mutex_job(key="k", on_busy="queue")
        async def job() -> None: ...


@pytest.mark.parametrize(
    ("options", "fix"),
    [
        ({"permits": 2}, "drop permits"),
        ({"queue": {"max": 0}}, "max"),
        ({"queue": {"limit": 3}}, "unknown"),
    ],
)
def test_bad_queue_options_are_refused(options, fix):
    with pytest.raises(ConstraintError, match=fix):
        mutex_job(key="k", on_busy="queue", **options)


def test_simple_mutex_list_shows_rq_lines(conn, run, queue):
    """18 jobs on 3 keys enqueued with no worker up: each key's first is queued, the other
    five park at the enqueue. ``simple-mutex list`` (run as an operator runs it) shows
    each key's line with 5 parked and nothing held: RQ's lines stand where Celery's do."""
    for entity in ("a", "b", "c"):
        for item in range(6):
            queue.enqueue(jobs.in_line, run, entity, item)
    listed = subprocess.run(
        [str(Path(sys.executable).parent / "simple-mutex"), "list", jobs.REDIS_URL, "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    ours = {row["key"]: row for row in json.loads(listed.stdout) if run in row["key"]}
    assert {key: row.get("parked") for key, row in ours.items()} == {
        f"line.{run}.{entity}": 5 for entity in ("a", "b", "c")
    }
    assert all(row["fence"] is None for row in ours.values())  # nothing held yet
    lines = Lines(RedisCache(conn), lease=6)
    conn.delete(*(lines.cache_key(key) for key in ours))
    queue.delete(delete_jobs=True)
