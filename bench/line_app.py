"""The app the per-entity order bench (``bench/bench_line.py``) runs in real prefork
workers: one task per busy policy, the same body (a 50 ms section that records its start
with its entity and number), keys ``b.<run>.<entity>``. Configured by ``BL_*`` variables.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery
from celery.signals import task_prerun

from celery_mutex import MutexTask

URL = os.environ.get("BL_REDIS", "redis://127.0.0.1:6379/12")
app = Celery("bench.line_app", set_as_current=False)
app.conf.update(
    broker_url=os.environ.get("BL_BROKER", URL),
    result_backend=URL,
    task_default_queue=os.environ.get("BL_QUEUE", "bench-line"),
    mutex_cache=URL,
    mutex_prefix=os.environ.get("BL_PREFIX", "bl."),
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)
PREFIX: str = app.conf.mutex_prefix
SECTION = float(os.environ.get("BL_SECTION", "0.05"))
_record = redis.Redis.from_url(URL)

# A busy retry as a user tuned for short sections would set it (the default starts at
# 1 s, which would make retry look far worse than it need be).
RETRY = {"countdown": 0.05, "backoff": 1.5, "cap": 1.0}
POLICIES = {
    "wait": {"on_busy": "wait"},
    "retry": {"on_busy": "retry", "retry": RETRY},
    "queue": {"on_busy": "queue", "queue": {"sweep_every": 1.0}},
}


def _section(run: str, entity: int, n: int) -> int:
    _record.rpush(f"{PREFIX}starts.{run}", f"{entity} {n} {time.time()}")
    time.sleep(SECTION)
    return n


@app.task(base=MutexTask, shared=False, mutex={"key": "b.{run}.{entity}", **POLICIES["wait"]})
def wait(run: str, entity: int, n: int) -> int:
    return _section(run, entity, n)


@app.task(base=MutexTask, shared=False, mutex={"key": "b.{run}.{entity}", **POLICIES["retry"]})
def retry(run: str, entity: int, n: int) -> int:
    return _section(run, entity, n)


@app.task(base=MutexTask, shared=False, mutex={"key": "b.{run}.{entity}", **POLICIES["queue"]})
def queue(run: str, entity: int, n: int) -> int:
    return _section(run, entity, n)


@task_prerun.connect(weak=False)
def _count_delivery(task_id: str | None = None, task: object = None, **_: object) -> None:
    """Every delivery a worker ran (parked, skipped or run): messages per task."""
    run = (getattr(getattr(task, "request", None), "args", None) or [None])[0]
    if isinstance(run, str):
        _record.incr(f"{PREFIX}deliveries.{run}")
