"""MutexTask semantics against a real Redis (broker, backend and lock cache), with an
in-process Celery worker (``celery.contrib.testing.worker.start_worker``, thread pool).

Redis must run at 127.0.0.1:6379: a missing server fails these tests, it never skips them.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Iterator
from typing import Any

import pytest
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery_support import inproc
from celery_support.inproc import PREFIX, REDIS_URL, RUNS, app
from celery_support.worker import threaded_worker
from workers import ReleaseLater, wait_until

# isort: split
from celery_mutex import AlreadyQueuedError, is_skipped, signals
from celery_mutex._owned import OwnedLocks
from simple_mutex import (
    ConstraintError,
    Mutex,
    SimpleMutexAcquireTimeoutError,
    SimpleMutexLeaseExpiredError,
    cache_from_url,
)

pytestmark = pytest.mark.integrations

GET = 10  # seconds any single result may take


@pytest.fixture(scope="module")
def mutex_worker() -> Iterator[None]:
    """One in-process worker (8 threads) for the module; Redis must be up."""
    with threaded_worker(app, REDIS_URL):
        yield


@pytest.fixture(scope="module")
def mutex_locks() -> Mutex:
    """A Mutex on the same cache and prefix the tasks use: the test holds keys with it."""
    return Mutex(cache_from_url(REDIS_URL), prefix=PREFIX, lease=30)


@pytest.fixture
def order_id() -> int:
    """An order id no other test uses."""
    return int(time.monotonic_ns() % 10**9)


def test_skip_does_not_run_the_body_and_is_ready_at_once(mutex_worker, mutex_locks, order_id):
    """A busy skip returns a marker at once (get() does not hang), distinct from a success,
    however the call spells its arguments: charge(7), charge(order_id=7) and
    charge(7, 5) lock one key, defaults applied."""
    task = inproc.skip_task
    assert task.mutex_key(order_id) == task.mutex_key(order_id=order_id, amount=0)
    with mutex_locks.acquire(f"order.{order_id}"):
        started = time.monotonic()
        result = task.delay(order_id).get(timeout=GET)
        assert time.monotonic() - started < 3
        assert is_skipped(task.delay(order_id=order_id).get(timeout=GET))
        assert is_skipped(task.apply_async(args=(order_id, 5)).get(timeout=GET))
    assert is_skipped(result)
    assert result["key"] == f"order.{order_id}"
    assert ("skip_task", order_id) not in RUNS
    assert task.delay(order_id).get(timeout=GET) == "ran"  # free again: runs
    assert not is_skipped("ran")


def test_raise_fails_the_task_with_acquire_timeout(mutex_worker, mutex_locks, order_id):
    """on_busy='raise': FAILURE with SimpleMutexAcquireTimeoutError; the body did not run."""
    with mutex_locks.acquire(f"order.{order_id}"):
        result = inproc.raise_task.delay(order_id)
        with pytest.raises(SimpleMutexAcquireTimeoutError):
            result.get(timeout=GET)
    assert result.state == "FAILURE"
    assert ("raise_task", order_id) not in RUNS


def test_busy_retry_does_not_use_up_max_retries(mutex_worker, mutex_locks, order_id):
    """on_busy='retry' re-queues until free; with max_retries=0 it still completes, and
    the body sees retries == 0 while the busy-retry count went up."""
    timer = ReleaseLater(0.6, mutex_locks.acquire(f"order.{order_id}").release)
    try:
        out = inproc.retry_task.delay(order_id).get(timeout=GET)
    finally:
        timer.join()
    assert out["retries"] == 0
    assert out["busy_retries"] >= 2
    assert RUNS.count(("retry_task", order_id)) == 1


def test_wait_blocks_until_free_and_times_out(mutex_worker, mutex_locks, order_id):
    """on_busy='wait' runs once the holder lets go; with a short timeout it fails."""
    timer = ReleaseLater(0.5, mutex_locks.acquire(f"order.{order_id}").release)
    started = time.monotonic()
    assert inproc.wait_task.delay(order_id).get(timeout=GET) == "ran"
    assert time.monotonic() - started >= 0.4
    timer.join()
    with mutex_locks.acquire(f"order.{order_id}"), pytest.raises(SimpleMutexAcquireTimeoutError):
        inproc.wait_short.delay(order_id).get(timeout=GET)


def test_lost_lease_interrupts_the_body_and_fails_the_task(mutex_worker, mutex_locks, order_id):
    """A fixed 0.4 s lease on a 3 s body: interrupted, FAILURE with the lease error."""
    started = time.monotonic()
    result = inproc.lose_lease.delay(order_id)
    with pytest.raises(SimpleMutexLeaseExpiredError) as caught:
        result.get(timeout=GET)
    assert time.monotonic() - started < 2.5  # interrupted, not run to the end
    assert type(caught.value) is SimpleMutexLeaseExpiredError
    # Celery's JSON result encoding keeps only the message (see the report), not .key
    assert f"'order.{order_id}'" in str(caught.value)
    assert ("lose_lease", order_id) not in RUNS
    assert not mutex_locks.locked(f"order.{order_id}")


def test_renewal_keeps_a_long_task_lease(mutex_worker, mutex_locks, order_id):
    """renew=True: a body 2.5x longer than its lease succeeds and keeps the lock."""
    result = inproc.long_renewed.delay(order_id)
    time.sleep(1.0)
    assert mutex_locks.locked(f"order.{order_id}")
    assert result.get(timeout=GET) == "ran"
    assert not mutex_locks.locked(f"order.{order_id}")


def test_running_task_reads_its_lease(mutex_worker, mutex_locks, order_id):
    """current_lease() gives the key and a fence that grows on every grant."""
    first = inproc.lease_info.delay(order_id).get(timeout=GET)
    second = inproc.lease_info.delay(order_id).get(timeout=GET)
    assert first["key"] == f"order.{order_id}"
    assert second["fence"] > first["fence"] >= 1


@pytest.mark.parametrize("task_name", ["fail_task", "ignore_task", "self_retry"])
def test_lock_is_freed_on_every_ending(mutex_worker, mutex_locks, order_id, task_name, caplog):
    """Failure, Ignore and a task's own retry all leave the key free afterwards; the retry
    (same task id) waits until its first attempt has unwound, then runs, and nothing
    fails."""
    caplog.set_level(logging.DEBUG, logger="celery_mutex")
    task = getattr(inproc, task_name)
    result = task.delay(order_id)
    if task_name == "fail_task":
        with pytest.raises(KeyError):
            result.get(timeout=GET)
    elif task_name == "self_retry":
        assert result.get(timeout=GET) == 1  # the retry (same task id) ran, not skipped
        times = dict(run for run in inproc.RUNS if str(run[0]).startswith("self_retry "))
        # the retry entered only after its first attempt had unwound (not beside it)
        assert times["self_retry entered"] > times["self_retry unwound"]
        time.sleep(0.2)
        assert result.state == "SUCCESS"  # the first attempt's end did not overwrite it
    else:
        wait_until(lambda: not mutex_locks.locked(f"order.{order_id}"), GET, "a release")
        time.sleep(0.2)
    assert not mutex_locks.locked(f"order.{order_id}")
    assert mutex_locks.try_acquire(f"order.{order_id}") is not None


def test_retry_of_same_task_id_reenters_but_redelivery_does_not(mutex_worker, order_id):
    """A record left by attempt 0 of task X: X's retry (retries=1) waits for it (attempt 0
    may still be unwinding) and runs once it is freed; another task, or a copy of attempt
    0 (an acks_late redelivery), finds it busy at once."""
    locks = OwnedLocks(Mutex(cache_from_url(REDIS_URL), lease=30, prefix=PREFIX))
    x, z = f"x-{order_id}", f"z-{order_id}"
    old = locks.acquire(f"order.{order_id}", owner=x, attempt=0, timeout=0, renew=False, label="")
    other = locks.acquire(
        f"order.{order_id + 1}", owner=z, attempt=0, timeout=0, renew=False, label=""
    )
    try:
        stranger = inproc.raise_task.apply_async((order_id,), task_id=f"{x}-other")
        with pytest.raises(SimpleMutexAcquireTimeoutError):
            stranger.get(timeout=GET)
        redelivered = inproc.raise_task.apply_async((order_id + 1,), task_id=z, retries=0)
        with pytest.raises(SimpleMutexAcquireTimeoutError):
            redelivered.get(timeout=GET)
        retried = inproc.raise_task.apply_async((order_id,), task_id=x, retries=1)
        with pytest.raises(CeleryTimeoutError):
            retried.get(timeout=1)  # waiting for attempt 0, not turned away
        assert old.release() is True  # attempt 0 still held it: nothing took it over
        assert retried.get(timeout=GET) == "ran"
        assert not locks.space.locked(f"order.{order_id}")  # and the retry released it
    finally:
        other.release()


def test_semaphore_caps_concurrency_at_permits(mutex_worker):
    """permits=3 on 8 threads: never more than 3 bodies at once, and 3 are reached."""
    results = [inproc.sem_task.delay(n) for n in range(9)]
    assert sorted(r.get(timeout=GET) for r in results) == list(range(9))
    assert inproc.CONCURRENCY["max"] == 3


def test_signals_report_acquire_busy_release(mutex_worker, mutex_locks, order_id):
    """mutex_acquired / mutex_busy / mutex_released fire with the key."""
    seen: list[tuple[str, Any]] = []

    def on(name: str) -> Any:
        def receiver(sender: Any = None, **kw: Any) -> None:
            if kw.get("key") == f"order.{order_id}":
                seen.append((name, kw.get("policy") or kw.get("by")))

        return receiver

    receivers = {name: on(name) for name in ("acquired", "busy", "released")}
    for name, receiver in receivers.items():
        getattr(signals, f"mutex_{name}").connect(receiver, weak=False)
    try:
        inproc.skip_task.delay(order_id).get(timeout=GET)
        with mutex_locks.acquire(f"order.{order_id}"):
            inproc.skip_task.delay(order_id).get(timeout=GET)
    finally:
        for name, receiver in receivers.items():
            getattr(signals, f"mutex_{name}").disconnect(receiver)
    assert seen == [("acquired", None), ("released", "task"), ("busy", "skip")]


def test_enqueue_return_gives_the_queued_calls_result(mutex_worker, order_id):
    """enqueue='return': an equal call while the first is queued or running returns the
    first call's AsyncResult (positional or keyword); once it ended, a new call is sent."""
    first = inproc.queued_once.delay(order_id)
    duplicate = inproc.queued_once.delay(order_id=order_id)
    assert duplicate.id == first.id
    assert first.get(timeout=GET) == "ran"
    deadline = time.monotonic() + 3  # the marker is cleared just after the result is stored
    while (again := inproc.queued_once.delay(order_id)).id == first.id:
        assert time.monotonic() < deadline, "the ended call still blocks new ones"
        time.sleep(0.05)
    assert again.get(timeout=GET) == "ran"


def test_enqueue_raise_names_the_queued_task(mutex_worker, order_id):
    """enqueue='raise': the duplicate call raises AlreadyQueuedError carrying the first id."""
    first = inproc.queued_raise.delay(order_id)
    with pytest.raises(AlreadyQueuedError) as caught:
        inproc.queued_raise.delay(order_id)
    assert caught.value.task_id == first.id
    assert pickle.loads(pickle.dumps(caught.value)).task_id == first.id
    assert first.get(timeout=GET) == "ran"


def test_send_task_cannot_bypass_the_run_time_lock(mutex_worker, order_id):
    """send_task skips apply_async (and enqueue de-duplication), but the worker still
    takes the lock: a copy sent while the first runs fails busy (on_busy='raise')."""
    first = inproc.queued_once.delay(order_id)
    time.sleep(0.2)  # the first is running now
    bypass = app.send_task(inproc.queued_once.name, args=(order_id,))
    assert bypass.id != first.id
    with pytest.raises(SimpleMutexAcquireTimeoutError):
        bypass.get(timeout=GET)
    assert first.get(timeout=GET) == "ran"


def test_enqueue_keeps_a_busy_retrying_call_and_its_retries_get_through(
    mutex_worker, mutex_locks, order_id
):
    """A call re-queued because its key is busy is still 'queued': duplicates return it,
    and its own re-publishes are not swallowed as duplicates (celery-singleton#20)."""
    timer = ReleaseLater(0.6, mutex_locks.acquire(f"order.{order_id}").release)
    try:
        first = inproc.queued_retry.delay(order_id)
        time.sleep(0.3)  # it has been busy-retried by now
        assert inproc.queued_retry.delay(order_id).id == first.id
        assert first.get(timeout=GET) == "ran"
    finally:
        timer.join()
    assert RUNS.count(("queued_retry", order_id)) == 1


def test_per_call_key_and_on_busy_survive_a_busy_republish(mutex_worker, mutex_locks, order_id):
    """``apply_async(mutex={"key": ..., "on_busy": "retry"})`` on a skip task, in a real
    worker: the call locks its own key, and its busy re-publish keeps both options (the
    worker turns the header into a request attribute), so it runs once the key is free."""
    own = f"custom.{order_id}"
    timer = ReleaseLater(0.6, mutex_locks.acquire(own).release)
    started = time.monotonic()
    try:
        result = inproc.skip_task.apply_async(
            (order_id,), mutex={"key": own, "on_busy": "retry", "timeout": 0}
        )
        assert result.get(timeout=GET) == "ran"
    finally:
        timer.join()
    assert time.monotonic() - started >= 0.5  # it waited for the holder of its own key
    assert RUNS.count(("skip_task", order_id)) == 1
    with mutex_locks.acquire(f"order.{order_id}"):  # its template's key is not the one
        assert inproc.skip_task.apply_async((order_id,), mutex={"key": own}).get(GET) == "ran"


def test_replace_stops_a_holder_in_a_thread_pool(mutex_worker, order_id):
    """on_busy='replace' in a threads pool (no child to signal): the worker's own process
    renews at once on the stop command, the renewal finds the key taken, and the holder's
    thread is interrupted: it never finishes its 8 s (its renewal alone would come after
    10 s), ends with SimpleMutexLeaseExpiredError, and the new call ran with a larger
    fence."""
    old = inproc.replace_task.delay(order_id, "old", 8)
    wait_until(lambda: any(r[0] == "replace_task" and r[1][:2] == (order_id, "old")
                           for r in RUNS), GET, "the holder to run")  # fmt: skip
    new = inproc.replace_task.delay(order_id, "new", 0.1)
    assert new.get(timeout=GET) == "new"
    with pytest.raises(SimpleMutexLeaseExpiredError):
        old.get(timeout=GET)
    assert ("replace_done", (order_id, "old")) not in RUNS
    fences = {r[1][1]: r[1][2] for r in RUNS if r[0] == "replace_task" and r[1][0] == order_id}
    assert fences["new"] > fences["old"]


def test_a_per_call_replace_of_a_semaphore_task_fails_naming_why(mutex_worker):
    """apply_async(mutex={"on_busy": "replace"}) of a permits=3 task: no single holder to
    replace, so the call fails with ConstraintError instead of freeing one of three."""
    result = inproc.sem_task.apply_async((1,), mutex={"on_busy": "replace"})
    with pytest.raises(ConstraintError, match="permits=3 there is no single holder"):
        result.get(timeout=GET)
