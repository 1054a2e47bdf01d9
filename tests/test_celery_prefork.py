"""MutexTask under real ``celery worker -P prefork`` subprocesses: contention across
workers and processes, a child killed with SIGKILL, a hard time limit.

Needs Redis at 127.0.0.1:6379 (lock cache, result backend, records) and, for the AMQP
case, RabbitMQ at 127.0.0.1:5672. A missing server fails the tests; it never skips them.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery_support.processes import REDIS_URL, Processes
from workers import wait_until

# isort: split
from simple_mutex import Mutex, cache_from_url

AMQP_URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")

pytestmark = pytest.mark.slow


class Workers(Processes):
    """N ``celery worker -P prefork -c C`` subprocesses of ``celery_support.app``."""

    def __init__(self, tmp: Path, broker: str, count: int, concurrency: int) -> None:
        super().__init__("celery_support.app", tmp, broker)
        for i in range(count):
            self.start_worker(f"w{i}", concurrency)
        self.locks = Mutex(cache_from_url(REDIS_URL), prefix=self.prefix)

    def send(self, name: str, *args: object) -> object:
        # send_task by name: the lock is taken by the worker, so it cannot be bypassed
        return self.app.send_task(f"celery_support.app.{name}", args=args)

    def wait_for(self, key: str, timeout: float) -> bytes:
        wait_until(lambda: self.record.get(self.prefix + key), timeout, f"{key} recorded")
        return bytes(self.record.get(self.prefix + key))  # type: ignore[arg-type]


def _workers(broker: str, count: int, concurrency: int) -> Iterator[Workers]:
    with tempfile.TemporaryDirectory() as tmp:
        workers = Workers(Path(tmp), broker, count, concurrency)
        try:
            yield workers
        finally:
            workers.stop()


@pytest.fixture(params=["redis", "amqp"])
def prefork_workers(request: pytest.FixtureRequest) -> Iterator[Workers]:
    """Two prefork workers of four processes each, on Redis or RabbitMQ as the broker."""
    yield from _workers(REDIS_URL if request.param == "redis" else AMQP_URL, 2, 4)


@pytest.fixture(scope="module")
def killable_worker() -> Iterator[Workers]:
    """One prefork worker of two processes on Redis, for kill and time-limit tests."""
    yield from _workers(REDIS_URL, 1, 2)


def test_contending_tasks_all_run_once_without_overlap(prefork_workers):
    """40 tasks over 4 keys, on_busy='retry', 2 workers x 4 processes: every task runs
    exactly once, and no two runs of one key overlap in time."""
    results = [prefork_workers.send("contend", n % 4, n) for n in range(40)]
    assert sorted(r.get(timeout=60) for r in results) == list(range(40))
    rows = [
        json.loads(r) for r in prefork_workers.record.lrange(prefork_workers.prefix + "runs", 0, -1)
    ]
    assert sorted(row["n"] for row in rows) == list(range(40))  # each body ran once
    by_key: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for row in rows:
        by_key[row["key"]].append((row["start"], row["end"]))
    overlaps = 0
    for intervals in by_key.values():
        intervals.sort()
        overlaps += sum(b[0] < a[1] for a, b in itertools.pairwise(intervals))
    assert overlaps == 0
    assert len({row["pid"] for row in rows}) >= 2  # really spread over processes


def test_sigkilled_child_frees_its_lock_from_the_parent(killable_worker):
    """SIGKILL the child running a task: the worker's main process frees its lock by task
    id, long before the 60 s lease would lapse."""
    workers = killable_worker
    result = workers.send("sleeper", 1)
    pid = int(workers.wait_for("pid.1", 20))
    assert workers.locks.locked("kill.1")
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not workers.locks.locked("kill.1"), 10, "the parent to free the lock")
    with pytest.raises(Exception, match=r"(?i)worker.*(lost|exited)|signal 9|SIGKILL"):
        result.get(timeout=10)


def test_hard_time_limit_frees_the_lock(killable_worker):
    """A task killed at its hard time limit (1.5 s) leaves its key free at once."""
    workers = killable_worker
    result = workers.send("overrun", 1)
    workers.wait_for("pid.slow.1", 20)
    assert workers.locks.locked("slow.1")
    with pytest.raises(Exception, match=r"(?i)time ?limit"):
        result.get(timeout=15)
    wait_until(lambda: not workers.locks.locked("slow.1"), 5, "the lock to be freed")
