"""The app of ``tests/test_celery_timeouts.py``'s ``celery worker -P prefork``: a task
that waits for its key under a soft time limit. Configured by the ``CM_*`` variables of
``celery_support.processes``."""

from __future__ import annotations

import os

import redis
from celery import Celery

# isort: split
from celery_mutex import MutexTask

PREFIX = os.environ.get("CM_PREFIX", "cmtest.")
app = Celery("celery_support.timeouts_app", set_as_current=False)
app.conf.update(
    broker_url=os.environ.get("CM_BROKER", "redis://127.0.0.1:6379/11"),
    result_backend=os.environ.get("CM_BACKEND", "redis://127.0.0.1:6379/11"),
    task_default_queue=os.environ.get("CM_QUEUE", "cmtest"),
    mutex_cache=os.environ.get("CM_CACHE", "redis://127.0.0.1:6379/11"),
    mutex_prefix=PREFIX,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)
_record = redis.Redis.from_url(os.environ.get("CM_CACHE", "redis://127.0.0.1:6379/11"))


@app.task(base=MutexTask, mutex={"key": "soft.{n}", "on_busy": "wait"}, soft_time_limit=1)
def waits_under_a_soft_limit(n: int) -> str:
    """Waits for soft.<n> (held by the test); records a run if its body ever starts."""
    _record.rpush(f"{PREFIX}ran.{n}", 1)
    return "ran"
