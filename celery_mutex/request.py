"""``MutexTask``'s worker request (``Task.Request``, Celery's hook for this): it tells
the worker's main process which delivery a failure is about.

Celery reports a pool child's death (``WorkerLostError``) and a hard time limit by task
id (``task_failure``), and a retry shares its task id with the attempt before it: by id
alone, the parent freed the lock of a retry that had taken the key when its earlier
attempt's child died, and watched the retry's child instead of the dead one. Around
Celery's own handling, this request names itself (``parent.reporting``), so the handlers in
``celery_mutex.safety_net`` act on exactly this attempt: its child's pid, its lock.
``MutexTask.Request`` names this class; a task that sets a Request class of its own
subclasses this one to keep it.
"""

from __future__ import annotations

from typing import Any

from celery.worker.request import Request  # type: ignore[import-untyped]

from .parent import reporting


class MutexRequest(Request):  # type: ignore[misc]  # celery ships no type hints
    """Celery's worker Request, naming itself while its failure is reported."""

    def on_timeout(self, soft: bool, timeout: float) -> None:
        with reporting(self):
            super().on_timeout(soft, timeout)

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> None:
        with reporting(self):
            super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
