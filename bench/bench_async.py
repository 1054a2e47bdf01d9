"""Benchmark: simple-mutex on redis.asyncio against redis.asyncio's own Lock and a bare floor.

Run against the redis-server at REDIS_URL (default redis://127.0.0.1:6379/0)::

    .venv/bin/python bench/bench_async.py            # about a minute

Three parts, in one run:

* cycle: one uncontended acquire + release on one event loop, mean µs over ``--cycles``
  in each of ``--repeats`` rounds, the contenders taking turns round by round: the floor
  (``SET NX PX`` + a compare-and-delete script through ``redis.asyncio``),
  ``redis.asyncio.lock.Lock``, and ``Mutex(redis.asyncio.Redis)``; ratios to the floor and
  to redis.asyncio's Lock (the target: at most 1.05x the Lock).
* crowd: ``--coroutines`` coroutines on ``--keys`` keys in one process, each key's
  critical sections counted and checked for overlap; the process's thread count before,
  while they wait, and after. Releases wake waiters by notification; the poll
  (``--interval``, 10 s here) only looks for crashed holders, and ten thousand waiters
  polling every second would be ten thousand puts a second by definition.
* hand-off: a holder on one loop releases, a waiter in another process (blocked in
  ``acquire_async``, poll 5 s) holds; p50 / p90 against the same with the blocking
  ``Mutex(redis.Redis)`` (the target: async p50 within 1.15x of the sync one).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import secrets
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import redis
import redis.asyncio
from rounds import interleaved_rounds_async

from simple_mutex import Mutex

URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
RELEASE = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) "
    "else return 0 end"
)


async def cycle_table(cycles: int, repeats: int) -> None:
    client = redis.asyncio.Redis.from_url(URL)
    release = client.register_script(RELEASE)
    mutex = Mutex(redis.asyncio.Redis.from_url(URL), lease=30, prefix="bench-async.")
    lock = client.lock("bench-async.redis-lock", timeout=30)

    async def floor() -> None:
        token = secrets.token_hex(16)
        await client.set("bench-async.floor", token, nx=True, px=30_000)
        await release(keys=["bench-async.floor"], args=[token])

    async def ours() -> None:
        lease = await mutex.acquire_async("cycle")
        await lease.release_async()

    async def theirs() -> None:
        await lock.acquire()
        await lock.release()

    contenders: dict[str, Callable[[], Awaitable[None]]] = {
        "floor: SET NX PX + script, redis.asyncio": floor,
        "redis.asyncio.lock.Lock": theirs,
        "Mutex(redis.asyncio.Redis)": ours,
    }
    rounds = await interleaved_rounds_async(contenders, cycles=cycles, repeats=repeats, warmup=200)
    floor_m = statistics.median(rounds[next(iter(rounds))])
    lock_m = statistics.median(rounds["redis.asyncio.lock.Lock"])
    print(f"\nuncontended acquire+release on one loop, µs ({repeats} rounds of {cycles})")
    print("| contender | median µs | x floor | x redis.asyncio Lock | fastest µs |")
    print("|---|---|---|---|---|")
    for name, values in rounds.items():
        median = statistics.median(values)
        print(
            f"| {name} | {median:.1f} | {median / floor_m:.2f} | {median / lock_m:.2f} "
            f"| {min(values):.1f} |"
        )
    await client.aclose()


async def crowd(coroutines: int, keys: int, interval: float) -> None:
    client = redis.asyncio.Redis.from_url(URL)
    mutex = Mutex(client, lease=30, interval=interval, prefix="bench-async.")
    warm = await mutex.acquire_async("warm", renew=True)  # the keeper thread exists now
    await warm.release_async()
    run = secrets.token_hex(4)
    inside = dict.fromkeys(range(keys), 0)
    counts = dict.fromkeys(range(keys), 0)
    overlaps = 0

    async def one(n: int) -> None:
        nonlocal overlaps
        key = n % keys
        async with mutex.acquire_async(f"crowd.{run}.{key}"):
            inside[key] += 1
            overlaps += inside[key] > 1
            await asyncio.sleep(0)
            counts[key] += 1
            inside[key] -= 1

    before = threading.active_count()
    started = time.monotonic()
    tasks = [asyncio.ensure_future(one(n)) for n in range(coroutines)]
    await asyncio.sleep(0.2)
    during = threading.active_count()
    await asyncio.gather(*tasks)
    took = time.monotonic() - started
    after = threading.active_count()
    exact = all(count == coroutines // keys for count in counts.values())
    print(
        f"\n{coroutines} coroutines on {keys} keys, one process, poll {interval:g} s: {took:.1f} s"
    )
    print(f"per-key counts exact: {exact}; overlaps: {overlaps}")
    print(f"threads: {before} before, {during} while waiting, {after} after")


def _waiter(kind: str, key: str, rounds: int, go: Any, out: Any) -> None:
    if kind == "async":

        async def main() -> None:
            mutex = Mutex(redis.asyncio.Redis.from_url(URL), lease=30, interval=5)
            for _ in range(rounds):
                go.wait()
                go.clear()
                lease = await mutex.acquire_async(key)
                out.send(time.monotonic())
                await lease.release_async()

        asyncio.run(main())
        return
    mutex = Mutex(redis.Redis.from_url(URL), lease=30, interval=5)
    for _ in range(rounds):
        go.wait()
        go.clear()
        lease = mutex.acquire(key)
        out.send(time.monotonic())
        lease.release()


def handoff(kind: str, rounds: int) -> tuple[float, float]:
    key = f"handoff.{secrets.token_hex(4)}"
    holder = Mutex(redis.Redis.from_url(URL), lease=30)
    go = mp.Event()
    receive, send = mp.Pipe(duplex=False)
    waiter = mp.get_context("fork").Process(target=_waiter, args=(kind, key, rounds, go, send))
    waiter.start()
    gaps = []
    try:
        for _ in range(rounds):
            lease = holder.acquire(key)
            go.set()
            time.sleep(0.02)  # the waiter tries, finds it held, blocks
            start = time.monotonic()
            lease.release()
            gaps.append(receive.recv() - start)
            time.sleep(0.002)
    finally:
        waiter.join(10)
        waiter.kill()
    gaps.sort()
    return statistics.median(gaps) * 1e3, gaps[int(len(gaps) * 0.9)] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--coroutines", type=int, default=10_000)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--interval", type=float, default=10.0, help="the crowd's poll (s)")
    parser.add_argument("--handoffs", type=int, default=100)
    parser.add_argument("--only", choices=["cycle", "crowd", "handoff"], help="one part only")
    args = parser.parse_args()
    print(f"redis at {URL}; redis-py {redis.__version__}")
    if args.only in (None, "cycle"):
        asyncio.run(cycle_table(args.cycles, args.repeats))
    if args.only in (None, "crowd"):
        asyncio.run(crowd(args.coroutines, args.keys, args.interval))
    if args.only not in (None, "handoff"):
        return
    sync_p50, sync_p90 = handoff("sync", args.handoffs)
    async_p50, async_p90 = handoff("async", args.handoffs)
    print("\nhand-off: release() -> a waiter in another process holds, ms")
    print("| waiter | p50 | p90 |")
    print("|---|---|---|")
    print(f"| Mutex(redis.Redis).acquire | {sync_p50:.2f} | {sync_p90:.2f} |")
    print(f"| Mutex(redis.asyncio.Redis).acquire_async | {async_p50:.2f} | {async_p90:.2f} |")
    print(f"async / sync p50: {async_p50 / sync_p50:.2f}x (target <= 1.15x)")


if __name__ == "__main__":
    main()
