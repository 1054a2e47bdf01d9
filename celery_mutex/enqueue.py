"""Opt-in de-duplication when a call is sent (``mutex={"enqueue": "return" | "raise"}``).

``apply_async`` writes a "queued or running" marker owned by the new task id; an equal call
(same key) while it lives gets the first call's AsyncResult, or AlreadyQueuedError. The
marker is cleared when the call ends without retrying (the safety-net handlers). The
run-time lock still applies: ``send_task`` and beat never pass through here.

A call that is *bound* (a member of a group or chord, a link of a chain, a chord's
callback, one carrying ``link``/``link_error``, or one whose task id the caller chose) has
an id something already waits on: the group's result, the chord's counter, the chain's
tail travelling in its message. Another call's AsyncResult cannot stand in for it, so in
``"return"`` mode it is sent anyway (it takes the marker only if it is free) and the
run-time lock decides; in ``"raise"`` mode it raises AlreadyQueuedError, which stops the
canvas at that call.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from typing import Any

from simple_mutex import Holder, Mutex, SimpleMutexAcquireTimeoutError
from simple_mutex.busy import shared_cache

from . import per_call
from ._celery import uuid
from ._owned import OwnedLocks, owner_of
from .acquire import BUSY_HEADER
from .config import config_of
from .errors import AlreadyQueuedError

log = logging.getLogger("celery_mutex")

QUEUED_HEADER = "mutex_queued"  # {"key", "prefix"} of the call's marker, set when it took it

# apply_async options by which a canvas waits on this call's own task id.
CANVAS_OPTIONS = ("group_id", "chord", "chain", "link", "link_error")


def send_once(
    task: Any,
    args: Any,
    kwargs: Any,
    task_id: str | None,
    options: dict[str, Any],
    send: Callable[..., Any],
    ttl: float | None = None,
) -> Any:
    """``send(args, kwargs, task_id=..., **options)`` unless an equal call is queued;
    ``ttl`` (seconds, checked) replaces ``enqueue_ttl`` for this call's record."""
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
    cfg = config_of(task)
    markers = cfg.markers
    if markers is None:
        return send(args, kwargs, task_id=task_id, **options)
    in_canvas = any(options.get(name) for name in CANVAS_OPTIONS)
    bound = in_canvas or task_id is not None
    if ttl is not None:
        space = markers.space
        markers = OwnedLocks(Mutex(space.cache, lease=ttl, prefix=space.prefix, name="enqueue"))
    task_id = task_id or uuid()
    key = per_call.key_of(task, args, kwargs, headers.get(per_call.HEADER) or {})
    marked, queued = _mark(markers, key, task_id)
    if not marked:
        holder = None if queued is None else queued.label
        if bound and cfg.enqueue == "return":
            log.info(
                "%s[%s]: %r is already queued as %s; sent anyway: a canvas or a caller "
                "waits on this call's own id",
                *(task.name, task_id, key, holder or "unknown"),
            )
            return send(args, kwargs, task_id=task_id, **options)
        log.info("%s: %r is already queued as %s", task.name, key, holder or "unknown")
        if cfg.enqueue == "raise" or holder is None:
            countdown = None
            if queued is not None:
                left = queued.expires_at - dt.datetime.now(dt.timezone.utc)
                countdown = max(0.0, left.total_seconds())
            stopped = (
                "; a canvas (group, chain, chord) stops at this call: its members sent "
                "before it run, the rest are not sent"
                if in_canvas
                else ""
            )
            raise AlreadyQueuedError(
                f"{task.name}: a call with key {key!r} is already queued or running "
                f"(task id {holder or 'unknown'}){stopped}",
                key=key,
                task_id=holder,
                countdown=countdown,
            )
        return task.AsyncResult(holder)
    # Where the marker is, for a worker that refuses the call without knowing the task.
    marker = {"key": key, "prefix": markers.space.prefix}
    options["headers"] = {**headers, QUEUED_HEADER: marker}
    try:
        return send(args, kwargs, task_id=task_id, **options)
    except BaseException:
        markers.release_owner(key, owner_of(task_id), attempt=None)
        raise


def _mark(markers: OwnedLocks, key: str, task_id: str) -> tuple[bool, Holder | None]:
    """Mark ``key`` queued by ``task_id``: (True, None) if it now is, else (False, the
    record of the call that is, or None if it kept ending before it could be read)."""
    for _ in range(3):  # the queued call may end between our try and our read
        try:
            markers.acquire(
                key, owner=owner_of(task_id), attempt=0, timeout=0, renew=False, label=task_id
            )
            return True, None
        except SimpleMutexAcquireTimeoutError:
            queued = markers.holder(key)
            if queued is not None:
                return False, queued
    return False, None


def unmark(task: Any, task_id: str, args: Any, kwargs: Any, request: Any = None) -> None:
    """The call is over (not retrying): let an equal call be queued again. ``request``:
    the call's, when at hand (its per-call key)."""
    try:
        markers = config_of(task).markers
        if markers is not None:
            key = per_call.key_of(task, args, kwargs, per_call.of_request(request))
            markers.release_owner(key, owner_of(task_id), attempt=None)
    except Exception as exc:  # from a signal handler: log, never raise into Celery
        log.warning("%s[%s]: could not clear its enqueue marker: %r", task.name, task_id, exc)


def unmark_refused(app: Any, headers: Any) -> None:
    """A worker refused a message without running it (the task is unknown to it, or the
    message is invalid), so no task hook will clear the call's marker: clear it here,
    from the header the sender stamped, in the worker's own ``mutex_cache``, and only
    the record this call (its task id) owns. A task whose markers live in a cache of
    its own leaves its marker to ``enqueue_ttl``."""
    try:
        found = headers.get(QUEUED_HEADER) if isinstance(headers, dict) else None
        task_id = headers.get("id") if isinstance(headers, dict) else None
        if not isinstance(found, dict) or not isinstance(task_id, str):
            return
        key, prefix = found.get("key"), found.get("prefix")
        spec = app.conf.get("mutex_cache")
        if not isinstance(key, str) or not isinstance(prefix, str) or spec is None:
            return
        if not prefix.startswith("queued."):  # only ever a marker, never a task's lock
            return
        markers = OwnedLocks(Mutex(shared_cache(spec), prefix=prefix, name="enqueue"))
        markers.release_owner(key, owner_of(task_id), attempt=None)
    except Exception as exc:  # from a signal handler: log, never raise into Celery
        log.warning("refused call %r: could not clear its enqueue marker: %r", headers, exc)
