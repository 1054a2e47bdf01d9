"""MutexTask under real ``celery worker -P prefork`` subprocesses: contention across
workers and processes, a child killed with SIGKILL, a hard time limit, a revoke with
terminate: the worker's main process frees a child's key only once the child is gone.

Needs Redis at 127.0.0.1:6379 (lock cache, result backend, records) and, for the AMQP
case, RabbitMQ at 127.0.0.1:5672. A missing server fails the tests; it never skips them.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery_support.processes import REDIS_URL, Processes
from workers import wait_until

# isort: split
from simple_mutex import Mutex, cache_from_url

AMQP_URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")

pytestmark = pytest.mark.integrations


class Workers(Processes):
    """N ``celery worker -P prefork -c C`` subprocesses of ``celery_support.app``."""

    def __init__(self, tmp: Path, broker: str, count: int, concurrency: int) -> None:
        super().__init__("celery_support.app", tmp, broker)
        for i in range(count):
            self.start_worker(f"w{i}", concurrency)
        self.locks = Mutex(cache_from_url(REDIS_URL), prefix=self.prefix)

    def send(self, name: str, *args: object, **headers: object) -> object:
        # send_task by name: the lock is taken by the worker, so it cannot be bypassed
        return self.app.send_task(f"celery_support.app.{name}", args=args, headers=headers)

    def wait_for(self, key: str, timeout: float) -> bytes:
        wait_until(lambda: self.record.get(self.prefix + key), timeout, f"{key} recorded")
        return bytes(self.record.get(self.prefix + key))  # type: ignore[arg-type]

    def steps(self, run: str) -> list[float]:
        """The time.monotonic() readings the holder of ``steps.<run>`` wrote, in order."""
        return [float(s) for s in self.record.lrange(f"{self.prefix}steps.{run}", 0, -1)]

    def holder_and_waiter(self, holder: str) -> tuple[str, int, object, object]:
        """Start ``holder`` on a fresh ``steps.<run>`` key, then a ``waiter`` for the same
        key once the holder runs; returns (run, holder's pid, their results) once the
        waiter has started waiting."""
        # billiard may take up to its 5 s maintenance tick to replace a child an earlier
        # test killed; with one child the waiter would only start after the holder.
        wait_until(lambda: len(self.children()) == 2, 20, "two pool children")
        run = uuid.uuid4().hex[:10]
        held = self.send(holder, run)
        pid = int(self.wait_for(f"pid.{run}", 20))
        waiting = self.send("waiter", run)
        self.wait_for(f"waiting.{run}", 20)
        time.sleep(0.3)  # from before_start into the acquire's wait
        assert not held.ready(), "the waiter should wait beside the holder, not after it"  # type: ignore[attr-defined]
        return run, pid, held, waiting

    def children(self) -> list[int]:
        """The live pool children of the (one) worker."""
        main = self.procs[0].pid
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as stat:
                        state, ppid = stat.read().rpartition(")")[2].split()[:2]
                except OSError:
                    continue
                if int(ppid) == main and state != "Z":
                    found.append(int(entry))
        return found


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie does not: it awaits only its reaping)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone, or reaped between open and read
        return False


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


def test_hard_time_limit_frees_the_key_only_once_the_child_is_gone(killable_worker):
    """At its hard time limit (5 s) `stubborn` shrugs off billiard's SIGTERM and keeps
    writing steps until the SIGKILL 0.1 s later. A waiter (on_busy="wait") for its key,
    waiting since before the limit, enters after the last of those steps, and soon after:
    the parent frees the key once the child is dead, not the 120 s lease."""
    workers = killable_worker
    run, _, held, waiting = workers.holder_and_waiter("stubborn")
    with pytest.raises(Exception, match=r"(?i)time ?limit"):
        held.get(timeout=30)  # type: ignore[attr-defined]
    entered = waiting.get(timeout=60)  # type: ignore[attr-defined]
    term = float(workers.wait_for(f"term.{run}", 10))
    assert float(workers.wait_for(f"waiting.{run}", 1)) < term  # it waited through it all
    steps = workers.steps(run)
    assert [s for s in steps if s > term]  # the body did keep working after the SIGTERM
    assert [s for s in steps if s >= entered] == []  # none once the waiter had the key
    assert entered - steps[-1] < 30


def test_hard_time_limit_frees_a_per_call_key_once_the_child_is_gone(killable_worker):
    """A call with its own key (apply_async(mutex={"key": ...})) past its hard time limit,
    deaf to SIGTERM, so only the parent can free it: the parent frees that key (read from
    the worker's request), not the template's, once the SIGKILL has ended the child."""
    workers = killable_worker
    wait_until(lambda: len(workers.children()) == 2, 20, "two pool children")
    run, own = uuid.uuid4().hex[:10], f"own.{uuid.uuid4().hex[:10]}"
    held = workers.send("stubborn", run, mutex_call={"key": own})
    pid = int(workers.wait_for(f"pid.{run}", 20))
    assert workers.locks.locked(own)
    assert not workers.locks.locked(f"steps.{run}")
    with pytest.raises(Exception, match=r"(?i)time ?limit"):
        held.get(timeout=30)  # type: ignore[attr-defined]
    wait_until(lambda: not _alive(pid), 20, "the child to be killed")
    wait_until(lambda: not workers.locks.locked(own), 10, "the parent to free the call's key")


def test_revoke_terminate_frees_the_key_after_the_clean_up_and_the_child_exits(killable_worker):
    """revoke(terminate=True) of `tidy` (sleeping; a `finally:` of 50 steps): the waiter
    enters after the clean-up's last step, and soon after; the child exits (the SIGTERM's
    SystemExit is not turned into a task failure on the way out) and the task is REVOKED."""
    workers = killable_worker
    run, pid, held, waiting = workers.holder_and_waiter("tidy")
    workers.app.control.revoke(held.id, terminate=True)  # type: ignore[attr-defined]
    entered = waiting.get(timeout=60)  # type: ignore[attr-defined]
    wait_until(lambda: len(workers.steps(run)) == 50, 20, "the clean-up to end")
    steps = workers.steps(run)
    assert [s for s in steps if s >= entered] == []  # none once the waiter had the key
    assert entered - steps[-1] < 30
    wait_until(lambda: not _alive(pid), 20, f"the revoked child {pid} to exit")
    assert held.state == "REVOKED"  # type: ignore[attr-defined]


def test_revoke_terminate_with_sigkill_frees_the_key_once_the_child_is_dead(killable_worker):
    """revoke(terminate=True, signal="SIGKILL"): no clean-up runs; the parent frees the
    key when it sees the child dead, well before the 120 s lease would lapse."""
    workers = killable_worker
    run, pid, held, waiting = workers.holder_and_waiter("tidy")
    revoked = time.monotonic()
    workers.app.control.revoke(held.id, terminate=True, signal="SIGKILL")  # type: ignore[attr-defined]
    entered = waiting.get(timeout=60)  # type: ignore[attr-defined]
    assert entered - revoked < 30
    assert workers.steps(run) == []
    assert not _alive(pid)
    assert held.state == "REVOKED"  # type: ignore[attr-defined]


def test_revoke_terminate_of_a_child_deaf_to_sigterm_keeps_the_key_while_it_works(
    killable_worker,
):
    """revoke(terminate=True) of `deaf`, which ignores the SIGTERM and writes steps for
    3 s: the key stays held while it works (a signal sent is not a process dead), and
    the waiter enters after its last step."""
    workers = killable_worker
    run, _, held, waiting = workers.holder_and_waiter("deaf")
    workers.app.control.revoke(held.id, terminate=True)  # type: ignore[attr-defined]
    entered = waiting.get(timeout=60)  # type: ignore[attr-defined]
    term = float(workers.wait_for(f"term.{run}", 10))
    steps = workers.steps(run)
    assert [s for s in steps if s > term]  # it kept working after the SIGTERM
    assert [s for s in steps if s >= entered] == []  # none once the waiter had the key
    assert entered - steps[-1] < 30


def test_revoked_child_exits_even_when_its_lease_lapses_in_the_clean_up(killable_worker):
    """revoke(terminate=True) of `tidy_past_lease`, whose clean-up outlasts its fixed 5 s
    lease: the loss interrupt cuts the clean-up short, and lands where SIGTERM's
    SystemExit is unwinding. The child still exits and the task stays REVOKED: the lock's
    error does not replace the SystemExit on its way out (DESIGN §4 rule 13)."""
    workers = killable_worker
    run = uuid.uuid4().hex[:10]
    held = workers.send("tidy_past_lease", run)
    pid = int(workers.wait_for(f"pid.{run}", 20))
    workers.app.control.revoke(held.id, terminate=True)  # type: ignore[attr-defined]
    wait_until(lambda: not _alive(pid), 30, f"the revoked child {pid} to exit")
    assert 0 < len(workers.steps(run)) < 50  # cut short by the lapse, not by the revoke
    assert held.state == "REVOKED"  # type: ignore[attr-defined]
    assert not workers.locks.locked(f"steps.{run}")


def test_a_retry_waits_for_its_earlier_attempt_to_unwind(killable_worker):
    """``self.retry()`` publishes attempt 1 before attempt 0 has run its ``finally:``
    clean-up (50 steps under the lock): attempt 1 enters after the last of them, with a
    larger fence (on_busy="raise" or not: it waits for its own earlier attempt). Before,
    it took the record over and ran beside the clean-up with the same fence (a reviewer
    saw 120-290 ms of overlap in 8 runs of 8)."""
    workers = killable_worker
    wait_until(lambda: len(workers.children()) == 2, 20, "two pool children")
    run = uuid.uuid4().hex[:10]
    result = workers.send("retries_with_clean_up", run)
    entered, fence, first_fence = result.get(timeout=60)  # type: ignore[attr-defined]
    steps = workers.steps(run)
    assert len(steps) == 50
    assert [s for s in steps if s >= entered] == [], "the retry ran beside the clean-up"
    assert fence > first_fence


def test_a_dead_attempt_leaves_its_retrys_lock_alone(killable_worker):
    """Attempt 0 retries, releases the key and lingers in its child; attempt 1 (same task
    id, the other child) takes the key; attempt 0's child is SIGKILLed. The parent frees
    what attempt 0 held (nothing), not attempt 1's lock: the key stays attempt 1's until
    it ends. (By task id alone it freed attempt 1's lock, and any other call entered.)"""
    workers = killable_worker
    wait_until(lambda: len(workers.children()) == 2, 20, "two pool children")
    run = uuid.uuid4().hex[:10]
    key = f"steps.{run}"
    result = workers.send("retried_then_killed", run)
    pid = int(workers.wait_for(f"pid.{run}", 20))
    workers.wait_for(f"entered.{run}", 20)
    holder = workers.locks.holder(key)
    assert holder is not None
    assert holder.label.endswith(f"[{result.id}]")
    os.kill(pid, signal.SIGKILL)
    # billiard reports a dead child's job only after its lost-worker wait (Celery's
    # worker_lost_wait, 10 s) at a maintenance tick (every 5 s); on a loaded machine (a CI
    # run with four test workers) that once took longer than 30 s.
    try:
        wait_until(lambda: "WorkerLostError" in workers.log_text("w0"), 90, "the loss reported")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; w0's log ends:\n{workers.log_text('w0')[-4000:]}") from None
    time.sleep(0.5)  # the parent's handler runs as Celery reports it
    assert workers.locks.locked(key), "the dead attempt's parent freed its retry's lock"
    still = workers.locks.holder(key)
    assert still is not None
    assert (still.pid, still.fence) == (holder.pid, holder.fence)
    workers.record.set(f"{workers.prefix}go.{run}", 1, ex=300)
    # Attempt 0's loss is stored as the task's result first; attempt 1's success after.

    def final() -> object:  # a fresh handle each look: one caches the first ready state
        return workers.app.AsyncResult(result.id)  # type: ignore[attr-defined]

    wait_until(lambda: final().state == "SUCCESS", 30, "attempt 1 to succeed")  # type: ignore[attr-defined]
    assert final().result == holder.fence  # type: ignore[attr-defined]
    assert not workers.locks.locked(key)


def test_a_hard_time_limit_frees_the_attempt_it_cut_short(killable_worker):
    """Attempt 0 sends its retry and keeps the key past its hard time limit; attempt 1
    (same task id) waits for it. The parent watches attempt 0's child, not the retry's:
    the key is freed once that child is gone, and attempt 1 enters long before attempt 0's
    20 s lease could lapse. (Looked up by task id, it watched attempt 1's child, and
    attempt 1 waited out the lease.)"""
    workers = killable_worker
    wait_until(lambda: len(workers.children()) == 2, 20, "two pool children")
    run = uuid.uuid4().hex[:10]
    workers.send("retried_past_its_time_limit", run)
    # Not the result: attempt 0's TimeLimitExceeded is stored first, attempt 1's after.
    entered = float(workers.wait_for(f"entered.{run}", 60))
    started = float(workers.wait_for(f"started.{run}", 5))
    assert entered - started < 10, f"attempt 1 entered {entered - started:.1f} s after attempt 0"
    # "entered" is written inside attempt 1's body, before it returns and releases: on a
    # loaded machine the check below once ran in between.
    wait_until(lambda: not workers.locks.locked(f"steps.{run}"), 10, "attempt 1 to release")
