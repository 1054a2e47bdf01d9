"""The timing loop and ratio table every tier's benchmark shares.

Contenders run in interleaved rounds (A B C, A B C, ...) so a burst of load on this
shared machine hits all of them alike; the table gives each one's median and fastest
round against the floor's.
"""

from __future__ import annotations

import secrets
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping

from simple_mutex import ConditionalCache, InMemoryCache, Mutex


def interleaved_rounds(
    contenders: Mapping[str, Callable[[], object]], *, cycles: int, repeats: int, warmup: int
) -> dict[str, list[float]]:
    """Microseconds per call of each contender, one value per round."""
    rounds: dict[str, list[float]] = {name: [] for name in contenders}
    for cycle in contenders.values():  # warm up: connections open, scripts loaded
        for _ in range(warmup):
            cycle()
    for _ in range(repeats):
        for name, cycle in contenders.items():
            start = time.perf_counter()
            for _ in range(cycles):
                cycle()
            rounds[name].append((time.perf_counter() - start) / cycles * 1e6)
    return rounds


async def interleaved_rounds_async(
    contenders: Mapping[str, Callable[[], Awaitable[object]]],
    *,
    cycles: int,
    repeats: int,
    warmup: int,
) -> dict[str, list[float]]:
    """``interleaved_rounds`` on the running loop: each contender's call awaited."""
    rounds: dict[str, list[float]] = {name: [] for name in contenders}
    for cycle in contenders.values():
        for _ in range(warmup):
            await cycle()
    for _ in range(repeats):
        for name, cycle in contenders.items():
            start = time.perf_counter()
            for _ in range(cycles):
                await cycle()
            rounds[name].append((time.perf_counter() - start) / cycles * 1e6)
    return rounds  # fmt: skip


def print_ratio_table(title: str, rounds: Mapping[str, list[float]], floor: str) -> None:
    """A markdown table: median and fastest round of each contender, and their ratios to
    the floor's median and fastest round."""
    floor_median, floor_best = statistics.median(rounds[floor]), min(rounds[floor])
    width = max(len(name) for name in rounds)
    print(f"\n{title}")
    print(f"| {'lock':{width}} | median µs | x floor | fastest µs | x floor |")
    print(f"|{'-' * (width + 2)}|-----------|---------|------------|---------|")
    for name, values in rounds.items():
        median, best = statistics.median(values), min(values)
        print(
            f"| {name:{width}} | {median:9.1f} | {median / floor_median:7.2f} "
            f"| {best:10.1f} | {best / floor_best:7.2f} |"
        )


RECORD = '{"v":1,"token":"%s","host":"bench","pid":1,"label":null,"acquired_at":1.5}'
"""A lock record of the usual size, for timing a backend's operations alone."""


def our_contenders(
    cache: ConditionalCache, label: str, *, lease: float
) -> dict[str, Callable[[], object]]:
    """The lines every tier's table shows besides its floor: the core with no I/O
    (InMemoryCache), the backend's two operations alone, and the full Mutex cycle."""
    memory = Mutex(InMemoryCache(), lease=lease)
    ours = Mutex(cache, lease=lease, prefix="bench.sm.")

    def in_memory() -> None:
        with memory.acquire("cycle"):
            pass

    def backend_only() -> None:
        entry = cache.put_if_absent("bench.ops", RECORD % secrets.token_hex(16), ttl=lease)
        cache.compare_and_delete("bench.ops", version=entry.version)

    def full_cycle() -> None:
        with ours.acquire("cycle"):
            pass

    return {
        "simple-mutex InMemoryCache": in_memory,
        f"{label} ops, no Mutex": backend_only,
        f"simple-mutex {label}": full_cycle,
    }
