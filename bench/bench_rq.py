"""Per-job overhead of ``rq_mutex.mutex_job`` against the bare job on the same worker.

An in-process ``SimpleWorker`` drains N queued jobs in burst mode, once with the bare
function and once with the same function under ``mutex_job`` (uncontended: acquire,
run, release on loopback Redis, the default cache on the job's own connection). Rounds
alternate; the best round of each is reported, per job in ms and as a ratio.

    .venv/bin/python bench/bench_rq.py [N] [ROUNDS]      # REDIS_URL, default db 0
"""

from __future__ import annotations

import logging
import os
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from rq import Queue, SimpleWorker

from rq_mutex import mutex_job

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


def bare(n: int) -> int:
    return n


@mutex_job(key="bench.rq", on_busy="raise", lease=60)
def guarded(n: int) -> int:
    return n


def drain(conn: redis.Redis, fn: Callable[..., Any], count: int) -> float:
    """Seconds per job for a burst SimpleWorker to run ``count`` queued calls of ``fn``."""
    queue = Queue(f"bench-rq-{uuid.uuid4().hex[:8]}", connection=conn)
    for n in range(count):
        queue.enqueue(fn, n, result_ttl=60)
    worker = SimpleWorker([queue], connection=conn)
    started = time.perf_counter()
    worker.work(burst=True, logging_level="ERROR")
    elapsed = time.perf_counter() - started
    failed = queue.failed_job_registry.count
    if failed:
        raise SystemExit(f"{failed} {fn.__name__} jobs failed")
    queue.delete(delete_jobs=True)
    return elapsed / count


def main() -> None:
    import bench_rq  # this file by name (its folder is sys.path[0]): RQ refuses __main__

    count = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    logging.getLogger("rq.worker").setLevel(logging.ERROR)
    conn = redis.Redis.from_url(REDIS_URL)
    conn.ping()
    drain(conn, bench_rq.guarded, 20)  # warm up: imports, script loading
    plain: list[float] = []
    locked: list[float] = []
    for _ in range(rounds):
        plain.append(drain(conn, bench_rq.bare, count))
        locked.append(drain(conn, bench_rq.guarded, count))
    base, with_lock = min(plain), min(locked)
    print(f"rq {count} jobs x {rounds} rounds, SimpleWorker burst, {REDIS_URL}")
    print(f"  bare job        {base * 1000:7.3f} ms/job")
    print(f"  mutex_job       {with_lock * 1000:7.3f} ms/job")
    added = (with_lock - base) * 1000
    print(f"  added           {added:7.3f} ms/job   ratio {with_lock / base:.2f}x")


if __name__ == "__main__":
    main()
