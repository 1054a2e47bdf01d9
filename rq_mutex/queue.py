"""``rq_mutex.Queue``: RQ's ``Queue``, for producers that want a ``mutex_job``'s checks
and its place in a line at the moment it is enqueued rather than when it starts.

RQ has no hook before a job is enqueued, and the decorated function cannot see the
enqueue. Every enqueue path (``enqueue``, ``enqueue_call``, ``enqueue_at``/``_in``,
``enqueue_many``, ``@job(..., queue_class=...)``) builds its Job in ``create_job``, with
the timeout already settled, in the caller's process. This class, named where the
producer names its queue class (``Queue(...)``, ``rq worker --queue-class``, django-rq's
``QUEUE_CLASS``), reads the new job there:

* a fixed lease (``renew=False``) not longer than the job's timeout is refused with
  ``ConstraintError`` right there, instead of failing every run of it in a worker;
* an ``on_busy="queue"`` (``latest``, ``debounce``) job takes its ticket as it is
  enqueued, so the line runs jobs in the order they were enqueued, and a job behind a
  ticket ahead is parked at once (``_enqueue_job`` schedules it instead of pushing it:
  a burst for one key costs no work horse per job).

A plain ``rq.Queue`` still runs every ``mutex_job``: the timeout is checked when the job
starts, and a line job takes its place when it first reaches a worker (the order is
then the order of arrival). Importing ``rq_mutex`` changes nothing of RQ's own classes.
"""

from __future__ import annotations

from typing import Any

from rq import Queue as RQQueue
from rq.job import Job

from . import line
from .job import decorated_run


class Queue(RQQueue):
    """RQ's ``Queue`` that checks and places a ``mutex_job`` as it is enqueued (above)."""

    def create_job(self, *args: Any, **kwargs: Any) -> Job:
        job = super().create_job(*args, **kwargs)
        run = decorated_run(job)
        if run is None:
            return job
        if not run.policy.renew:
            run.check_timeout(job, None)
        if run.policy.in_line and self._is_async:
            key = run.key_of(*job.args, **job.kwargs)
            line.at_send(
                job, run.lines(self.connection), key, run.policy, origin=self.name,
                connection=self.connection, name=run.name,
            )  # fmt: skip
        return job

    def enqueue_many(self, *args: Any, **kwargs: Any) -> Any:
        with line.sending_batch():  # a failed batch gives back the tickets it took
            return super().enqueue_many(*args, **kwargs)

    def _enqueue_job(self, job: Job, pipeline: Any = None, *args: Any, **kwargs: Any) -> Job:
        # Every push goes through here (enqueue, enqueue_many, retries, the scheduler);
        # only a job its create_job parked at the send is diverted, once.
        if line.divert(self, job, pipeline):
            return job
        return super()._enqueue_job(job, pipeline, *args, **kwargs)
