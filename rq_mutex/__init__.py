"""RQ integration of simple-mutex: jobs that never overlap per key.

::

    from rq_mutex import Queue, mutex_job

    @mutex_job(key="order.{order_id}", on_busy="retry", lease=60)
    def charge(order_id, amount=0): ...

    queue = Queue("default", connection=redis)  # or a plain rq.Queue (see below)
    queue.enqueue(charge, 42)

The lock is taken when the job starts (owner label = the job id), kept alive by renewal
while the body runs, and released when the job returns, fails or is interrupted; a killed
work horse's lock frees when its lease lapses, or at once for the next run of the same
job id when its worker is an ``rq_mutex.Worker`` (``rq worker -w rq_mutex.Worker``; see
``rq_mutex.horses``). The default cache is Redis on the job's own
connection, so a plain RQ setup configures nothing.

``on_busy="queue"`` runs a key's jobs one at a time in enqueue order, parked off the
queue while they wait (``rq_mutex.line``; start workers with ``-w rq_mutex.Worker``).
Importing ``rq_mutex`` changes nothing of RQ's: what a producer opts into it names,
``rq_mutex.Queue`` (checks and tickets at enqueue, ``rq_mutex.queue``) and
``rq_mutex.Worker``; a plain ``rq.Queue`` still runs every ``mutex_job``.

Several ``rq cron`` processes enqueue each tick once after one line in the cron config:
``from rq_mutex import once_per_tick; once_per_tick()`` (see ``rq_mutex.cron``).
"""

from __future__ import annotations

from simple_mutex.busy import SKIPPED, current_lease, is_skipped
from simple_mutex.busy.extras import queue_imports

with queue_imports("rq_mutex", "RQ", "rq"):
    # First: a missing RQ names its extra, a changed RQ fails loudly, before the rest.
    from . import host  # noqa: F401
from .cron import first_run_of_tick, once_per_tick
from .job import mutex_job
from .queue import Queue
from .worker import Worker

__all__ = [
    "SKIPPED",
    "Queue",
    "Worker",
    "current_lease",
    "first_run_of_tick",
    "is_skipped",
    "mutex_job",
    "once_per_tick",
]
