"""The app of ``tests/celery_mutex/test_celery_timeouts.py``'s ``celery worker -P prefork``:
``celery_support.app`` (configured by the ``CM_*`` variables) plus a task that waits for
its key under a soft time limit."""

from __future__ import annotations

from celery_support.app import PREFIX, _record, app

# isort: split
from celery_mutex import MutexTask

__all__ = ["app"]


@app.task(base=MutexTask, mutex={"key": "soft.{n}", "on_busy": "wait"}, soft_time_limit=1)
def waits_under_a_soft_limit(n: int) -> str:
    """Waits for soft.<n> (held by the test); records a run if its body ever starts."""
    _record.rpush(f"{PREFIX}ran.{n}", 1)
    return "ran"
