"""``on_busy="replace"`` under real ``celery worker -P prefork`` subprocesses: the newest
call takes the key from the running holder with a larger fence and stops it; the stopped
holder ends FAILURE with SimpleMutexLeaseExpiredError and its fenced writes are refused.

The holder is ``celery_support.replace_app.writer``: a fenced write every 20 ms, each
outcome logged. "After the takeover" means after the new holder's first fenced write: from
then on the store knows the new fence (between the takeover and that write it cannot).

Needs Redis at 127.0.0.1:6379. A missing server fails the tests; it never skips them.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery_support.processes import REDIS_URL, Processes
from celery_support.replace_app import STORE_URL
from workers import wait_until

# isort: split
from celery import Celery

from celery_mutex import MutexTask
from simple_mutex import ConstraintError, InMemoryCache, Mutex, cache_from_url
from simple_mutex.fenced import fenced_get

pytestmark = pytest.mark.slow


class Workers(Processes):
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

    def rows(self, what: str, doc: str) -> list[dict[str, Any]]:
        return [json.loads(r) for r in self.record.lrange(f"{self.prefix}{what}.{doc}", 0, -1)]

    def started(self, doc: str, name: str) -> dict[str, Any]:
        wait_until(
            lambda: any(r["name"] == name for r in self.rows("started", doc)), 30, f"{name} to run"
        )
        return next(r for r in self.rows("started", doc) if r["name"] == name)

    def writes_of(self, doc: str, name: str) -> list[dict[str, Any]]:
        return [r for r in self.rows("writes", doc) if r["name"] == name]

    def first_write(self, doc: str, name: str) -> dict[str, Any]:
        wait_until(lambda: self.writes_of(doc, name), 30, f"{name}'s first write")
        return self.writes_of(doc, name)[0]


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


def _after(rows: list[dict[str, Any]], t: float, outcome: str) -> list[dict[str, Any]]:
    return [r for r in rows if r["t"] > t and r["outcome"] == outcome]


def test_the_newest_call_replaces_the_running_holder(workers):
    """A holder writing (300 writes, 6 s and more: less than the 10 s its renewal would
    take to find the lease gone) is replaced by a newer call: the new one runs with a
    larger fence and all its 20 writes land; the old one is stopped (it never finishes
    its loop), 0 of its writes after the new holder's first are accepted, and it ends
    FAILURE with SimpleMutexLeaseExpiredError. The key is free at the end."""
    doc = uuid.uuid4().hex[:8]
    old = workers.write(doc, "old", 300)
    old_fence = workers.started(doc, "old")["fence"]
    workers.first_write(doc, "old")
    sent = time.monotonic()
    new = workers.write(doc, "new", 20)
    assert new.get(timeout=60) == "new"
    _failed_with_lease_expired(old)
    new_fence = workers.started(doc, "new")["fence"]
    assert new_fence > old_fence
    first_new = workers.first_write(doc, "new")["t"]
    old_writes = workers.writes_of(doc, "old")
    assert _after(old_writes, first_new, "accepted") == []
    assert [r["outcome"] for r in workers.writes_of(doc, "new")] == ["accepted"] * 20
    assert not any(r["name"] == "old" for r in workers.rows("done", doc))
    assert len(old_writes) < 300
    assert fenced_get(workers.store, f"{workers.prefix}doc.{doc}") == (b"new.19", new_fence)
    wait_until(lambda: not workers.locks.locked(f"doc.{doc}"), 10, "the key to be free")
    ended = next(r["t"] for r in workers.rows("ended", doc) if r["name"] == "old")
    print(
        f"\nreplace: send -> old holder stopped {ended - sent:.3f} s, send -> new holder's "
        f"first write {first_new - sent:.3f} s, old writes after it: "
        f"{len(_after(old_writes, first_new, 'accepted'))} accepted, "
        f"{len(_after(old_writes, first_new, 'refused'))} refused"
    )


def test_a_holder_deaf_to_the_stop_has_every_later_write_refused(workers):
    """A holder that catches the loss interrupt and writes on (60 writes) keeps its old
    fence: every one of its writes after the new holder's first is refused (some are
    made, 0 accepted), the new holder's all land, and the deaf one still ends FAILURE
    with SimpleMutexLeaseExpiredError (its lease was lost, whatever its body did)."""
    doc = uuid.uuid4().hex[:8]
    old = workers.write(doc, "old", 60, deaf=True)
    workers.first_write(doc, "old")
    new = workers.write(doc, "new", 10)
    assert new.get(timeout=60) == "new"
    _failed_with_lease_expired(old)
    first_new = workers.first_write(doc, "new")["t"]
    old_writes = workers.writes_of(doc, "old")
    assert {r["i"] for r in old_writes} == set(range(60))  # it did not stop
    assert _after(old_writes, first_new, "accepted") == []
    refused = _after(old_writes, first_new, "refused")
    assert refused
    assert [r["outcome"] for r in workers.writes_of(doc, "new")] == ["accepted"] * 10
    assert any(r["name"] == "old" for r in workers.rows("ignored", doc))
    print(f"\nreplace, deaf holder: {len(refused)} later writes, all refused")


def test_a_sigkilled_holder_loses_nothing_and_runs_nothing_twice(workers):
    """c1 runs; c2 replaces it; c2's child is SIGKILLed mid-way; c3 then replaces what
    is left: c1 FAILURE (lease lost), c2 FAILURE (worker lost), c3 SUCCESS; each call's
    body started exactly once; only c3 finished its loop; fences rise c1 < c2 < c3; the
    store ends on c3's last write and the key is free."""
    doc = uuid.uuid4().hex[:8]
    c1 = workers.write(doc, "c1", 300)
    workers.first_write(doc, "c1")
    c2 = workers.write(doc, "c2", 300)
    pid2 = workers.started(doc, "c2")["pid"]
    workers.first_write(doc, "c2")
    os.kill(pid2, signal.SIGKILL)
    c3 = workers.write(doc, "c3", 10)
    assert c3.get(timeout=60) == "c3"
    _failed_with_lease_expired(c1)
    with pytest.raises(Exception, match=r"(?i)worker.*(lost|exited)|signal 9|SIGKILL"):
        c2.get(timeout=30)
    started = workers.rows("started", doc)
    assert sorted(r["name"] for r in started) == ["c1", "c2", "c3"]
    fences = [next(r["fence"] for r in started if r["name"] == n) for n in ("c1", "c2", "c3")]
    assert fences == sorted(set(fences))
    assert [r["name"] for r in workers.rows("done", doc)] == ["c3"]
    first_c3 = workers.first_write(doc, "c3")["t"]
    late = [r for r in workers.rows("writes", doc) if r["name"] != "c3" and r["t"] > first_c3]
    assert [r for r in late if r["outcome"] == "accepted"] == []
    assert fenced_get(workers.store, f"{workers.prefix}doc.{doc}") == (b"c3.9", fences[2])
    wait_until(lambda: not workers.locks.locked(f"doc.{doc}"), 10, "the key to be free")


def test_the_lease_passes_on_when_the_holders_worker_cannot_be_reached(workers):
    """The holder's worker main process is SIGSTOPped (the stop command reaches nobody;
    its child runs on): the new call takes the key all the same, on the other worker;
    the unreachable holder writes with its old fence, is refused, and finds its lease
    lost at its next renewal (30 s lease: within 10 s), ending FAILURE."""
    doc = uuid.uuid4().hex[:8]
    old = workers.write(doc, "old", 1500)  # 30 s of writes
    pid = workers.started(doc, "old")["pid"]
    main = _parent_of(pid)
    workers.first_write(doc, "old")
    os.kill(main, signal.SIGSTOP)
    try:
        # To the other worker's own queue: a stopped worker's pending BRPOP would take it.
        other = next(p for p in workers.procs if p.pid != main)
        new = workers.write(doc, "new", 10, queue=workers.own_queue[other.pid])
        assert new.get(timeout=60) == "new"
        _failed_with_lease_expired(old)
    finally:
        os.kill(main, signal.SIGCONT)
    first_new = workers.first_write(doc, "new")["t"]
    old_writes = workers.writes_of(doc, "old")
    assert _after(old_writes, first_new, "accepted") == []
    assert len(old_writes) < 1500
    ended = next(r["t"] for r in workers.rows("ended", doc) if r["name"] == "old")
    print(f"\nreplace, unreachable holder: stopped by its renewal {ended - first_new:.3f} s later")


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rpartition(")")[2].split()[1])


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
        ({"enqueue": "return"}, "drop enqueue"),
    ],
)
def test_replace_with_an_option_it_cannot_honour_raises_naming_the_fix(mutex, fix):
    """replace with permits > 1, a timeout or enqueue in the task's options:
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
