"""The app of the nemesis's ``celery beat`` tier: several real beats with MutexScheduler
and one prefork worker. Configured from the environment: ``NEM_BROKER``, ``NEM_BACKEND``,
``NEM_PREFIX``, ``NEM_QUEUE``, ``NEM_HISTORY``, ``NEM_TZ`` (the app's time zone: a
non-UTC one, issue 21 item 1).

Entries: ``every`` (a 1 s interval) and ``cron`` (``crontab()``: every minute, in the
app's zone). An hour-restricted crontab is not used: on Celery 5.7 a fresh entry's UTC
``last_run_at`` makes Celery's own ``PersistentScheduler`` read its hours in UTC, so the
expected ticks would be Celery's question, not the guard's. The task records a ``tick``
event with the slot the beat stamped on it.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery.schedules import crontab
from celery_support.env_app import app_from_env

import nemesis  # noqa: F401  (sys.path)
from nemesis.history import Recorder

app = app_from_env(
    "nemesis.beat_app",
    "NEM",
    broker="amqp://guest:guest@127.0.0.1:5672//",
    backend="redis://127.0.0.1:6379/14",
    queue="nembeat",
    prefix="nembeat.",
    mutex_cache=os.environ.get("NEM_BACKEND", "redis://127.0.0.1:6379/14"),  # one Redis
    worker_prefetch_multiplier=4,  # Celery's default, as this app always had
    timezone=os.environ.get("NEM_TZ", "UTC"),
    beat_schedule={
        "every": {"task": "nemesis.beat_app.tick", "schedule": 1.0, "args": ("every",)},
        "cron": {
            "task": "nemesis.beat_app.tick",
            "schedule": crontab(),
            "args": ("cron",),
        },
    },
)
_rec: list[Recorder] = []


@app.task(bind=True)
def tick(self: Any, entry: str) -> None:
    if not _rec or _rec[0].pid != os.getpid():
        _rec[:] = [Recorder(os.environ["NEM_HISTORY"], "beat-worker")]
        _rec[0]("start", forked=True)
    stamp = getattr(self.request, "mutex_beat_slot", None) or ""
    _rec[0]("tick", entry=entry, slot=stamp.partition("@")[2], wall=time.time())
