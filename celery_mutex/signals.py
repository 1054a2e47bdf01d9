"""Signals a metrics exporter can hook (``celery.utils.dispatch.Signal``, as Celery's own).

Every signal is sent with ``sender`` = the task and the keyword arguments listed.

* ``mutex_acquired``: ``task_id``, ``key``, ``fence``, ``waited`` (seconds in before_start)
* ``mutex_busy``: ``task_id``, ``key``, ``policy`` ("skip" | "retry" | "wait" | "raise"),
  ``holder`` (``task.name[task id]`` of a holder when known, else None)
* ``mutex_released``: ``task_id``, ``key``, ``held`` (seconds), ``in_time`` (False when the
  lease had lapsed or been taken over), ``by`` ("task" or "parent": freed by the worker's
  main process after the child running the task died)
* ``mutex_lost``: ``task_id``, ``key``, ``fence`` (sent from the lease keeper thread)
* ``mutex_parked``: ``task_id``, ``key``, ``ticket`` (``on_busy="queue"``: the call waits
  in the key's line, its slot free)
* ``mutex_promoted``: ``task_id``, ``key``, ``ticket``, ``by`` ("end" | "sweep" |
  "revoke" | "parent"): a parked call was published again for its turn
"""

from __future__ import annotations

from ._celery import Signal

mutex_acquired = Signal(name="mutex_acquired")
mutex_busy = Signal(name="mutex_busy")
mutex_released = Signal(name="mutex_released")
mutex_lost = Signal(name="mutex_lost")
mutex_parked = Signal(name="mutex_parked")
mutex_promoted = Signal(name="mutex_promoted")

__all__ = [
    "mutex_acquired",
    "mutex_busy",
    "mutex_lost",
    "mutex_parked",
    "mutex_promoted",
    "mutex_released",
]
