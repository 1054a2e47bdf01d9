"""``mutex_job``: wrap an RQ job function so runs that share a key never overlap.

Lifecycle of one run (the wrapper is the job function RQ imports by name, so it runs
under every worker class and in ``Queue(is_async=False)``)::

    enqueue    through ``rq_mutex.Queue``: renew=False's job_timeout must be < lease, or
               ConstraintError right there; a line job takes its ticket (``rq_mutex.queue``)
    start      key from the bound arguments; a second copy of an ``rq cron`` tick is
               dropped (skip marker, reason "duplicate tick"; see ``rq_mutex.cron``)
               A skipped run is flagged in ``job.meta`` (saved), for dashboards:
               ``rq_mutex_skipped`` True, ``rq_mutex_skip_reason`` ("busy" |
               "duplicate tick"), ``rq_mutex_holder`` (the holder's label, when known)
               renew=False: job_timeout < lease again (a plain rq.Queue checks nothing)
               acquire (label "rq:<job id>")
               busy: skip    -> return {"rq_mutex": "skipped", "key": ...}
                     retry   -> return rq.Retry(max, interval): same job id, rescheduled
                                (a synchronous queue waits instead: simple_mutex.busy)
                     wait    -> block until free (bounded by timeout)
                     raise   -> the job fails with SimpleMutexAcquireTimeoutError
               queue: the key's line decides first (``rq_mutex.line``): its turn ->
                      acquire and run; else parked (returns rq.Retry, off the queue)
    body       runs inside ``with lease:``: a lost lease interrupts it and the job fails
               with SimpleMutexLeaseExpiredError (no SIGALRM: RQ's timeout owns it)
    end        released on return, exception, RQ's JobTimeoutException; a killed work
               horse's lease stops being renewed and lapses within one lease, and the
               next run of the same job id frees it at once when the worker recorded
               that horse's death (``rq_mutex.horses``; token "rq.<job>.<attempt>.<random>")
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import os
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from rq import Queue, Retry, get_current_job
from rq.job import Job

from simple_mutex import (
    ConstraintTypeError,
    ConstraintValueError,
    Lease,
    MalfunctionError,
    Mutex,
    Semaphore,
    SimpleMutexAcquireTimeoutError,
)
from simple_mutex.busy import (
    BusyPolicy,
    Duration,
    PerProcess,
    RunAgain,
    Skip,
    running,
    shared_cache,
    skip_marker,
    unreachable,
)
from simple_mutex.busy.line import Lines
from simple_mutex.caches.url import backend_of
from simple_mutex.contract import is_async
from simple_mutex.decorator import key_function
from simple_mutex.errors import shown

from . import line, replace
from .connection import cache_on
from .cron import META_TICK, first_run_of_tick
from .horses import LINE_KEEPER_ENV, free_ended_attempts, token_for

log = logging.getLogger("rq_mutex")

F = TypeVar("F", bound=Callable[..., Any])

SYNC_WORKER = "sync"  # the worker name Queue(is_async=False) gives the job it runs
NO_SCHEDULER_FLAG = "rq_mutex:no-scheduler-warned:"  # + queue name; one warning per 5 min
NO_SCHEDULER_WARN_EVERY = 300  # seconds between two of the same warning (either kind)
NO_LINE_KEEPER_FLAG = "rq_mutex:no-line-keeper-warned:"  # + worker name; as often
UNLIMITED_RETRIES = 2**31 - 1  # rq.Retry needs a number; None means "until it is free"


def mutex_job(
    forgot_the_parentheses: object = None,
    /,
    *,
    key: str | Callable[..., str] | None = None,
    on_busy: str = "retry",
    timeout: Duration | None = None,
    retry: Mapping[str, Any] | None = None,
    lease: Duration = 60.0,
    renew: bool = True,
    permits: int = 1,
    queue: Mapping[str, Any] | None = None,
    debounce: Mapping[str, Any] | None = None,
    cache: object = None,
) -> Callable[[F], F]:
    """Make a job function take a lease lock on ``key`` for each run.

    ``key``: a template over the function's arguments (``"order.{order_id}"``, bound with
    defaults, so ``f(7)`` and ``f(order_id=7)`` share a lock) or a callable taking them.
    The other options mean what they mean for Celery's ``MutexTask`` (README, "Celery"):
    ``on_busy`` skip / retry (returns ``rq.Retry``: start workers ``--with-scheduler``) /
    wait / raise / queue (runs in enqueue order per key, parked off the queue while it
    waits: ``rq_mutex.line``) / latest (one running and one waiting per key, the newest
    job taking the waiting one's place) / debounce (``debounce={"period", "max_delay"}``:
    one run after the enqueues stopped), ``timeout``, ``retry={"countdown", "backoff", "jitter",
    "cap", "max"}``, ``queue={"max", "on_full", "park_for", "gap_for", "sweep_every"}``,
    ``lease`` and ``renew``, ``permits``. ``cache``: a cache, a raw client or a URL; by
    default Redis on the job's own connection. Bad options raise ConstraintError here.
    """
    if forgot_the_parentheses is not None or key is None:
        raise ConstraintTypeError(
            "mutex_job takes its options by name and needs a key: write "
            '@mutex_job(key="order.{order_id}") (with the parentheses), not @mutex_job'
        )
    options = {"on_busy": on_busy, "timeout": timeout, "retry": retry, "lease": lease}
    if queue is not None:
        options["queue"] = queue
    if debounce is not None:
        options["debounce"] = debounce
    policy = BusyPolicy.from_options("mutex_job", {**options, "renew": renew, "permits": permits})
    if isinstance(cache, str):
        backend_of(cache)  # a URL is checked here, as Celery checks it: built at first use

    def decorate(fn: F) -> F:
        if not callable(fn) or inspect.isclass(fn):
            raise ConstraintTypeError(f"mutex_job wraps a job function, got {fn!r}")
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            raise ConstraintTypeError(
                f"mutex_job cannot guard the generator function {fn.__qualname__}: its body "
                "runs after the job returns; return a list, or lock inside the generator"
            )
        if (policy.in_line or policy.on_busy == "replace") and inspect.iscoroutinefunction(fn):
            raise ConstraintValueError(
                f"mutex_job: on_busy={policy.on_busy!r} is not available for the async job "
                f"function {fn.__qualname__} yet; make it a plain def, or use on_busy='wait'"
            )
        run = _Run(fn, key_function(fn, key), policy, cache)
        wrapper: Callable[..., Any]
        if inspect.iscoroutinefunction(fn):  # RQ >= 2.? runs what it returns, asyncio.run

            async def wrapper(*args: Any, **kwargs: Any) -> Any:
                job = get_current_job()
                if job is None:  # called directly, not as an RQ job: a plain call
                    return await fn(*args, **kwargs)
                return await run.run_async(job, args, kwargs)

        else:

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                job = get_current_job()
                if job is None:  # called directly, not as an RQ job: a plain call
                    return fn(*args, **kwargs)
                return run(job, args, kwargs)

        wrapper = functools.wraps(fn)(wrapper)
        setattr(wrapper, RUN_ATTRIBUTE, run)  # for the check at enqueue
        return wrapper  # type: ignore[return-value]

    return decorate


class _Run:
    """What one decorated function does on each run."""

    def __init__(
        self, fn: Callable[..., Any], key_of: Callable[..., str], policy: BusyPolicy, cache: object
    ) -> None:
        self.fn = fn
        self.key_of = key_of
        self.policy = policy
        self.cache = cache
        # Its Mutex (or Semaphore) per cache, in this process.
        name = f"{fn.__module__}.{fn.__qualname__}"  # RQ's own name for the job function
        self.name = name
        self.spaces: PerProcess[Mutex | Semaphore] = PerProcess(
            functools.partial(policy.lock_space, name=name), limit=16
        )
        # The lines of on_busy="queue" (rq_mutex.line), beside the locks, per cache.
        self.lines_by: PerProcess[Lines] = PerProcess(
            functools.partial(Lines, lease=policy.lease, park_for=policy.queue.park_for),
            limit=16,
        )

    def __call__(self, job: Job, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        key, skipped = self._before(job, args, kwargs)
        if skipped is not None:
            return skipped
        if self.policy.in_line and job.worker_name != SYNC_WORKER:
            _warn_if_no_line_keeper(job, key)
            return self._in_line(job, key, args, kwargs)
        try:
            held = self._take(job, key)
        except replace.NewerCall as newer:  # on_busy="replace": the newest job wins
            log.info("job %s superseded: %s", job.id, newer)
            flag_skipped(job, "superseded", newer.label)
            return skip_marker("rq_mutex", key, reason="superseded")
        except SimpleMutexAcquireTimeoutError as busy:
            return self._busy(job, key, busy)
        try:  # nothing runs between the grant and this try (a job timeout's alarm)
            if job.worker_name != SYNC_WORKER:  # a newer on_busy="replace" job may take
                replace.watch(held)  # the key and have this one stopped
            with running(held), held:
                return self.fn(*args, **kwargs)
        except BaseException:
            held.let_go_at_the_door()  # an interrupt before the block was entered
            raise

    def _in_line(self, job: Job, key: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``on_busy`` queue, latest or debounce: the body runs in the job's turn, else the
        job parks (or finishes, superseded by a newer one)."""
        lines, queue = self.lines(job.connection), self.policy.queue
        if job.number_of_retries or job.retries_left is not None:
            # Run before (parked, or RQ's retry after its horse died: that one counts in
            # retries_left only): a dead attempt's record is freed at once.
            free_ended_attempts(job, self._space(job), key)
        got = line.arrive(
            job, key, lines, self.policy, self.name, lambda: self._acquire(job, key),
            lambda job, reason: flag_skipped(job, reason, None),
        )  # fmt: skip
        if isinstance(got, line.Finish):
            return got.value
        held, then = got.lease, _nothing
        try:  # nothing runs between the grant and this try (a job timeout's alarm)
            with running(held), held:
                try:
                    value = line.own_retry(job, self.fn(*args, **kwargs))
                except BaseException as exc:
                    then = line.ending(job, key, got, lines, queue, self.name, failed=exc)
                    raise
                then = line.ending(job, key, got, lines, queue, self.name, returned=value)
                return value
        except BaseException:
            held.let_go_at_the_door()  # an interrupt before the block was entered
            raise
        finally:
            then()  # after the release: the next in the line is enqueued

    async def run_async(self, job: Job, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """An ``async def`` job: waiting, renewal and release never block the loop, and a
        lost lease cancels the body."""
        key, skipped = self._before(job, args, kwargs)
        if skipped is not None:
            return skipped
        try:
            held = await self._acquire_async(job, key)
        except SimpleMutexAcquireTimeoutError as busy:
            return self._busy(job, key, busy)
        with running(held):
            async with held:
                return await self.fn(*args, **kwargs)

    def _take(self, job: Job, key: str) -> Lease:
        """Acquire, or (``on_busy="replace"``, a worker's run) take the key from its
        holder and have that one stopped (``rq_mutex.replace``)."""
        if self.policy.on_busy == "replace" and job.worker_name != SYNC_WORKER:
            return replace.take(job, self._space(job), key, lambda: self._acquire(job, key))
        return self._acquire(job, key)

    def _acquire(self, job: Job, key: str) -> Lease:
        """Acquire as the policy says; a record of an earlier attempt of this job whose
        horse died (``horses``) is freed first, so the run is not busy with itself. Only
        a busy try pays for that check, or a wait, which would sit out that lease."""
        space, acquiring = self._space(job), self._acquiring(job)
        waits = acquiring["timeout"] != 0
        if waits:
            free_ended_attempts(job, space, key)
        try:
            return space.acquire(key, **acquiring)
        except SimpleMutexAcquireTimeoutError:
            if waits or not free_ended_attempts(job, space, key):
                raise
        return space.acquire(key, **acquiring)

    async def _acquire_async(self, job: Job, key: str) -> Lease:
        """``_acquire`` for an ``async def`` job (the check runs in a thread)."""
        space, acquiring = self._space(job), self._acquiring(job)
        waits = acquiring["timeout"] != 0
        if waits:
            await asyncio.to_thread(free_ended_attempts, job, space, key)
        try:
            return await space.acquire_async(key, **acquiring)
        except SimpleMutexAcquireTimeoutError:
            if waits or not await asyncio.to_thread(free_ended_attempts, job, space, key):
                raise
        return await space.acquire_async(key, **acquiring)

    def _before(
        self, job: Job, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[str, dict[str, Any] | None]:
        """The run's key, and the skip marker of a tick that already ran (else None)."""
        key = self.key_of(*args, **kwargs)
        if job.meta and META_TICK in job.meta and not first_run_of_tick(job):
            log.info("job %s skipped: its cron tick already ran", job.id)
            flag_skipped(job, "duplicate tick", None)
            return key, skip_marker("rq_mutex", key, reason="duplicate tick")
        if not self.policy.renew:
            self.check_timeout(job, key)
        return key, None

    def cache_for(self, connection: Any) -> Any:
        """The lock cache: the job's own Redis connection unless ``cache=`` named one."""
        return cache_on(connection) if self.cache is None else shared_cache(self.cache)

    def _space(self, job: Job) -> Mutex | Semaphore:
        return self.spaces.get(self.cache_for(job.connection))

    def lines(self, connection: Any) -> Lines:
        return self.lines_by.get(self.cache_for(connection))

    def _acquiring(self, job: Job) -> dict[str, Any]:
        synchronous = job.worker_name == SYNC_WORKER
        return {
            "timeout": self.policy.wait_for(synchronous),
            "renew": self.policy.renew,
            "label": f"rq:{job.id}",
            "token": token_for(job),  # names this attempt: see rq_mutex.horses
        }

    def _busy(self, job: Job, key: str, busy: SimpleMutexAcquireTimeoutError) -> Any:
        count = job.number_of_retries or 0
        synchronous = job.worker_name == SYNC_WORKER
        match self.policy.after_busy(busy, synchronous=synchronous, busy_retries=count):
            case Skip():
                return self._skip(job, key)
            case RunAgain(delay=delay):
                interval = max(1, math.ceil(delay))  # RQ schedules by the second (int)
                _warn_if_no_scheduler(job)
                log.info("job %s: %r is busy, retrying in %d s", job.id, key, interval)
                limit = self.policy.retry.max
                return Retry(max=UNLIMITED_RETRIES if limit is None else limit, interval=interval)
            case _ as unknown:
                return unreachable(unknown)

    def _skip(self, job: Job, key: str) -> Any:
        """The skip marker of a busy run, with who held the key in the job's meta."""
        holder = self._holder_label(job, key)
        if holder == f"rq:{job.id}":  # an attempt of this very job: is it alive?
            log.warning(
                "job %s skipped: %r is held by another attempt of this job id, which "
                "is still running or whose work horse died unrecorded (start workers "
                "with `rq worker -w rq_mutex.Worker`; see rq_mutex.horses)",
                job.id,
                key,
            )
        else:
            log.info("job %s skipped: %r is busy (held by %s)", job.id, key, holder)
        flag_skipped(job, "busy", holder)
        return skip_marker("rq_mutex", key)

    def _holder_label(self, job: Job, key: str) -> str | None:
        """Who was in the way, for the job's meta: best effort, never failing the skip."""
        try:
            space = self._space(job)
            holder = None if is_async(space.cache) else space.holder(key)
        except MalfunctionError as fault:
            log.warning("job %s: could not read who holds %r: %s", job.id, key, fault)
            return None
        return None if holder is None else holder.label

    def check_timeout(self, job: Job, key: str | None) -> None:
        """With a fixed lease, RQ's own timeout must end the job before the lease can:
        a job_timeout not below the lease fails every run of a job that outlives it."""
        limit = job.timeout if job.timeout is not None else Queue.DEFAULT_TIMEOUT
        lease = self.policy.lease
        if limit == -1 or float(limit) >= lease:
            shown = "infinite (-1)" if limit == -1 else f"{limit} s"
            of = "" if key is None else f" of {key!r}"
            raise ConstraintValueError(
                f"job {job.id} ({self.fn.__qualname__}): job_timeout {shown} is not shorter "
                f"than the lease ({lease:g} s){of} with renew=False, so the lease could "
                "lapse while the job runs. Enqueue with a shorter job_timeout, raise lease, "
                "or use renew=True",
                key=key,
            )


META_SKIPPED = "rq_mutex_skipped"
META_SKIP_REASON = "rq_mutex_skip_reason"
META_HOLDER = "rq_mutex_holder"


def _nothing() -> None:
    pass


def flag_skipped(job: Job, reason: str, holder: str | None) -> None:
    """Mark a skipped run in ``job.meta`` where dashboards and ``Job.fetch`` see it: the
    job itself ends FINISHED, like any run that returned."""
    job.meta.update({META_SKIPPED: True, META_SKIP_REASON: reason, META_HOLDER: holder})
    job.save_meta()  # type: ignore[no-untyped-call]


def _warn_if_no_scheduler(job: Job) -> None:
    """A returned Retry waits in the ScheduledJobRegistry for a scheduler: without one on
    the queue the job would wait forever. Say so loudly, at most every few minutes per
    queue across processes (each work horse is a new process)."""
    connection = job.connection
    if Queue(job.origin, connection=connection).scheduler_pid is not None:
        return
    _warn_now_and_then(
        job,
        NO_SCHEDULER_FLAG + job.origin,
        f"rq_mutex: job {job.id} on queue {job.origin!r} was busy and returned rq.Retry, "
        "but no worker on that queue runs the scheduler: the job stays SCHEDULED until "
        "one does. Start a worker with `rq worker --with-scheduler` (a burst worker's "
        "scheduler makes one pass, when it starts)",
    )


def _warn_if_no_line_keeper(job: Job, key: str) -> None:
    """A line's turn passes on when its holder ends; a horse that dies (the OOM killer, a
    stop command) ends nothing, and only an ``rq_mutex.Worker`` notices and sweeps. On
    any other worker say so, at most every few minutes per worker across its horses."""
    if os.environ.get(LINE_KEEPER_ENV) == "1":
        return
    _warn_now_and_then(
        job,
        NO_LINE_KEEPER_FLAG + (job.worker_name or "?"),
        f"rq_mutex: job {job.id} (on_busy in a line, key {shown(key)}) runs on worker "
        f"{job.worker_name!r}, which is not an rq_mutex.Worker: if one of its work horses "
        "dies mid-job, the key's line waits until an rq_mutex.Worker sweeps it, and with "
        "none, for good. Start workers with `rq worker -w rq_mutex.Worker` (or subclass it)",
    )


def _warn_now_and_then(job: Job, flag: str, message: str) -> None:
    """Log ``message`` and warn with it, unless it was said under ``flag`` in the last few
    minutes, by any process (each work horse is a new one)."""
    if job.connection.set(flag, 1, nx=True, ex=NO_SCHEDULER_WARN_EVERY):
        log.error(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


RUN_ATTRIBUTE = "_rq_mutex_run"  # on a mutex_job wrapper: its _Run


def decorated_run(job: Job) -> _Run | None:
    """The ``_Run`` of the mutex_job function ``job`` calls, if its module is loaded
    (never imported here: a producer need not be able to import every job function)."""
    module_name, _, name = (job.func_name or "").rpartition(".")
    target: Any = sys.modules.get(module_name)
    for part in name.split("."):
        target = getattr(target, part, None)
    run = getattr(target, RUN_ATTRIBUTE, None)
    return run if isinstance(run, _Run) else None
