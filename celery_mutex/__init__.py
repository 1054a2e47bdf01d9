"""Celery integration of simple-mutex: tasks that never overlap per key.

::

    app.conf.mutex_cache = "redis://127.0.0.1:6379/0"

    @app.task(base=MutexTask, mutex={"key": "order.{order_id}", "on_busy": "retry"})
    def charge(order_id, amount=0): ...

The lock is taken when the task starts, owned by the task id, kept alive by renewal
while the body runs, and released on every way the task ends. Users of celery-once and
celery-singleton can keep their code: ``celery_mutex.compat`` has drop-in classes.
"""

from __future__ import annotations

from simple_mutex.busy import SKIPPED, current_lease, is_skipped
from simple_mutex.busy.extras import queue_imports

with queue_imports("celery_mutex", "Celery", "celery"):
    from . import _celery  # noqa: F401  (first: a missing Celery names its extra here)

from . import safety_net, signals, startup
from .config import acl_prefixes
from .errors import AlreadyQueuedError, ConstantKeyWarning
from .task import MutexTask

__all__ = [
    "SKIPPED",
    "AlreadyQueuedError",
    "ConstantKeyWarning",
    "MutexTask",
    "acl_prefixes",
    "current_lease",
    "is_skipped",
    "safety_net",  # imported for its signal handlers (release on every ending)
    "signals",
    "startup",  # imported for its check as a worker starts
]
