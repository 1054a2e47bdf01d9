"""Lease: release, renew, lapse, and the context manager that interrupts work whose lease
was lost. Real leases of 0.1-0.3 s; every busy loop is bounded (workers.spin), so a broken
interrupt fails the test instead of hanging it. A stale holder refused after a take-over is
the behaviour suite's (tests/behaviour.py), on every tier."""

from __future__ import annotations

import gc
import logging
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
from workers import spin, wait_until

from simple_mutex import (
    InMemoryCache,
    Lease,
    MalfunctionError,
    Mutex,
    Semaphore,
    SimpleCacheConditionError,
    SimpleMutexLeaseExpiredError,
)
from simple_mutex._core.timing import lapse_margin

pytestmark = pytest.mark.fast

# An interrupted loop ends soon after the lease; a broken interrupt runs to spin's guard.
PROMPT = 1.5


def delete_behind_its_back(cache: InMemoryCache, cache_key: str) -> None:
    """Free the record as an operator (or a bug) would, racing a possible renewal."""
    for _ in range(10):
        entry = cache.get(cache_key)
        assert entry is not None
        try:
            cache.compare_and_delete(cache_key, version=entry.version)
            return
        except SimpleCacheConditionError:
            continue  # renewed between our get and delete: read again
    raise AssertionError("could not delete the record")


def delete_then_spin(cache: InMemoryCache, cache_key: str) -> None:
    delete_behind_its_back(cache, cache_key)
    spin()


def renew_then_spin(lease: Lease, length: float) -> None:
    lease.renew(lease=length)
    spin()


# -- release ---------------------------------------------------------------------------


@pytest.mark.parametrize("ending", ["late release", "interrupted block"])
def test_a_lapsed_holder_frees_a_record_the_cache_still_shows_as_ours(ending):
    """The cache's clock lags ours (here it never moves): after our lease lapsed, a late
    release() (False) or the block the lapse interrupted still frees our record."""
    mutex = Mutex(InMemoryCache(clock=lambda: 1_000_000.0), lease=0.2)
    lease = mutex.acquire("k")
    if ending == "late release":
        time.sleep(0.25)
        assert mutex.locked("k") is True
        assert lease.release() is False
    else:
        with pytest.raises(SimpleMutexLeaseExpiredError), lease:
            spin()
    assert not mutex.locked("k"), "the lapsed holder left its record behind"


def test_lease_exposes_key_token_fence_and_expiry(memory_cache, key):
    """A Lease has the user's key verbatim, a token, a positive fence and an aware expiry."""
    mutex = Mutex(memory_cache, lease=30)
    lease = mutex.acquire(key)
    assert lease.key == key
    assert isinstance(lease.token, str)
    assert isinstance(lease.fence, int)
    assert lease.fence >= 1
    assert lease.length == 30
    assert lease.lost is False
    expected = datetime.now(timezone.utc) + timedelta(seconds=30)
    assert abs(lease.expires_at - expected) < timedelta(seconds=1)
    assert lease.expires_at.utcoffset() == timedelta(0)


# -- renew -----------------------------------------------------------------------------


def test_renew_extends_the_lease_past_its_first_expiry(any_cache, key):
    """renew() restarts the lease: it is still held after its original length. (A 0.3 s
    lease renewed after a 0.2 s sleep lapsed once on a loaded CI machine, the sleep
    overshooting: the margins are half a second now.)"""
    mutex = Mutex(any_cache, lease=1.0)
    lease = mutex.acquire(key)
    first_expiry = lease.expires_at
    time.sleep(0.5)
    lease.renew()
    assert lease.expires_at > first_expiry
    time.sleep(0.7)  # 1.2 s after acquire: past the first lease
    assert lease.lost is False
    assert mutex.locked(key) is True
    assert mutex.holder(key).fence == lease.fence  # type: ignore[union-attr]
    assert lease.release() is True


def test_renew_with_a_length_sets_a_new_lease_length(any_cache, key):
    """renew(lease=...) changes the length: expires_at and the cache record move to it; a
    lease left to lapse is lost, frees the key, and its late release() is False."""
    mutex = Mutex(any_cache, lease=0.3)
    lease = mutex.acquire(key)
    lease.renew(lease={"seconds": 5})
    assert lease.length == 5
    expected = datetime.now(timezone.utc) + timedelta(seconds=5)
    assert abs(lease.expires_at - expected) < timedelta(seconds=0.5)
    holder = mutex.holder(key)
    assert holder is not None
    assert abs(holder.expires_at - expected) < timedelta(seconds=0.5)
    time.sleep(0.35)
    assert lease.lost is False
    assert mutex.locked(key)
    lease.renew(timedelta(seconds=0.1))
    assert lease.length == pytest.approx(0.1)
    time.sleep(0.15)
    assert lease.lost is True
    assert not mutex.locked(key)
    assert lease.release() is False  # released after it lapsed: the work ran unprotected


@pytest.mark.parametrize("ended", ["lapsed", "released"])
def test_an_ended_lease_can_neither_renew_nor_guard_a_block(any_cache, key, ended):
    """A lease that lapsed, or was released, raises SimpleMutexLeaseExpiredError (with its
    key) from renew() and at the door of a block, before the work begins; a lapsed one is
    marked lost. Neither brings the lock back."""
    mutex = Mutex(any_cache, lease=0.1 if ended == "lapsed" else 30)  # released in time
    lease = mutex.acquire(key)
    if ended == "lapsed":
        time.sleep(0.15)
    else:
        lease.release()
    with pytest.raises(SimpleMutexLeaseExpiredError) as info:
        lease.renew()
    assert info.value.key == key
    assert lease.lost is (ended == "lapsed")
    ran = []
    with pytest.raises(SimpleMutexLeaseExpiredError), lease:
        ran.append(1)
    assert ran == []
    assert mutex.locked(key) is False


def test_renew_after_the_record_was_deleted_raises(memory_cache, key):
    """A live-looking lease whose record vanished fails to renew (the cache is the truth)."""
    mutex = Mutex(memory_cache, lease=30)
    lease = mutex.acquire(key)
    delete_behind_its_back(memory_cache, "mutex." + key)
    with pytest.raises(SimpleMutexLeaseExpiredError):
        lease.renew()
    assert lease.lost is True


# -- the context manager ---------------------------------------------------------------


def test_context_manager_releases_on_exit(any_cache, key):
    """Leaving the block frees the lock."""
    mutex = Mutex(any_cache)
    with mutex.acquire(key) as lease:
        assert mutex.locked(key)
        assert lease.key == key
    assert not mutex.locked(key)
    assert lease.release() is False  # already released by the block


def test_body_exception_propagates_unchanged_and_the_lock_is_released(any_cache, key):
    """An error in the block comes out as itself (same object) and the lock is freed."""
    mutex = Mutex(any_cache)
    boom = KeyError("boom")
    with pytest.raises(KeyError) as info, mutex.acquire(key):
        raise boom
    assert info.value is boom
    assert not mutex.locked(key)


def test_lapse_interrupts_a_pure_python_busy_loop(memory_cache, key):
    """A lapse interrupts a pure-Python loop, a margin before the cache's own expiry; the
    block raises LeaseExpired with the key."""
    mutex = Mutex(memory_cache, lease=0.2)
    start = time.monotonic()
    with pytest.raises(SimpleMutexLeaseExpiredError) as info, mutex.acquire(key):
        spin()
    elapsed = time.monotonic() - start
    assert elapsed < PROMPT, f"the loop ran {elapsed:.2f} s: it was not interrupted"
    assert elapsed >= 0.2 - lapse_margin(0.2)
    assert info.value.key == key
    assert "renew=True" in str(info.value)
    assert not mutex.locked(key)


def test_lapse_inside_a_blocking_call_raises_on_exit(memory_cache, key):
    """A lapse during a C call (time.sleep) cannot cut it short, but never passes silently."""
    mutex = Mutex(memory_cache, lease=0.1)
    with pytest.raises(SimpleMutexLeaseExpiredError), mutex.acquire(key):
        time.sleep(0.25)


def test_lapse_is_reported_even_if_the_block_swallows_the_interrupt(memory_cache, key):
    """Code that catches Exception broadly still gets the error when the block exits."""
    mutex = Mutex(memory_cache, lease=0.2)
    swallowed = []

    def careless_work() -> None:
        try:
            spin()
        except Exception as exc:
            swallowed.append(exc)

    with pytest.raises(SimpleMutexLeaseExpiredError), mutex.acquire(key):
        careless_work()
    assert len(swallowed) == 1
    assert isinstance(swallowed[0], SimpleMutexLeaseExpiredError)


def test_lapse_after_the_block_has_no_effect(memory_cache, key):
    """A block that finishes in time is not interrupted later: no stray exception lands."""
    mutex = Mutex(memory_cache, lease=0.15)
    with mutex.acquire(key):
        pass
    time.sleep(0.25)  # past where the lease would have lapsed; an interrupt would hit here
    assert spin(0.05) >= 0.05


def test_renew_true_keeps_a_short_lease_alive_across_a_long_block(any_cache, key):
    """renew=True holds a 0.3 s lease through a 1 s block; the lock is ours throughout."""
    mutex = Mutex(any_cache, lease=0.3)
    with mutex.acquire(key, renew=True) as lease:
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            time.sleep(0.05)
            holder = mutex.holder(key)
            assert holder is not None
            assert holder.fence == lease.fence
        assert lease.lost is False
    assert not mutex.locked(key)


def test_failed_renewal_interrupts_the_block(memory_cache, key):
    """With renew=True, a renewal that finds the record deleted interrupts the block."""
    mutex = Mutex(memory_cache, lease=0.3)
    start = time.monotonic()
    with (
        pytest.raises(SimpleMutexLeaseExpiredError) as info,
        mutex.acquire(key, renew=True) as lease,
    ):
        delete_then_spin(memory_cache, "mutex." + key)
    elapsed = time.monotonic() - start
    assert elapsed < PROMPT, f"the loop ran {elapsed:.2f} s: it was not interrupted"
    assert info.value.key == key
    assert lease.lost is True


def test_nested_leases_inner_lapse_interrupts_only_the_inner_block(memory_cache):
    """The inner key's lapse surfaces as its own error; the outer lease stays held."""
    outer_mutex = Mutex(memory_cache, lease=10)
    inner_mutex = Mutex(memory_cache, lease=0.2)
    with outer_mutex.acquire("outer") as outer:
        start = time.monotonic()
        with pytest.raises(SimpleMutexLeaseExpiredError) as info, inner_mutex.acquire("inner"):
            spin()
        assert time.monotonic() - start < PROMPT
        assert info.value.key == "inner"
        assert outer.lost is False
        assert outer_mutex.holder("outer").fence == outer.fence  # type: ignore[union-attr]
        assert spin(0.05) >= 0.05  # no second interrupt lands in the outer block
    assert not outer_mutex.locked("outer")
    assert not inner_mutex.locked("inner")


def test_nested_leases_outer_lapse_inside_the_inner_block(memory_cache):
    """The outer lease lapsing inside the inner block frees both and names the outer key."""
    outer_mutex = Mutex(memory_cache, lease=0.2)
    inner_mutex = Mutex(memory_cache, lease=10)
    start = time.monotonic()
    with (
        pytest.raises(SimpleMutexLeaseExpiredError) as info,
        outer_mutex.acquire("outer"),
        inner_mutex.acquire("inner"),
    ):
        spin()
    assert time.monotonic() - start < PROMPT
    assert info.value.key == "outer"
    assert not inner_mutex.locked("inner")
    assert not outer_mutex.locked("outer")


class FlakyDelete(InMemoryCache):
    """Fails the next ``failures`` compare-and-deletes as a reset connection would."""

    name = "flaky"

    def __init__(self, failures: int = 0) -> None:
        super().__init__()
        self.failures = failures

    def compare_and_delete(self, key, *, version):
        if self.failures:
            self.failures -= 1
            raise ConnectionResetError("network down")
        return super().compare_and_delete(key, version=version)


def test_release_failure_after_success_is_reported_as_malfunction(key):
    """A cache fault releasing after a clean block raises MalfunctionError with the key."""
    cache = FlakyDelete()
    mutex = Mutex(cache)
    with pytest.raises(MalfunctionError) as info, mutex.acquire(key):
        cache.failures = 2  # the delete, and the second one after the read found our record
    assert info.value.key == key
    assert "flaky" in str(info.value)


def test_release_failure_after_a_body_error_keeps_the_body_error(key):
    """If the body failed and the release fails too, the body's error is the one raised."""
    lease = Mutex(FlakyDelete(failures=5)).acquire(key)
    with pytest.raises(ZeroDivisionError), lease:
        1 / 0  # noqa: B018


def test_release_failure_after_a_body_error_reaches_the_caller_as_a_note(key):
    """The seed's rule: when the body fails and the release fails too, both reach the
    caller: the body's error, carrying the release's fault (naming the cache) as a note."""
    lease = Mutex(FlakyDelete(failures=5)).acquire(key)
    with pytest.raises(ZeroDivisionError) as info, lease:
        1 / 0  # noqa: B018
    notes = getattr(info.value, "__notes__", [])
    assert any("releasing the lock" in n and "flaky" in n for n in notes), notes


# -- exceptions a lock never replaces (DESIGN §4 rule 13) --------------------------------


@pytest.mark.parametrize("leaving", [KeyboardInterrupt, SystemExit, GeneratorExit])
def test_a_base_exception_leaving_a_lost_block_passes_through(memory_cache, key, leaving):
    """Ctrl-C or sys.exit leaving a block whose lease was lost (its record taken away) is
    not replaced by SimpleMutexLeaseExpiredError, so a loop's ``except Exception`` cannot
    swallow it; the loss travels beside it as a note."""
    mutex = Mutex(memory_cache)

    def lose_then_leave() -> None:
        with mutex.acquire(key) as lease:
            delete_behind_its_back(memory_cache, lease._cache_key)
            raise leaving()

    with pytest.raises(leaving) as info:
        lose_then_leave()
    assert type(info.value) is leaving
    assert any("was lost" in n for n in getattr(info.value, "__notes__", []))


def test_an_interrupt_landing_while_a_system_exit_unwinds_lets_the_system_exit_leave(
    memory_cache, key
):
    """SIGTERM's SystemExit runs a ``finally:`` inside the block, and the lease lapses
    there: the interrupt raised in the ``finally:`` displaced the SystemExit. The
    SystemExit leaves (with the loss as a note), or the process would not exit."""
    mutex = Mutex(memory_cache, lease=0.2)

    def unwinding() -> None:
        with mutex.acquire(key):
            try:
                raise SystemExit(3)
            finally:
                spin()  # the lease lapses here: the interrupt lands in the clean-up

    with pytest.raises(SystemExit) as info:
        unwinding()
    assert info.value.code == 3
    assert any("was lost" in n for n in getattr(info.value, "__notes__", []))


def test_a_sigterm_arriving_as_the_lease_lapses_still_ends_the_block_with_system_exit(
    memory_cache, key
):
    """The lease lapses while the body sleeps (the interrupt waits for the sleep to
    return), then SIGTERM wakes the sleep: CPython runs the SIGTERM handler and raises the
    waiting interrupt at the handler's first instruction, before its ``sys.exit()`` ran
    (found by the nemesis: a worker lived on 23 s after SIGTERM). The block still ends in
    the handler's SystemExit, carrying the loss as a note."""
    import signal
    import sys

    mutex = Mutex(memory_cache, lease=0.2)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main = threading.get_ident()
    later = threading.Timer(0.6, signal.pthread_kill, (main, signal.SIGTERM))
    later.start()
    try:
        with pytest.raises(SystemExit) as info, mutex.acquire(key):
            time.sleep(3)  # lapses at 0.2 s; SIGTERM at 0.6 s cuts the sleep short
    finally:
        later.cancel()
        signal.signal(signal.SIGTERM, previous)
    assert info.value.code == 143
    assert any("was lost" in n for n in getattr(info.value, "__notes__", []))
    assert not mutex.locked(key)


async def _hold_then(cache, key, leaving, lease_length=30.0):
    mutex = Mutex(cache, lease=lease_length)
    async with mutex.acquire_async(key) as lease:
        delete_behind_its_back(cache, lease._cache_key)
        raise leaving()


@pytest.mark.parametrize("leaving", [KeyboardInterrupt, SystemExit])
def test_async_exit_lets_a_base_exception_pass_through(memory_cache, key, leaving):
    """``async with``: the same rule."""
    import asyncio

    with pytest.raises(leaving):
        asyncio.run(_hold_then(memory_cache, key, leaving))


def test_async_exit_lets_an_outside_cancellation_pass_through(memory_cache, key):
    """A task cancelled by someone else while its lease was lost stays cancelled (asyncio
    cancellation is not a lock error); only the lock's own cancellation becomes one."""
    import asyncio

    async def main() -> None:
        mutex = Mutex(memory_cache)
        entered = asyncio.Event()

        async def body() -> None:
            async with mutex.acquire_async(key) as lease:
                delete_behind_its_back(memory_cache, lease._cache_key)
                entered.set()
                await asyncio.sleep(30)

        task = asyncio.create_task(body())
        await entered.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_async_loss_still_cancels_the_body_into_the_loss_error(memory_cache, key):
    """The lock's own cancellation (its lease lapsed) still ends as the loss error."""
    import asyncio

    async def main() -> None:
        mutex = Mutex(memory_cache, lease=0.2)
        async with mutex.acquire_async(key):
            await asyncio.sleep(5)

    with pytest.raises(SimpleMutexLeaseExpiredError):
        asyncio.run(main())


def test_renew_to_a_shorter_length_inside_a_block_moves_the_interrupt(memory_cache, key):
    """renew(lease=shorter) in a block moves the interrupt to the new, earlier deadline."""
    mutex = Mutex(memory_cache, lease=3)
    start = time.monotonic()
    with pytest.raises(SimpleMutexLeaseExpiredError), mutex.acquire(key) as lease:
        renew_then_spin(lease, 0.2)
    elapsed = time.monotonic() - start
    assert elapsed < PROMPT, f"interrupted after {elapsed:.2f} s, not at the new 0.2 s"


def test_renew_to_a_shorter_length_keeps_background_renewal_in_step(memory_cache, key):
    """With renew=True and no block, a lease shortened to 0.3 s is renewed on the new
    schedule and stays held for 1.2 s."""
    mutex = Mutex(memory_cache, lease=3)
    lease = mutex.acquire(key, renew=True)
    lease.renew(lease=0.3)
    time.sleep(1.2)
    assert lease.lost is False, "the keeper kept the old schedule and let the lease lapse"
    assert mutex.holder(key).fence == lease.fence  # type: ignore[union-attr]
    assert lease.release() is True


class FlakyRenew(InMemoryCache):
    """Fails the next ``failures`` compare-and-sets (renewals) with a backend fault."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def compare_and_set(self, key: str, value: str, *, ttl: float, version: str):
        if self.failures:
            self.failures -= 1
            raise ConnectionResetError("blip")
        return super().compare_and_set(key, value, ttl=ttl, version=version)


def test_background_renewal_retries_after_a_transient_cache_fault(key):
    """A renewal that hits a backend fault is retried soon; the lease survives."""
    cache = FlakyRenew(failures=1)
    mutex = Mutex(cache, lease=0.3)
    with mutex.acquire(key, renew=True) as lease:
        time.sleep(0.8)
        assert cache.failures == 0  # the fault did happen
        assert lease.lost is False
    assert not mutex.locked(key)


def test_background_renewal_failing_until_the_deadline_interrupts_the_block(key):
    """A cache down for every renewal lets the lease lapse and interrupts the block."""
    mutex = Mutex(FlakyRenew(failures=10**9), lease=0.3)
    start = time.monotonic()
    with pytest.raises(SimpleMutexLeaseExpiredError), mutex.acquire(key, renew=True):
        spin()
    assert 0.3 - lapse_margin(0.3) <= time.monotonic() - start < PROMPT


def test_a_release_fault_the_read_back_settles_frees_the_key():
    """One delete lost on the way: the read finds our record still there and the second
    delete frees it; the caller sees a plain release."""
    mutex = Mutex(FlakyDelete(failures=1), lease=60)
    lease = mutex.acquire("k")
    assert lease.release() is True
    assert not mutex.locked("k")
    assert not lease.lost


def test_a_release_that_hit_a_fault_can_be_retried():
    """A MalfunctionError on release leaves the lease releasable: the retry frees it."""
    mutex = Mutex(FlakyDelete(failures=2), lease=60)
    lease = mutex.acquire("k")
    with pytest.raises(MalfunctionError):
        lease.release()
    assert mutex.locked("k")
    assert lease.release() is True
    assert not mutex.locked("k")


def test_a_failed_release_stops_renewal_so_the_lock_lapses():
    """If nobody retries a failed release, renewal stops and the lease runs out."""
    mutex = Mutex(FlakyDelete(failures=2), lease=0.3)
    lease = mutex.acquire("k", renew=True)
    with pytest.raises(MalfunctionError):
        lease.release()
    wait_until(lambda: not mutex.locked("k"), 5, "the keeper to stop renewing it")


class _RetriedRenewal(InMemoryCache):
    """The first renewal lands, loses its reply, and is retried by the driver."""

    retried = False

    def compare_and_set(self, key, value, *, ttl, version):
        if not self.retried:
            self.retried = True
            super().compare_and_set(key, value, ttl=ttl, version=version)
        return super().compare_and_set(key, value, ttl=ttl, version=version)


def test_a_retried_renewal_that_landed_is_not_reported_lost():
    """The retry misses its own new version; reading back our token shows we still hold it."""
    mutex = Mutex(_RetriedRenewal(), lease=60)
    lease = mutex.acquire("k")
    lease.renew()
    assert not lease.lost
    assert lease.release() is True


def test_an_early_release_inside_the_block_is_not_reported_as_a_loss(memory_cache, key):
    """`lease.release()` inside `with` returns True, and the block's exit raises nothing;
    a release after a lapse inside the block still does."""
    mutex = Mutex(memory_cache, lease=0.2)
    with mutex.acquire(key) as lease:
        assert lease.release() is True
        assert not mutex.locked(key)
    with pytest.raises(SimpleMutexLeaseExpiredError):
        release_in_the_block_after_a_lapse(mutex.acquire(key))


def release_in_the_block_after_a_lapse(lease: Lease) -> None:
    with lease:
        time.sleep(0.3)  # a C call: the interrupt waits, the lapse does not
        assert lease.release() is False


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


def test_a_dropped_renewing_lease_stops_being_renewed():
    """A renew=True lease nobody references any more lapses instead of living forever."""
    mutex = Mutex(InMemoryCache(), lease=0.3)

    def forgetful() -> None:
        mutex.acquire("leaked", renew=True)

    forgetful()
    gc.collect()
    wait_until(lambda: not mutex.locked("leaked"), 3, "the dropped lease to lapse")


def test_a_renewing_lease_left_held_by_a_closed_loop_stops_being_visited():
    """A renewing lease on an asyncio cache still held when ``asyncio.run`` returns: its
    loop is gone, so nothing can renew it. It is marked lost at the first renewal due,
    instead of the keeper retrying at once until the deadline (it spun: 45,940 attempts
    and 2.6 s of CPU in 4.5 s)."""
    import asyncio

    from async_memory import AsyncMemory

    async def take() -> Lease:
        return await Mutex(AsyncMemory(), lease=0.3).acquire_async("k", renew=True)

    lease = asyncio.run(take())  # the loop closes with the lease held
    visits = 0
    renew_in_background = lease._renew_in_background

    def counted() -> None:
        nonlocal visits
        visits += 1
        renew_in_background()

    lease._renew_in_background = counted  # type: ignore[method-assign]
    wait_until(lambda: lease.lost, 5, "the lease to be marked lost")
    time.sleep(0.5)
    assert visits == 1
    assert "event loop closed" in (lease._state.loss or "")


# -- one renewal at a time; a deadline only from a write we saw land (DESIGN §4 rule 15) --


class _SlowLongRenewal(InMemoryCache):
    """A 60 s renewal waits 0.3 s before it writes: another renewal of the same lease can
    be sent meanwhile (a background renewal and a user's renew(lease=...), two threads)."""

    def compare_and_set(self, key, value, *, ttl, version):
        if ttl == 60:
            time.sleep(0.3)
        return super().compare_and_set(key, value, ttl=ttl, version=version)


def rival_gets(mutex: Mutex, key: str, within: float) -> Lease | None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        rival = mutex.try_acquire(key)
        if rival is not None:
            return rival
        time.sleep(0.01)
    return None


def test_two_renewals_at_once_never_leave_the_holder_past_its_record():
    """A 60 s renewal is in flight when the user renews to 1 s. Before, the 60 s one missed
    the version the other wrote, read its own value back, and took 60 s for its deadline:
    the holder believed in a minute while its record lapsed in a second, and a rival got
    in with the first lease still not lost. Now the second waits its turn: the record and
    the holder's deadline are the last write's, 1 s, and the rival finds the holder lost."""
    mutex = Mutex(_SlowLongRenewal(), lease=60)
    lease = mutex.acquire("k")
    background = threading.Thread(target=lease.renew)
    background.start()
    time.sleep(0.1)
    lease.renew(lease=1)
    background.join()
    rival = rival_gets(mutex, "k", within=5)
    assert rival is not None, "the 1 s renewal did not hold: the record was kept longer"
    assert lease.lost, "a rival holds the key while the first holder still counts on it"
    assert lease.length == 1  # the user's length is the one that stuck
    rival.release()


def test_a_renewal_with_an_unknown_outcome_only_brings_the_deadline_closer(faulty_cache):
    """renew(lease=0.5) lands but its reply is lost (MalfunctionError): the record now
    lapses in 0.5 s, so the holder's deadline must not stay a minute away."""
    mutex = Mutex(faulty_cache, lease=60)
    lease = mutex.acquire("k")
    faulty_cache.lose_reply("compare_and_set")
    with pytest.raises(MalfunctionError):
        lease.renew(lease=0.5)
    rival = rival_gets(mutex, "k", within=5)
    assert rival is not None
    assert lease.lost
    rival.release()


def test_two_renewals_at_once_on_an_event_loop_take_turns():
    """The same on an asyncio cache, whose renewals run on the holder's loop."""
    import asyncio

    from async_memory import AsyncMemory

    class SlowLong(AsyncMemory):
        async def compare_and_set(self, key, value, *, ttl, version):
            if ttl == 60:
                await asyncio.sleep(0.3)
            return await super().compare_and_set(key, value, ttl=ttl, version=version)

    async def main() -> None:
        mutex = Mutex(SlowLong(), lease=60)
        lease = await mutex.acquire_async("k")
        background = asyncio.create_task(lease.renew_async())
        await asyncio.sleep(0.1)
        await lease.renew_async(lease=1)
        await background
        deadline = time.monotonic() + 5
        rival = None
        while rival is None and time.monotonic() < deadline:
            rival = await mutex.try_acquire_async("k")
            await asyncio.sleep(0.01)
        assert rival is not None
        assert lease.lost
        await rival.release_async()

    asyncio.run(main())


# -- extend by token (dmutex's extend) ----------------------------------------------------


def lock_space(kind: str, cache, lease: float) -> Mutex | Semaphore:
    return (
        Semaphore(cache, permits=2, lease=lease)
        if kind == "semaphore"
        else Mutex(cache, lease=lease)
    )


@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
def test_extend_by_token_restarts_the_permit_from_another_handle(any_cache, kind):
    """dmutex's ``extend``: whoever knows a permit's token (another handle, process, or
    an operator's tool) restarts it for a new length; False once it is not held."""
    lease = lock_space(kind, any_cache, 0.5).acquire("k")
    other = lock_space(kind, any_cache, 0.5)
    assert other.extend("k", token=lease.token, lease=5) is True
    time.sleep(0.7)  # past the first 0.5 s: only the extension keeps the record
    assert [h.fence for h in other.holders("k")] == [lease.fence]
    assert other.extend("k", token="not-the-token") is False
    lease.release()  # a lapsed handle still frees its record while the cache keeps it
    assert other.extend("k", token=lease.token) is False


@pytest.mark.parametrize("kind", ["mutex", "semaphore"])
def test_a_renewing_holder_stays_valid_through_an_extension_by_its_token(any_cache, kind):
    """The extension keeps the record's value: the holder's own handle goes on renewing
    and releasing as if nothing happened (its next renewal reads its value back at the
    new version and writes from there)."""
    # A lease the renewal keeps on a loaded machine (a renewal a third into a 0.3 s lease
    # once came too late on a busy disk); the block outlives it either way.
    locks = lock_space(kind, any_cache, 1.5)
    with locks.acquire("k", renew=True) as lease:
        for _ in range(3):
            assert locks.extend("k", token=lease.token, lease=1.5) is True
            spin(1.0)
        assert not lease.lost
    assert lease.release() is False  # released by the block's exit, in time
    assert not locks.locked("k")


def test_an_extension_never_shortens_the_permit_its_holder_counts_on(any_cache):
    """extend(lease=1) on a permit held for 30 s keeps the 30 s: the holder does not
    know of the extension, so a shorter record would let a rival in while it works
    (the reviewer's case: a rival got the key 1.5 s later, the holder not interrupted)."""
    mutex = Mutex(any_cache, lease=30)
    lease = mutex.acquire("k")
    assert Mutex(any_cache).extend("k", token=lease.token, lease=1) is True
    time.sleep(1.3)
    assert mutex.try_acquire("k") is None
    assert lease.release() is True


# -- found by review (issue 22): endings the lifecycle must get right ----------------------


class _SlowDelete(InMemoryCache):
    """A cache whose release takes ``delay`` s: before its delete lands, or after it
    (``reply_late``: the delete lands at once and only the reply is slow)."""

    def __init__(self, delay: float, reply_late: bool = False) -> None:
        super().__init__()
        self.delay, self.reply_late, self.down = delay, reply_late, False

    def compare_and_delete(self, key: str, *, version: str) -> bool | None:
        if self.down:
            raise MalfunctionError(f"memory down (test) during compare_and_delete on {key!r}")
        if self.reply_late:
            done = super().compare_and_delete(key, version=version)
            time.sleep(self.delay)
            return done
        time.sleep(self.delay)
        return super().compare_and_delete(key, version=version)


def test_a_lapsed_lease_whose_release_meets_a_fault_still_reports_its_loss(key):
    """The "lost" event of a lapsed lease does not depend on the cache answering its
    release (it did when the cache faulted: the event was never sent)."""
    from simple_mutex import events

    seen: list[str] = []
    stop = events.subscribe(lambda event: seen.append(event.kind) if event.key == key else None)
    try:
        cache = _SlowDelete(0.0)
        lease = Mutex(cache, lease=0.2).acquire(key)
        time.sleep(0.35)
        cache.down = True
        assert lease.release() is False
    finally:
        stop()
    assert seen == ["acquired", "lost"]


def test_a_cancelled_release_async_abandons_the_record_and_ends_the_lease(key):
    """Cancelling ``await lease.release_async()`` mid-delete ends the lease as an
    interrupted ``release()`` does: the record is freed and the lease is over (it stayed
    'releasing' and later reported a loss nobody caused)."""
    import asyncio

    async def main() -> None:
        cache = _SlowDelete(0.3)
        mutex = Mutex(cache, lease=1.0)
        lease = await mutex.acquire_async(key)
        releasing = asyncio.ensure_future(lease.release_async())
        await asyncio.sleep(0.1)
        releasing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await releasing
        await asyncio.sleep(0.6)  # the delete in flight and the abandon both landed
        assert await mutex.holder_async(key) is None
        assert "released" in repr(lease)
        assert await lease.release_async() is False
        await asyncio.sleep(1.0)  # past the deadline: nothing reports a loss
        assert "released" in repr(lease)

    asyncio.run(main())


@pytest.mark.parametrize("reply_late", [True, False])
def test_async_with_whose_release_outlasts_the_deadline_ends_as_the_release_says(key, reply_late):
    """The body ends 0.2 s before the deadline and the release is in flight when it
    passes: the block ends normally if that release freed the record in time, else with
    the loss error; never with a bare CancelledError from its own loss."""
    import asyncio

    async def main() -> str:
        mutex = Mutex(_SlowDelete(0.5, reply_late=reply_late), lease=1.0)
        async with mutex.acquire_async(key) as lease:
            await asyncio.sleep(lease._deadline - time.monotonic() - 0.2)
        return "ended"

    if reply_late:
        assert asyncio.run(main()) == "ended"
    else:
        with pytest.raises(SimpleMutexLeaseExpiredError):
            asyncio.run(main())


@pytest.mark.backends
def test_exiting_with_a_renewed_lease_held_logs_no_keeper_error(tmp_path):
    """A process that ends holding a renew=True lease while an atexit handler takes a
    moment: the keeper's next renewal finds the pools shut; it is dropped, not logged as
    an error (the lease lapses, as a crashed holder's does)."""
    import subprocess
    import sys

    script = tmp_path / "exit_holding.py"
    script.write_text(
        "import atexit, time\n"
        "import simple_mutex as sm\n"
        "lease = sm.Mutex(sm.InMemoryCache(), lease=0.3).acquire('k', renew=True)\n"
        "atexit.register(time.sleep, 0.6)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert "keeper" not in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_a_lost_lease_interrupts_a_holder_that_is_starting_threads(monkeypatch):
    """Before CPython 3.12 a thread being started carries its parent's id until it runs,
    so an interrupt sent to a holder starting a thread could land in the new thread: that
    thread died unborn and the holder waited for it in Thread.start() for good (1 send in
    7, in a loop like this one, on 3.11). Each holder here starts threads until its lease
    lapses: each gets the interrupt itself, and no thread dies of it. (3.12 stamps a
    thread's own id in the thread; the lower-bounds run, on 3.10, runs this too.)"""
    misdelivered: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda a: misdelivered.append(a.exc_type.__name__))
    mutex = Mutex(InMemoryCache(), lease=0.05)
    for attempt in range(60):
        outcome: list[str] = []

        def holder(key: str = f"k{attempt}", outcome: list[str] = outcome) -> None:
            try:
                with mutex.acquire(key):
                    while True:
                        threading.Thread(target=int, daemon=True).start()
            except SimpleMutexLeaseExpiredError:
                outcome.append("interrupted")

        thread = threading.Thread(target=holder, daemon=True)
        thread.start()
        thread.join(10)
        assert not thread.is_alive(), f"attempt {attempt}: the holder hangs in Thread.start()"
        assert outcome == ["interrupted"]
    assert misdelivered == [], "an interrupt landed in a thread its holder was starting"


@pytest.mark.parametrize("found_at", ["release", "renewal"])
def test_a_lock_freed_by_force_names_that_not_the_lease(memory_cache, key, found_at):
    """A renewed lease whose record an operator freed (``simple-mutex release``): the
    holder's error, found at its release or at its next renewal, names a lock freed or
    taken while it had time, not a lease to raise."""
    from simple_mutex.admin import live_locks, release

    mutex = Mutex(memory_cache, lease=30 if found_at == "release" else 0.6)

    def hold() -> None:
        with mutex.acquire(key, renew=True):
            [held] = live_locks(memory_cache, "mutex.")
            assert release(memory_cache, held)  # the operator's release
            if found_at == "renewal":
                spin(3.0)  # the renewal at a third of the lease finds it gone: interrupted

    with pytest.raises(SimpleMutexLeaseExpiredError) as info:
        hold()
    message = str(info.value)
    assert "freed or taken while it still had time" in message
    assert "simple-mutex release" in message
    assert 'on_busy="replace"' in message  # a replacing call's take-over is one such cause
    assert "renew=True" not in message
