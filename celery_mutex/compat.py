"""Drop-in base classes for users of celery-once and celery-singleton: one import changes.

::

    from celery_mutex.compat import QueueOnce, AlreadyQueued   # was: from celery_once import ...
    from celery_mutex.compat import Singleton, DuplicateTaskError, clear_locks
                                                # was: from celery_singleton import ...

They take the peers' task options and settings, and keep what their callers see: a
duplicate ``apply_async`` raises ``AlreadyQueued`` (or, ``graceful``, returns a result of
None), or returns the queued call's ``AsyncResult`` (or raises ``DuplicateTaskError``).
Underneath they are ``MutexTask`` subclasses: the "queued or running" record is cleared
on every way a call ends (a killed child, a hard time limit, a revoke, ``Ignore``,
``Reject`` included), a retry keeps it, and besides it the worker takes a renewed lock on
the same key, so a copy that got past the check (``send_task``, a beat that did not
import the task, an expired record) never runs beside the first: it is skipped
(``unlock_before_run``: it waits its turn through busy retries).

What differs from the peers, on purpose:

* Direct calls (``task(1)``) stay plain function calls, as the peers documented
  (``lock_direct_calls = False``; a ``MutexTask`` locks them).
* Keys bind defaults (``f(1)`` and ``f(1, b=2)`` with ``b=2`` the default are one call),
  and ``keys=[]`` / ``unique_on=[]`` lock on the task name alone.
* ``timeout`` / ``lock_expiry`` bound how long a *queued* call blocks equal ones
  (``enqueue_ttl``); a running call holds a short renewed lease instead, so a crashed
  worker's call frees within a minute. ``lock_expiry=None`` ("never") is one hour
  (``mutex_enqueue_ttl``), so a purged queue cannot block a key forever.

Settings are read under the peers' names, with a ``DeprecationWarning`` naming the
``mutex_*`` setting that replaces each; a ``mutex_*`` setting wins where both are set:

* celery-once: ``app.conf.ONCE = {"backend": "celery_once.backends.Redis",
  "settings": {"url": ..., "default_timeout": ...}}`` (``File`` with ``location`` becomes
  a ``DiskCache`` there) -> ``mutex_cache``, ``mutex_enqueue_ttl``.
* celery-singleton: ``singleton_backend_url`` -> ``mutex_cache``, ``singleton_key_prefix``
  -> ``mutex_prefix``, ``singleton_lock_expiry`` -> ``mutex_enqueue_ttl``,
  ``singleton_raise_on_duplicate`` -> the task's ``raise_on_duplicate``.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Mapping
from typing import Any

from simple_mutex import ConstraintValueError
from simple_mutex.busy import check_known, positive_seconds
from simple_mutex.busy.policy import check_bool

from . import enqueue, per_call
from ._celery import EagerResult, states
from .errors import AlreadyQueuedError
from .task import MutexTask

ONCE_OPTIONS = frozenset({"keys", "graceful", "timeout", "unlock_before_run"})
ONCE_PER_CALL = frozenset({"graceful", "timeout"})
ONCE_SETTINGS = frozenset({"url", "location", "default_timeout", "blocking", "blocking_timeout"})


class AlreadyQueued(AlreadyQueuedError):
    """celery-once's error: an equal call is queued or running. ``countdown``: seconds
    until its record lapses at the latest; ``task_id``: its id (celery-once had none)."""


class DuplicateTaskError(AlreadyQueuedError):
    """celery-singleton's error (``raise_on_duplicate``): ``task_id`` is the queued call's.
    Unlike the original it pickles, so raising it inside a task cannot kill the worker."""


def _translated(cls: type[MutexTask], options: dict[str, Any]) -> None:
    """Make ``options`` the task's ``mutex={...}``; the task's own ``mutex`` wins."""
    cls.mutex = {**options, **(cls.__dict__.get("mutex") or {})}


def _deprecated(found: str, instead: str) -> None:
    warnings.warn(
        f"{found} is read for celery_mutex.compat; set {instead} instead",
        DeprecationWarning,
        stacklevel=3,
    )


def _send(
    task: MutexTask,
    args: Any,
    kwargs: Any,
    task_id: str | None,
    options: dict[str, Any],
    ttl: float | None,
) -> Any:
    """Celery's own apply_async behind the enqueue check; AlreadyQueuedError if refused."""
    send = super(MutexTask, task).apply_async
    per_call.into_headers(task.name, options)
    return enqueue.send_once(task, args, kwargs, task_id, options, send, ttl)


def _as(kind: type[AlreadyQueuedError], dup: AlreadyQueuedError) -> AlreadyQueuedError:
    """``dup`` as the peer's error class, saying how long equal calls stay refused."""
    left = "an unknown time" if dup.countdown is None else f"{dup.countdown:.0f} s"
    return kind(
        f"{dup.message}; equal calls are refused for {left} at most",
        key=dup.key,
        task_id=dup.task_id,
        countdown=dup.countdown,
    )


# -- celery-once ---------------------------------------------------------------------------


class QueueOnce(MutexTask):
    """celery-once's ``QueueOnce``: ``@app.task(base=QueueOnce, once={...})``.

    ``once``: ``keys`` (argument names; ``[]``: the task name alone; default: every
    argument), ``graceful`` (a duplicate returns a result of None instead of raising
    ``AlreadyQueued``), ``timeout`` (seconds a queued or running call blocks equal ones at
    most; default ``ONCE["settings"]["default_timeout"]`` or one hour),
    ``unlock_before_run`` (an equal call may be queued as soon as this one starts; it runs
    after this one ends). Per call: ``apply_async(..., once={"graceful", "timeout"})``.
    """

    AlreadyQueued = AlreadyQueued
    once: Mapping[str, Any] = {"graceful": False, "unlock_before_run": False}
    lock_direct_calls = False
    _once_graceful = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        if "run" in cls.__dict__:
            name = cls.__dict__.get("name") or f"{cls.__module__}.{cls.__qualname__}"
            once = {**QueueOnce.once, **check_known(name, "once option", cls.once, ONCE_OPTIONS)}
            cls._once_graceful = check_bool(name, "once graceful", once["graceful"])
            unlock = check_bool(name, "once unlock_before_run", once["unlock_before_run"])
            options: dict[str, Any] = {"enqueue": "raise", "on_busy": "skip"}
            if unlock:  # queued again while this runs: it must wait its turn, not vanish
                options.update(enqueue_until="start", on_busy="retry")
            if once.get("keys") is not None:
                options["key"] = once["keys"]
            if "timeout" in once:
                options["enqueue_ttl"] = once["timeout"]
            _translated(cls, options)
        super().__init_subclass__(**kwargs)

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        once: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> Any:
        """Send the call, unless an equal one is queued or running: then raise
        ``AlreadyQueued``, or with ``graceful`` return a result of None (REJECTED)."""
        where = f"{self.name}: apply_async"
        call = check_known(where, "once option", once or {}, ONCE_PER_CALL)
        graceful = check_bool(where, "once graceful", call.get("graceful", self._once_graceful))
        ttl = None if "timeout" not in call else positive_seconds(call["timeout"], "once timeout")
        try:
            return _send(self, args, kwargs, task_id, options, ttl)
        except AlreadyQueuedError as dup:
            if graceful:
                return EagerResult(None, None, states.REJECTED)
            raise _as(AlreadyQueued, dup) from None

    def mutex_defaults(self) -> dict[str, Any]:
        """``app.conf.ONCE`` (Django: ``CELERY_ONCE``), under the ``mutex_*`` settings."""
        once = self._get_app().conf.get("ONCE")
        if once is None:
            return {}
        _deprecated("app.conf.ONCE", "app.conf.mutex_cache (and mutex_enqueue_ttl)")
        once = check_known("app.conf.ONCE", "key", once, frozenset({"backend", "settings"}))
        settings = check_known(
            "app.conf.ONCE['settings']", "setting", once.get("settings") or {}, ONCE_SETTINGS
        )
        if settings.get("blocking"):
            warnings.warn(
                "app.conf.ONCE blocking is not supported by celery_mutex.compat: a duplicate "
                "is refused at once (a MutexTask with on_busy='wait' waits in the worker)",
                DeprecationWarning,
                stacklevel=2,
            )
        backend = str(once.get("backend") or "celery_once.backends.Redis")
        found: dict[str, Any] = {}
        kind = backend.rsplit(".", 1)[-1]
        if kind == "Redis" and settings.get("url"):
            found["cache"] = settings["url"]
        elif kind == "File":
            location = settings.get("location") or os.path.join(
                tempfile.gettempdir(), "celery_once"
            )
            found["cache"] = "file://" + os.path.abspath(location)  # a DiskCache there
        elif kind != "Redis":
            raise ConstraintValueError(
                f"app.conf.ONCE: backend {backend!r} has no counterpart in celery_mutex; "
                "set app.conf.mutex_cache to a cache URL (redis://, file:///, "
                "postgresql://, ...)"
            )
        if "default_timeout" in settings:
            timeout = settings["default_timeout"]
            found["enqueue_ttl"] = positive_seconds(timeout, "app.conf.ONCE default_timeout")
        return found


# -- celery-singleton ----------------------------------------------------------------------

SINGLETON_SETTINGS = {  # celery-singleton's setting -> the option it sets
    "singleton_backend_url": "cache",
    "singleton_key_prefix": "prefix",
    "singleton_lock_expiry": "enqueue_ttl",
}
SINGLETON_IGNORED = ("singleton_backend_class", "singleton_backend_kwargs")


class Singleton(MutexTask):
    """celery-singleton's ``Singleton``: ``@app.task(base=Singleton, unique_on=[...])``.

    ``unique_on``: argument names (a str is one name; ``[]``: the task name alone;
    default: every argument); ``raise_on_duplicate``: raise ``DuplicateTaskError``
    instead of returning the queued call's ``AsyncResult`` (default
    ``app.conf.singleton_raise_on_duplicate``, else False); ``lock_expiry``: seconds a
    queued or running call blocks equal ones at most (default one hour).
    """

    unique_on: str | list[str] | tuple[str, ...] | None = None
    raise_on_duplicate: bool | None = None
    lock_expiry: float | None = None
    lock_direct_calls = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        if "run" in cls.__dict__:
            options: dict[str, Any] = {"enqueue": "raise", "on_busy": "skip"}
            if cls.unique_on is not None:
                unique_on = cls.unique_on
                options["key"] = [unique_on] if isinstance(unique_on, str) else unique_on
            if cls.lock_expiry is not None:
                options["enqueue_ttl"] = cls.lock_expiry
            _translated(cls, options)
        super().__init_subclass__(**kwargs)

    def apply_async(
        self, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any
    ) -> Any:
        """Send the call, unless an equal one is queued or running: then return its
        ``AsyncResult``, or raise ``DuplicateTaskError`` (``raise_on_duplicate``)."""
        try:
            return _send(self, args, kwargs, task_id, options, None)
        except AlreadyQueuedError as dup:
            if dup.task_id is not None and not self._raises_on_duplicate():
                return self.AsyncResult(dup.task_id)
            raise _as(DuplicateTaskError, dup) from None

    def _raises_on_duplicate(self) -> bool:
        if self.raise_on_duplicate is not None:
            return check_bool(self.name, "raise_on_duplicate", self.raise_on_duplicate)
        app_wide = self._get_app().conf.get("singleton_raise_on_duplicate")
        if app_wide is None:
            return False
        _deprecated("app.conf.singleton_raise_on_duplicate", "raise_on_duplicate on the task")
        return check_bool("app.conf.singleton_raise_on_duplicate", "value", app_wide)

    def mutex_defaults(self) -> dict[str, Any]:
        """celery-singleton's ``singleton_*`` settings, under the ``mutex_*`` settings."""
        conf = self._get_app().conf
        found: dict[str, Any] = {}
        for setting, option in SINGLETON_SETTINGS.items():
            value = conf.get(setting)
            if value is not None:
                _deprecated(f"app.conf.{setting}", f"app.conf.mutex_{option}")
                if option == "enqueue_ttl":
                    value = positive_seconds(value, f"app.conf.{setting}")
                found[option] = value
        for setting in SINGLETON_IGNORED:
            if conf.get(setting) is not None:
                warnings.warn(
                    f"app.conf.{setting} is not used by celery_mutex.compat: locks live in "
                    "app.conf.mutex_cache (a URL or a cache instance)",
                    DeprecationWarning,
                    stacklevel=2,
                )
        return found


def clear_locks(app: Any) -> None:
    """celery-singleton's escape hatch, now a no-op: a crashed worker's records are freed
    by its parent process or lapse with their lease, and clearing every lock on one
    worker's start would free those of the others still running."""
    warnings.warn(
        "clear_locks() does nothing under celery_mutex: locks of crashed workers are freed "
        "for you; remove the call",
        DeprecationWarning,
        stacklevel=2,
    )


__all__ = ["AlreadyQueued", "DuplicateTaskError", "QueueOnce", "Singleton", "clear_locks"]
