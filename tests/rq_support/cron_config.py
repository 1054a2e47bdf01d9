"""An ``rq cron`` config: one job every second on queue ``$RQT_QUEUE``, named
``$RQT_NAME``; with ``RQT_GUARD=1`` the once-per-tick guard is on (the one line).

``RQT_OVERLAP=skip|buffer`` registers instead one job every second that holds its key
2.5 s: ``on_busy="skip"`` (a tick while the last still runs is skipped) or
``on_busy="latest"`` (one tick is buffered and runs when the last ends: Temporal's
BUFFER_ONE). ``RQT_SHARED=1`` registers instead four ``cleanup`` jobs under that one name (RQ allows
it: a name defaults to the function's): tables ``users`` and ``orders`` every second
(cron), ``sessions`` and ``carts`` every 2 s (interval)."""

from __future__ import annotations

import os

from rq import cron

from rq_support import jobs

if os.environ.get("RQT_GUARD") == "1":
    from rq_mutex.cron import once_per_tick

    once_per_tick()

QUEUE, NAME = os.environ["RQT_QUEUE"], os.environ["RQT_NAME"]

OVERLAP = {"skip": jobs.tick_or_skip, "buffer": jobs.tick_or_buffer}
if os.environ.get("RQT_OVERLAP") in OVERLAP:
    job = OVERLAP[os.environ["RQT_OVERLAP"]]
    cron.register(job, QUEUE, args=(NAME,), cron="* * * * * *", name=NAME)
elif os.environ.get("RQT_SHARED") == "1":
    for table in ("users", "orders"):
        cron.register(jobs.cleanup, QUEUE, args=(NAME, table), cron="* * * * * *", name=NAME)
    for table in ("sessions", "carts"):
        cron.register(jobs.cleanup, QUEUE, args=(NAME, table), interval=2, name=NAME)
else:
    cron.register(
        jobs.ticked,
        QUEUE,
        args=(NAME,),
        cron="* * * * * *",  # croniter's sixth field: seconds
        name=NAME,
    )
