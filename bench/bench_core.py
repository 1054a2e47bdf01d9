"""Benchmark the per-process and per-machine tiers against the locks Python users already have.

Run: ``.venv/bin/python bench/bench_core.py`` (about 30 s). Prints, in one run:

* the uncontended acquire+release cycle of ``Mutex(InMemoryCache)`` against a bare
  ``threading.Lock``, and of ``Mutex(DiskCache)`` against ``filelock.FileLock`` on the same
  directory, with ratios;
* hand-off latency (release -> a waiting thread holds the lock), p50 and p90.

Timings are medians of several rounds, since this shared 2-core machine is noisy.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import filelock

from simple_mutex import DiskCache, InMemoryCache, Lease, Mutex

T = TypeVar("T")


def cycle_us(cycle: Callable[[], None], count: int, rounds: int = 5) -> float:
    """Median over rounds of the mean time of one call, in microseconds."""
    results = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(count):
            cycle()
        results.append((time.perf_counter() - start) / count * 1e6)
    return statistics.median(results)


def handoff_us(
    hold: Callable[[], T],
    take: Callable[[], T],
    drop: Callable[[T], object],
    samples: int,
) -> tuple[float, float]:
    """Holder releases at t0; a waiter blocked in ``take`` records t1 once it holds.
    Returns p50 and p90 of t1 - t0 in microseconds."""
    gaps = []
    for _ in range(samples):
        held = hold()
        got = threading.Event()
        stamp: list[float] = []

        def waiter(got: threading.Event = got, stamp: list[float] = stamp) -> None:
            token = take()
            stamp.append(time.perf_counter())
            got.set()
            drop(token)

        thread = threading.Thread(target=waiter)
        thread.start()
        time.sleep(0.002)  # let the waiter block
        released_at = time.perf_counter()
        drop(held)
        got.wait(10)
        thread.join(10)
        gaps.append((stamp[0] - released_at) * 1e6)
    gaps.sort()
    return gaps[len(gaps) // 2], gaps[int(len(gaps) * 0.9)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    args = parser.parse_args()
    scale = 5 if args.quick else 1
    rows: list[tuple[str, float, str]] = []

    # -- per process ---------------------------------------------------------------------
    plain = threading.Lock()

    def plain_cycle() -> None:
        plain.acquire()
        plain.release()

    memory = Mutex(InMemoryCache())

    def memory_cycle() -> None:
        memory.acquire("bench").release()

    def memory_with() -> None:
        with memory.acquire("bench"):
            pass

    base = cycle_us(plain_cycle, 200_000 // scale)
    mem = cycle_us(memory_cycle, 50_000 // scale)
    mem_with = cycle_us(memory_with, 50_000 // scale)
    rows += [
        ("threading.Lock acquire+release", base, "1.00x"),
        ("Mutex(InMemoryCache) acquire()+release()", mem, f"{mem / base:.0f}x Lock"),
        ("Mutex(InMemoryCache) with acquire():", mem_with, f"{mem_with / base:.0f}x Lock"),
    ]

    # -- per machine, same directory ------------------------------------------------------
    with tempfile.TemporaryDirectory(dir=".") as directory:
        flock = filelock.FileLock(f"{directory}/bench.lock")

        def flock_cycle() -> None:
            flock.acquire()
            flock.release()

        disk = Mutex(DiskCache(directory))

        def disk_cycle() -> None:
            disk.acquire("bench").release()

        file_us = cycle_us(flock_cycle, 20_000 // scale)
        disk_us = cycle_us(disk_cycle, 20_000 // scale)
        rows += [
            ("filelock.FileLock acquire+release", file_us, "1.00x"),
            ("Mutex(DiskCache) acquire()+release()", disk_us, f"{disk_us / file_us:.2f}x FileLock"),
        ]

        # -- hand-off -----------------------------------------------------------------------
        samples = 300 // scale
        mem_p50, mem_p90 = handoff_us(
            lambda: memory.acquire("handoff"),
            lambda: memory.acquire("handoff"),
            Lease.release,
            samples,
        )
        lock_p50, lock_p90 = handoff_us(
            lambda: plain.acquire(), lambda: plain.acquire(), lambda _: plain.release(), samples
        )
        polled = Mutex(DiskCache(directory), interval=0.01)
        disk_p50, disk_p90 = handoff_us(
            lambda: polled.acquire("handoff"),
            lambda: polled.acquire("handoff"),
            Lease.release,
            samples // 3,
        )
        # FileLock keeps one context per thread, so each thread releases its own hold.
        flock_p50, flock_p90 = handoff_us(
            flock.acquire, flock.acquire, lambda _: flock.release(), samples // 3
        )

    width = max(len(name) for name, _, _ in rows) + 2
    print(f"{'uncontended cycle':<{width}}{'µs':>9}   ratio")
    for name, value, ratio in rows:
        print(f"{name:<{width}}{value:>9.2f}   {ratio}")
    print()
    print(f"{'hand-off (release -> waiter holds)':<{width}}{'p50 µs':>9}{'p90 µs':>10}")
    for name, p50, p90 in [
        ("threading.Lock", lock_p50, lock_p90),
        ("Mutex(InMemoryCache) (notified)", mem_p50, mem_p90),
        ("Mutex(DiskCache) interval=0.01 s (polled)", disk_p50, disk_p90),
        ("filelock.FileLock poll_interval=0.05 s", flock_p50, flock_p90),
    ]:
        print(f"{name:<{width}}{p50:>9.0f}{p90:>10.0f}")
    print()
    print(
        "targets: InMemory cycle < 10 µs; DiskCache cycle <= 0.5x FileLock; "
        "in-memory hand-off p50 < 1000 µs"
    )
    ok = mem < 10 and disk_us <= 0.5 * file_us and mem_p50 < 1000
    print("all targets met" if ok else "TARGET MISSED")


if __name__ == "__main__":
    main()
