"""Benchmark: what the operator's ``show``, ``list`` and ``watch`` cost on a Redis that
holds many keys the library never wrote.

Run against a Redis OF YOUR OWN (it empties the database of the URL first)::

    REDIS_URL=redis://127.0.0.1:6393/3 .venv/bin/python bench/bench_admin_redis.py

It fills the database with ``--unrelated`` keys (``MSET`` in batches), takes ``--locks``
mutexes and a 3-permit semaphore under ``mutex.``, then times ``show`` of one key,
``list`` and ``--frames`` refreshes of ``watch`` (no pause between frames), each with the
commands it sent as the server counts them (``INFO commandstats``, reset before each).
"""

from __future__ import annotations

import argparse
import io
import os
import time

import redis

from simple_mutex import Mutex, Semaphore
from simple_mutex.admin import commands
from simple_mutex.caches.redis import RedisCache

URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


def calls(admin: redis.Redis) -> dict[str, int]:
    """Commands the server ran since the last reset, by name (this client's INFO and
    CONFIG RESETSTAT left out)."""
    stats = admin.info("commandstats")
    found = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}
    return {k: v for k, v in found.items() if k not in ("info", "config|resetstat")}


def measured(admin: redis.Redis, what: str, run: object) -> None:
    admin.config_resetstat()
    started = time.perf_counter()
    run()  # type: ignore[operator]
    took = time.perf_counter() - started
    sent = calls(admin)
    busiest = ", ".join(f"{k} {v}" for k, v in sorted(sent.items(), key=lambda kv: -kv[1])[:4])
    print(f"{what:<24} {took * 1000:9.1f} ms   {sum(sent.values()):6d} commands ({busiest})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--unrelated", type=int, default=1_000_000)
    parser.add_argument("--locks", type=int, default=100)
    parser.add_argument("--frames", type=int, default=10)
    args = parser.parse_args()
    admin = redis.Redis.from_url(URL)
    admin.flushdb()
    for start in range(0, args.unrelated, 10_000):
        batch = range(start, min(start + 10_000, args.unrelated))
        admin.mset({f"unrelated:{n}": "x" for n in batch})
    cache = RedisCache(redis.Redis.from_url(URL))
    mutex = Mutex(cache, lease=600)
    leases = [mutex.acquire(f"job.{n}") for n in range(args.locks)]
    pool = Semaphore(cache, permits=3, lease=600, prefix="mutex.")
    leases += [pool.acquire("pool") for _ in range(3)]
    print(f"{admin.dbsize():,} keys, {args.locks} mutexes and 3 permits held under 'mutex.'")
    viewer = RedisCache(redis.Redis.from_url(URL))  # an operator's process: nothing noted
    out = io.StringIO()
    measured(admin, "show job.7", lambda: commands.show_lock(viewer, "job.7", "mutex.", out))
    measured(admin, "show pool", lambda: commands.show_lock(viewer, "pool", "mutex.", out))
    measured(admin, "list", lambda: commands.list_locks(viewer, "mutex.", out))
    measured(
        admin,
        f"watch, {args.frames} frames",
        lambda: commands.watch_locks(
            viewer, "mutex.", out, interval=0, refreshes=args.frames, sleep=lambda _: None
        ),
    )
    assert "job.7" in out.getvalue()
    for lease in leases:
        lease.release()
    admin.flushdb()


if __name__ == "__main__":
    main()
