"""The job functions the RQ per-entity order bench (``bench/bench_rq_line.py``) runs in
real ``rq worker`` horses: one per busy policy, the same body (a 50 ms section that
records its start with its entity and number), keys
``b.<run>.<entity>``. Configured by ``BL_*`` variables."""

from __future__ import annotations

import os
import time

import redis

from rq_mutex import mutex_job

URL = os.environ.get("BL_REDIS", "redis://127.0.0.1:6379/12")
SECTION = float(os.environ.get("BL_SECTION", "0.05"))
_record = redis.Redis.from_url(URL)

# RQ retries by whole seconds: the shortest busy retry it can schedule is 1 s.
RETRY = {"countdown": 1, "backoff": 1, "jitter": False}


def _section(run: str, entity: int, n: int) -> int:
    _record.rpush(f"bl.starts.{run}", f"{entity} {n} {time.time()}")
    time.sleep(SECTION)
    return n


@mutex_job(key="b.{run}.{entity}", on_busy="wait", lease=30)
def wait(run: str, entity: int, n: int) -> int:
    return _section(run, entity, n)


@mutex_job(key="b.{run}.{entity}", on_busy="retry", retry=RETRY, lease=30)
def retry(run: str, entity: int, n: int) -> int:
    return _section(run, entity, n)


@mutex_job(key="b.{run}.{entity}", on_busy="queue", lease=30)
def queue(run: str, entity: int, n: int) -> int:
    return _section(run, entity, n)


def plain(run: str, entity: int, n: int) -> int:
    """No lock at all (and, with RQ's RateLimit, its own parking)."""
    return _section(run, entity, n)
