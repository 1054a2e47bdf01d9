"""The two drivers that run the engine's flows (``simple_mutex._core.flows``): ``run``
blocks, ``run_async`` awaits (an asyncio cache directly, a non-blocking one on the loop,
others in threads). Here, and only here, operations meet a cache: a stray driver error
becomes a MalfunctionError naming the backend and operation; a sleep (``Pause``) sleeps.
Also the per-space hand-off marks (``Handoffs``), which read the clock.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from simple_mutex._core.flows import Call, Flow, Pause, PutIfAbsent, T, Wait, abandon
from simple_mutex._core.timing import HANDOFF_COURTESY
from simple_mutex._runtime.interrupt import swallowed_by_driver
from simple_mutex.contract import DRIVER_ERRORS, AnyCache, ConditionalCache, is_async
from simple_mutex.errors import MalfunctionError, SimpleCacheConditionError, SimpleMutexError


class Handoffs:
    """Keys of one lock space that this process just handed to a waiter it woke."""

    def __init__(self) -> None:
        self._until: dict[str, float] = {}  # cache key -> monotonic end of the courtesy

    def woke(self, cache_key: str) -> None:
        if len(self._until) > 1024:  # marks of keys never taken again
            self._until.clear()
        self._until[cache_key] = time.monotonic() + HANDOFF_COURTESY

    def courtesy(self, slot_keys: Sequence[str]) -> float:
        """How long an acquire of these slots should hold back (0 or less: not at all)."""
        if not self._until:
            return 0.0
        return max(self._until.pop(k, 0.0) for k in slot_keys) - time.monotonic()


def execute(cache: ConditionalCache, op: Call) -> Any:
    """Run one operation, mapping a stray driver error to a MalfunctionError."""
    try:
        return op.apply(cache)
    except SimpleMutexError:
        raise
    except Exception as exc:
        if not is_driver_error(cache, exc):
            raise
        raise stray(cache, op, exc) from exc


def is_driver_error(cache: AnyCache, exc: Exception) -> bool:
    """Is ``exc`` a fault of the cache's driver (one of its ``driver_errors``)? Anything
    else raised inside a cache call is not the backend's: a signal handler's exception
    (RQ's job timeout, Celery's soft time limit, an alarm) landing while we wait, or a
    bug. It must reach the caller at once, never be taken for a backend fault that the
    acquire waits out before it runs the body anyway."""
    return isinstance(exc, getattr(cache, "driver_errors", DRIVER_ERRORS))


def stray(cache: AnyCache, op: Call, exc: Exception) -> MalfunctionError:
    """A driver error the backend forgot to map (backends map their own; this is the net)."""
    where = getattr(op, "key", op)
    return MalfunctionError(
        f"{cache.name} cache failed during {type(op).__name__} on {where!r}: {exc!r}"
    )


class Outcome(NamedTuple):
    """What an operation gave back to a flow: a result, or an error to throw into it."""

    result: Any = None
    error: SimpleMutexError | None = None


def attempt(cache: ConditionalCache, op: Call) -> Outcome:
    try:
        return Outcome(execute(cache, op))
    except (SimpleCacheConditionError, MalfunctionError) as exc:
        return Outcome(error=_not_swallowed(exc))


def _not_swallowed(error: SimpleMutexError) -> SimpleMutexError:
    """``error``, unless it is a backend fault standing for a job timeout (or a lease's
    interrupt) that the driver caught and replaced: that one is raised instead."""
    if isinstance(error, MalfunctionError):
        swallowed = swallowed_by_driver(error)
        if swallowed is not None:
            raise swallowed
    return error


def run(cache: ConditionalCache, flow: Flow[T]) -> T:
    """The blocking driver. (``execute`` and ``attempt`` inlined: this is the hot path.)"""
    result: Any = None
    error: SimpleMutexError | None = None
    while True:
        try:
            op = flow.send(result) if error is None else flow.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        if isinstance(op, Pause):
            time.sleep(op.seconds)
            result, error = None, None
            continue
        try:
            result, error = op.apply(cache), None
        except (SimpleCacheConditionError, MalfunctionError) as exc:
            result, error = None, _not_swallowed(exc)
        except SimpleMutexError:
            raise
        except Exception as exc:
            if not is_driver_error(cache, exc):
                raise
            result, error = None, stray(cache, op, exc)
            error.__cause__ = exc


async def run_async(cache: AnyCache, flow: Flow[T]) -> T:
    """The asyncio driver: the same flows. An asyncio cache is awaited directly; a cache
    that never blocks (InMemoryCache) is called on the loop; others run in threads."""
    attempt_one: Callable[[Any, Call], Awaitable[Outcome]]
    if is_async(cache):
        attempt_one = attempt_native
    elif vars(type(cache)).get("nonblocking", False):  # declared by the class itself:
        attempt_one = attempt_inline  # a subclass may block (a test double that sleeps)
    else:
        attempt_one = attempt_async
    try:
        op = next(flow)
        while True:
            if isinstance(op, Pause):
                await asyncio.sleep(op.seconds)
                result, error = None, None
            else:
                result, error = await attempt_one(cache, op)
            op = flow.send(result) if error is None else flow.throw(error)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


async def attempt_native(cache: Any, op: Call) -> Outcome:
    try:
        return Outcome(await op.apply_async(cache))
    except (SimpleCacheConditionError, MalfunctionError) as exc:
        return Outcome(error=_not_swallowed(exc))
    except SimpleMutexError:
        raise
    except asyncio.CancelledError:
        # Cancelled mid-request, the write may still land: free it behind the caller.
        if isinstance(op, PutIfAbsent):
            in_background(run_async(cache, abandon([op.key], op.value)))
        raise
    except Exception as exc:
        if not is_driver_error(cache, exc):
            raise
        error = stray(cache, op, exc)
        error.__cause__ = exc
        return Outcome(error=error)


async def attempt_inline(cache: Any, op: Call) -> Outcome:
    """A cache whose operations never block, on the loop itself; its waits park on a
    future (``wait_async``)."""
    if isinstance(op, Wait):
        await cache.wait_async(op.keys, op.seconds)
        return Outcome()
    return attempt(cache, op)


async def attempt_async(cache: Any, op: Call) -> Outcome:
    if isinstance(op, Wait):
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
            await asyncio.shield(in_background(_free_if_granted(cache, op, call)))
        raise


_cleanups: set[asyncio.Future[Any]] = set()


def in_background(work: Coroutine[Any, Any, Any]) -> asyncio.Future[Any]:
    """Run clean-up work in a task of its own, kept alive until done: a second cancel of
    the caller cannot skip it."""
    task = asyncio.ensure_future(work)
    _cleanups.add(task)
    task.add_done_callback(_cleanups.discard)
    return task


async def _free_if_granted(
    cache: ConditionalCache, op: PutIfAbsent, call: asyncio.Future[Outcome]
) -> None:
    outcome = await call
    if outcome.error is None:
        await asyncio.to_thread(run, cache, abandon([op.key], op.value))


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
