"""The job the cron tier's ticks enqueue: records which tick of which registration ran."""

from __future__ import annotations

import os
import time

from rq import get_current_job

import nemesis  # noqa: F401  (sys.path)
from nemesis.history import Recorder

_rec: list[Recorder] = []


def cleanup(what: str) -> str:
    if not _rec or _rec[0].pid != os.getpid():
        _rec[:] = [Recorder(os.environ["NEM_HISTORY"], "cron-worker")]
        _rec[0]("start", forked=True)
    job = get_current_job()
    tick = str((job.meta or {}).get("rq_mutex_tick", "")) if job is not None else ""
    _rec[0]("tick", entry=what, slot=tick.partition("@")[2], wall=time.time())
    return what
