"""Regressions found by review: each test failed before its fix."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import time

import pytest
from workers import spin, wait_until

from simple_mutex import (
    ConstraintError,
    InMemoryCache,
    Mutex,
    SimpleMutexLeaseExpiredError,
    with_simple_mutex,
)


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


class _SlowRenewal(InMemoryCache):
    def compare_and_set(self, key, value, *, ttl, version):
        time.sleep(2.0)  # a backend stall on renewal
        return super().compare_and_set(key, value, ttl=ttl, version=version)


def test_a_stalled_renewal_does_not_delay_another_leases_interrupt(caplog):
    """One backend stalling a renewal must not hold up the lapse of a lease elsewhere."""
    caplog.set_level(logging.ERROR, logger="simple_mutex")
    slow = Mutex(_SlowRenewal(), lease=0.3)
    stalled = slow.acquire("a", renew=True)  # its renewal is due at 0.1 s and takes 2 s
    time.sleep(0.15)
    fast = Mutex(InMemoryCache(), lease=0.5)
    started = time.monotonic()
    with pytest.raises(SimpleMutexLeaseExpiredError), fast.acquire("b"):
        spin()
    ran = time.monotonic() - started
    assert ran < 1.5, f"interrupted only after {ran:.2f} s"
    time.sleep(2.2)
    stalled.release()


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


def test_a_dropped_renewing_lease_stops_being_renewed():
    """A renew=True lease nobody references any more lapses instead of living forever."""
    mutex = Mutex(InMemoryCache(), lease=0.3)

    def forgetful() -> None:
        mutex.acquire("leaked", renew=True)

    forgetful()
    gc.collect()
    wait_until(lambda: not mutex.locked("leaked"), 3, "the dropped lease to lapse")
