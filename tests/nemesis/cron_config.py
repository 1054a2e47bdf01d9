"""The ``rq cron`` config of the nemesis's cron tier (``rq cron cron_config.py``): the
once-per-tick guard, and two registrations of one job function that share a name (RQ
allows it; the name defaults to the function's): ``cleanup("users")`` and
``cleanup("orders")``, every second, on ``$NEM_QUEUE`` (issue 21, item 2)."""

from __future__ import annotations

import os

from rq import cron

import nemesis  # noqa: F401  (sys.path)
from nemesis import cron_jobs
from rq_mutex.cron import once_per_tick

once_per_tick()
for what in ("users", "orders"):
    cron.register(cron_jobs.cleanup, os.environ["NEM_QUEUE"], args=(what,),
                  cron="* * * * * *", name="cleanup")  # fmt: skip
