"""A job whose work horse died while it held its lock, run again under the same job id.

Real ``rq worker`` processes (the forking ``Worker``) and a real Redis (db 12). The job
(``jobs.hold_on_attempts``, ``on_busy="skip"``, a 30 s lease) counts its attempts; its first
attempt holds the lock until it is killed. The horse is taken down three ways: SIGKILL (an
OOM kill), ``send_stop_job_command``, and a cold worker shutdown (two SIGTERMs). Each time
the next run of the same job id must run the body exactly once more and finish with the
real result, long before the dead attempt's lease would have lapsed. And a holder that is
alive (a worker SIGKILLed under its horse, a second live attempt) is never entered.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import test_rq
from rq import Retry
from rq.command import send_stop_job_command
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry
from rq_support import jobs
from rq_support.workers import Worker  # RQ's, but a shutdown never waits a minute
from test_rq import burst, records
from workers import start, stop, wait_until

# isort: split
from rq_mutex import is_skipped

pytestmark = pytest.mark.integrations

# test_rq's fixtures: its Redis (db 12), a run id, the run's queue, real `rq worker`s.
conn, run, queue, rq_workers = test_rq.conn, test_rq.run, test_rq.queue, test_rq.rq_workers

REAPING = ("-w", "rq_mutex.Worker")  # rq_mutex in the worker's main process
ENDED = (JobStatus.FINISHED, JobStatus.FAILED, JobStatus.STOPPED)


def holding(conn: redis.Redis, run: str, attempts: int) -> dict[str, Any]:
    """Wait until attempt number ``attempts`` runs; its record (pid, fence, lease end)."""
    wait_until(lambda: len(records(conn, run, "attempts")) >= attempts, 30, "the attempt")
    return records(conn, run, "attempts")[attempts - 1]


def ended(job: Job) -> bool:
    return job.get_status(refresh=True) in ENDED


def assert_ran_once_more(conn: redis.Redis, run: str, job: Job) -> None:
    """The second run entered the body once, got a fresh grant while the dead attempt's
    lease was still valid (so it was freed, not waited out), and returned the real result."""
    attempts = records(conn, run, "attempts")
    assert [r["attempt"] for r in attempts] == [1, 2], "the second run never entered the body"
    first, second = attempts
    assert [r["attempt"] for r in records(conn, run, "done")] == [2]
    assert second["pid"] != first["pid"]
    assert second["at"] < first["expires"]  # the dead attempt's record had not lapsed
    assert second["fence"] > first["fence"]  # a new grant, not the dead one's fence
    assert job.get_status(refresh=True) == JobStatus.FINISHED
    assert job.return_value() == "attempt 2"
    assert not job.meta.get("rq_mutex_skipped")


@pytest.fixture
def strays() -> Iterator[list[int]]:
    """Pids of work horses a test orphaned; killed at teardown, whatever happened."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    "work",
    [jobs.hold_on_attempts, jobs.hold_on_attempts_waiting, jobs.hold_on_attempts_async],
    ids=["skip", "wait", "async"],
)
def test_retry_after_sigkilled_horse_runs_the_body(conn, run, queue, rq_workers, work):
    """Retry(max=2), the horse SIGKILLed while it holds the lock (what the OOM killer does):
    the worker reaps it and RQ re-enqueues the same job id; that run is not turned away by
    its own dead attempt (skipped, or for on_busy="wait" kept waiting for its lease): it
    runs the body and finishes with the real result. The same for an ``async def`` job."""
    rq_workers(*REAPING)
    job = queue.enqueue(work, run, retry=Retry(max=2))
    first = holding(conn, run, 1)
    os.kill(first["pid"], signal.SIGKILL)
    wait_until(lambda: ended(job), 30, "the retried job to end")
    assert_ran_once_more(conn, run, job)


def test_requeue_after_stop_job_command_runs_the_body(conn, run, queue, rq_workers):
    """``send_stop_job_command`` kills the horse (the job ends STOPPED, never retried by
    RQ); requeued, the same job id runs the body once more instead of being skipped."""
    rq_workers(*REAPING)
    job = queue.enqueue(jobs.hold_on_attempts, run)
    holding(conn, run, 1)
    send_stop_job_command(conn, job.id)
    wait_until(lambda: ended(job), 30, "the job to stop")
    assert job.get_status() == JobStatus.STOPPED
    job.requeue()
    wait_until(lambda: ended(job), 30, "the requeued job to end")
    assert_ran_once_more(conn, run, job)


def test_retry_after_cold_shutdown_runs_the_body(conn, run, queue, rq_workers):
    """A cold shutdown (a second SIGTERM) kills and reaps the horse, then the worker exits;
    the job is left STARTED until RQ's abandoned-job cleanup retries it (forced here with
    a late timestamp instead of waiting for the heartbeat to lapse); a forking Worker then
    runs the body once more."""
    worker = rq_workers(*REAPING)
    job = queue.enqueue(jobs.hold_on_attempts, run, retry=Retry(max=2))
    holding(conn, run, 1)
    worker.send_signal(signal.SIGTERM)  # warm: waits for the horse
    time.sleep(1.5)  # RQ ignores a second signal within 1 s of the first
    worker.send_signal(signal.SIGTERM)  # cold: kills the horse, waits for it, exits
    worker.wait(timeout=20)
    assert job.get_status(refresh=True) == JobStatus.STARTED
    StartedJobRegistry(queue=queue).cleanup(timestamp=time.time() + 3600)
    assert job.get_status(refresh=True) == JobStatus.QUEUED
    burst(queue, Worker)
    assert_ran_once_more(conn, run, job)


def test_orphaned_live_horse_is_never_entered(conn, run, queue, rq_workers, strays):
    """The worker itself SIGKILLed: its horse lives on, holding the lock, and RQ's
    abandoned-job cleanup retries the job (nothing reaped the horse). That run must find
    the lock busy and skip, never enter; the orphan then finishes the work itself."""
    worker = rq_workers(*REAPING)
    job = queue.enqueue(jobs.hold_on_attempts, run, retry=Retry(max=2))
    first = holding(conn, run, 1)
    strays.append(first["pid"])
    worker.kill()
    worker.wait(timeout=10)
    StartedJobRegistry(queue=queue).cleanup(timestamp=time.time() + 3600)
    burst(queue, Worker)
    job.refresh()
    assert is_skipped(job.return_value())
    assert job.meta["rq_mutex_skipped"] is True
    assert [r["attempt"] for r in records(conn, run, "attempts")] == [1]  # never entered
    conn.set(f"rqt:{run}:go", 1)
    wait_until(lambda: bool(records(conn, run, "done")), 20, "the orphan to finish")
    assert [r["attempt"] for r in records(conn, run, "done")] == [1]


def test_live_later_attempt_is_never_entered(conn, run, queue, rq_workers):
    """Attempt 1 is SIGKILLed and reaped, its retry (attempt 2) takes the lock and keeps
    it, alive; the same job id enqueued again by mistake runs on another worker while
    attempt 2 still holds: the reaped attempt 1 lets nobody into attempt 2's lock, so
    the copy is skipped, and attempt 2 finishes with its own result."""
    rq_workers(*REAPING)
    job = queue.enqueue(jobs.hold_on_attempts, run, (1, 2), retry=Retry(max=2))
    os.kill(holding(conn, run, 1)["pid"], signal.SIGKILL)
    holding(conn, run, 2)
    queue.enqueue_job(Job.fetch(job.id, connection=conn))  # the accidental re-enqueue
    copy_worker = Worker([queue], connection=conn)
    copy_worker.work(burst=True)
    copy = Job.fetch(job.id, connection=conn)
    assert is_skipped(copy.return_value())
    assert [r["attempt"] for r in records(conn, run, "attempts")] == [1, 2]  # not entered
    conn.set(f"rqt:{run}:go", 1)
    wait_until(lambda: bool(records(conn, run, "done")), 20, "attempt 2 to finish")
    assert [r["attempt"] for r in records(conn, run, "done")] == [2]


def test_plain_rq_worker_leaves_it_to_the_lease_and_says_so(conn, run, queue, tmp_path):
    """A plain ``rq worker`` never imports rq_mutex in its main process, so nothing
    records the horse's death: the retry finds the lock of its own dead attempt and is
    skipped, as before (the lock lapses with its lease), but not silently: the job's meta
    names its own job id as the holder, and the horse logs a warning naming the fix."""
    log = tmp_path / "worker.log"
    worker = start(["rq", "worker", "-u", jobs.REDIS_URL, queue.name], log=log)
    try:
        job = queue.enqueue(jobs.hold_on_attempts, run, retry=Retry(max=2))
        os.kill(holding(conn, run, 1)["pid"], signal.SIGKILL)
        wait_until(lambda: ended(job), 30, "the retried job to end")
    finally:
        stop([worker])
    job.refresh()
    assert is_skipped(job.return_value())
    assert job.meta["rq_mutex_holder"] == f"rq:{job.id}"
    assert [r["attempt"] for r in records(conn, run, "attempts")] == [1]
    assert "rq worker -w rq_mutex.Worker" in log.read_text()
