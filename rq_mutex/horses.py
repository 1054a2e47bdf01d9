"""Work horses that died holding a lock: the worker records which ones it reaped, and a
later run of the same job id frees what they held.

A horse SIGKILLed by the OOM killer, by ``send_stop_job_command`` or by a cold shutdown
runs no ``finally``: its lock stays held until the lease lapses, and RQ re-runs the same
job id before that (``Retry``, the abandoned-job cleanup, a requeue), which then found the
key busy with its own dead attempt and was skipped. The worker's main process knows the
horse is gone once ``os.wait4`` returns it (``Worker.wait_for_horse``, which every path
that ends a horse goes through: the monitor loop, the job-timeout kill, the stop command,
the cold shutdown); RQ writes nothing that proves it (an abandoned job's records look the
same whether its horse is dead or orphaned and still running), so this module does::

    worker, fork_work_horse     a fresh attempt id per horse, handed to it in the
                                environment as "<worker pid>.<attempt>"
    horse, acquire              token "rq.<job>.<attempt>.<random>"
    worker, wait_for_horse      it returned this horse, not exited 0: HSET
                                rq_mutex:ended:<job id> <attempt> (a day), before RQ
                                re-enqueues the job
    next run of the job, busy   frees (compare-and-delete) the key's records whose
                                attempt is in that hash, then acquires as usual (a
                                fresh fence)

Only a reaped attempt is ever freed (lifecycle rule 12): a live one, an orphan whose
worker was SIGKILLed, or a live attempt of the same job id enqueued twice by mistake is
not in the hash, so it keeps the lock. A horse whose worker is not an
``rq_mutex.Worker`` (``rq worker -w rq_mutex.Worker``; a class of your own can subclass
it), a ``SimpleWorker``, a ``SpawnWorker`` and a synchronous queue get an attempt no one
ever records; their dead runs' locks lapse with their lease, as before.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rq.job import Job
from rq.worker import Worker as RQWorker

from simple_mutex import Mutex, Semaphore
from simple_mutex.contract import is_async

log = logging.getLogger("rq_mutex")

ATTEMPT_ENV = "RQ_MUTEX_ATTEMPT"  # "<worker pid>.<attempt>", for the horse being started
LINE_KEEPER_ENV = "RQ_MUTEX_LINE_KEEPER"  # "1" in an rq_mutex.Worker and its horses
ENDED = "rq_mutex:ended:"  # + job id: hash of attempt -> when its horse was reaped
ENDED_TTL = 24 * 3600  # far beyond any retry of a dead attempt's still-valid record


@dataclass(frozen=True)
class _Horse:
    job_id: str
    pid: int
    attempt: str


def _owner(job_id: str) -> str:
    # Job ids may hold any character; a token only plain ones (and never needs the id back).
    return hashlib.sha256(job_id.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def _my_attempt() -> str:
    """The attempt id the worker gave this horse; a random one anywhere else (it is then
    never recorded as ended). The worker's pid in the value keeps a process the horse
    starts from taking it for its own."""
    worker_pid, _, attempt = os.environ.get(ATTEMPT_ENV, "").partition(".")
    if attempt and worker_pid == str(os.getppid()):
        return attempt
    return secrets.token_hex(8)


def token_for(job: Job) -> str:
    """The owner token of a lock this run of ``job`` takes."""
    return f"rq.{_owner(job.id)}.{_my_attempt()}.{secrets.token_hex(16)}"


def attempts_of(job_id: str) -> Callable[[str], bool]:
    """Whether a lock token is one an attempt of ``job_id`` took (``token_for``)."""
    prefix = f"rq.{_owner(job_id)}."
    return lambda token: token.startswith(prefix)


def free_ended_attempts(job: Job, space: Mutex | Semaphore, key: str) -> bool:
    """Free the records of ``key`` that earlier attempts of ``job`` hold whose horses
    their worker reaped; True if any was freed. One read when none ever died."""
    if is_async(space.cache):
        return False  # release_where is blocking-only; such a record lapses with its lease
    raw = job.connection.hkeys(ENDED + job.id)
    if not raw:
        return False
    ended = {a.decode() if isinstance(a, bytes) else str(a) for a in raw}
    owner = _owner(job.id)

    def reaped(token: str) -> bool:
        parts = token.split(".")
        return len(parts) == 4 and parts[:2] == ["rq", owner] and parts[2] in ended

    freed = space.release_where(key, reaped)
    if freed:
        log.info("job %s: freed %r, held by an earlier attempt whose horse died", job.id, key)
    return freed


# -- the worker's main process (``rq_mutex.Worker``) ---------------------------------------


class RecordsReapedHorses(RQWorker):
    """RQ's forking worker that hands each horse an attempt id and records the horses it
    reaps that did not exit 0 (``rq_mutex.Worker`` is one). A worker class that overrides
    ``fork_work_horse`` or ``wait_for_horse`` keeps this when it calls ``super()``."""

    _rq_mutex_horse: _Horse | None = None  # the horse this worker started, while it runs

    def fork_work_horse(self, job: Job, queue: Any) -> None:
        attempt = secrets.token_hex(8)
        os.environ[ATTEMPT_ENV] = f"{os.getpid()}.{attempt}"
        try:
            super().fork_work_horse(job, queue)
        finally:
            os.environ.pop(ATTEMPT_ENV, None)  # a forked horse never returns here
        self._rq_mutex_horse = _Horse(job.id, self.horse_pid, attempt)

    def wait_for_horse(self) -> tuple[int | None, int | None, Any]:
        pid, status, rusage = super().wait_for_horse()
        horse = self._rq_mutex_horse
        if horse is not None and pid == horse.pid:
            self._rq_mutex_horse = None
            if status != 0:  # exit 0: the job ran to its end and released what it held
                _record_ended(self, horse)
        return pid, status, rusage


def _record_ended(worker: RQWorker, horse: _Horse) -> None:
    try:
        with worker.connection.pipeline(transaction=False) as pipe:
            pipe.hset(ENDED + horse.job_id, horse.attempt, worker.name)
            pipe.expire(ENDED + horse.job_id, ENDED_TTL)
            pipe.execute()
    except Exception as fault:  # inside RQ's own handling of the death: never raise there
        log.warning(
            "job %s: could not record that its work horse %d died (%r); a lock it held "
            "frees when its lease lapses",
            horse.job_id,
            horse.pid,
            fault,
        )
