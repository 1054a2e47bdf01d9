"""What rq_mutex relies on of RQ beyond its public API, checked once, at import.

RQ offers no hook before a job is enqueued, none around a work horse's fork and reaping,
and no public word for a job's dependencies before it is saved; rq_mutex's own classes
override RQ's methods for these (``rq_mutex.Queue``, ``rq_mutex.Worker``), and never
replace anything on RQ's. A release of RQ that renames or reshapes one would otherwise
break the line or the dead-horse recovery silently: instead, importing rq_mutex fails, naming
what is missing and the RQ version installed. Tested on RQ ``TESTED`` (the lowest is
pyproject's bound; the highest, the newest RQ when this was released).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import rq
from rq import Queue
from rq.job import Job
from rq.worker import Worker as RQWorker

from simple_mutex.errors import ConstraintError

TESTED = ("2.11", "3.0")


def _parameters(function: Any) -> list[str]:
    return list(inspect.signature(function).parameters)


def _starts_with(names: list[str]) -> Callable[[Any], bool]:
    return lambda function: _parameters(function)[: len(names)] == names


# (what rq_mutex uses, where it is, what it must look like)
EXPECTED: tuple[tuple[str, Callable[[], Any], Callable[[Any], bool]], ...] = (
    ("Queue.create_job", lambda: Queue.create_job, callable),
    ("Queue.enqueue_many", lambda: Queue.enqueue_many, callable),
    ("Queue._enqueue_job(job, pipeline)", lambda: Queue._enqueue_job,
     _starts_with(["self", "job", "pipeline"])),
    ("Queue.schedule_job(job, datetime, pipeline=)", lambda: Queue.schedule_job,
     lambda f: _parameters(f)[:3] == ["self", "job", "datetime"] and "pipeline" in _parameters(f)),
    ("Worker.fork_work_horse(job, queue)", lambda: RQWorker.__dict__["fork_work_horse"],
     _starts_with(["self", "job", "queue"])),
    ("Worker.wait_for_horse()", lambda: RQWorker.__dict__["wait_for_horse"],
     _starts_with(["self"])),
    ("Worker.dequeue_timeout (a property)", lambda: RQWorker.dequeue_timeout,
     lambda found: isinstance(found, property)),
    ("Queue.intermediate_queue_key (a property)", lambda: Queue.intermediate_queue_key,
     lambda found: isinstance(found, property)),
    ("Queue.started_job_registry (a property)", lambda: Queue.started_job_registry,
     lambda found: isinstance(found, property)),
    ("Job._dependency_ids (set by Job())", lambda: Job.__init__.__code__.co_names,
     lambda names: "_dependency_ids" in names),
)  # fmt: skip


def check_host() -> None:
    """Raise ``ConstraintError`` naming each of RQ's internals rq_mutex relies on that the
    installed RQ lacks or has changed."""
    wrong = []
    for what, find, fits in EXPECTED:
        try:
            found = find()
        except (AttributeError, KeyError):
            wrong.append(f"{what}: missing")
            continue
        if not fits(found):
            wrong.append(f"{what}: changed")
    if wrong:
        raise ConstraintError(
            f"rq_mutex relies on parts of RQ that RQ {rq.__version__} does not have as "
            f"expected ({'; '.join(wrong)}); rq_mutex is tested on RQ {TESTED[0]} to "
            f"{TESTED[1]}: install an RQ in that range (pip install 'rq>={TESTED[0]},"
            f"<={TESTED[1]}'), or report it"
        )


check_host()
