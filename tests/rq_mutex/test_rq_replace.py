"""``mutex_job(on_busy="replace")`` under real ``rq worker -w rq_mutex.Worker`` processes:
the newest job takes the key from the running holder with a larger fence and has it
stopped; the stopped holder ends FAILED with SimpleMutexLeaseExpiredError and its fenced
writes are refused.

The holder is ``rq_support.replace_jobs.writer``: a fenced write every 20 ms, each
outcome logged. "After the takeover" means after the new holder's first fenced write: from
then on the store knows the new fence (between the takeover and that write it cannot).

Needs Redis at 127.0.0.1:6379. A missing server fails the tests; it never skips them.
"""

from __future__ import annotations

import os
import signal

import pytest
import redis
import test_rq
from replaced_writer import STORE_URL, Checks, after
from rq.job import Job, JobStatus
from rq_support import replace_jobs
from test_rq import exc_text
from workers import wait_until

# isort: split
from rq_mutex import Queue, mutex_job
from simple_mutex import ConstraintError, Mutex
from simple_mutex.caches import RedisCache

pytestmark = pytest.mark.integrations

conn, run, queue, rq_workers = test_rq.conn, test_rq.run, test_rq.queue, test_rq.rq_workers

WORKER = ("-w", "rq_mutex.Worker")  # answers the stop, gives its horses the handler
ENDED = (JobStatus.FINISHED, JobStatus.FAILED, JobStatus.STOPPED)


class Docs(Checks):
    """One test's view of the writers' rows, the fenced store and the lock."""

    def __init__(self, conn: redis.Redis, run: str, queue: Queue) -> None:
        self.conn, self.run, self.queue = conn, run, queue
        self.record, self.prefix = conn, f"rqr:{run}:"
        self.store = redis.Redis.from_url(STORE_URL)
        self.locks = Mutex(RedisCache(conn), lease=30)

    def write(self, doc: str, name: str, writes: int, deaf: bool = False) -> Job:
        return self.queue.enqueue(replace_jobs.writer, self.run, doc, name, writes, deaf)

    def key(self, doc: str) -> str:
        return f"doc.{self.run}.{doc}"


@pytest.fixture
def docs(conn: redis.Redis, run: str, queue: Queue) -> Docs:
    return Docs(conn, run, queue)


def ends(job: Job, timeout: float = 60) -> JobStatus:
    wait_until(lambda: job.get_status(refresh=True) in ENDED, timeout, f"job {job.id} to end")
    return JobStatus(job.get_status())


def failed_with_lease_expired(job: Job) -> None:
    assert ends(job) == JobStatus.FAILED, job.get_status()
    text = exc_text(job)
    assert "SimpleMutexLeaseExpiredError" in text, text
    assert "lost" in text or "lapsed" in text, text


def test_the_newest_job_replaces_the_running_holder(docs, rq_workers):
    """A holder writing (300 writes, 6 s and more: less than the 10 s its renewal would
    take to find the lease gone) is replaced by a newer job: the new one runs with a
    larger fence and all its 20 writes land; the old one is stopped (it never finishes
    its loop), 0 of its writes after the new holder's first are accepted, and it ends
    FAILED with SimpleMutexLeaseExpiredError. The key is free at the end."""
    for _ in range(2):
        rq_workers(*WORKER)
    doc = "d"
    old, new, sent = docs.replacing(doc, 300, 20)
    assert ends(new) == JobStatus.FINISHED, exc_text(new)
    assert new.return_value() == "new"
    failed_with_lease_expired(old)
    first_new, old_writes = docs.takeover(doc)
    docs.finished_alone(doc, "new", 20)
    assert len(old_writes) < 300
    wait_until(lambda: not docs.locks.locked(docs.key(doc)), 10, "the key to be free")
    print(f"\nRQ replace: {docs.timings(doc, sent, first_new, old_writes)}")


def test_a_holder_deaf_to_the_stop_has_every_later_write_refused(docs, rq_workers):
    """A holder that catches the loss interrupt and writes on (60 writes) keeps its old
    fence: every one of its writes after the new holder's first is refused (some are
    made, 0 accepted), the new holder's all land, and the deaf one still ends FAILED with
    SimpleMutexLeaseExpiredError (its lease was lost, whatever its body did)."""
    for _ in range(2):
        rq_workers(*WORKER)
    doc = "d"
    old, new, _ = docs.replacing(doc, 60, 10, deaf=True)
    assert ends(new) == JobStatus.FINISHED, exc_text(new)
    failed_with_lease_expired(old)
    refused = docs.deaf(doc, 60, 10)
    print(f"\nRQ replace, deaf holder: {refused} later writes, all refused")


def test_a_sigkilled_holder_loses_nothing_and_runs_nothing_twice(docs, rq_workers):
    """j1 runs; j2 replaces it; j2's horse is SIGKILLed mid-way; j3 then replaces what
    is left: j1 FAILED (lease lost), j2 FAILED (its horse died), j3 FINISHED; each job's
    body started exactly once; only j3 finished its loop; fences rise j1 < j2 < j3; the
    store ends on j3's last write and the key is free."""
    for _ in range(2):
        rq_workers(*WORKER)
    doc = "d"
    j1, j2, j3 = docs.killed_between(doc, ("j1", "j2", "j3"))
    assert ends(j3) == JobStatus.FINISHED, exc_text(j3)
    failed_with_lease_expired(j1)
    assert ends(j2) == JobStatus.FAILED
    docs.chain(doc, ("j1", "j2", "j3"), 10)
    wait_until(lambda: not docs.locks.locked(docs.key(doc)), 10, "the key to be free")


def test_the_lease_passes_on_when_the_holders_worker_cannot_be_reached(docs, rq_workers):
    """The holder's worker main process is SIGSTOPped (the stop reaches nobody; its horse
    runs on): the new job takes the key all the same, on the other worker; the
    unreachable holder writes with its old fence, is refused, and finds its lease lost at
    its next renewal (30 s lease: within 10 s), ending FAILED."""
    for _ in range(2):
        rq_workers(*WORKER)
    doc = "d"
    old, main = docs.holder_unreachable(doc, 1500)  # 30 s of writes
    try:
        new = docs.write(doc, "new", 10)  # the stopped worker dequeues nothing
        assert ends(new) == JobStatus.FINISHED, exc_text(new)
        failed_with_lease_expired(old)
    finally:
        os.kill(main, signal.SIGCONT)
    first_new, old_writes = docs.taken_from_unreachable(doc, 1500)
    assert after(old_writes, first_new, "refused")
    stopped = docs.ended(doc, "old") - first_new
    print(f"\nRQ replace, unreachable holder: stopped by its renewal {stopped:.3f} s later")


# -- no worker -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "fix"),
    [
        ({"permits": 2}, "permits=2 there is no single holder to replace: drop permits"),
        ({"timeout": 1}, "drop timeout"),
        ({"renew": False}, "drop renew=False"),
    ],
)
def test_replace_with_an_option_it_cannot_honour_raises_naming_the_fix(options, fix):
    with pytest.raises(ConstraintError, match=fix):
        mutex_job(key="k.{n}", on_busy="replace", **options)


def test_replace_refuses_an_async_job_function():
    """Its lease renews on its own loop, which the stop cannot reach: refused, naming it."""
    with pytest.raises(ConstraintError, match=r"async job function .*plain def"):

        @mutex_job(key="k.{n}", on_busy="replace")
        async def job(n: int) -> int:
            return n


def test_a_synchronous_replace_runs_when_the_key_is_free(conn, run):
    """Queue(is_async=False) has no worker to stop a holder through: it takes a free key
    and runs."""
    sync = Queue(f"rqt-{run}-sync", connection=conn, is_async=False)
    job = sync.enqueue(replace_jobs.writer, run, "s", "only", 3)
    assert job.get_status() == JobStatus.FINISHED, exc_text(job)
    assert job.return_value() == "only"
    assert Docs(conn, run, sync).stored("s")[0] == b"only.2"
