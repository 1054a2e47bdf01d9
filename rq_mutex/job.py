"""``mutex_job``: wrap an RQ job function so runs that share a key never overlap.

Lifecycle of one run (the wrapper is the job function RQ imports by name, so it runs
under every worker class and in ``Queue(is_async=False)``)::

    start      key from the bound arguments; a second copy of an ``rq cron`` tick is
               dropped (skip marker, reason "duplicate tick"; see ``rq_mutex.cron``)
               renew=False: job_timeout must be < lease
               acquire (label "rq:<job id>")
               busy: skip    -> return {"rq_mutex": "skipped", "key": ...}
                     retry   -> return rq.Retry(max, interval): same job id, rescheduled
                                (a synchronous queue waits instead: it would store the
                                Retry as the result)
                     wait    -> block until free (bounded by timeout)
                     raise   -> the job fails with SimpleMutexAcquireTimeoutError
    body       runs inside ``with lease:``: a lost lease interrupts it and the job fails
               with SimpleMutexLeaseExpiredError (no SIGALRM: RQ's timeout owns it)
    end        released on return, exception, RQ's JobTimeoutException; a killed work
               horse's lease stops being renewed and lapses within one lease
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import random
import threading
import warnings
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any, TypeVar

from rq import Queue, Retry, get_current_job
from rq.job import Job

from simple_mutex import (
    ConstraintError,
    Lease,
    Mutex,
    Semaphore,
    SimpleMutexAcquireTimeoutError,
    SimpleMutexLeaseExpiredError,
    cache_from_url,
)
from simple_mutex.caches import RedisCache
from simple_mutex.decorator import key_function
from simple_mutex.durations import Duration, positive_seconds, timeout_seconds
from simple_mutex.interrupt import LeaseInterrupt

from .cron import META_TICK, first_run_of_tick
from .options import (
    UNLIMITED_RETRIES,
    RetryPolicy,
    check_bool,
    check_on_busy,
    check_permits,
    retry_policy,
    whole_seconds,
)

log = logging.getLogger("rq_mutex")

F = TypeVar("F", bound=Callable[..., Any])

SKIPPED = "skipped"
SYNC_WORKER = "sync"  # the worker name Queue(is_async=False) gives the job it runs
NO_SCHEDULER_FLAG = "rq_mutex:no-scheduler-warned:"  # + queue name; one warning per 5 min
NO_SCHEDULER_WARN_EVERY = 300

_current: ContextVar[Lease | None] = ContextVar("rq_mutex_lease", default=None)
_rng = random.Random()


def is_skipped(result: object) -> bool:
    """True if ``result`` (``job.return_value()``) is the marker of a run skipped because
    its key was busy (``on_busy="skip"``)."""
    return isinstance(result, Mapping) and result.get("rq_mutex") == SKIPPED


def current_lease() -> Lease | None:
    """The lease of the ``mutex_job`` running now (its ``key``, ``fence``, ``expires_at``),
    or None outside one. Pass ``fence`` to the store you write to."""
    return _current.get()


# -- lock spaces: built lazily, once per process (a work horse is a fresh fork) ----------

_Space = Mutex | Semaphore
_redis_caches: dict[int, tuple[object, RedisCache]] = {}
_state_lock = threading.Lock()
_warned: set[str] = set()


def _after_fork() -> None:
    global _state_lock
    _redis_caches.clear()
    _warned.clear()
    _state_lock = threading.Lock()
    _rng.seed()


os.register_at_fork(after_in_child=_after_fork)


def _redis_cache_for(connection: object) -> RedisCache:
    """One RedisCache per job connection in this process (the default cache)."""
    with _state_lock:
        found = _redis_caches.get(id(connection))
        if found is None or found[0] is not connection:
            if len(_redis_caches) > 16:  # connections of long-gone queues
                _redis_caches.clear()
            found = _redis_caches[id(connection)] = (connection, RedisCache(connection))
        return found[1]


class _Spaces:
    """The Mutex (or Semaphore) of one decorated function, per cache, per process."""

    def __init__(self, cache: object, permits: int, lease: float) -> None:
        self._cache = cache
        self._permits = permits
        self._lease = lease
        self._pid = 0
        self._spaces: dict[int, tuple[object, _Space]] = {}
        self._lock = threading.Lock()

    def for_job(self, job: Job) -> _Space:
        if self._cache is None:
            cache: object = _redis_cache_for(job.connection)
        elif isinstance(self._cache, str):
            cache = self._cache  # a URL: built below, once per process
        else:
            cache = self._cache
        with self._lock:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                self._spaces.clear()
            found = self._spaces.get(id(cache))
            if found is None or found[0] is not cache:
                built = cache_from_url(cache) if isinstance(cache, str) else cache
                space: _Space
                if self._permits == 1:
                    space = Mutex(built, lease=self._lease)
                else:
                    space = Semaphore(built, permits=self._permits, lease=self._lease)
                if len(self._spaces) > 16:
                    self._spaces.clear()
                found = self._spaces[id(cache)] = (cache, space)
            return found[1]


# -- the decorator ---------------------------------------------------------------------


def mutex_job(
    *,
    key: str | Callable[..., str],
    on_busy: str = "retry",
    timeout: Duration | None = None,
    retry: Mapping[str, Any] | None = None,
    lease: Duration = 60.0,
    renew: bool = True,
    permits: int = 1,
    cache: object = None,
) -> Callable[[F], F]:
    """Make a job function take a lease lock on ``key`` for each run.

    ``key``: a template over the function's arguments (``"order.{order_id}"``, bound with
    defaults, so ``f(7)`` and ``f(order_id=7)`` share a lock) or a callable taking the same
    arguments. ``on_busy``: ``"retry"`` (return ``rq.Retry``: the same job runs again
    later; needs a worker started with ``--with-scheduler``), ``"skip"`` (finish with a
    marker that ``is_skipped`` recognizes), ``"wait"`` (block until free), ``"raise"``
    (fail with SimpleMutexAcquireTimeoutError). ``timeout``: how long to wait before
    ``on_busy`` applies (``wait``: None = forever; the others: one try).
    ``retry``: ``{"countdown": 1, "backoff": 2, "jitter": True, "cap": 60, "max": None}``,
    the busy-retry schedule in seconds. ``lease``/``renew``: hold length, renewed while the
    body runs; a killed work horse's lock frees within one lease. ``permits``: N > 1 allows
    N runs per key at once. ``cache``: a simple-mutex cache, a raw client or a URL; by
    default Redis on the job's own connection.

    Bad options and key templates raise ConstraintError here, when decorating.
    """
    where = "mutex_job"
    policy_on_busy = check_on_busy(where, on_busy)
    wait = timeout_seconds(timeout)
    policy = retry_policy(where, retry)
    lease_s = positive_seconds(lease, "lease")
    check_bool(where, "renew", renew)
    check_permits(where, permits)
    if isinstance(cache, str) and "://" not in cache:
        raise ConstraintError(f"{where}: cache must be a cache, a client or a URL, got {cache!r}")

    def decorate(fn: F) -> F:
        if not callable(fn) or inspect.isclass(fn):
            raise ConstraintError(f"mutex_job wraps a job function, got {fn!r}")
        if (
            inspect.iscoroutinefunction(fn)
            or inspect.isgeneratorfunction(fn)
            or inspect.isasyncgenfunction(fn)
        ):
            raise ConstraintError(
                f"mutex_job does not support {fn.__qualname__}: async and generator job "
                "functions are not handled yet; use a plain function"
            )
        key_of = key_function(fn, key)
        spaces = _Spaces(cache, permits, lease_s)
        run = _Run(
            fn=fn,
            key_of=key_of,
            spaces=spaces,
            on_busy=policy_on_busy,
            wait=wait,
            policy=policy,
            lease=lease_s,
            renew=renew,
        )

        @functools.wraps(fn)
        def mutex_job_wrapper(*args: Any, **kwargs: Any) -> Any:
            job = get_current_job()
            if job is None:  # called directly, not as an RQ job: a plain call
                return fn(*args, **kwargs)
            return run(job, args, kwargs)

        return mutex_job_wrapper  # type: ignore[return-value]

    return decorate


class _Run:
    """What one decorated function does on each run."""

    def __init__(
        self,
        *,
        fn: Callable[..., Any],
        key_of: Callable[..., str],
        spaces: _Spaces,
        on_busy: str,
        wait: float | None,
        policy: RetryPolicy,
        lease: float,
        renew: bool,
    ) -> None:
        self.fn = fn
        self.key_of = key_of
        self.spaces = spaces
        self.on_busy = on_busy
        self.wait = wait
        self.policy = policy
        self.lease = lease
        self.renew = renew

    def __call__(self, job: Job, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        key = self.key_of(*args, **kwargs)
        if job.meta and META_TICK in job.meta and not first_run_of_tick(job):
            log.info("job %s skipped: its cron tick already ran", job.id)
            return {"rq_mutex": SKIPPED, "key": key, "reason": "duplicate tick"}
        sync = job.worker_name == SYNC_WORKER
        if not self.renew:
            self._check_timeout(job, key)
        space = self.spaces.for_job(job)
        try:
            held = space.acquire(
                key, timeout=self._wait_for(sync), renew=self.renew, label=f"rq:{job.id}"
            )
        except SimpleMutexAcquireTimeoutError as busy:
            return self._busy(job, key, sync, busy)
        token = _current.set(held)
        try:
            with held:
                return self.fn(*args, **kwargs)
        except LeaseInterrupt as lost:
            # The per-lease interrupt class: report it as the public error.
            raise SimpleMutexLeaseExpiredError(lost.message, key=key) from lost
        finally:
            _current.reset(token)

    def _wait_for(self, sync: bool) -> float | None:
        if self.on_busy == "wait":
            return self.wait
        if self.on_busy == "retry" and sync:
            # A synchronous queue stores a returned Retry as the job's result and never
            # runs it again: wait instead, bounded (by default one lease: the holder
            # either finishes or renews, and a nested same-key call must not hang).
            return self.lease if self.wait is None else self.wait
        return 0.0 if self.wait is None else self.wait

    def _busy(self, job: Job, key: str, sync: bool, busy: SimpleMutexAcquireTimeoutError) -> Any:
        if self.on_busy == "skip":
            log.info("job %s skipped: %r is busy", job.id, key)
            return {"rq_mutex": SKIPPED, "key": key}
        if self.on_busy != "retry" or sync:
            raise busy
        count = job.number_of_retries or 0
        limit = self.policy.max
        if limit is not None and count >= limit:
            raise SimpleMutexAcquireTimeoutError(
                f"job {job.id}: {key!r} was still busy after {count} busy retries "
                f"(retry max={limit})",
                key=key,
            ) from busy
        interval = whole_seconds(self.policy, count, _rng.random())
        _warn_if_no_scheduler(job)
        log.info("job %s: %r is busy, retrying in %d s", job.id, key, interval)
        return Retry(max=UNLIMITED_RETRIES if limit is None else limit, interval=interval)

    def _check_timeout(self, job: Job, key: str) -> None:
        """With a fixed lease, RQ's own timeout must end the job before the lease can."""
        limit = job.timeout if job.timeout is not None else Queue.DEFAULT_TIMEOUT
        if limit == -1 or float(limit) >= self.lease:
            shown = "infinite (-1)" if limit == -1 else f"{limit} s"
            raise ConstraintError(
                f"job {job.id}: job_timeout {shown} is not shorter than the lease "
                f"({self.lease:g} s) of {key!r} with renew=False, so the lease could lapse "
                "while the job runs. Enqueue with a shorter job_timeout, raise lease, or "
                "use renew=True",
                key=key,
            )


def _warn_if_no_scheduler(job: Job) -> None:
    """A returned Retry waits in the ScheduledJobRegistry for a scheduler: without one on
    the queue the job would wait forever. Say so loudly, once per queue (per process, and
    at most every few minutes across processes: each work horse is a new process)."""
    queue_name = job.origin
    if queue_name in _warned:
        return
    _warned.add(queue_name)
    connection = job.connection
    if Queue(queue_name, connection=connection).scheduler_pid is not None:
        return
    if not connection.set(NO_SCHEDULER_FLAG + queue_name, 1, nx=True, ex=NO_SCHEDULER_WARN_EVERY):
        return
    message = (
        f"rq_mutex: job {job.id} on queue {queue_name!r} was busy and returned rq.Retry, "
        "but no worker on that queue runs the scheduler: the job stays SCHEDULED until "
        "one does. Start a worker with `rq worker --with-scheduler` (a burst worker's "
        "scheduler makes one pass, when it starts)"
    )
    log.error(message)
    warnings.warn(message, RuntimeWarning, stacklevel=2)
