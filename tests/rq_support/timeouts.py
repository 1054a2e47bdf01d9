"""A job for the job-timeout case of ``tests/rq_mutex/test_rq_timeouts.py``, importable by the work
horse: it waits for its key, and records in Redis (db 12) whether its body ran."""

from __future__ import annotations

import redis

from rq_mutex import mutex_job

REDIS_URL = "redis://127.0.0.1:6379/12"


@mutex_job(key="timeout.{run}", on_busy="wait")
def waits_for_its_key(run: str) -> str:
    redis.Redis.from_url(REDIS_URL).rpush(f"rqt:{run}:ran", 1)
    return "ran"
