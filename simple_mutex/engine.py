"""The lock engine: every decision, no I/O.

An acquire is a generator "flow" that yields cache operations (plain values) and receives
their results; a driver runs the operations. ``run`` below is the blocking driver; an
asyncio driver is the same loop with ``await``. Tests drive flows on a fake clock.

The acquire flow, for the permit slots of one key (a mutex has one slot)::

    try put-if-absent on each slot, starting at a random one   -> granted: done
    on an unclear failure (a timeout may have written): read back, compare our value
    all busy: give up if the deadline passed (or timeout == 0)
    otherwise wait for a release notification, at most a jittered poll interval
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from .contract import ConditionalCache, Entry
from .errors import (
    MalfunctionError,
    SimpleCacheConditionError,
    SimpleMutexAcquireTimeoutError,
    SimpleMutexError,
)

# Operations are small immutable values (NamedTuples: cheap to build on the hot path), each
# knowing the one cache method it stands for.


class Get(NamedTuple):
    key: str

    def apply(self, cache: ConditionalCache) -> Entry | None:
        return cache.get(self.key)


class PutIfAbsent(NamedTuple):
    key: str
    value: str
    ttl: float

    def apply(self, cache: ConditionalCache) -> Entry:
        return cache.put_if_absent(self.key, self.value, ttl=self.ttl)


class CompareAndSet(NamedTuple):
    key: str
    value: str
    ttl: float
    version: str

    def apply(self, cache: ConditionalCache) -> Entry:
        return cache.compare_and_set(self.key, self.value, ttl=self.ttl, version=self.version)


class CompareAndDelete(NamedTuple):
    key: str
    version: str

    def apply(self, cache: ConditionalCache) -> bool:
        return bool(cache.compare_and_delete(self.key, version=self.version))


class Wait(NamedTuple):
    keys: tuple[str, ...]
    seconds: float

    def apply(self, cache: ConditionalCache) -> None:
        cache.wait(self.keys, self.seconds)


class Pause(NamedTuple):
    """Sleep without asking the cache anything (the hand-off courtesy below)."""

    seconds: float

    def apply(self, cache: ConditionalCache) -> None:
        time.sleep(self.seconds)


Op = Get | PutIfAbsent | CompareAndSet | CompareAndDelete | Wait | Pause

HANDOFF_COURTESY = 0.005
"""How long a holder that just woke a waiter by releasing a key holds back from taking
that key again. The releaser is already running while the woken waiter still has to be
scheduled, so without it a worker looping on one key wins nearly every race and starves
the others (measured on Redis: fairness 0.52-0.79 of the mean without, 1.00 with)."""


class Grant(NamedTuple):
    slot: int
    entry: Entry
    started: float
    """The monotonic time just before the winning write was sent: the lease runs from here
    on the holder's side, which is never later than the cache's own start."""


Flow = Generator[Op, Any, Grant]


def acquire_flow(
    *,
    key: str,
    slot_keys: Sequence[str],
    value: str,
    lease: float,
    timeout: float | None,
    interval: float,
    now: Callable[[], float],
    rng: random.Random,
    courtesy: float = 0.0,
) -> Flow:
    deadline = None if timeout is None else now() + timeout
    count = len(slot_keys)
    if courtesy > 0 and timeout != 0:
        # We just handed this key to a waiter we woke: let it go first.
        yield Pause(courtesy if timeout is None else min(courtesy, timeout))
    while True:
        # A random first slot spreads semaphore holders instead of piling on slot 0.
        first = rng.randrange(count) if count > 1 else 0
        for step in range(count):
            slot = (first + step) % count
            started = now()
            try:
                entry = yield PutIfAbsent(slot_keys[slot], value, lease)
            except SimpleCacheConditionError:
                continue
            except MalfunctionError:
                # The write may have landed before the reply was lost: read back and compare
                # (our value carries a unique token, so equality proves it is ours).
                entry = yield Get(slot_keys[slot])
                if entry is None or entry.value != value:
                    raise
            return Grant(slot, entry, started)
        remaining = None if deadline is None else deadline - now()
        if remaining is not None and remaining <= 0:
            raise SimpleMutexAcquireTimeoutError(
                f"lock {key!r} stayed busy for the whole timeout of {timeout:g} s; raise "
                "timeout, or treat this as 'another worker is already on it'",
                key=key,
            )
        pause = poll_pause(interval, rng)
        yield Wait(tuple(slot_keys), pause if remaining is None else min(pause, remaining))


def poll_pause(interval: float, rng: random.Random) -> float:
    """A jittered poll (0.5x to 1.5x) so waiters that started together do not stay in step."""
    return interval * (0.5 + rng.random())


def renew_after(lease: float) -> float:
    """Renew at a third of the lease: two renewals can fail before the lease lapses."""
    return lease / 3.0


def retry_renew_after(lease: float) -> float:
    """After a failed renewal (backend fault), try again soon but without hammering."""
    return min(max(lease / 10.0, 0.01), 1.0)


def execute(cache: ConditionalCache, op: Op) -> Any:
    """Run one operation, mapping any stray driver error to a MalfunctionError."""
    try:
        return op.apply(cache)
    except SimpleMutexError:
        raise
    except Exception as exc:
        # A backend should map its own errors; this is the net for those it missed.
        name = type(op).__name__
        raise MalfunctionError(
            f"{cache.name} cache failed during {name} on {getattr(op, 'key', op)!r}: {exc!r}"
        ) from exc


class Outcome(NamedTuple):
    """What an operation gave back to a flow: a result, or an error to throw into it."""

    result: Any = None
    error: SimpleMutexError | None = None


def attempt(cache: ConditionalCache, op: Op) -> Outcome:
    try:
        return Outcome(execute(cache, op))
    except (SimpleCacheConditionError, MalfunctionError) as exc:
        return Outcome(error=exc)


def resume(flow: Flow, outcome: Outcome) -> Op | Grant:
    """Hand an outcome to the flow; its next operation, or the Grant it returned."""
    try:
        if outcome.error is not None:
            return flow.throw(outcome.error)
        return flow.send(outcome.result)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


def run(cache: ConditionalCache, flow: Flow) -> Grant:
    """The blocking driver."""
    step: Op | Grant = next(flow)
    while not isinstance(step, Grant):
        step = resume(flow, attempt(cache, step))
    return step


async def run_async(cache: ConditionalCache, flow: Flow) -> Grant:
    """The asyncio driver: the same flow, cache calls moved off the event loop."""
    step: Op | Grant = next(flow)
    while not isinstance(step, Grant):
        step = resume(flow, await attempt_async(cache, step))
    return step


async def attempt_async(cache: ConditionalCache, op: Op) -> Outcome:
    if isinstance(op, Pause):
        await asyncio.sleep(op.seconds)
        return Outcome()
    if isinstance(op, Wait):
        wait_async = getattr(cache, "wait_async", None)
        if wait_async is not None:  # the cache can wake an event loop itself
            await wait_async(op.keys, op.seconds)
            return Outcome()
        # A blocking wait (Redis BLPOP, a sleep) in a pool of its own, so that waiters
        # never fill the loop's default executor that the other operations run in.
        loop = asyncio.get_running_loop()
        waiting = loop.run_in_executor(_wait_pool(), attempt, cache, op)
        try:
            # Queued behind other waiters, a wait would start late and overrun the
            # deadline: give up on it after its own length (a queued one is dropped).
            return await asyncio.wait_for(waiting, op.seconds)
        except asyncio.TimeoutError:
            return Outcome()
    call = asyncio.ensure_future(asyncio.to_thread(attempt, cache, op))
    try:
        return await asyncio.shield(call)
    except asyncio.CancelledError:
        # The thread runs on regardless. If it wins the lock after we were cancelled,
        # nobody would hold the lease: free it before passing the cancellation on. Done
        # in a task of its own, so that a second cancel cannot skip it.
        if isinstance(op, PutIfAbsent):
            cleanup = asyncio.ensure_future(_free_if_granted(cache, op, call))
            _cleanups.add(cleanup)
            cleanup.add_done_callback(_cleanups.discard)
            await asyncio.shield(cleanup)
        raise


_cleanups: set[asyncio.Future[None]] = set()


async def _free_if_granted(
    cache: ConditionalCache, op: PutIfAbsent, call: asyncio.Future[Outcome]
) -> None:
    outcome = await call
    if outcome.error is None:
        await asyncio.to_thread(attempt, cache, CompareAndDelete(op.key, outcome.result.version))


_waits: ThreadPoolExecutor | None = None


def _wait_pool() -> ThreadPoolExecutor:
    global _waits
    if _waits is None:
        _waits = ThreadPoolExecutor(max_workers=64, thread_name_prefix="simple-mutex-wait")
    return _waits


def _forget_wait_pool() -> None:
    global _waits
    _waits = None  # its threads stayed in the parent


os.register_at_fork(after_in_child=_forget_wait_pool)
