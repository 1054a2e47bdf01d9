"""The testing kit users get: FaultyCache, the pytest plugin's fixtures, and settings that
tests can change (simple_mutex.busy.reset)."""

from __future__ import annotations

import time

import pytest
from async_memory import AsyncMemory
from workers import spin, wait_until

from simple_mutex import (
    ConstraintError,
    InMemoryCache,
    MalfunctionError,
    Mutex,
    SimpleMutexLeaseExpiredError,
)

pytestmark = pytest.mark.fast

pytest_plugins = ["pytester"]


def test_failed_renewals_interrupt_a_renewing_holder(faulty_cache, mutex_events):
    """With every renewal failing, the holder's block is interrupted at its deadline and
    the loss is an event."""
    faulty_cache.fail("compare_and_set", times=100)
    mutex = Mutex(faulty_cache, lease=0.3)
    with pytest.raises(SimpleMutexLeaseExpiredError), mutex.acquire("k", renew=True):
        spin(5)
    assert faulty_cache.calls["compare_and_set"] >= 1
    assert [e.kind for e in mutex_events][-1] == "lost"


def test_a_lost_reply_never_yields_two_holders(faulty_cache):
    """The put lands but its caller sees a fault: within its wait the caller reads it back
    and holds the key; nobody else gets it meanwhile."""
    faulty_cache.lose_reply("put_if_absent")
    mutex = Mutex(faulty_cache)
    lease = mutex.acquire("k", timeout=1)
    assert mutex.try_acquire("k") is None
    lease.release()
    faulty_cache.lose_reply("put_if_absent")
    with pytest.raises(MalfunctionError):
        mutex.acquire("k", timeout=0)  # no time to read back: a fault...
    wait_until(lambda: not mutex.locked("k"), 5, "the landed write to be freed")  # ...undone


def test_delay_and_call_counts(faulty_cache):
    """delay slows every call of an operation; calls counts them."""
    faulty_cache.delay("get", 0.05)
    mutex = Mutex(faulty_cache)
    started = time.monotonic()
    assert not mutex.locked("k")
    assert time.monotonic() - started >= 0.05
    assert faulty_cache.calls["get"] == 1
    faulty_cache.clear()
    assert mutex.holder("k") is None


def test_expire_makes_the_holders_record_lapse_now(faulty_cache, mutex_events):
    """expire(key): another acquire succeeds at once with a larger fence and says it
    took over (as after a real lapse), and the renewing holder learns at its next
    renewal."""
    mutex = Mutex(faulty_cache, lease=0.6)
    held = mutex.acquire("order.7", renew=True)
    assert faulty_cache.expire("order.7") == 1
    taker = mutex.acquire("order.7", timeout=0)
    assert taker.fence > held.fence
    wait_until(lambda: held.lost, 2, "the holder to learn of the lapse")
    taker.release()
    mutex.acquire("order.7", timeout=0).release()
    grants = [e.took_over for e in mutex_events if e.kind == "acquired"]
    assert grants == [False, True, False]


def test_bad_fault_plans_are_refused(faulty_cache):
    """Unknown operations and counts name what is allowed."""
    with pytest.raises(ConstraintError, match="put_if_absent"):
        faulty_cache.fail("put")
    with pytest.raises(ConstraintError, match="times"):
        faulty_cache.fail("get", times=0)
    with pytest.raises(ConstraintError, match="writes"):
        faulty_cache.lose_reply("get")


@pytest.mark.backends
def test_the_plugin_runs_a_users_suite_on_a_real_cache_url(pytester):
    """--mutex-cache-url puts mutex_cache on that server, a prefix per test: two tests
    taking the same key both get it."""
    pytester.makepyfile(
        """
        from simple_mutex import Mutex

        def test_one(mutex_cache):
            assert type(mutex_cache).__name__ == "_Prefixed"
            Mutex(mutex_cache).acquire("shared", timeout=0)  # never released

        def test_two(mutex_cache):
            Mutex(mutex_cache).acquire("shared", timeout=0).release()
        """
    )
    result = pytester.runpytest(
        "-p", "no:cacheprovider", "--mutex-cache-url=redis://127.0.0.1:6379/0"
    )
    result.assert_outcomes(passed=2)


def test_settings_a_test_changes_apply_after_reset():
    """simple_mutex.busy.reset() forgets what Celery tasks built from app.conf: the next
    call reads the new settings (the plugin does this between tests by itself)."""
    import celery

    from celery_mutex import MutexTask, is_skipped
    from simple_mutex.busy import reset

    app = celery.Celery("kit", set_as_current=False)
    app.conf.mutex_cache = InMemoryCache()
    app.conf.task_always_eager = True

    @app.task(base=MutexTask, mutex={"key": "k.{n}"}, shared=False)
    def work(n: int) -> str:
        return "ran"

    Mutex(app.conf.mutex_cache).acquire("k.1")  # busy from here on
    app.conf.mutex_on_busy = "skip"
    reset()
    assert is_skipped(work.apply(args=(1,)).get())
    app.conf.mutex_on_busy = "raise"
    reset()
    with pytest.raises(Exception, match="busy"):
        work.apply(args=(1,)).get()


def test_faulty_cache_is_a_class_for_both_faces():
    """``FaultyCache`` is a class: ``isinstance`` works on the blocking face and on the
    asyncio one it picks for an asyncio cache (which is an ``AsyncFaultyCache``)."""
    from simple_mutex.contract import is_async
    from simple_mutex.testing import AsyncFaultyCache, FaultyCache

    blocking = FaultyCache(InMemoryCache())
    awaited = FaultyCache(AsyncMemory())
    assert isinstance(blocking, FaultyCache)
    assert not isinstance(blocking, AsyncFaultyCache)
    assert isinstance(awaited, FaultyCache)
    assert isinstance(awaited, AsyncFaultyCache)
    assert not is_async(blocking)
    assert is_async(awaited)

    async def take() -> int:
        lease = await Mutex(awaited).acquire_async("k", timeout=0)
        await lease.release_async()
        return awaited.calls["put_if_absent"]

    import asyncio

    assert asyncio.run(take()) == 1
