"""The app the beat suite's real ``celery beat`` and ``celery worker`` subprocesses run.

Configured from the environment: ``CM_BROKER``, ``CM_CACHE`` (lock cache, result backend
and records), ``CM_PREFIX``, ``CM_QUEUE``, ``CM_RUN`` (a run id, passed to every tick so
runs of one test never mix with another's), ``CM_PERIOD`` (seconds), ``CM_SLOW`` ("1": add
a job that outlives its period), ``CM_OVERLAP`` ("1": only ``slow`` and ``buffered``, the
two overlap choices), ``CM_ROLE`` ("worker" registers ``remote``), ``CM_CRON``
("1": only the crontab entry ``cron``, whose fields ``CM_CRON_FIELDS`` may give as JSON),
``CM_TIMEZONE`` (the app's ``timezone``; UTC when unset).

Entries: ``fast`` (a plain task the beat imports: ``task.apply_async``), ``remote`` (a
task only the worker registers: beat calls ``send_task``), ``slow`` (skips a tick while it
runs), ``buffered`` (buffers one).
Each run is recorded in Redis as JSON under ``<prefix>runs``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from typing import Any

import redis
from celery.schedules import crontab

from celery_support.env_app import app_from_env

# isort: split
from celery_mutex import MutexTask, signals
from celery_mutex.beat import MutexScheduler, mutex_beat_skipped

PREFIX = os.environ.get("CM_PREFIX", "cmbeat.")
CACHE = os.environ.get("CM_CACHE", "redis://127.0.0.1:6379/11")
RUN = os.environ.get("CM_RUN", "run")
PERIOD = dt.timedelta(seconds=float(os.environ.get("CM_PERIOD", "1")))

app = app_from_env(
    "celery_support.beat_app",
    broker=CACHE,
    queue="cmbeat",
    prefix=PREFIX,
    result_backend=CACHE,  # CM_CACHE is the lock cache, result backend and records
    mutex_cache=CACHE,
    beat_schedule={
        "fast": {"task": "celery_support.beat_app.fast", "schedule": PERIOD, "args": (RUN,)},
        "remote": {
            "task": "celery_support.beat_app.remote",  # not registered in beat: send_task
            "schedule": PERIOD,
            "args": (RUN,),
        },
    },
)
if os.environ.get("CM_ROLE"):
    # In its own process the app is the current one, as a user's app is: beat reloads its
    # schedule entries from the schedule file without their app, and Celery then reads
    # the crontab's time zone from the current app (the default, UTC, otherwise).
    app.set_current()
if os.environ.get("CM_TIMEZONE"):
    app.conf.timezone = os.environ["CM_TIMEZONE"]
if os.environ.get("CM_CRON") == "1":
    fields = json.loads(os.environ.get("CM_CRON_FIELDS") or "{}")  # {}: every minute
    app.conf.beat_schedule = {  # only a crontab entry
        "cron": {
            "task": "celery_support.beat_app.cron",
            "schedule": crontab(**fields),
            "args": (RUN,),
        }
    }
if os.environ.get("CM_OVERLAP") == "1":
    # Only the two overlap choices, 2.5 s and 2.2 s jobs on a 1 s tick: skip, buffer one.
    app.conf.beat_schedule = {
        entry: {"task": f"celery_support.beat_app.{entry}", "schedule": PERIOD, "args": (RUN,)}
        for entry in ("slow", "buffered", "newest")
    }
if os.environ.get("CM_SLOW") == "1":
    app.conf.beat_schedule["slow"] = {
        "task": "celery_support.beat_app.slow",
        "schedule": PERIOD,
        "args": (RUN,),
    }
_record = redis.Redis.from_url(CACHE)


class RecordingScheduler(MutexScheduler):  # type: ignore[misc]
    """``MutexScheduler`` noting, for each tick it claimed, when its send returned: by
    then the call was published, or parked in its key's line (``on_busy="latest"`` and
    ``"queue"`` take their place at the send). What a run's successor could be chosen
    from, whatever the load on the beat."""

    def mutex_claim(self, entry: Any, now: float | None = None) -> str | None:
        # Claimed as the tick reserves the entry; sent (or not) by the apply_async after.
        claimed: str | None = super().mutex_claim(entry, now)
        self.__dict__.setdefault("_claimed", {})[entry.name] = claimed
        return claimed

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **kw: Any) -> Any:
        result = super().apply_async(entry, producer, advance, **kw)
        claimed = self.__dict__.setdefault("_claimed", {}).pop(entry.name, None)
        if claimed is not None:
            _record.hset(PREFIX + "sent", claimed, time.time())
        return result


def record(task: Any, run: str, entry: str, start: float) -> None:
    row = {
        "run": run,
        "entry": entry,
        "slot": getattr(task.request, "mutex_beat_slot", None),
        "start": start,
        "end": time.time(),
        "pid": os.getpid(),
        "id": task.request.id,
    }
    _record.rpush(PREFIX + "runs", json.dumps(row))


@app.task(bind=True)
def fast(self: Any, run: str) -> None:
    record(self, run, "fast", time.time())


@app.task(bind=True)
def cron(self: Any, run: str) -> None:
    record(self, run, "cron", time.time())


@app.task(base=MutexTask, bind=True, mutex={"key": "slow.{run}", "on_busy": "skip"})
def slow(self: Any, run: str) -> None:
    """Outlives its 1 s period: the ticks that find it running are skipped."""
    start = time.time()
    time.sleep(2.5)
    record(self, run, "slow", start)


# Temporal's BUFFER_ONE: one run plus one tick parked in the key's line; a tick that
# finds both places taken is not sent (on_full="skip").
BUFFER_ONE = {"on_busy": "queue", "queue": {"max": 2, "on_full": "skip"}}


@app.task(base=MutexTask, bind=True, mutex={"key": "buffered.{run}", **BUFFER_ONE})
def buffered(self: Any, run: str) -> None:
    """Outlives its 1 s period: one tick that finds it running waits and runs next."""
    start = time.time()
    time.sleep(2.2)
    record(self, run, "buffered", start)


@app.task(base=MutexTask, bind=True, mutex={"key": "newest.{run}", "on_busy": "latest"})
def newest(self: Any, run: str) -> None:
    """Buffer one the other way: the newest tick waits, replacing an older waiting one."""
    start = time.time()
    time.sleep(2.2)
    record(self, run, "newest", start)


@app.task(base=MutexTask, bind=True, mutex={"key": "guarded.{n}", "on_busy": "retry"})
def guarded(self: Any, run: str, n: int) -> int:
    record(self, run, "guarded", time.time())
    return n


@app.task(base=MutexTask, bind=True, max_retries=3, mutex={"key": "again.{run}"})
def retried(self: Any, run: str) -> int:
    """Retries once: the retry carries the same beat slot and must not be dropped."""
    if self.request.retries == 0:
        raise self.retry(countdown=0.1)
    record(self, run, "retried", time.time())
    return int(self.request.retries)


if os.environ.get("CM_ROLE") == "worker":

    @app.task(bind=True, name="celery_support.beat_app.remote")
    def remote(self: Any, run: str) -> None:
        record(self, run, "remote", time.time())


def _count_busy(sender: Any = None, key: str = "", policy: str = "", **_: Any) -> None:
    _record.incr(f"{PREFIX}busy.{policy}.{key}")


def _count_dropped(sender: Any = None, entry: str = "", reason: str = "", **_: Any) -> None:
    if isinstance(sender, MutexTask):  # worker side; beat side is in the beat logs
        _record.incr(f"{PREFIX}dropped.{reason}")


signals.mutex_busy.connect(_count_busy, weak=False)
mutex_beat_skipped.connect(_count_dropped, weak=False)
