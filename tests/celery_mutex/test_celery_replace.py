"""``on_busy="replace"`` under real ``celery worker -P prefork`` subprocesses: the newest
call takes the key from the running holder with a larger fence and stops it; the stopped
holder ends FAILURE with SimpleMutexLeaseExpiredError and its fenced writes are refused.

The holder is ``celery_support.replace_app.writer``: a fenced write every 20 ms, each
outcome logged. "After the takeover" means after the new holder's first fenced write: from
then on the store knows the new fence (between the takeover and that write it cannot).

Needs Redis at 127.0.0.1:6379. A missing server fails the tests; it never skips them.
"""

from __future__ import annotations

import os
import signal
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery_support.processes import REDIS_URL, Processes
from replaced_writer import STORE_URL, Checks
from workers import wait_until

# isort: split
from celery import Celery

from celery_mutex import MutexTask
from simple_mutex import ConstraintError, InMemoryCache, Mutex, cache_from_url

pytestmark = pytest.mark.integrations


class Workers(Processes, Checks):
    """``celery worker -P prefork`` subprocesses of ``celery_support.replace_app``."""

    def __init__(self, tmp: Path, count: int, concurrency: int, lease: float) -> None:
        super().__init__("celery_support.replace_app", tmp)
        self.own_queue: dict[int, str] = {}  # worker main pid -> a queue only it consumes
        for i in range(count):
            own = f"{self.queue}-w{i}"
            self.start(f"w{i}", [
                *("worker", "-P", "prefork", "-c", str(concurrency), "-Q", f"{self.queue},{own}"),
                *("-n", f"w{i}-{self.run}@%h", "--without-gossip", "--without-mingle"),
                "--without-heartbeat",
            ], CM_LEASE=str(lease))  # fmt: skip
            self.own_queue[self.procs[-1].pid] = own
        self.locks = Mutex(cache_from_url(REDIS_URL), prefix=self.prefix)
        self.store = redis.Redis.from_url(STORE_URL)

    def write(self, doc: str, name: str, writes: int, deaf: bool = False, **options: Any) -> Any:
        return self.app.send_task(
            "celery_support.replace_app.writer", args=(doc, name, writes, deaf), **options
        )


@pytest.fixture(scope="module")
def workers() -> Iterator[Workers]:
    """Two prefork workers of two processes each (a 30 s lease: only a stop ends a holder
    within the test's waits)."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = Workers(Path(tmp), 2, 2, lease=30)
        try:
            yield procs
        finally:
            procs.stop()


def _failed_with_lease_expired(result: Any) -> None:
    try:
        value = result.get(timeout=60)
    except Exception as exc:
        failed: BaseException = exc
    else:
        raise AssertionError(f"{result.id} returned {value!r}")
    assert result.state == "FAILURE", (result.state, repr(failed), result.traceback)
    assert type(failed).__name__ == "SimpleMutexLeaseExpiredError", (
        repr(failed),
        result.traceback,
    )
    assert "lost" in str(failed) or "lapsed" in str(failed), repr(failed)


def test_the_newest_call_replaces_the_running_holder(workers):
    """A holder writing (300 writes, 6 s and more: less than the 10 s its renewal would
    take to find the lease gone) is replaced by a newer call: the new one runs with a
    larger fence and all its 20 writes land; the old one is stopped (it never finishes
    its loop), 0 of its writes after the new holder's first are accepted, and it ends
    FAILURE with SimpleMutexLeaseExpiredError. The key is free at the end."""
    doc = uuid.uuid4().hex[:8]
    old, new, sent = workers.replacing(doc, 300, 20)
    assert new.get(timeout=60) == "new"
    _failed_with_lease_expired(old)
    first_new, old_writes = workers.takeover(doc)
    workers.finished_alone(doc, "new", 20)
    assert len(old_writes) < 300
    wait_until(lambda: not workers.locks.locked(f"doc.{doc}"), 10, "the key to be free")
    print(f"\nreplace: {workers.timings(doc, sent, first_new, old_writes)}")


def test_a_holder_deaf_to_the_stop_has_every_later_write_refused(workers):
    """A holder that catches the loss interrupt and writes on (60 writes) keeps its old
    fence: every one of its writes after the new holder's first is refused (some are
    made, 0 accepted), the new holder's all land, and the deaf one still ends FAILURE
    with SimpleMutexLeaseExpiredError (its lease was lost, whatever its body did)."""
    doc = uuid.uuid4().hex[:8]
    old, new, _ = workers.replacing(doc, 60, 10, deaf=True)
    assert new.get(timeout=60) == "new"
    _failed_with_lease_expired(old)
    refused = workers.deaf(doc, 60, 10)
    print(f"\nreplace, deaf holder: {refused} later writes, all refused")


def test_a_sigkilled_holder_loses_nothing_and_runs_nothing_twice(workers):
    """c1 runs; c2 replaces it; c2's child is SIGKILLed mid-way; c3 then replaces what
    is left: c1 FAILURE (lease lost), c2 FAILURE (worker lost), c3 SUCCESS; each call's
    body started exactly once; only c3 finished its loop; fences rise c1 < c2 < c3; the
    store ends on c3's last write and the key is free."""
    doc = uuid.uuid4().hex[:8]
    c1, c2, c3 = workers.killed_between(doc, ("c1", "c2", "c3"))
    assert c3.get(timeout=60) == "c3"
    _failed_with_lease_expired(c1)
    with pytest.raises(Exception, match=r"(?i)worker.*(lost|exited)|signal 9|SIGKILL"):
        c2.get(timeout=30)
    workers.chain(doc, ("c1", "c2", "c3"), 10)
    wait_until(lambda: not workers.locks.locked(f"doc.{doc}"), 10, "the key to be free")


def test_the_lease_passes_on_when_the_holders_worker_cannot_be_reached(workers):
    """The holder's worker main process is SIGSTOPped (the stop command reaches nobody;
    its child runs on): the new call takes the key all the same, on the other worker;
    the unreachable holder writes with its old fence, is refused, and finds its lease
    lost at its next renewal (30 s lease: within 10 s), ending FAILURE."""
    doc = uuid.uuid4().hex[:8]
    old, main = workers.holder_unreachable(doc, 1500)  # 30 s of writes
    try:
        # To the other worker's own queue: a stopped worker's pending BRPOP would take it.
        other = next(p for p in workers.procs if p.pid != main)
        new = workers.write(doc, "new", 10, queue=workers.own_queue[other.pid])
        assert new.get(timeout=60) == "new"
        _failed_with_lease_expired(old)
    finally:
        os.kill(main, signal.SIGCONT)
    first_new, _ = workers.taken_from_unreachable(doc, 1500)
    stopped = workers.ended(doc, "old") - first_new
    print(f"\nreplace, unreachable holder: stopped by its renewal {stopped:.3f} s later")


# -- option checks (no worker) -------------------------------------------------------------


def _task(app: Celery | None = None, **mutex: Any) -> Any:
    if app is None:
        app = Celery("replace_options", set_as_current=False)
        app.conf.update(mutex_cache=InMemoryCache(), broker_url="memory://")
        app.finalize()  # tasks are made at once: bad options raise at definition

    @app.task(shared=False, base=MutexTask, mutex={"key": "k.{n}", **mutex})
    def job(n: int) -> int:
        return n

    return job


@pytest.mark.parametrize(
    ("mutex", "fix"),
    [
        ({"permits": 2}, "permits=2 there is no single holder to replace: drop permits"),
        ({"timeout": 1}, "drop timeout"),
        ({"renew": False}, "drop renew=False"),
        ({"enqueue": "return"}, "drop enqueue"),
    ],
)
def test_replace_with_an_option_it_cannot_honour_raises_naming_the_fix(mutex, fix):
    """replace with permits > 1, a timeout, renew=False or enqueue in the task's options:
    ConstraintError naming the fix, when the task is defined."""
    with pytest.raises(ConstraintError, match=fix):
        _task(on_busy="replace", **mutex)


def test_replace_against_the_apps_settings_is_checked_once_merged():
    """on_busy='replace' on the task and mutex_enqueue in the app's settings: the merged
    configuration is refused at the first call, naming the fix."""
    app = Celery("replace_settings", set_as_current=False)
    app.conf.update(mutex_cache=InMemoryCache(), broker_url="memory://", mutex_enqueue="raise")
    app.finalize()
    job = _task(app, on_busy="replace")
    with pytest.raises(ConstraintError, match="drop enqueue"):
        job(1)


def test_a_synchronous_replace_runs_when_the_key_is_free():
    """apply() and a direct call of a replace task (no worker to stop a holder through)
    take a free key and run."""
    job = _task(on_busy="replace")
    assert job.apply((3,)).get() == 3
    assert job(4) == 4
