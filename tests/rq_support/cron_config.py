"""An ``rq cron`` config: one job every second on queue ``$RQT_QUEUE``, named
``$RQT_NAME``; with ``RQT_GUARD=1`` the once-per-tick guard is on (the one line)."""

from __future__ import annotations

import os

from rq import cron

from rq_support import jobs

if os.environ.get("RQT_GUARD") == "1":
    from rq_mutex.cron import once_per_tick

    once_per_tick()

cron.register(
    jobs.ticked,
    os.environ["RQT_QUEUE"],
    args=(os.environ["RQT_NAME"],),
    cron="* * * * * *",  # croniter's sixth field: seconds
    name=os.environ["RQT_NAME"],
)
