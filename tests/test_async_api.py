"""The asyncio surface on an asyncio cache: the same names as the sync API with ``_async``,
``async with mutex.acquire_async(key)`` without ``await``, renewal on the event loop, no
thread per waiter, and a clear refusal of every blocking call."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from async_crowds import LIMIT
from async_memory import AsyncMemory

from simple_mutex import (
    ConstraintError,
    Mutex,
    Semaphore,
    SimpleMutexLeaseExpiredError,
    with_simple_mutex,
)
from simple_mutex.contract import is_async

pytestmark = pytest.mark.fast


def run(coro):
    # A hang guard, not a bound: hundreds of hand-offs take seconds alone and more than 20 s
    # under coverage beside a loaded tier.
    return asyncio.run(asyncio.wait_for(coro, LIMIT))


@pytest.fixture
def cache() -> AsyncMemory:
    return AsyncMemory()


def test_the_async_names_mirror_the_sync_ones(cache):
    """acquire_async, try_acquire_async, locked_async, holder_async, release_async,
    renew_async, on an asyncio cache."""
    assert is_async(cache)
    mutex = Mutex(cache, lease=30)

    async def main():
        lease = await mutex.acquire_async("k")
        assert await mutex.locked_async("k")
        assert (await mutex.holder_async("k")).fence == lease.fence
        assert await mutex.try_acquire_async("k") is None
        await lease.renew_async(60)
        assert lease.length == 60
        assert await lease.release_async() is True
        assert not await mutex.locked_async("k")
        assert await mutex.holder_async("k") is None
        again = await mutex.try_acquire_async("k")
        assert again is not None
        assert again.fence > lease.fence
        await again.release_async()

    run(main())


def test_async_with_acquire_async_needs_no_await_and_releases_on_exit(cache):
    """The form a new user writes first works; the older `await` form still does."""
    mutex = Mutex(cache, lease=30)

    async def main():
        async with mutex.acquire_async("k") as lease:
            assert lease.fence > 0
            assert await mutex.locked_async("k")
        assert not await mutex.locked_async("k")
        async with await mutex.acquire_async("k"):
            assert await mutex.locked_async("k")
        assert not await mutex.locked_async("k")
        lease = await asyncio.create_task(mutex.acquire_async("k"))  # a coroutine, too
        await lease.release_async()

    run(main())


def test_every_blocking_call_on_an_asyncio_cache_names_the_async_one(cache):
    """A sync call would block the loop (or need a thread): refused with the fix."""
    mutex = Mutex(cache, lease=30)
    for call, name in [
        (lambda: mutex.acquire("k"), "acquire_async"),
        (lambda: mutex.try_acquire("k"), "try_acquire_async"),
        (lambda: mutex.locked("k"), "locked_async"),
        (lambda: mutex.holder("k"), "holder_async"),
        (lambda: mutex.holders("k"), "holders_async"),
    ]:
        with pytest.raises(ConstraintError, match=rf"\.{name[:-6]}\(\).*`await {name}\("):
            call()
    lease = run(mutex.acquire_async("k"))
    with pytest.raises(ConstraintError, match="release_async"):
        lease.release()
    with pytest.raises(ConstraintError, match="renew_async"):
        lease.renew()
    with pytest.raises(ConstraintError, match="async with lease"), lease:
        pass
    run(lease.release_async())
    with pytest.raises(ConstraintError, match="async def"):
        with_simple_mutex(lambda: None, key="k", cache=cache)


def test_renewal_of_an_asyncio_lease_runs_on_its_loop_and_keeps_it(cache):
    """renew=True keeps a 0.3 s lease across 1 s; the renewals run on the holder's loop
    (no thread touches the asyncio cache)."""
    mutex = Mutex(cache, lease=0.3)
    seen_threads: set[int] = set()
    put = cache.compare_and_set

    async def spy(*args, **kwargs):
        seen_threads.add(threading.get_ident())
        return await put(*args, **kwargs)

    cache.compare_and_set = spy  # type: ignore[method-assign]

    async def main():
        async with mutex.acquire_async("k", renew=True) as lease:
            for _ in range(10):
                await asyncio.sleep(0.1)
                assert await mutex.locked_async("k")
            assert not lease.lost
        return threading.get_ident()

    loop_thread = run(main())
    assert seen_threads == {loop_thread}


def test_a_lost_asyncio_lease_cancels_its_block_on_time(cache):
    """A renewal that finds the record gone cancels the holder's task; the block raises
    SimpleMutexLeaseExpiredError."""
    mutex = Mutex(cache, lease=0.3)

    async def hold() -> None:
        async with mutex.acquire_async("k", renew=True):
            entry = cache.sync.get(mutex.prefix + "k")
            cache.sync.compare_and_delete(mutex.prefix + "k", version=entry.version)
            await asyncio.sleep(5)

    async def main():
        started = time.monotonic()
        with pytest.raises(SimpleMutexLeaseExpiredError):
            await hold()
        return time.monotonic() - started

    assert run(main()) < 1.0


def test_a_crowd_of_waiting_coroutines_start_no_thread(cache):
    """Coroutines waiting on one key park on futures: the thread count does not move, and
    every one of them gets the key in turn. (300 of them: a thousand took 9 s alone and
    more than the 60 s hang guard beside two loaded suites, saying nothing more.)"""
    mutex = Mutex(cache, lease=30)
    semaphore = Semaphore(cache, permits=4, lease=30)
    run(mutex.acquire_async("warm", renew=True))  # the keeper thread exists from here
    holding = 0
    most = 0

    async def one() -> None:
        nonlocal holding, most
        async with semaphore.acquire_async("k"):
            holding += 1
            most = max(most, holding)
            await asyncio.sleep(0)
            holding -= 1

    async def main():
        # Threads by identity, not a count: a thread another test left winding down may
        # end meanwhile (the count once fell from 11 to 9), which says nothing of ours.
        before = set(threading.enumerate())
        tasks = [asyncio.ensure_future(one()) for _ in range(300)]
        await asyncio.sleep(0.05)
        during = set(threading.enumerate())
        await asyncio.gather(*tasks)
        return before, during

    before, during = run(main())
    assert during - before == set(), "threads started while the coroutines waited"
    assert most <= 4
