"""The typed boundary to Celery, which ships no type hints: every Celery name this
package uses is imported here once (hence the ignores), and is ``Any`` beyond it."""

from __future__ import annotations

from typing import Any

from billiard.exceptions import WorkerLostError  # type: ignore[import-untyped]
from celery import Task, current_task, states  # type: ignore[import-untyped]
from celery.backends.base import DisabledBackend  # type: ignore[import-untyped]
from celery.exceptions import (  # type: ignore[import-untyped]
    Ignore,
    Reject,
    Retry,
    SoftTimeLimitExceeded,
    TimeLimitExceeded,
)
from celery.result import EagerResult  # type: ignore[import-untyped]
from celery.signals import (  # type: ignore[import-untyped]
    task_failure,
    task_postrun,
    task_received,
    task_rejected,
    task_revoked,
    task_unknown,
    worker_init,
    worker_process_init,
    worker_ready,
    worker_shutdown,
)
from celery.utils import uuid  # type: ignore[import-untyped]
from celery.utils.dispatch import Signal  # type: ignore[import-untyped]
from celery.worker import state as worker_state  # type: ignore[import-untyped]
from celery.worker.control import control_command  # type: ignore[import-untyped]
from kombu.exceptions import KombuError

__all__ = [
    "DisabledBackend",
    "EagerResult",
    "Ignore",
    "KombuError",
    "Reject",
    "Retry",
    "Signal",
    "SoftTimeLimitExceeded",
    "Task",
    "TimeLimitExceeded",
    "WorkerLostError",
    "control_command",
    "current_task",
    "runs_in_children",
    "states",
    "task_failure",
    "task_postrun",
    "task_received",
    "task_rejected",
    "task_revoked",
    "task_unknown",
    "uuid",
    "worker_init",
    "worker_process_init",
    "worker_ready",
    "worker_shutdown",
    "worker_state",
]


def runs_in_children(pool: Any) -> bool:
    """Whether a worker's pool runs its tasks in child processes (prefork), as opposed to
    threads or greenlets of the worker's own process (threads, eventlet, gevent, solo)."""
    # Imported here: only a worker needs it, and it brings billiard's pool and the hub.
    from celery.concurrency.prefork import TaskPool  # type: ignore[import-untyped]

    return isinstance(pool, TaskPool)
