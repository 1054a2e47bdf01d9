"""Errors and warnings of the Celery integration (the rest are simple_mutex's)."""

from __future__ import annotations

from typing import Any

from simple_mutex import ConstraintError


class AlreadyQueuedError(ConstraintError):
    """``enqueue="raise"``: an equal call is already queued or running; ``task_id`` is
    its id (None if it ended between the check and the read); ``countdown`` the seconds
    until its "queued" record lapses at the latest (``enqueue_ttl``; None if unknown)."""

    def __init__(
        self,
        message: str,
        key: str | None = None,
        *,
        task_id: str | None = None,
        countdown: float | None = None,
    ) -> None:
        super().__init__(message, key=key)
        self.task_id = task_id
        self.countdown = countdown

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.message, self.key, self.task_id, self.countdown)


def _rebuild(
    cls: type[AlreadyQueuedError],
    message: str,
    key: str | None,
    task_id: str | None,
    countdown: float | None = None,
) -> AlreadyQueuedError:
    return cls(message, key=key, task_id=task_id, countdown=countdown)


class ConstantKeyWarning(UserWarning):
    """A ``mutex`` key template without a ``{field}`` on a task that takes arguments:
    every call shares one lock, which is rarely meant (celery-singleton's
    ``unique_on="c"`` copied as ``key: "c"``). Name the arguments (``"{c}"`` or
    ``["c"]``), or say a constant key is meant with ``key=[]`` (the task name) or a
    callable."""
