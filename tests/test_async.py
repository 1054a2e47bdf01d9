"""with_simple_mutex on ``async def`` functions and Mutex.acquire_async: serialization
(also behind a plain wrapper), cancellation on a lapsed lease, release on cancellation,
and ``async with`` (never ``with``) in a coroutine.
Each test drives its own loop with asyncio.run (no pytest plugin)."""

from __future__ import annotations

import asyncio
import functools
import time

import pytest

from simple_mutex import (
    ConstraintError,
    Mutex,
    Semaphore,
    SimpleMutexAcquireTimeoutError,
    SimpleMutexLeaseExpiredError,
    with_simple_mutex,
)
from simple_mutex.caches import InMemoryCache

pytestmark = pytest.mark.fast

LIMIT = 10.0  # no test here should come near it; a broken release fails instead of hanging


def run(coro):
    """asyncio.run with a hard bound, so a lock that is never released fails the test."""
    return asyncio.run(asyncio.wait_for(coro, LIMIT))


def test_async_functions_on_one_key_serialize(any_cache):
    """Concurrent calls on one key never overlap; calls on other keys still run."""
    active = 0
    peak = 0
    order: list[tuple[str, int]] = []

    @with_simple_mutex(key="a.{n}", cache=any_cache, interval=0.01, timeout=5)
    async def work(n, tag):
        nonlocal active, peak
        if n == 1:
            active += 1
            peak = max(peak, active)
        order.append(("in", tag))
        await asyncio.sleep(0.03)
        order.append(("out", tag))
        if n == 1:
            active -= 1
        return tag

    async def main():
        return await asyncio.gather(*(work(1, t) for t in range(4)), work(2, 99))

    start = time.monotonic()
    results = run(main())
    assert results == [0, 1, 2, 3, 99]
    assert peak == 1
    same_key = [event for event in order if event[1] != 99]
    for i in range(0, len(same_key), 2):  # strictly in, out, in, out...
        assert same_key[i][0] == "in"
        assert same_key[i + 1] == ("out", same_key[i][1])
    assert time.monotonic() - start >= 0.12


def test_acquire_async_timeout_raises(memory_cache, key):
    """acquire_async on a busy key raises SimpleMutexAcquireTimeoutError after ~timeout."""
    mutex = Mutex(memory_cache)
    mutex.acquire(key)
    start = time.monotonic()
    with pytest.raises(SimpleMutexAcquireTimeoutError) as info:
        run(mutex.acquire_async(key, timeout=0.1, interval=0.02))
    assert 0.09 <= time.monotonic() - start < 1.0
    assert info.value.key == key


def test_lapsed_lease_cancels_the_coroutine_and_raises(memory_cache):
    """A lapse mid-call cancels the coroutine, raises LeaseExpired, and frees the lock."""
    events = []

    @with_simple_mutex(key="slow", cache=memory_cache, lease=0.2)
    async def slow():
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            events.append("cancelled")
            raise
        events.append("finished")  # pragma: no cover

    start = time.monotonic()
    with pytest.raises(SimpleMutexLeaseExpiredError) as info:
        run(slow())
    assert time.monotonic() - start < 1.5
    assert events == ["cancelled"]
    assert info.value.key == "slow"
    # Free now, or at the latest when the cache's own expiry passes a moment later.
    assert Mutex(memory_cache).acquire("slow", timeout=1).release() is True


def test_renew_true_keeps_an_async_call_protected(memory_cache):
    """renew=True keeps a 0.5 s lease alive across a 1.5 s coroutine."""
    probe = Mutex(memory_cache)

    @with_simple_mutex(key="renewed", cache=memory_cache, lease=0.5, renew=True)
    async def long_call():
        seen = []
        for _ in range(6):
            await asyncio.sleep(0.25)
            seen.append(probe.locked("renewed"))
        return seen

    assert run(long_call()) == [True] * 6
    assert not probe.locked("renewed")


def test_cancelling_the_caller_releases_the_lock(memory_cache):
    """A caller cancelled while inside the guarded coroutine frees the lock."""
    probe = Mutex(memory_cache)

    @with_simple_mutex(key="cancel-me", cache=memory_cache)
    async def hang(inside):
        inside.set()
        await asyncio.sleep(30)

    async def main():
        inside = asyncio.Event()
        task = asyncio.ensure_future(hang(inside))
        await asyncio.wait_for(inside.wait(), 5)
        assert probe.locked("cancel-me")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    start = time.monotonic()
    run(main())
    assert time.monotonic() - start < 2
    assert not probe.locked("cancel-me")


def test_cancelling_a_caller_that_waits_for_the_lock_leaves_no_lock_behind(memory_cache, key):
    """A caller cancelled while waiting neither takes nor disturbs the lock."""
    mutex = Mutex(memory_cache)
    held = mutex.acquire(key)

    async def main():
        task = asyncio.ensure_future(mutex.acquire_async(key, timeout=5, interval=0.01))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    assert mutex.holder(key).fence == held.fence  # type: ignore[union-attr]
    held.release()
    assert not mutex.locked(key)


def test_cancelled_acquire_whose_put_lands_late_leaves_no_orphan_lock(key):
    """A caller cancelled while its put is in flight leaves no orphan lock behind."""

    class SlowPut(InMemoryCache):
        def put_if_absent(self, key, value, *, ttl):
            time.sleep(0.1)  # the reply is slow; the write lands after the cancel
            return super().put_if_absent(key, value, ttl=ttl)

    cache = SlowPut()
    mutex = Mutex(cache)

    async def main():
        task = asyncio.ensure_future(mutex.acquire_async(key, timeout=5))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    assert mutex.holder(key) is None
    assert mutex.try_acquire(key) is not None


def test_async_renewal_failure_cancels_the_coroutine(memory_cache):
    """With renew=True, a renewal finding the record gone cancels the coroutine."""
    events = []

    @with_simple_mutex(key="renew-lost", cache=memory_cache, lease=0.3, renew=True)
    async def work():
        entry = memory_cache.get("mutex.renew-lost")
        memory_cache.compare_and_delete("mutex.renew-lost", version=entry.version)
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            events.append("cancelled")
            raise

    start = time.monotonic()
    with pytest.raises(SimpleMutexLeaseExpiredError):
        run(work())
    assert time.monotonic() - start < 1.5
    assert events == ["cancelled"]


def test_async_semaphore_bounds_concurrency(memory_cache, key):
    """Semaphore.acquire_async lets at most ``permits`` coroutines in at once."""
    sem = Semaphore(memory_cache, permits=2)
    active = 0
    peak = 0

    async def worker():
        nonlocal active, peak
        lease = await sem.acquire_async(key, timeout=5, interval=0.01)
        try:
            active += 1
            peak = max(peak, active)
            await asyncio.sleep(0.05)
            active -= 1
        finally:
            await asyncio.to_thread(lease.release)

    async def main():
        await asyncio.gather(*(worker() for _ in range(6)))

    run(main())
    assert peak == 2
    assert not sem.locked(key)


def test_lapsed_async_call_frees_a_record_the_cache_still_holds():
    """After a lapse cancels the call, our record is freed even if the cache says it lives."""
    frozen = InMemoryCache(clock=lambda: 1_000_000.0)  # the cache's clock lags ours

    @with_simple_mutex(key="lagging", cache=frozen, lease=0.2)
    async def slow():
        await asyncio.sleep(5)

    with pytest.raises(SimpleMutexLeaseExpiredError):
        run(slow())
    assert not Mutex(frozen).locked("lagging"), "the lapsed holder left its record behind"


def test_a_sync_with_inside_a_coroutine_is_refused():
    """`with lease:` in a coroutine would arm the event loop's thread; it is refused."""

    async def body() -> None:
        mutex = Mutex(InMemoryCache(), lease=5)
        lease = await mutex.acquire_async("k")
        try:
            with pytest.raises(ConstraintError, match="async with"), lease:
                await asyncio.sleep(0)
        finally:
            lease.release()

    asyncio.run(body())


def test_async_with_cancels_only_its_own_task_on_loss():
    """`async with lease:` turns a lapse into SimpleMutexLeaseExpiredError for its task,
    and a bystander task on the same loop runs on untouched."""
    mutex = Mutex(InMemoryCache(), lease=0.3)
    outcome: dict[str, object] = {}

    async def holder() -> None:
        lease = await mutex.acquire_async("k")
        started = time.monotonic()
        try:
            async with lease:
                await asyncio.sleep(5)
        except SimpleMutexLeaseExpiredError:
            outcome["lost_after"] = time.monotonic() - started

    async def bystander() -> None:
        for _ in range(200):
            await asyncio.sleep(0.005)
        outcome["bystander"] = "done"

    async def main() -> None:
        await asyncio.wait_for(asyncio.gather(holder(), bystander()), 10)

    asyncio.run(main())
    assert outcome["bystander"] == "done"
    assert 0.2 < outcome["lost_after"] < 2.0  # type: ignore[operator]


def test_a_coroutine_behind_a_plain_wrapper_is_still_guarded_as_async():
    """A functools.wraps decorator over an async def does not make it run unlocked."""

    def traced(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(*args, **kwargs)

        return wrapper

    running = peak = 0

    @with_simple_mutex(key="order.{order_id}", cache=InMemoryCache(), lease=10)
    @traced
    async def ship(order_id: int) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.02)
        running -= 1

    async def main() -> None:
        await asyncio.wait_for(asyncio.gather(*(ship(7) for _ in range(5))), 10)

    asyncio.run(main())
    assert peak == 1
