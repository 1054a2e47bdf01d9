"""Celery integration of simple-mutex: tasks that never overlap per key.

::

    app.conf.mutex_cache = "redis://127.0.0.1:6379/0"

    @app.task(base=MutexTask, mutex={"key": "order.{order_id}", "on_busy": "retry"})
    def charge(order_id, amount=0): ...

The lock is taken when the task starts, owned by the task id, kept alive by renewal
while the body runs, and released on every way the task ends.
"""

from __future__ import annotations

from . import signals
from .errors import AlreadyQueuedError
from .task import SKIPPED, MutexTask, current_lease, is_skipped

__all__ = ["SKIPPED", "AlreadyQueuedError", "MutexTask", "current_lease", "is_skipped", "signals"]
