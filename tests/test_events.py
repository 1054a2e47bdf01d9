"""The event stream (simple_mutex.events): every lock reports what happened to it, once,
with the fields operators need and never a token; a failing subscriber breaks nothing."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from alarms import Alarm
from workers import spin

from simple_mutex import (
    InMemoryCache,
    Mutex,
    Semaphore,
    SimpleMutexAcquireTimeoutError,
    SimpleMutexLeaseExpiredError,
    events,
    with_simple_mutex,
)
from simple_mutex.events import LockEvent

pytestmark = pytest.mark.fast


@pytest.fixture
def seen() -> Iterator[list[LockEvent]]:
    """Every event emitted while the test runs."""
    got: list[LockEvent] = []
    unsubscribe = events.subscribe(got.append)
    yield got
    unsubscribe()


@contextlib.contextmanager
def subscribed(subscriber: events.Subscriber) -> Iterator[None]:
    """``subscriber`` hears the events of the block, and only those."""
    stop = events.subscribe(subscriber)
    try:
        yield
    finally:
        stop()


def kinds(seen: list[LockEvent]) -> list[str]:
    return [event.kind for event in seen]


def test_a_cycle_reports_acquired_then_released_with_every_field(seen):
    """acquired carries waited, fence, slot and the holder (never the token); released
    carries how long it was held."""
    mutex = Mutex(InMemoryCache(), name="orders")
    lease = mutex.acquire("order.7", label="worker-1")
    time.sleep(0.02)
    lease.release()
    acquired, released = seen
    assert (acquired.kind, released.kind) == ("acquired", "released")
    for event in seen:
        assert (event.key, event.name, event.cache) == ("order.7", "orders", "memory")
        assert event.fence == lease.fence
        assert event.slot == 0
        assert event.holder is not None
        assert event.holder.label == "worker-1"
        assert event.at.tzinfo is not None
        assert lease.token not in repr(event)
    assert 0 <= acquired.waited < 1
    assert released.held >= 0.02
    assert acquired.took_over is False


def test_busy_timed_out_renewed_and_lost(seen):
    """A try-once on a held key is busy (with the holder in the way), a longer wait
    times out, a renewal is reported, and a lapse is lost with its reason and hold."""
    cache = InMemoryCache()
    mutex = Mutex(cache, lease=0.3)
    held = mutex.acquire("k", label="first")
    assert mutex.try_acquire("k") is None
    with pytest.raises(SimpleMutexAcquireTimeoutError):
        mutex.acquire("k", timeout=0.05)
    held.renew()
    with pytest.raises(SimpleMutexLeaseExpiredError), held:
        spin(5)
    assert kinds(seen) == ["acquired", "busy", "timed_out", "renewed", "lost"]
    busy, timed_out, lost = seen[1], seen[2], seen[4]
    assert busy.holder is not None
    assert busy.holder.label == "first"
    assert timed_out.waited >= 0.05
    assert "lapsed" in lost.reason
    assert lost.held >= 0.25


def test_a_takeover_of_a_lapsed_holder_says_so(seen):
    """A waiter that gets the key after its holder lapsed reports took_over; one that
    gets it from a release does not."""
    mutex = Mutex(InMemoryCache(), lease=0.2)
    mutex.acquire("crashed")  # never released: it lapses
    mutex.acquire("crashed", timeout=2, interval=0.05).release()
    first = mutex.acquire("polite")
    first.release()
    mutex.acquire("polite").release()
    grants = [e for e in seen if e.kind == "acquired"]
    assert [(e.key, e.took_over) for e in grants] == [
        ("crashed", False), ("crashed", True), ("polite", False), ("polite", False)
    ]  # fmt: skip


def test_a_waiter_handed_a_released_key_did_not_take_over(seen):
    """took_over is what the cache knows, not a guess from the clock: a waiter that saw
    the holder, then got the key only after that holder's lease would have ended, was
    handed a released key (the holder freed it): no take-over."""
    waiting, go_on = threading.Event(), threading.Event()

    class HeldBack(InMemoryCache):
        def wait(self, keys, timeout):  # the waiter sleeps until the test lets it go
            waiting.set()
            go_on.wait(10)

    mutex = Mutex(HeldBack(), lease=0.3)
    holder = mutex.acquire("k")
    waiter = threading.Thread(target=lambda: mutex.acquire("k", timeout=10).release())
    waiter.start()
    assert waiting.wait(10)
    assert holder.release() is True
    time.sleep(0.4)  # past the end of the released holder's lease
    go_on.set()
    waiter.join(10)
    assert [e.took_over for e in seen if e.kind == "acquired"] == [False, False]


def test_names_come_from_the_template_the_class_or_the_caller(seen):
    """with_simple_mutex names its events by its template; Semaphore by default
    "semaphore"; async acquires report the same events."""
    cache = InMemoryCache()

    @with_simple_mutex(key="phone.{phone}", cache=cache)
    def assign(phone: str) -> None: ...

    assign("+1555")
    Semaphore(cache, permits=2).acquire("pool").release()

    async def main() -> None:
        async with Mutex(cache, name="api").acquire_async("k"):
            pass

    asyncio.run(main())
    assert [(e.kind, e.name, e.key) for e in seen] == [
        ("acquired", "phone.{phone}", "phone.+1555"), ("released", "phone.{phone}", "phone.+1555"),
        ("acquired", "semaphore", "pool"), ("released", "semaphore", "pool"),
        ("acquired", "api", "k"), ("released", "api", "k"),
    ]  # fmt: skip


def test_a_failing_subscriber_is_logged_and_never_breaks_the_lock(seen, caplog):
    """A subscriber that raises is logged; the lock works and later subscribers still hear."""

    def broken(event: LockEvent) -> None:
        raise RuntimeError("dashboard down")

    with subscribed(broken):
        Mutex(InMemoryCache()).acquire("k").release()
    assert kinds(seen) == ["acquired", "released"]
    assert "dashboard down" in caplog.text


@pytest.mark.parametrize("kind", ["acquired", "released"])
def test_a_job_timeout_landing_in_a_subscriber_reaches_the_caller(alarm, kind):
    """A signal handler runs inside whatever the main thread runs, a subscriber too: its
    exception is the caller's timeout, never the subscriber's failure to log and drop.
    (Found by the alarm test of tests/test_interrupted_wait.py hanging: with a subscriber
    installed, 55 of 1,000 alarms at random moments of Redis lock cycles were swallowed,
    107 of 1,000 on InMemoryCache, and the loop they should end ran on.)"""

    def slow_dashboard(event: LockEvent) -> None:
        if event.kind == kind:
            signal.raise_signal(signal.SIGALRM)  # the timer fires while this runs

    cache = InMemoryCache()
    with subscribed(slow_dashboard), pytest.raises(Alarm):
        Mutex(cache).acquire("k", timeout=0).release()
    assert not Mutex(cache).locked("k"), "the interrupted cycle left its record"


@pytest.mark.parametrize("face", ["asyncio cache", "blocking cache awaited"])
def test_a_job_timeout_in_an_acquired_subscriber_of_an_async_acquire_frees_the_grant(alarm, face):
    """acquire_async: the timeout reaches the caller and the grant it never got is freed
    (found by review: it stayed held for the whole lease)."""
    from async_memory import AsyncMemory

    def slow_dashboard(event: LockEvent) -> None:
        if event.kind == "acquired":
            signal.raise_signal(signal.SIGALRM)

    cache: object = AsyncMemory() if face == "asyncio cache" else InMemoryCache()
    mutex = Mutex(cache, lease=600)

    async def main() -> bool:
        with subscribed(slow_dashboard), pytest.raises(Alarm):
            async with mutex.acquire_async("k", timeout=0):
                pytest.fail("the body ran")
        return await mutex.locked_async("k")

    assert asyncio.run(main()) is False, "the grant stayed held for its lease"


def _traced(function: Any) -> Any:
    """A decorator as tracing SDKs write them: every function it wraps shares one code."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    return wrapper


def test_a_decorated_subscriber_s_own_failure_is_not_taken_for_a_decorated_handler_s(caplog):
    """The handler and the subscriber share a wrapper's code: told apart by what each
    wrapped (found by review: the subscriber's KeyError failed the acquire). A job
    timeout raised through the same wrapper still reaches the caller."""

    @_traced
    def ring(signum: int, frame: object) -> None:
        raise Alarm("the job's time is up")

    @_traced
    def buggy(event: LockEvent) -> None:
        raise KeyError("bug in the dashboard")

    @_traced
    def slow(event: LockEvent) -> None:
        signal.raise_signal(signal.SIGALRM)

    previous = signal.signal(signal.SIGALRM, ring)
    try:
        with subscribed(buggy), Mutex(InMemoryCache()).acquire("k", timeout=0):
            pass
        assert "bug in the dashboard" in caplog.text
        with subscribed(slow), pytest.raises(Alarm):
            Mutex(InMemoryCache()).acquire("k", timeout=0)
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_a_lease_interrupt_landing_in_a_subscriber_is_not_swallowed_either():
    """The lock's own interrupt (a lapse raised in the holder's thread) passes a
    subscriber too."""
    from simple_mutex._runtime.interrupt import interrupt_class

    lost = interrupt_class("k", "lease on 'k' lost")

    def unlucky(event: LockEvent) -> None:
        raise lost("lease on 'k' lost")

    with subscribed(unlucky), pytest.raises(SimpleMutexLeaseExpiredError):
        Mutex(InMemoryCache()).acquire("k", timeout=0)


def test_log_records_carry_the_events_fields(caplog):
    """subscribe(log_event) makes each event a record whose extra holds its fields; a
    lost lease is a WARNING record even with nobody subscribed."""
    caplog.set_level(logging.DEBUG, logger="simple_mutex")
    with subscribed(events.log_event):
        Mutex(InMemoryCache(), name="orders").acquire("order.7").release()
    mutex = Mutex(InMemoryCache(), lease=0.2)
    with pytest.raises(SimpleMutexLeaseExpiredError), mutex.acquire("k"):
        spin(5)
    records = [r for r in caplog.records if hasattr(r, "mutex_kind")]
    assert [r.mutex_kind for r in records] == ["acquired", "released", "lost"]
    assert records[0].mutex_key == "order.7"
    assert records[0].mutex_name == "orders"
    assert records[-1].levelno == logging.WARNING


@pytest.mark.backends
def test_unsubscribed_nothing_is_built():
    """With nobody listening, a lease takes no event state at all (the hot path)."""
    assert events.subscribers == ()
    lease = Mutex(InMemoryCache()).acquire("k")
    assert lease._listening is False
    lease.release()
