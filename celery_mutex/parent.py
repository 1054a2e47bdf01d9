"""What the worker's main process frees on behalf of the child that ran a task (lifecycle
rule 12): only once that child can no longer act.

* A child killed outright (SIGKILL, OOM: ``WorkerLostError``) has been reaped when Celery
  reports it, or (billiard 4.3+: the task raised SystemExit itself) has run its own
  release already: its lock is freed at once.
* After a hard time limit Celery reports the failure before billiard sends SIGTERM, and
  ``revoke(terminate=True)`` is announced right after its SIGTERM: the child may still
  run its body or its ``finally:`` blocks. The lock is freed once the child's process has
  ended (``exits``); a child that unwinds frees it itself first, on its way out.
* A pool that runs tasks in this process (threads, eventlet, gevent, solo) has no child
  to outlive: the task's own thread or greenlet releases as it unwinds (a gevent kill
  is announced before the greenlet unwinds), or the lease lapses. Nothing is freed here.

Only the attempt that died is freed: a retry shares its task id, and may hold the key by
then. The child's pid and the attempt come from the worker's ``Request`` of that very
delivery (``worker_pid``, set when the child accepted it; ``retries``), which
``celery_mutex.request`` names while Celery reports its failure.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import weakref
from collections.abc import Iterator
from typing import Any

from ._celery import runs_in_children
from .call_state import attempt_of
from .enqueue import unmark
from .exits import exit_watch
from .line import end_of_dead
from .run import release_owner

log = logging.getLogger("celery_mutex")


class _Received:
    """The MutexTask requests this process received as a worker's main process."""

    def __init__(self) -> None:
        self.requests: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        self.seen: weakref.WeakSet[Any] = weakref.WeakSet()  # every attempt, not the last
        self.in_children = False  # the worker's pool runs tasks in child processes


_received = _Received()


_failing: contextvars.ContextVar[Any] = contextvars.ContextVar("celery_mutex_failing", default=None)


def failing() -> Any:
    """The worker Request whose failure Celery is reporting now (None: not a
    ``MutexRequest``'s report)."""
    return _failing.get()


@contextlib.contextmanager
def reporting(request: Any) -> Iterator[None]:
    """While Celery reports ``request``'s failure (``celery_mutex.request``)."""
    token = _failing.set(request)
    try:
        yield
    finally:
        _failing.reset(token)


def remember(consumer: Any, request: Any) -> None:
    """``task_received`` (the worker's main process): keep the request by task id."""
    _received.in_children = runs_in_children(getattr(consumer, "pool", None))
    _received.requests[request.id] = request  # the latest attempt of its task id
    _received.seen.add(request)


def request_of(task_id: str) -> Any:
    """The worker's Request of ``task_id``, if this process received it and still has it."""
    return _received.requests.get(task_id)


def _retried_since(task_id: str, attempt: int | None) -> bool:
    """Whether this process received a later attempt of ``task_id`` than ``attempt``: the
    call is not over (its retry owns the enqueue marker and the line's turn)."""
    latest = attempt_of(request_of(task_id))
    return attempt is not None and latest is not None and latest > attempt


def free(task: Any, task_id: str, args: Any, kwargs: Any, reason: str, context: Any) -> None:
    """Free the lock of attempt ``context`` of ``task_id`` now (and, unless a later
    attempt was received, the enqueue marker and the line's turn). ``context``: the
    attempt's request or Context, for its per-call key and attempt number (None: any)."""
    attempt = attempt_of(context)
    release_owner(task, task_id, args, kwargs, reason, context, attempt=attempt)
    if _retried_since(task_id, attempt):
        return
    unmark(task, task_id, args, kwargs, context)
    end_of_dead(task, task_id, args, kwargs, context, killed=reason == "WorkerLostError")


def received(request: Any) -> Any:
    """The worker Request this process received for the delivery ``request`` names (that
    Request itself, or a Context of it: same task id, same attempt); None if none."""
    if request in _received.seen:
        return request
    task_id, attempt = getattr(request, "id", None), attempt_of(request)
    for seen in list(_received.seen):
        if seen.id == task_id and attempt_of(seen) == attempt:
            return seen
    return None


def free_when_gone(task: Any, delivery: Any, reason: str) -> None:
    """Free the lock of the attempt ``delivery`` is (a worker Request, or its Context)
    once the child that ran it has exited (at once if it has); nothing when no child of
    ours ran it."""
    task_id, args, kwargs = delivery.id, delivery.args, delivery.kwargs
    request = received(delivery)
    if request is None or not _received.in_children:
        log.debug("%s[%s] after %s: no child of this process ran it", task.name, task_id, reason)
        return
    pid = request.worker_pid
    if not isinstance(pid, int) or pid == os.getpid():
        log.warning(
            "%s[%s] after %s: the pid of its child is not known; its lock frees when its "
            "lease lapses",
            task.name,
            task_id,
            reason,
        )
        return
    action = functools.partial(free, task, task_id, args, kwargs, reason, request)
    exit_watch().after_exit(pid, f"{task.name}[{task_id}].{attempt_of(request)}", action)


def _forget_after_fork() -> None:
    global _received
    _received = _Received()  # a pool child receives nothing: the parent's requests are not its


os.register_at_fork(after_in_child=_forget_after_fork)
