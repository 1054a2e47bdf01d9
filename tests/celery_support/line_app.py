"""The app of the ``on_busy="queue"`` suite (``tests/celery_mutex/test_celery_line.py``):
tasks of one entity that must run one at a time, in send order. Each run records its
start and end (wall clock: one machine, one clock) with its pid, in a Redis list.

Configured from the environment as ``celery_support.app`` is (``CM_*``).
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import redis

from celery_support.env_app import app_from_env

# isort: split
from celery_mutex import MutexTask

app = app_from_env("celery_support.line_app")
PREFIX: str = app.conf.mutex_prefix
# The runs are recorded in Redis (the result backend's server) whatever the lock cache is.
_record = redis.Redis.from_url(app.conf.result_backend)

SECTION = 0.05  # each task's work
# A short gap_for and a quick sweep, so the crash tests measure the line's recovery in
# seconds; the lease bounds how long a dead holder's key stays held.
LINE: dict[str, Any] = {
    "on_busy": "queue",
    "lease": 4,
    "queue": {"sweep_every": 0.5, "gap_for": 3},
}

# A whole worker SIGKILLed mid-run gets such a task's message delivered again.
REDELIVERED: dict[str, Any] = {"acks_late": True, "reject_on_worker_lost": True}


def _mark(run: str, entity: int, n: int, what: str) -> None:
    entry = json.dumps([entity, n, what, time.time(), os.getpid()])
    _record.rpush(f"{PREFIX}runs.{run}", entry)


def _work(run: str, entity: int, n: int, seconds: float = SECTION) -> int:
    _mark(run, entity, n, "start")
    _while_held(run)
    time.sleep(seconds)
    _mark(run, entity, n, "end")
    return n


@app.task(base=MutexTask, mutex={"key": "e.{run}.{entity}", **LINE})
def step(run: str, entity: int, n: int, seconds: float = SECTION) -> int:
    return _work(run, entity, n, seconds)


@app.task(base=MutexTask, ignore_result=True, mutex={"key": "e.{run}.{entity}", **LINE})
def step_quietly(run: str, entity: int, n: int, seconds: float = SECTION) -> int:
    """``step`` whose result nobody stores: another task in the same line."""
    return _work(run, entity, n, seconds)


@app.task(base=MutexTask, mutex={"key": "e.{run}.{entity}", **LINE})
def step_or_fail(run: str, entity: int, n: int, fail_at: int) -> int:
    """Raises at ``n == fail_at``, between its start and its end."""
    _mark(run, entity, n, "start")
    try:
        if n == fail_at:
            raise ValueError(f"task {n} fails")
        time.sleep(SECTION)
    finally:
        _mark(run, entity, n, "end")
    return n


@app.task(base=MutexTask, bind=True, mutex={"key": "e.{run}.{entity}", **LINE})
def step_or_retry(self: Any, run: str, entity: int, n: int, retry_at: int) -> int:
    """At ``n == retry_at``, its first attempt retries itself (Task.retry, a countdown)."""
    _mark(run, entity, n, "start")
    try:
        if n == retry_at and not self.request.retries:
            raise self.retry(countdown=0.5, max_retries=1)
        time.sleep(SECTION)
    finally:
        _mark(run, entity, n, "end")
    return n


@app.task(base=MutexTask, mutex={"key": "e.{run}.{entity}", **LINE})
def step_or_die(run: str, entity: int, n: int, die_at: int) -> int:
    """At ``n == die_at`` its pool child SIGKILLs itself mid-run (after its start)."""
    _mark(run, entity, n, "start")
    if n == die_at:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(SECTION)
    _mark(run, entity, n, "end")
    return n


@app.task(base=MutexTask, mutex={"key": "e.{run}.{entity}", **LINE}, **REDELIVERED)
def step_redelivered(run: str, entity: int, n: int, seconds: float = SECTION) -> int:
    """acks_late with reject_on_worker_lost: a whole worker SIGKILLed mid-run gets its
    message delivered again, and the line waits for that copy."""
    return _work(run, entity, n, seconds)


@app.task(base=MutexTask, acks_late=True, mutex={"key": "e.{run}.{entity}", **LINE})
def step_or_reject(run: str, entity: int, n: int, reject_at: int) -> int:
    """At ``n == reject_at`` its first delivery raises ``Reject(requeue=True)`` (acks_late:
    the message goes back to the queue)."""
    from celery.exceptions import Reject

    _mark(run, entity, n, "start")
    try:
        if n == reject_at and _record.set(f"{PREFIX}rejected.{run}", 1, nx=True):
            raise Reject("again, please", requeue=True)
        time.sleep(SECTION)
    finally:
        _mark(run, entity, n, "end")
    return n


# Keep latest and debounce (issue 25): the same line, one waiting call per key.
LATEST: dict[str, Any] = {**LINE, "on_busy": "latest"}
PERIOD, MAX_DELAY = 1.0, 3.0
DEBOUNCE: dict[str, Any] = {
    **LINE,
    "on_busy": "debounce",
    "debounce": {"period": PERIOD, "max_delay": MAX_DELAY},
}


def held(prefix: str, run: str) -> str:
    """While this Redis key (under the app's ``mutex_prefix``) exists, a run of ``_work``
    or ``_work_or_die`` that started waits (up to 60 s) before it goes on: a test sending a
    burst behind it sets it first and deletes it once every call was sent, so the burst
    is behind the run however slow the sends."""
    return f"{prefix}held.{run}"


def _while_held(run: str) -> None:
    """Wait while ``held`` is set for ``run`` (up to 60 s)."""
    deadline = time.monotonic() + 60
    while _record.exists(held(PREFIX, run)) and time.monotonic() < deadline:
        time.sleep(0.02)


def _work_or_die(run: str, entity: int, n: int, seconds: float, die_at: int) -> int:
    """Records the run; at ``n == die_at`` its pool child SIGKILLs itself mid-run."""
    _mark(run, entity, n, "start")
    _while_held(run)
    if n == die_at:
        time.sleep(seconds / 2)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(seconds)
    _mark(run, entity, n, "end")
    return n


@app.task(base=MutexTask, mutex={"key": "l.{run}.{entity}", **LATEST})
def latest(run: str, entity: int, n: int, seconds: float = SECTION, die_at: int = -1) -> int:
    return _work_or_die(run, entity, n, seconds, die_at)


@app.task(base=MutexTask, mutex={"key": "d.{run}.{entity}", **DEBOUNCE})
def debounced(run: str, entity: int, n: int, seconds: float = SECTION, die_at: int = -1) -> int:
    return _work_or_die(run, entity, n, seconds, die_at)


@app.task(base=MutexTask, mutex={"key": "l.{run}.{entity}", **LATEST}, **REDELIVERED)
def latest_redelivered(run: str, entity: int, n: int, seconds: float = SECTION) -> int:
    """Keep latest with acks_late and reject_on_worker_lost: a whole worker SIGKILLed
    mid-run gets its message delivered again, and it runs before the waiting call. Waits
    while ``held`` is set, so the kill finds it running however slow the machine."""
    return _work_or_die(run, entity, n, seconds, -1)
