"""``on_busy="replace"`` for RQ: the newest job wins, also when an older one comes back
(its own ``Retry``, a job enqueued earlier with ``enqueue_in``), and a stop that reaches a
worker as it forks never ends the new horse. Real ``rq worker -w rq_mutex.Worker``
processes on Redis (db 12), as in ``test_rq_replace.py``.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import test_rq
from rq import Retry
from rq.job import JobStatus
from rq_support import replace_jobs
from test_rq import exc_text
from test_rq_replace import WORKER, Docs, ends, failed_with_lease_expired
from workers import wait_until

# isort: split
from rq_mutex import is_skipped
from rq_mutex.job import META_HOLDER, META_SKIP_REASON
from simple_mutex.busy.replace import STOP_SIGNAL

pytestmark = pytest.mark.integrations

conn, run, queue, rq_workers = test_rq.conn, test_rq.run, test_rq.queue, test_rq.rq_workers


@pytest.fixture
def docs(conn, run, queue) -> Docs:
    return Docs(conn, run, queue)


def superseded_by(job, newer) -> None:
    """``job`` finished as the skip marker, superseded by ``newer`` (its meta says so)."""
    assert ends(job) == JobStatus.FINISHED, exc_text(job)
    assert is_skipped(job.return_value()), job.return_value()
    assert job.return_value()["reason"] == "superseded"
    meta = job.get_meta(refresh=True)
    assert (meta[META_SKIP_REASON], meta[META_HOLDER]) == ("superseded", f"rq:{newer.id}")


def test_a_replaced_holders_retry_does_not_run_after_the_newer_job(docs, queue, rq_workers):
    """The holder has ``Retry(max=2, interval=2)``: replaced, it fails with the lost lease
    and RQ runs it again 2 s later, after the newer job (20 writes) has finished and the
    key is free; that attempt finds a newer job took the key from it and finishes
    superseded: its body never starts again, the store keeps the newer job's last write.
    Without the check the retry ran its old writes over the newer job's."""
    rq_workers(*WORKER, "--with-scheduler")
    rq_workers(*WORKER)
    doc = "d"
    retry = Retry(max=2, interval=2)
    old = queue.enqueue(replace_jobs.writer, docs.run, doc, "old", 300, retry=retry)
    docs.first_write(doc, "old")
    new = queue.enqueue(replace_jobs.writer, docs.run, doc, "new", 20)
    assert ends(new) == JobStatus.FINISHED, exc_text(new)
    assert new.return_value() == "new"
    wait_until(lambda: old.get_status(refresh=True) == JobStatus.FINISHED, 60, "old's retry")
    superseded_by(old, new)
    assert [r["name"] for r in docs.rows("started", doc)] == ["old", "new"]  # once each
    docs.takeover(doc)
    docs.finished_alone(doc, "new", 20)


def test_an_older_job_starting_late_gives_way_to_the_newer_holder(docs, queue, rq_workers):
    """A job enqueued first with ``enqueue_in`` starts while a job enqueued after it
    holds the key: the older one finishes superseded without running, the newer one is
    not disturbed (all its writes land). The older one is moved up from RQ's schedule
    once the newer one writes (a fixed 2 s delay raced the newer one's start on a loaded
    machine: the older then ran first, and was rightly replaced and failed)."""
    rq_workers(*WORKER, "--with-scheduler")
    rq_workers(*WORKER)
    doc = "d"
    older = queue.enqueue_in(timedelta(seconds=600), replace_jobs.writer, docs.run, doc,
                             "older", 10)  # fmt: skip
    new = queue.enqueue(replace_jobs.writer, docs.run, doc, "new", 250)  # 5 s and more
    docs.first_write(doc, "new")
    queue.scheduled_job_registry.remove(older)
    queue.enqueue_job(older)  # its time has come: it starts while the newer job holds
    assert ends(new, 90) == JobStatus.FINISHED, exc_text(new)
    superseded_by(older, new)
    assert [r["name"] for r in docs.rows("started", doc)] == ["new"]
    docs.finished_alone(doc, "new", 250)


def test_the_worker_ignores_the_stop_signal_so_a_horse_being_forked_cannot_die_of_it(
    queue, rq_workers
):
    """``rq_mutex.Worker``'s main process ignores SIGUSR2, so a horse inherits that until
    it answers the signal itself: a stop the worker sends just after the fork, before the
    horse installed its handler, is lost instead of ending the horse (a reviewer's 80
    forced races killed 17 horses before). Read from the kernel's mask of the process."""
    worker = rq_workers(*WORKER)
    bit = 1 << (STOP_SIGNAL - 1)

    def ignored() -> bool:
        status = Path(f"/proc/{worker.pid}/status").read_text()
        mask = next(line for line in status.splitlines() if line.startswith("SigIgn:"))
        return bool(int(mask.split()[1], 16) & bit)

    wait_until(ignored, 30, "the worker to ignore SIGUSR2")


def test_a_new_job_reusing_a_replaced_jobs_id_runs(docs, queue, rq_workers):
    """A replaced job's mark names its id and creation time: a new job enqueued later
    with the same ``job_id`` (de-duplication by id) is a new job, and runs."""
    for _ in range(2):
        rq_workers(*WORKER)
    doc, job_id = "d", f"reused-{docs.run}"
    old = queue.enqueue(replace_jobs.writer, docs.run, doc, "old", 300, job_id=job_id)
    docs.first_write(doc, "old")
    new = queue.enqueue(replace_jobs.writer, docs.run, doc, "new", 20)
    assert ends(new) == JobStatus.FINISHED, exc_text(new)
    failed_with_lease_expired(old)
    again = queue.enqueue(replace_jobs.writer, docs.run, doc, "again", 5, job_id=job_id)
    assert ends(again) == JobStatus.FINISHED, exc_text(again)
    assert again.return_value() == "again"
    assert [r["name"] for r in docs.rows("done", doc)] == ["new", "again"]
    assert docs.stored(doc)[0] == b"again.4"
