"""``on_busy="replace"`` for RQ: the round and the holder's side are
``simple_mutex.busy.replace``; here, how a job is named and how its worker is told.

    new job (a work horse)            the holder's worker (rq_mutex.Worker)
    one try: busy; the holder's
    label "rq:<old job id>"
    frees every record of that
      job id's attempts (compare-
      and-delete, on the version
      read)
    Job.fetch(old).worker_name,
    RQ's pubsub command
    "rq-mutex-stop" to it         ->  its pubsub thread: the job it runs is that one:
    takes the key (fence > f),        STOP_SIGNAL (SIGUSR2) to its work horse, which
    runs                              renews now, finds its record gone, and the loss
                                      interrupt fails the job: FAILED with
                                      SimpleMutexLeaseExpiredError

Why not RQ's ``send_stop_job_command``: it SIGKILLs the horse, so the job's ``finally:``
blocks never run, and it ends STOPPED, which reads like an operator's choice. The stop
here only hastens a renewal, so the ending is the lease's: the body unwinds and the job
fails with the same error as any lost lease.

Only ``rq_mutex.Worker`` (``rq worker -w rq_mutex.Worker``) answers the command and gives
its horses a handler for the signal; a holder on another worker class is stopped by its
own next renewal, a third of a lease later at most, its writes refused by a fenced store
meanwhile. ``async def`` jobs are refused (their lease renews on their loop, not from the
watch thread).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError
from rq.command import send_command
from rq.exceptions import NoSuchJobError
from rq.job import Job

from simple_mutex import Holder, Lease, Mutex, Semaphore, SimpleMutexError
from simple_mutex.busy.replace import (
    STOP_SIGNAL,
    Marks,
    NewerCall,
    Takeover,
    answer_stop_signal,
    check_now,
    ignore_stop_signal,
    watch,
)
from simple_mutex.busy.replace import take as take_over

from .horses import attempts_of

log = logging.getLogger("rq_mutex")

COMMAND = "rq-mutex-stop"  # RQ's pubsub command a replacing job sends the holder's worker
LABEL = "rq:"  # + job id: the label of every lock a mutex_job run takes
MARKS = "taken."  # + the lock prefix: the jobs a newer one replaced (Marks), as Celery's
__all__ = [
    "COMMAND",
    "NewerCall",
    "answer_stop_signal",
    "ignore_stop_signal",
    "stop_here",
    "take",
    "watch",
]


def take(job: Job, space: Mutex | Semaphore, key: str, take_once: Callable[[], Lease]) -> Lease:
    """The key's lease for this run of ``job``, taken from its holder if need be. Raises
    ``NewerCall`` when a job created after this one holds the key or took it from an
    earlier attempt of this one: the newest job wins, and this is not it."""
    marks = Marks(space.cache, MARKS + space.prefix)
    marks.check(_mark_of(job))  # a retry (or requeue) of a job a newer one replaced
    victims: dict[str, Job] = {}  # the holders read this round, by job id

    def holder() -> Holder | None:
        try:
            return space.holder(key)
        except SimpleMutexError:  # unreadable: the round tries again
            return None

    def victim_of(held: Holder) -> str | None:
        label = held.label or ""
        victim = label[len(LABEL) :] if label.startswith(LABEL) else ""
        # Not a job's record, or an attempt of this very job id (a dead one is freed by
        # take_once, rq_mutex.horses): nothing here can stop it.
        if not victim or victim == job.id:
            return None
        try:
            other = victims[victim] = Job.fetch(victim, connection=job.connection)
        except NoSuchJobError:
            return victim  # deleted: still its record to free (its run may go on)
        if other.created_at and job.created_at and other.created_at > job.created_at:
            raise NewerCall(label)  # an older job arriving late (a retry, enqueue_in)
        return victim

    def free(victim: str) -> bool:
        freed = space.evict(key, attempts_of(victim), by=LABEL + job.id)
        if freed and victim in victims:  # its later attempts (Retry, requeue) give way
            marks.mark(_mark_of(victims[victim]), LABEL + job.id)
        return freed

    return take_over(
        Takeover(
            key=key,
            call=f"job {job.id}",
            take_once=take_once,
            holder=holder,
            victim_of=victim_of,
            free=free,
            stop=lambda victim: stop(job.connection, victim),
            log=log,
        )
    )


def _mark_of(job: Job) -> str:
    """What names ``job`` in the marks: its id and creation time, so a new job that
    reuses the id (``job_id=`` to de-duplicate) is not taken for it."""
    created = job.created_at.timestamp() if job.created_at else ""
    return f"{job.id}:{created}"


def stop(connection: Any, job_id: str) -> None:
    """Ask the worker running ``job_id`` to stop it (no reply: the key is ours already)."""
    try:
        worker = Job.fetch(job_id, connection=connection).worker_name
        if worker:
            send_command(connection, worker, COMMAND, job_id=job_id)
    except NoSuchJobError:
        return  # deleted: its run, if any, finds its lease gone at its next renewal
    except RedisError as exc:  # the lease passes on all the same; the renewal ends it
        log.warning("could not ask the worker of job %s to stop it: %r", job_id, exc)


def stop_here(worker: Any, job_id: object) -> None:
    """The worker's side of COMMAND (its pubsub thread): signal the horse running
    ``job_id``; a body run in this very process is nudged directly."""
    if not isinstance(job_id, str) or worker.get_current_job_id() != job_id:
        log.debug("%s: not running job %r; the stop is ignored", worker.name, job_id)
        return
    pid = getattr(worker, "horse_pid", 0)
    if pid and pid != os.getpid():
        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            # The horse alone, not its process group: a job's own subprocesses would die
            # of the signal's default action.
            os.kill(pid, STOP_SIGNAL)
    else:
        check_now()
