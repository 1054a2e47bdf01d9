"""Errors of the Celery integration (the rest are simple_mutex's)."""

from __future__ import annotations

from typing import Any

from simple_mutex import ConstraintError


class AlreadyQueuedError(ConstraintError):
    """``enqueue="raise"``: an equal call is already queued or running; ``task_id`` is
    its id (None if it ended between the check and the read)."""

    def __init__(self, message: str, *, key: str | None = None, task_id: str | None = None) -> None:
        super().__init__(message, key=key)
        self.task_id = task_id

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (self.message, self.key, self.task_id)


def _rebuild(message: str, key: str | None, task_id: str | None) -> AlreadyQueuedError:
    return AlreadyQueuedError(message, key=key, task_id=task_id)
