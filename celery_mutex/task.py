"""``MutexTask``: a Celery task base class that runs each call under a lease lock.

Lifecycle of one request (the lock is owned by the task id, see ``_owned``)::

    before_start   key from the bound arguments -> acquire (owner = task id)
                   busy: skip (marker result) | retry (re-publish, same retries count)
                         | wait (block, bounded by timeout) | raise
                   got it: lease on self.request, loss interrupt armed for this thread
    run            the task body; on any exit (return, exception, Retry, Ignore, Reject)
                   the lease is disarmed and released by compare-and-delete; a lost lease
                   turns the outcome into FAILURE with SimpleMutexLeaseExpiredError
    task_postrun   safety net: releases a lease the run wrapper did not reach
    parent         task_failure (WorkerLostError, hard TimeLimitExceeded) and task_revoked
                   (terminate=True) free the dead child's lock by its task id

With ``enqueue`` set, ``apply_async`` also writes a "queued or running" marker (owner =
the new task id) and answers an equal call with the first call's AsyncResult; the marker
is cleared when the call ends without retrying (task_postrun, parent handlers, revoke).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from simple_mutex import (
    ConstraintError,
    Lease,
    MalfunctionError,
    SimpleMutexAcquireTimeoutError,
    SimpleMutexLeaseExpiredError,
    cache_from_url,
)
from simple_mutex.busy import RetryPolicy, retry_policy
from simple_mutex.durations import timeout_seconds
from simple_mutex.interrupt import LeaseInterrupt

from . import signals
from ._celery import (
    Retry,
    Task,
    TimeLimitExceeded,
    WorkerLostError,
    current_task,
    task_failure,
    task_postrun,
    task_revoked,
    uuid,
)
from ._owned import OwnedLocks, owner_of
from .errors import AlreadyQueuedError
from .options import (
    DEFAULTS,
    OPTIONS,
    KeyOf,
    check_options,
    check_value,
    make_key_of,
    user_signature,
)

log = logging.getLogger("celery_mutex")

SKIPPED = "skipped"
BUSY_HEADER = "mutex_busy_retries"
_rng = random.Random()
os.register_at_fork(after_in_child=_rng.seed)


def is_skipped(result: object) -> bool:
    """True if ``result`` (an ``AsyncResult.get()`` value) is the marker of a skipped run."""
    return isinstance(result, Mapping) and result.get("celery_mutex") == SKIPPED


def current_lease() -> Lease | None:
    """The lease of the MutexTask running in this thread (for its ``fence`` and ``key``)."""
    if not current_task:  # a proxy: false when no task runs in this thread
        return None
    lease = getattr(current_task.request, "mutex_lease", None)
    return lease if isinstance(lease, Lease) else None


# -- caches: one per URL per process, built after fork ----------------------------------

_caches: dict[str, object] = {}
_caches_lock = threading.Lock()


def _reset_caches() -> None:
    global _caches_lock
    _caches.clear()
    _caches_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_caches)


def _cache_for(url: str) -> object:
    with _caches_lock:
        cache = _caches.get(url)
        if cache is None:
            cache = _caches[url] = cache_from_url(url)
        return cache


@dataclass(frozen=True)
class _Spec:
    """What the task definition says: its checked options and its key function."""

    options: dict[str, Any]
    key_of: KeyOf


@dataclass(frozen=True)
class _Config:
    """A task's options merged with the app's settings, for this process."""

    pid: int
    on_busy: str
    timeout: float | None
    renew: bool
    retry: RetryPolicy
    locks: OwnedLocks
    enqueue: str | None
    markers: OwnedLocks | None  # "queued or running" records, when enqueue is on


class MutexTask(Task):  # type: ignore[misc]  # celery ships no type hints: Task is Any
    """Base class for tasks that must not overlap per key.

    ``@app.task(base=MutexTask, mutex={"key": "order.{order_id}", "on_busy": "retry"})``.
    Options and their ``app.conf.mutex_*`` defaults are described in the README.
    """

    mutex: Mapping[str, Any] | None = None
    _mutex_spec: _Spec | None = None
    _mutex_cfg: _Config | None = None

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
        cls._mutex_spec = _Spec(options, make_key_of(name, fn, bound, options.get("key")))
        cls._mutex_cfg = None
        cls.run = _guarded(fn, bound)

    # -- configuration ----------------------------------------------------------------

    def _mutex_config(self) -> _Config:
        cfg = self._mutex_cfg
        if cfg is not None and cfg.pid == os.getpid():
            return cfg
        merged = dict(DEFAULTS)
        conf = self._get_app().conf
        for name in sorted(OPTIONS - {"key"}):
            value = conf.get(f"mutex_{name}")
            if value is not None:
                merged[name] = check_value(f"app.conf.mutex_{name}", name, value)
        options = self._spec().options
        merged.update(options)
        # retry fields merge field by field: defaults < app.conf.mutex_retry < the task's
        merged["retry"] = {
            **DEFAULTS["retry"],
            **(conf.get("mutex_retry") or {}),
            **options.get("retry", {}),
        }
        cache = merged.get("cache")
        if cache is None:
            raise ConstraintError(
                f"{self.name}: no lock cache configured; set app.conf.mutex_cache "
                "(e.g. 'redis://host:6379/0') or mutex={'cache': ...} on the task. "
                "The broker is never used silently"
            )
        if isinstance(cache, str):
            cache = _cache_for(cache)
        locks = OwnedLocks(
            cache, permits=merged["permits"], lease=merged["lease"], prefix=merged["prefix"]
        )
        timeout = merged["timeout"]
        markers = None
        if merged["enqueue"] is not None:
            markers = OwnedLocks(
                cache,
                permits=1,
                lease=merged["enqueue_ttl"],
                prefix=merged["prefix"] + "queued.",
            )
        cfg = _Config(
            pid=os.getpid(),
            on_busy=merged["on_busy"],
            timeout=timeout_seconds(timeout),
            renew=merged["renew"],
            retry=retry_policy(self.name, merged["retry"]),
            locks=locks,
            enqueue=merged["enqueue"],
            markers=markers,
        )
        self._mutex_cfg = cfg
        return cfg

    def mutex_key(self, *args: Any, **kwargs: Any) -> str:
        """The lock key a call with these arguments uses."""
        return self._spec().key_of(self.name, args, kwargs)

    def _spec(self) -> _Spec:
        if self._mutex_spec is None:
            raise ConstraintError(f"{self.name}: a MutexTask needs a run method")
        return self._mutex_spec

    # -- enqueue-time de-duplication (opt-in) -----------------------------------------

    def apply_async(
        self, args: Any = None, kwargs: Any = None, task_id: str | None = None, **options: Any
    ) -> Any:
        """With ``enqueue`` set, a call while an equal one is queued or running returns
        that call's AsyncResult (``"return"``) or raises AlreadyQueuedError (``"raise"``).
        The run-time lock still applies: ``send_task`` and beat cannot bypass it."""
        spec = self._spec()
        headers = options.get("headers") or {}
        if (
            (
                spec.options.get("enqueue") is None
                and self._get_app().conf.get("mutex_enqueue") is None
            )
            or options.get("retries")
            or BUSY_HEADER in headers
        ):
            # off, or a re-publish of a call already let through (retry, busy retry)
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        cfg = self._mutex_config()
        if cfg.markers is None:
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        task_id = task_id or uuid()
        key = self.mutex_key(*(args or ()), **(kwargs or {}))
        holder: str | None = None
        for _ in range(3):  # the queued call may end between our try and our read
            try:
                cfg.markers.acquire(
                    key, owner=owner_of(task_id), attempt=0, timeout=0, renew=False, label=task_id
                )
                break
            except SimpleMutexAcquireTimeoutError:
                holder = _safe_holder(cfg.markers, key)
                if holder is not None:
                    break
        else:
            holder = "unknown"
        if holder is not None:
            log.info("%s: %r is already queued as %s", self.name, key, holder)
            if cfg.enqueue == "raise" or holder == "unknown":
                raise AlreadyQueuedError(
                    f"{self.name}: a call with key {key!r} is already queued or running "
                    f"(task id {holder})",
                    key=key,
                    task_id=None if holder == "unknown" else holder,
                )
            return self.AsyncResult(holder)
        try:
            return super().apply_async(args, kwargs, task_id=task_id, **options)
        except BaseException:
            cfg.markers.release_owner(key, owner_of(task_id))
            raise

    def _mutex_unmark(self, task_id: str, args: Any, kwargs: Any) -> None:
        """The call is over (not retrying): let an equal call be queued again."""
        cfg = self._mutex_config()
        if cfg.markers is not None:
            key = self.mutex_key(*(args or ()), **(kwargs or {}))
            cfg.markers.release_owner(key, owner_of(task_id))

    # -- acquire ----------------------------------------------------------------------

    def before_start(self, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        request = self.request
        cfg = self._mutex_config()
        if getattr(request, "mutex_beat_slot", None) is not None:  # stamped by beat.py
            from .beat import drop_duplicate_tick

            space = cfg.locks.space
            dropped = drop_duplicate_tick(self, space.cache, space.prefix, task_id)
            if dropped is not None:  # this tick already started: run nothing
                request.mutex_skipped = dropped
                return
        key = self.mutex_key(*args, **kwargs)
        request.mutex_key = key
        policy = cfg.on_busy
        if policy == "retry" and request.is_eager:
            policy = "wait"  # an eager retry re-runs at once, in this thread: wait instead
        timeout = cfg.timeout if cfg.timeout is not None else None if policy == "wait" else 0
        started = time.monotonic()
        try:
            lease = cfg.locks.acquire(
                key,
                owner=owner_of(task_id),
                attempt=request.retries or 0,
                timeout=timeout,
                renew=cfg.renew,
                label=f"{self.name}[{task_id}]",
            )
        except SimpleMutexAcquireTimeoutError as busy:
            self._mutex_busy(cfg, policy, key, busy, task_id, args, kwargs)
            return
        request.mutex_lease = lease
        request.mutex_started = time.monotonic()
        log.debug("acquired %r for %s[%s] (fence %d)", key, self.name, task_id, lease.fence)
        lease.on_lost(functools.partial(_lost, self, task_id, lease))
        signals.mutex_acquired.send(
            sender=self,
            task_id=task_id,
            key=key,
            fence=lease.fence,
            waited=request.mutex_started - started,
        )
        lease.__enter__()  # last: from here a loss interrupts this thread

    def _mutex_busy(
        self,
        cfg: _Config,
        policy: str,
        key: str,
        busy: SimpleMutexAcquireTimeoutError,
        task_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        holder = _safe_holder(cfg.locks, key)
        signals.mutex_busy.send(sender=self, task_id=task_id, key=key, policy=policy, holder=holder)
        if policy == "skip":
            log.info("skipped %s[%s]: %r is held by %s", self.name, task_id, key, holder)
            self.request.mutex_skipped = {"celery_mutex": SKIPPED, "key": key, "holder": holder}
            return
        if policy != "retry":
            log.info("%s[%s] failed: %r is busy (held by %s)", self.name, task_id, key, holder)
            raise busy
        request = self.request
        count = int(getattr(request, BUSY_HEADER, None) or 0)
        if cfg.retry.max is not None and count >= cfg.retry.max:
            log.info("%s[%s]: %r still busy after %d retries", self.name, task_id, key, count)
            raise busy
        delay = cfg.retry.delay(count, _rng.random())
        headers = dict(request.headers or {})
        headers[BUSY_HEADER] = count + 1
        # Our own re-publish, not Task.retry: ``retries`` stays as it was, so waiting for a
        # busy key never uses up the task's max_retries (nor counts as a new attempt).
        sig = self.signature_from_request(
            request,
            args,
            kwargs,
            countdown=delay,
            retries=request.retries or 0,
            headers=headers,
        )
        sig.apply_async()
        log.info(
            "%s[%s]: %r is busy (held by %s); retry %d in %.2f s",
            self.name,
            task_id,
            key,
            holder,
            count + 1,
            delay,
        )
        raise Retry(exc=busy, when=delay, sig=sig)

    # -- run and release ----------------------------------------------------------------

    def _mutex_run(self, body: Callable[[], Any]) -> Any:
        request = self.request
        skipped = getattr(request, "mutex_skipped", None)
        if skipped is not None:
            return skipped
        lease: Lease | None = getattr(request, "mutex_lease", None)
        if lease is None or getattr(request, "mutex_done", False):
            return body()  # called directly (no tracer): a plain function call
        try:
            result = body()
        except BaseException as exc:
            self._mutex_end(lease, exc)
            if isinstance(exc, LeaseInterrupt):
                # The per-lease class does not serialize by name: report the public error.
                raise SimpleMutexLeaseExpiredError(exc.message, key=exc.key) from None
            raise
        self._mutex_end(lease, None)
        return result

    def _mutex_end(self, lease: Lease, exc: BaseException | None) -> None:
        """Disarm and release; raises SimpleMutexLeaseExpiredError if the lease lapsed."""
        request = self.request
        request.mutex_done = True
        in_time = False
        try:
            lease.__exit__(None if exc is None else type(exc), exc, None)
            in_time = not lease.lost
        except MalfunctionError as fault:
            # The work is done; the lock lapses on its own within the (short) lease.
            log.warning("%s[%s]: releasing %r failed: %s", self.name, request.id, lease.key, fault)
        except SimpleMutexLeaseExpiredError:
            if not isinstance(exc, Retry):
                raise
            # Task.retry publishes before this run unwinds: the retry (same task id, next
            # attempt) may already have taken the record over. The work runs again anyway.
            log.debug("%s[%s]: %r passed on to its retry", self.name, request.id, lease.key)
        finally:
            held = time.monotonic() - getattr(request, "mutex_started", time.monotonic())
            log.debug("released %r for %s[%s] after %.3f s", lease.key, self.name, request.id, held)
            signals.mutex_released.send(
                sender=self,
                task_id=request.id,
                key=lease.key,
                held=held,
                in_time=in_time,
                by="task",
            )

    def _mutex_release_owner(self, task_id: str, args: Any, kwargs: Any, reason: str) -> bool:
        """Free the lock ``task_id`` holds, from any process (the worker's parent)."""
        try:
            key = self.mutex_key(*(args or ()), **(kwargs or {}))
            freed = self._mutex_config().locks.release_owner(key, owner_of(task_id))
        except Exception as exc:  # a signal handler: log, never raise into Celery
            log.warning(
                "%s[%s]: could not free its lock after %s: %r", self.name, task_id, reason, exc
            )
            return False
        if freed:
            log.warning("freed %r held by %s[%s] after %s", key, self.name, task_id, reason)
            signals.mutex_released.send(
                sender=self, task_id=task_id, key=key, held=None, in_time=True, by="parent"
            )
        return freed


def _guarded(fn: Callable[..., Any], bound: bool) -> Callable[..., Any]:
    """The task's ``run``: the user's function inside the lease."""
    if bound:

        def run(self: MutexTask, *args: Any, **kwargs: Any) -> Any:
            return self._mutex_run(lambda: fn(self, *args, **kwargs))

    else:

        def run(self: MutexTask, *args: Any, **kwargs: Any) -> Any:
            return self._mutex_run(lambda: fn(*args, **kwargs))

    signature = user_signature(fn, bound)
    me = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    run.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[me, *signature.parameters.values()]
    )
    for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
        setattr(run, attr, getattr(fn, attr, None))
    return run


def _safe_holder(locks: OwnedLocks, key: str) -> str | None:
    try:
        return locks.holder_label(key)
    except Exception:  # only for logs and the skip marker
        return None


def _lost(task: MutexTask, task_id: str, lease: Lease) -> None:
    log.error(
        "%s[%s]: lease on %r (fence %d) lost while the task ran; interrupting it",
        task.name,
        task_id,
        lease.key,
        lease.fence,
    )
    signals.mutex_lost.send(sender=task, task_id=task_id, key=lease.key, fence=lease.fence)


# -- safety nets -------------------------------------------------------------------------


def _release_leftover(
    sender: Any = None,
    task_id: str | None = None,
    args: Any = None,
    kwargs: Any = None,
    state: str | None = None,
    **_: Any,
) -> None:
    """The run wrapper releases on every exit it sees; this catches what it could not
    (an interrupt landing between before_start and the body, a before_start failure),
    and clears the enqueue marker of a call that ended without a retry."""
    if not isinstance(sender, MutexTask):
        return
    if task_id and state != "RETRY":
        _unmark(sender, task_id, args, kwargs)
    request = sender.request
    lease = getattr(request, "mutex_lease", None)
    if lease is None or getattr(request, "mutex_done", False):
        return
    try:
        sender._mutex_end(lease, None)
    except Exception as exc:
        log.warning("%s[%s]: late release of %r: %r", sender.name, request.id, lease.key, exc)


_PARENT_SIDE = (WorkerLostError, TimeLimitExceeded)


def _release_after_child_died(
    sender: Any = None,
    task_id: str | None = None,
    exception: BaseException | None = None,
    args: Any = None,
    kwargs: Any = None,
    **_: Any,
) -> None:
    """The worker's main process reports a child killed (SIGKILL, OOM) or a hard time
    limit; no task hook ran in the child, so free its lock here, by its task id."""
    if isinstance(sender, MutexTask) and task_id and isinstance(exception, _PARENT_SIDE):
        sender._mutex_release_owner(task_id, args, kwargs, type(exception).__name__)
        _unmark(sender, task_id, args, kwargs)


def _release_after_terminate(
    sender: Any = None, request: Any = None, terminated: bool = False, **_: Any
) -> None:
    """``revoke(terminate=True)`` kills the child running the task: free its lock. Any
    revoke or expiry ends the call: clear its enqueue marker."""
    if not isinstance(sender, MutexTask) or request is None:
        return
    args, kwargs = getattr(request, "args", ()), getattr(request, "kwargs", {})
    if terminated:
        sender._mutex_release_owner(request.id, args, kwargs, "revoke")
    _unmark(sender, request.id, args, kwargs)


def _unmark(task: MutexTask, task_id: str, args: Any, kwargs: Any) -> None:
    try:
        task._mutex_unmark(task_id, args, kwargs)
    except Exception as exc:  # a signal handler: log, never raise into Celery
        log.warning("%s[%s]: could not clear its enqueue marker: %r", task.name, task_id, exc)


task_postrun.connect(_release_leftover, weak=False)
task_failure.connect(_release_after_child_died, weak=False)
task_revoked.connect(_release_after_terminate, weak=False)
