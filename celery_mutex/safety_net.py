"""Celery signal handlers that free what the run wrapper could not.

* ``task_postrun``: a lease the wrapper did not reach (an interrupt landing between
  before_start and the body, a before_start failure); clears the enqueue marker of a call
  that ended without a retry.
* ``task_received`` in the worker's main process: remembers each MutexTask request, so
  the handlers below know which child ran it (``parent``).
* ``task_failure`` in the worker's main process: a child killed (SIGKILL, OOM:
  ``WorkerLostError``) ran no task hook and is gone: its lock is freed at once, by its
  task id and attempt (a retry of it may hold the key by then). After a hard time limit
  the child is still alive when Celery reports it: its lock is freed once the child has
  exited.
* ``task_revoked``: any revoke or expiry ends the call, so its enqueue marker goes; after
  ``revoke(terminate=True)`` the lock (and the marker) go once the child has exited.
* ``worker_ready``: the worker's main process starts sweeping the lines of its app's
  ``on_busy="queue"`` tasks (``sweeper.Sweeper``); ``worker_shutdown`` stops it.
* ``task_unknown`` / ``task_rejected``: the worker refused the message without running
  it (a task it does not know, an invalid message): the call is over, its marker goes
  (found through the header its sender stamped: ``enqueue.unmark_refused``).

A call whose body raised ``Reject(requeue=True)`` under ``acks_late`` keeps its marker:
its message goes back to the queue, so the call is still queued.
"""

from __future__ import annotations

import logging
from typing import Any

from . import _celery, call_state, line, parent
from ._celery import TimeLimitExceeded, WorkerLostError
from .enqueue import unmark, unmark_refused
from .run import end
from .sweeper import Sweeper
from .task import MutexTask

log = logging.getLogger("celery_mutex")


def _release_leftover(
    sender: Any = None,
    task_id: str | None = None,
    args: Any = None,
    kwargs: Any = None,
    state: str | None = None,
    retval: Any = None,
    **_: Any,
) -> None:
    if not isinstance(sender, MutexTask):
        return
    request = sender.request
    # Reject(requeue=True) puts the message back only if it was not acked on receipt.
    requeued = state == "REJECTED" and getattr(retval, "requeue", False) and sender.acks_late
    call = call_state.of(request)
    parked = call.parked  # on_busy="queue": not over yet
    if task_id and state != "RETRY" and not requeued and not parked:
        unmark(sender, task_id, args, kwargs, request)
    lease = call.lease
    if lease is None or call.done:
        return
    try:
        end(sender, lease, None)
    except Exception as exc:
        log.warning("%s[%s]: late release of %r: %r", sender.name, request.id, lease.key, exc)


def _remember(sender: Any = None, request: Any = None, **_: Any) -> None:
    if request is not None and isinstance(getattr(request, "task", None), MutexTask):
        parent.remember(sender, request)


def _release_after_child_died(
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    args: Any = None,
    kwargs: Any = None,
    **_: Any,
) -> None:
    if not (isinstance(sender, MutexTask) and task_id):
        return
    # Which delivery failed: the worker Request that reports it (``MutexRequest``), else
    # the context Celery pushed (not on every path nor in every version), else the last
    # Request of this task id received here (an attempt of it, maybe not this one).
    failed = parent.failing()
    if failed is None or failed.id != task_id:
        pushed = sender.request if getattr(sender.request, "id", None) == task_id else None
        failed = parent.request_of(task_id) if pushed is None else pushed
    if isinstance(exception, WorkerLostError):
        parent.free(sender, task_id, args, kwargs, "WorkerLostError", failed)
    elif isinstance(exception, TimeLimitExceeded) and failed is not None:
        parent.free_when_gone(sender, failed, "TimeLimitExceeded")


def _release_after_revoke(
    sender: Any = None, request: Any = None, terminated: bool = False, **_: Any
) -> None:
    if not isinstance(sender, MutexTask) or request is None:
        return
    args, kwargs = getattr(request, "args", ()), getattr(request, "kwargs", {})
    if terminated:
        parent.free_when_gone(sender, request, "revoke")
    else:  # nothing ran: only the "queued" record is left, and its place in a line
        unmark(sender, request.id, args, kwargs, request)
        line.revoked(sender, request.id, args, kwargs, request)


_sweepers: dict[int, Sweeper] = {}


def _start_sweeping(sender: Any = None, **_: Any) -> None:
    """``worker_ready``: the worker's main process sweeps its app's lines."""
    app = getattr(sender, "app", None)
    if app is not None and id(app) not in _sweepers:
        sweeper = _sweepers[id(app)] = Sweeper(app)
        sweeper.start()


def _stop_sweeping(**_: Any) -> None:
    for sweeper in _sweepers.values():
        sweeper.stop()


def _unmark_refused(sender: Any = None, message: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)  # the worker's consumer
    if app is not None and message is not None:
        unmark_refused(app, getattr(message, "headers", None))


_celery.task_postrun.connect(_release_leftover, weak=False)
_celery.task_received.connect(_remember, weak=False)
_celery.task_unknown.connect(_unmark_refused, weak=False)
_celery.task_rejected.connect(_unmark_refused, weak=False)
_celery.task_failure.connect(_release_after_child_died, weak=False)
_celery.task_revoked.connect(_release_after_revoke, weak=False)
_celery.worker_ready.connect(_start_sweeping, weak=False)
_celery.worker_shutdown.connect(_stop_sweeping, weak=False)
