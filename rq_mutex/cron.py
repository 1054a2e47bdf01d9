"""Once per tick for ``rq cron``: several cron processes, each tick enqueued once.

``rq cron`` processes do not coordinate: N of them enqueue N copies of every tick. One
line in the cron config file turns that off::

    from rq_mutex.cron import once_per_tick; once_per_tick()

Enqueue side: before a cron job is enqueued, the process claims its tick: a ``Mutex``
``try_acquire`` on Redis over the scheduler's own connection, under ``rq_mutex:tick:``,
with a lease as long as the claim must live (never released); a process that finds the
claim taken skips that tick and moves on to the next. A cron-string job's tick is its
scheduled time (the same in every process); an interval job has no shared tick (each
process counts from its own start), so it claims a window of ``interval`` seconds (less a
tenth, at most one second, for scheduling jitter) instead.

A claim names the **registration**, not only the cron job's name: RQ lets several
registrations share a name (it defaults to the function's), so the key is
``"<name>~<registration>@<tick>"``, where ``<registration>`` is a digest of the function,
its arguments, the queue and the schedule (the same in every process that loads the same
config), and the claim's holder label spells them out for ``simple-mutex list``.
Arguments are read by their JSON form (``repr`` for other values): a value whose ``repr``
differs between processes (an object's address) would give each process its own claims.

Run side: the enqueued job carries its tick in ``job.meta["rq_mutex_tick"]``. The first
job id to run a tick records it the same way (under ``rq_mutex:tick-ran:``, labelled
with the job id); a ``mutex_job`` drops a second copy of a tick it sees (it finishes
with the skip marker, ``reason="duplicate tick"``). Other job functions can call
``first_run_of_tick()``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any

from redis import Redis
from rq import get_current_job
from rq.cron import CronJob
from rq.job import Job

from simple_mutex import Mutex

from .connection import cache_on

log = logging.getLogger("rq_mutex")

META_TICK = "rq_mutex_tick"
CLAIM_PREFIX = "rq_mutex:tick:"  # + "<name>~<registration>@<tick>": which process enqueued it
RAN_PREFIX = "rq_mutex:tick-ran:"  # + the same: which job id ran it
CLAIM_TTL = 600.0  # s; a cron process lagging further behind than this could enqueue again

_GUARD_FLAG = "_rq_mutex_once_per_tick"


def once_per_tick() -> None:
    """Make every ``rq cron`` tick in this process claim its slot before enqueuing.

    Call it in the cron config file (it patches ``rq.cron.CronJob.enqueue`` in this
    process only; calling it again does nothing)."""
    original = CronJob.enqueue
    if getattr(original, _GUARD_FLAG, False):
        return

    def enqueue(self: CronJob, connection: Redis) -> Job | None:
        slot, tick, lifetime = _tick_of(self)
        claims = Mutex(
            cache_on(connection), lease=lifetime, prefix=CLAIM_PREFIX,
            label=f"rq cron {_described(self)}", name="rq cron",
        )  # fmt: skip
        if claims.try_acquire(slot) is None:
            log.info(
                "rq_mutex: cron tick %s (%s) already enqueued by another process",
                tick,
                _described(self),
            )
            return None  # CronScheduler.enqueue_jobs ignores it and moves to the next tick
        options = self.job_options
        self.job_options = {**options, "meta": {**(options.get("meta") or {}), META_TICK: tick}}
        try:
            return original(self, connection)
        finally:
            self.job_options = options

    setattr(enqueue, _GUARD_FLAG, True)
    CronJob.enqueue = enqueue  # type: ignore[assignment,method-assign]


def _tick_of(cron_job: CronJob) -> tuple[str, str, float]:
    """(claim slot, tick id for the job, claim lifetime in s) of the tick being enqueued."""
    registration = f"{cron_job.name}~{_registration(cron_job)}"
    if cron_job.cron and cron_job.next_enqueue_time is not None:
        tick = f"{registration}@{cron_job.next_enqueue_time.timestamp():.0f}"
        return tick, tick, CLAIM_TTL
    interval_ms = int((cron_job.interval or 1) * 1000)
    window = max(1, interval_ms - min(1000, interval_ms // 10))
    tick = f"{registration}@{time.time():.3f}"  # the window's owner names its run
    return f"{registration}@every-{interval_ms}ms", tick, window / 1000


def _registration(cron_job: CronJob) -> str:
    """A short digest of what makes a registration itself: function, arguments, queue and
    schedule; equal in every process that registers the same job."""
    identity = [
        cron_job.func_name,
        _canonical(list(cron_job.args)),
        _canonical(cron_job.kwargs),
        cron_job.queue_name,
        cron_job.cron,
        cron_job.interval,
    ]
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:12]


def _canonical(value: Any) -> str:
    """Arguments as text that does not depend on the process: JSON with sorted keys (sets
    sorted too), ``repr`` where JSON has no form."""
    try:
        return json.dumps(value, sort_keys=True, default=_json_default, separators=(",", ":"))
    except (TypeError, ValueError):  # e.g. a dict with keys of mixed types
        return repr(value)


def _json_default(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(_canonical(item) for item in value)
    return repr(value)


def _described(cron_job: CronJob) -> str:
    """The registration as an operator reads it: ``module.func('users') on default
    cron '0 3 * * *'``."""
    arguments = [repr(arg) for arg in cron_job.args]
    arguments += [f"{name}={value!r}" for name, value in sorted(cron_job.kwargs.items())]
    schedule = f"cron {cron_job.cron!r}" if cron_job.cron else f"every {cron_job.interval} s"
    return f"{cron_job.func_name}({', '.join(arguments)}) on {cron_job.queue_name} {schedule}"


def first_run_of_tick(job: Job | None = None) -> bool:
    """False if ``job`` (default: the current one) carries a cron tick that another job
    already ran; True otherwise (no tick, or this job id is the first, retries included)."""
    job = job or get_current_job()
    if job is None:
        return True
    meta: dict[str, Any] = job.meta or {}
    tick = meta.get(META_TICK)
    if not isinstance(tick, str):
        return True
    runs = Mutex(
        cache_on(job.connection), lease=CLAIM_TTL, prefix=RAN_PREFIX, label=job.id,
        name="rq cron run",
    )  # fmt: skip
    if runs.try_acquire(tick) is not None:
        return True
    first = runs.holder(tick)  # None: the record lapsed meanwhile, so this is not the first
    return first is not None and first.label == job.id
