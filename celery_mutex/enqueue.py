"""Opt-in de-duplication when a call is sent (``mutex={"enqueue": "return" | "raise"}``).

``apply_async`` writes a "queued or running" marker owned by the new task id; an equal call
(same key) while it lives gets the first call's AsyncResult, or AlreadyQueuedError. The
marker is cleared when the call ends without retrying (the safety-net handlers). The
run-time lock still applies: ``send_task`` and beat never pass through here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from simple_mutex import SimpleMutexAcquireTimeoutError

from ._celery import uuid
from ._owned import owner_of
from .acquire import BUSY_HEADER
from .config import config_of
from .errors import AlreadyQueuedError

log = logging.getLogger("celery_mutex")


def send_once(
    task: Any,
    args: Any,
    kwargs: Any,
    task_id: str | None,
    options: dict[str, Any],
    send: Callable[..., Any],
) -> Any:
    """``send(args, kwargs, task_id=..., **options)`` unless an equal call is queued."""
    headers = options.get("headers") or {}
    if (
        (
            task._mutex_spec.options.get("enqueue") is None
            and task._get_app().conf.get("mutex_enqueue") is None
        )
        or options.get("retries")
        or BUSY_HEADER in headers
    ):
        # off (no cache needed to publish), or a re-publish of a call already let through
        return send(args, kwargs, task_id=task_id, **options)
    markers = config_of(task).markers
    if markers is None:
        return send(args, kwargs, task_id=task_id, **options)
    task_id = task_id or uuid()
    key = task.mutex_key(*(args or ()), **(kwargs or {}))
    holder: str | None = None
    for _ in range(3):  # the queued call may end between our try and our read
        try:
            markers.acquire(
                key, owner=owner_of(task_id), attempt=0, timeout=0, renew=False, label=task_id
            )
            break
        except SimpleMutexAcquireTimeoutError:
            holder = markers.holder_label(key)
            if holder is not None:
                break
    else:
        holder = "unknown"
    if holder is not None:
        log.info("%s: %r is already queued as %s", task.name, key, holder)
        if config_of(task).enqueue == "raise" or holder == "unknown":
            raise AlreadyQueuedError(
                f"{task.name}: a call with key {key!r} is already queued or running "
                f"(task id {holder})",
                key=key,
                task_id=None if holder == "unknown" else holder,
            )
        return task.AsyncResult(holder)
    try:
        return send(args, kwargs, task_id=task_id, **options)
    except BaseException:
        markers.release_owner(key, owner_of(task_id))
        raise


def unmark(task: Any, task_id: str, args: Any, kwargs: Any) -> None:
    """The call is over (not retrying): let an equal call be queued again."""
    try:
        markers = config_of(task).markers
        if markers is not None:
            markers.release_owner(
                task.mutex_key(*(args or ()), **(kwargs or {})), owner_of(task_id)
            )
    except Exception as exc:  # from a signal handler: log, never raise into Celery
        log.warning("%s[%s]: could not clear its enqueue marker: %r", task.name, task_id, exc)
