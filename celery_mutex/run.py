"""The task body inside its lease, and the release on every way it ends.

A direct call (``charge(7)``: no before_start ran) takes the lock here, synchronously as
``apply()`` does, unless the class sets ``lock_direct_calls = False``. A direct call made
inside a body that already holds the same key (a task calling another as a subroutine)
runs inside that hold: waiting for a lock our own caller holds could only end in a
timeout.

Celery's ``Task.__call__`` pushes a request that copies the current one, so a direct call
is told apart by what it copied: ``called_directly`` from a task's idle request (a call
from outside, or from another task), the call state's ``running`` from a body of this
same task that is running (a recursive call: the copy shares the running call's state,
and gets a state of its own before it takes the lock). A custom ``__call__`` that calls
``super()`` on the tracer's behalf copies the traced request before its body runs: that
is no direct call.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from simple_mutex import Lease, MalfunctionError, SimpleMutexLeaseExpiredError
from simple_mutex.busy import running

from . import acquire, call_state, line, per_call, signals
from ._celery import Retry, uuid
from ._owned import owner_of
from .config import config_of
from .keys import user_signature

log = logging.getLogger("celery_mutex")


def guarded(fn: Callable[..., Any], bound: bool) -> Callable[..., Any]:
    """The task's ``run``: the user's function inside the lease ``before_start`` took."""
    if bound:

        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            return run_body(self, lambda: fn(self, *args, **kwargs), args, kwargs)

    else:

        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            return run_body(self, lambda: fn(*args, **kwargs), args, kwargs)

    signature = user_signature(fn, bound)
    me = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    run.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[me, *signature.parameters.values()]
    )
    for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
        setattr(run, attr, getattr(fn, attr, None))
    return run


Held = tuple[int, str, str]  # (id of the cache, prefix, key): one lock, in any task
_held: ContextVar[frozenset[Held]] = ContextVar("celery_mutex_held", default=frozenset())


def run_body(
    task: Any, body: Callable[[], Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    request = task.request
    direct = request.called_directly or call_state.of(request).running
    if direct:
        if not task.lock_direct_calls:
            return body()  # a plain function call, as the peers' direct calls were
        if _held_here(task, task.mutex_key(*args, **kwargs)):
            return body()  # a subroutine of the run that holds this key
        call_state.fresh(request, running=call_state.of(request).running)  # not the caller's
        acquire.before_start(task, f"direct-{uuid()}", args, kwargs, direct=True)
    state = call_state.of(request)
    if state.skipped is not None:
        return state.skipped
    lease: Lease | None = state.lease
    if lease is None or state.done:
        return body()  # no lease was taken for this request: nothing to hold
    state.running = True
    with running(lease), _holding(task, lease.key):
        try:
            result = body()
        except BaseException as exc:
            end(task, lease, exc)
            raise
        end(task, lease, None)
        return result


def _identity(task: Any, key: str) -> Held:
    space = config_of(task).locks.space
    return id(space.cache), space.prefix, key


def _held_here(task: Any, key: str) -> bool:
    held = _held.get()
    return bool(held) and _identity(task, key) in held


@contextmanager
def _holding(task: Any, key: str) -> Iterator[None]:
    token = _held.set(_held.get() | {_identity(task, key)})
    try:
        yield
    finally:
        _held.reset(token)


def end(task: Any, lease: Lease, exc: BaseException | None) -> None:
    """Disarm and release; raises SimpleMutexLeaseExpiredError if the lease lapsed."""
    request = task.request
    state = call_state.of(request)
    state.done = True
    in_time = False
    # on_busy="queue": the turn moves on before the lock is released, and the next in
    # line is published after it (publish-then-forget: a crash between leaves a head a
    # sweep publishes).
    then = line.ending(task, exc)
    try:
        lease.__exit__(None if exc is None else type(exc), exc, None)
        in_time = not lease.lost
    except MalfunctionError as fault:
        # The work is done; the lock lapses on its own within the (short) lease.
        log.warning("%s[%s]: releasing %r failed: %s", task.name, request.id, lease.key, fault)
    except SimpleMutexLeaseExpiredError:
        if not isinstance(exc, Retry):
            raise
        # Task.retry publishes before this run unwinds; the retry (same task id, next
        # attempt) waits for this one, but if our lease lapsed meanwhile it may already
        # hold the key. The work runs again anyway.
        log.debug("%s[%s]: %r passed on to its retry", task.name, request.id, lease.key)
    finally:
        then()
        held = time.monotonic() - (state.started or time.monotonic())
        log.debug("released %r for %s[%s] after %.3f s", lease.key, task.name, request.id, held)
        signals.mutex_released.send(
            sender=task, task_id=request.id, key=lease.key, held=held, in_time=in_time, by="task"
        )


def release_owner(
    task: Any,
    task_id: str,
    args: Any,
    kwargs: Any,
    reason: str,
    request: Any = None,
    *,
    attempt: int | None,
) -> bool:
    """Free the lock attempt ``attempt`` of ``task_id`` holds (None: any attempt), from
    any process (the worker's parent). ``request``: the call's, when at hand (its
    per-call key)."""
    try:
        key = per_call.key_of(task, args, kwargs, per_call.of_request(request))
        freed = config_of(task).locks.release_owner(key, owner_of(task_id), attempt=attempt)
    except Exception as exc:  # a signal handler: log, never raise into Celery
        log.warning("%s[%s]: could not free its lock after %s: %r", task.name, task_id, reason, exc)
        return False
    if freed:
        log.warning("freed %r held by %s[%s] after %s", key, task.name, task_id, reason)
        signals.mutex_released.send(
            sender=task, task_id=task_id, key=key, held=None, in_time=True, by="parent"
        )
    return freed
