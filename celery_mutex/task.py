"""``MutexTask``: a Celery task base class that runs each call under a lease lock.

Lifecycle of one request (the lock is owned by the task id, see ``_owned``)::

    apply_async    with ``enqueue`` set: an equal queued call answers instead (enqueue)
    before_start   key from the bound arguments -> acquire (owner = task id)   (acquire)
                   busy: skip (marker result) | retry (re-publish, same retries count)
                         | wait (block, bounded by timeout) | raise
                   got it: lease on self.request, loss interrupt armed for this thread;
                   ``enqueue_until="start"``: the "queued" record goes now
    run            the task body; on any exit (return, exception, Retry, Ignore, Reject)
                   the lease is disarmed and released by compare-and-delete; a lost lease
                   turns the outcome into FAILURE with SimpleMutexLeaseExpiredError  (run)
    task_postrun   safety net: releases a lease the run wrapper did not reach
    parent         frees a child's lock by its task id: a killed child's (WorkerLostError)
                   at once; after a hard time limit or revoke(terminate=True) once the child
                   has exited, never on the signal alone (safety_net, parent, exits)

A direct call (``charge(7)``: no tracer, no before_start) runs the same way in the
calling process, like ``apply()`` (run): the body always holds its lock, so
``current_lease()`` is never None inside it. Set ``lock_direct_calls = False`` on a base
class for plain direct calls (``celery_mutex.compat`` does, as the peers did).

Options are checked at definition and merged with the app's settings once per process
(config); what busy means is ``simple_mutex.busy``'s, shared with RQ.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from simple_mutex import ConstraintTypeError

from . import acquire, call_state, enqueue, line, per_call
from ._celery import Task
from .config import Config, check_options, config_of
from .keys import KeyOf, make_key_of
from .run import guarded


@dataclass(frozen=True)
class _Spec:
    """What the task definition says: its checked options and its key function."""

    options: dict[str, Any]
    key_of: KeyOf


class MutexTask(Task):  # type: ignore[misc]  # celery ships no type hints: Task is Any
    """Base class for tasks that must not overlap per key.

    ``@app.task(base=MutexTask, mutex={"key": "order.{order_id}", "on_busy": "retry"})``.
    Options and their ``app.conf.mutex_*`` defaults are described in the README.
    """

    mutex: Mapping[str, Any] | None = None
    # The worker's Request: names the very delivery whose child died (celery_mutex.request).
    Request = "celery_mutex.request:MutexRequest"
    lock_direct_calls = True  # charge(7) takes the lock like charge.apply((7,))
    _mutex_spec: _Spec | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Runs when the task class is made (``@app.task`` builds one per task): bad options
        # and key templates naming missing arguments fail here, not when the task runs.
        super().__init_subclass__(**kwargs)
        run = cls.__dict__.get("run")
        if run is None:
            return  # an intermediate base class
        name = cls.__dict__.get("name") or f"{cls.__module__}.{cls.__qualname__}"
        options = check_options(name, cls.__dict__.get("mutex", cls.mutex))
        fn, bound = (run.__func__, False) if isinstance(run, staticmethod) else (run, True)
        key_of = make_key_of(name, fn, bound, options.get("key"), permits=options.get("permits", 1))
        cls._mutex_spec = _Spec(options, key_of)
        cls.run = guarded(fn, bound)

    def mutex_key(self, *args: Any, **kwargs: Any) -> str:
        """The lock key a call with these arguments uses."""
        if self._mutex_spec is None:
            raise ConstraintTypeError(f"{self.name}: a MutexTask needs a run method")
        return self._mutex_spec.key_of(self.name, args, kwargs)

    def mutex_defaults(self) -> dict[str, Any]:
        """Options under the app's ``mutex_*`` settings, for a base class to supply
        (``celery_mutex.compat`` reads the peers' settings here). Called once per process."""
        return {}

    def _mutex_config(self) -> Config:
        """This task's options merged with the app's settings, for this process."""
        return config_of(self)

    def apply_async(
        self, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any
    ) -> Any:
        """With ``enqueue`` set, a call while an equal one is queued or running returns
        that call's AsyncResult (``"return"``) or raises AlreadyQueuedError (``"raise"``).
        The run-time lock still applies: ``send_task`` and beat cannot bypass it.
        ``mutex={"key": ..., "on_busy": ..., "timeout": ...}`` changes them for this call
        (``per_call``); any other option there raises ConstraintError."""
        per_call.into_headers(self.name, options)
        send = line.sending(self, super().apply_async)  # on_busy="queue": with a ticket
        return enqueue.send_once(self, args, kwargs, task_id, options, send)

    def retry(self, args: Any = None, kwargs: Any = None, *more: Any, **options: Any) -> Any:
        """``Task.retry``, the call's lock options kept: its per-call options and, with
        ``on_busy="queue"``, its ticket (the retry keeps the turn) travel in the retry's
        headers, which a worker's request does not hand back on its own."""
        carried = {
            name: value
            for name in (per_call.HEADER, line.HEADER)
            if (value := getattr(self.request, name, None)) is not None
        }
        if carried:
            options["headers"] = {
                **(self.request.headers or {}),
                **carried,
                **(options.get("headers") or {}),
            }
        return super().retry(args, kwargs, *more, **options)

    def before_start(self, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        acquire.before_start(self, task_id, args, kwargs)
        started = call_state.of(self.request).lease is not None
        if started and config_of(self).enqueue_until == "start":  # once's unlock_before_run
            enqueue.unmark(self, task_id, args, kwargs, self.request)
