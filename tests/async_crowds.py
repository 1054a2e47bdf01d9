"""Crowds of coroutines for the asyncio cache suites: several OS processes, each running
many coroutines that count under one lock, and the process's OS thread count."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

from procs import FORK

from simple_mutex import Mutex

LIMIT = 60.0  # a hang fails the test instead of blocking the run


async def count_under_lock(mutex: Mutex, key: str, tasks: int, rounds: int, shared: Any) -> None:
    """``tasks`` coroutines each take ``key`` ``rounds`` times and bump the shared
    counters (inside, total, overlaps) inside the lock, with an await between reading the
    total and writing it back: a second holder would lose an increment."""
    inside, total, overlaps = shared

    async def worker() -> None:
        for _ in range(rounds):
            async with mutex.acquire_async(key, timeout=LIMIT, interval=0.02):
                inside.value += 1
                if inside.value != 1:
                    overlaps.value += 1
                seen = total.value
                await asyncio.sleep(0.001)  # another holder would interleave here
                total.value = seen + 1
                inside.value -= 1

    await asyncio.gather(*(worker() for _ in range(tasks)))


def contend(
    child: Callable[..., None], args: tuple[Any, ...], procs: int, context: Any = FORK
) -> tuple[int, ...]:
    """Run ``child(*args, shared)`` in ``procs`` processes, forked (or started by another
    multiprocessing ``context``: procs.CTX spawns fresh interpreters), each calling
    ``count_under_lock``; their exit codes, then (total, overlaps, inside)."""
    shared = tuple(context.RawValue("i", 0) for _ in range(3))
    children = [context.Process(target=child, args=(*args, shared)) for _ in range(procs)]
    for process in children:
        process.start()
    for process in children:
        process.join(LIMIT)
        if process.exitcode is None:
            process.kill()
    inside, total, overlaps = (value.value for value in shared)
    return (*(process.exitcode for process in children), total, overlaps, inside)


def os_threads() -> frozenset[str]:
    """The OS threads of this process, by id (an executor's or a driver's would show
    here). A test counts those new since a moment (``len(os_threads() - before)``), not
    the total, which a thread of an earlier test ending meanwhile would lower."""
    return frozenset(os.listdir("/proc/self/task"))
