"""The "queued" marker of an enqueue-de-duplicated call (``mutex={"enqueue": "return"}``)
when a real ``celery worker`` refuses the call instead of running it: the task is unknown
to that worker (producers deployed before workers), or its body raises ``Reject``.

The marker must go when the call is over (an equal call is then sent anew instead of
being answered, for ``enqueue_ttl``, with the refused one), and stay while the call is
still queued (``Reject(requeue=True)``). Redis at 127.0.0.1:6379; a missing server fails.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery_support.processes import REDIS_URL, Processes
from workers import wait_until

# isort: split
from celery_mutex import MutexTask
from simple_mutex import Mutex, cache_from_url

pytestmark = pytest.mark.slow

GET = 20


@pytest.fixture(scope="module")
def worker() -> Iterator[Processes]:
    """One prefork worker of ``celery_support.app``, which has no task named
    ``celery_support.app.not_deployed_yet``."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = Processes("celery_support.app", Path(tmp))
        procs.start_worker("w", 2)
        try:
            yield procs
        finally:
            procs.stop()


@pytest.fixture(scope="module")
def producer(worker: Processes) -> Celery:
    """The sending side: the worker's queue, lock cache and prefix, and the tasks with the
    names and options the producer's (newer) code has."""
    app = Celery("producer", set_as_current=False)
    app.conf.update(
        broker_url=REDIS_URL,
        result_backend=REDIS_URL,
        task_default_queue=worker.queue,
        mutex_cache=REDIS_URL,
        mutex_prefix=worker.prefix,
    )
    options = {"key": "nd.{order_id}", "enqueue": "return"}

    @app.task(
        base=MutexTask, shared=False, name="celery_support.app.not_deployed_yet", mutex=options
    )
    def not_deployed_yet(order_id: int) -> str:
        return "ran"

    @app.task(
        base=MutexTask,
        shared=False,
        name="celery_support.app.rejects",
        mutex={"key": "rej.{order_id}", "enqueue": "return"},
    )
    def rejects(order_id: int, requeue: bool) -> str:
        return "ran"

    return app


def marked(worker: Processes, key: str) -> bool:
    return Mutex(cache_from_url(REDIS_URL), prefix="queued." + worker.prefix).locked(key)


def sent_anew(task: Any, first: Any, *args: Any) -> Any:
    """An equal call, once the first's marker is gone (bounded wait); the new result."""
    again: list[Any] = []

    def answered_by_a_new_call() -> bool:
        again[:] = [task.delay(*args)]
        return again[0].id != first.id

    wait_until(answered_by_a_new_call, GET, "an equal call to be sent anew")
    return again[0]


def test_unknown_task_clears_its_marker(worker, producer):
    """The worker does not know the task: it rejects the message and records the call as
    failed (NotRegistered); its marker goes with it, so the next equal call is sent."""
    task = producer.tasks["celery_support.app.not_deployed_yet"]
    first = task.delay(1)
    wait_until(lambda: first.state == "FAILURE", GET, "the worker to refuse the call")
    assert type(first.result).__name__ == "NotRegistered"
    again = sent_anew(task, first, 1)
    wait_until(lambda: again.state == "FAILURE", GET, "the worker to refuse it too")
    wait_until(lambda: not marked(worker, "nd.1"), GET, "its marker to go")


def test_rejected_call_clears_its_marker_but_a_requeued_one_keeps_it(worker, producer):
    """Reject(requeue=False): the call is over, its marker goes. Reject(requeue=True)
    under acks_late: the message goes back to the queue, so the call is still queued: an
    equal call sent while it runs again is answered by it, and it finishes."""
    task = producer.tasks["celery_support.app.rejects"]
    dropped = task.delay(2, False)  # Celery < 5.7 stores no result for it: PENDING
    sent_anew(task, dropped, 2, False)

    requeued = task.delay(3, True)
    runs = f"{worker.prefix}runs.3"
    wait_until(lambda: int(worker.record.get(runs) or 0) == 2, GET, "the requeued run")
    assert task.delay(3, True).id == requeued.id  # still queued: de-duplicated
    worker.record.set(f"{worker.prefix}go.3", 1, ex=60)
    assert requeued.get(timeout=GET) == "ran"


def test_message_the_worker_cannot_accept_clears_its_marker(worker, producer):
    """A message the worker refuses to decode (pickle, where it accepts JSON only) is
    rejected as invalid (task_rejected), and stores no result: the call is over all the
    same, so its marker goes and the next equal call is sent."""
    task = producer.tasks["celery_support.app.rejects"]
    refused = task.apply_async((4, False), serializer="pickle")
    sent_anew(task, refused, 4, False)
    assert refused.state == "PENDING"  # nothing recorded it: only the marker knew
