"""What the worker's main process frees on behalf of the child that ran a task (DESIGN §4
rule 12, §6): only once that child can no longer act.

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

The child's pid comes from the worker's ``Request`` (``worker_pid``, set when the child
accepted the task), remembered from ``task_received`` while the request lives.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from typing import Any

from ._celery import runs_in_children
from .enqueue import unmark
from .exits import exit_watch
from .line import end_of_dead
from .run import release_owner

log = logging.getLogger("celery_mutex")


class _Received:
    """The MutexTask requests this process received as a worker's main process."""

    def __init__(self) -> None:
        self.requests: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        self.in_children = False  # the worker's pool runs tasks in child processes


_received = _Received()


def remember(consumer: Any, request: Any) -> None:
    """``task_received`` (the worker's main process): keep the request by task id."""
    _received.in_children = runs_in_children(getattr(consumer, "pool", None))
    _received.requests[request.id] = request


def request_of(task_id: str) -> Any:
    """The worker's Request of ``task_id``, if this process received it and still has it."""
    return _received.requests.get(task_id)


def free(task: Any, task_id: str, args: Any, kwargs: Any, reason: str, context: Any) -> None:
    """Free the lock (and the enqueue marker) of ``task_id`` now. ``context``: the call's
    request or Context, for its per-call key."""
    release_owner(task, task_id, args, kwargs, reason, context)
    unmark(task, task_id, args, kwargs, context)
    end_of_dead(task, task_id, args, kwargs, context, killed=reason == "WorkerLostError")


def free_when_gone(
    task: Any, task_id: str, args: Any, kwargs: Any, reason: str, context: Any = None
) -> None:
    """Free the lock of ``task_id`` once the child that ran it has exited (at once if it
    has); nothing when no child of ours ran it."""
    request = request_of(task_id)
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
    context = request if context is None else context
    action = functools.partial(free, task, task_id, args, kwargs, reason, context)
    exit_watch().after_exit(pid, f"{task.name}[{task_id}]", action)


def _forget_after_fork() -> None:
    global _received
    _received = _Received()  # a pool child receives nothing: the parent's requests are not its


os.register_at_fork(after_in_child=_forget_after_fork)
