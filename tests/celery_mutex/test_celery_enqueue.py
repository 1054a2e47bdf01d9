"""Enqueue de-duplication (``mutex={"enqueue": ...}``) against a real ``celery worker``
(prefork, ``celery_support.app``) on a real Redis (broker, backend, lock cache).

Canvases: a canvas has given each of its calls a task id that something waits on (the
group's result, the chord's counter, the chain's tail travelling in the head's message, a
link), so another call's AsyncResult cannot stand in for it. In ``"return"`` mode such a
call is sent anyway and the run-time lock decides (``on_busy``); in ``"raise"`` mode it
raises AlreadyQueuedError at send time, before anything else of that chain goes out.

Refused calls: when the worker refuses a call instead of running it (a task it does not
know, producers deployed before workers; a message it cannot decode; ``Reject``), the
call's "queued" marker must go (an equal call is then sent anew instead of being
answered, for ``enqueue_ttl``, with the refused one), and stay while the call is still
queued (``Reject(requeue=True)``).

The test process is the producer: its tasks carry the names and options the worker's
have (``not_deployed_yet`` only here); their bodies never run in it. A missing Redis fails.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, chain, chord, group
from celery_support.processes import REDIS_URL, Processes
from workers import wait_until

# isort: split
from celery_mutex import AlreadyQueuedError, MutexTask, is_skipped
from simple_mutex import Mutex, cache_from_url

pytestmark = pytest.mark.integrations

GET = 20

# name -> mutex options, as celery_support.app defines them (the worker's side)
PRODUCED = {
    "not_deployed_yet": {"key": "nd.{order_id}", "enqueue": "return"},
    "rejects": {"key": "rej.{order_id}", "enqueue": "return"},
    "dedup_skip": {"key": "dd.{order_id}", "on_busy": "skip", "enqueue": "return"},
    "dedup_raise": {"key": "dd.{order_id}", "enqueue": "raise"},
}


@pytest.fixture(scope="module")
def worker() -> Iterator[Processes]:
    """One prefork worker of ``celery_support.app`` (3 processes)."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = Processes("celery_support.app", Path(tmp))
        procs.start_worker("w", 3)
        try:
            yield procs
        finally:
            procs.stop()


@pytest.fixture(scope="module")
def producer(worker: Processes) -> Celery:
    """The sending side: the worker's queue, lock cache and prefix, and its tasks."""
    app = Celery("producer", set_as_current=False)
    app.conf.update(
        broker_url=REDIS_URL,
        result_backend=REDIS_URL,
        task_default_queue=worker.queue,
        mutex_cache=REDIS_URL,
        mutex_prefix=worker.prefix,
    )
    for name, options in PRODUCED.items():

        def run(order_id: int, *more: Any) -> None: ...

        app.task(base=MutexTask, shared=False, name=f"celery_support.app.{name}", mutex=options)(
            run
        )
    return app


@pytest.fixture
def order_id(worker: Processes) -> int:
    """An order id no other test of the module uses."""
    return int(worker.record.incr(worker.prefix + "order_ids"))


def task(producer: Celery, name: str) -> Any:
    return producer.tasks[f"celery_support.app.{name}"]


def tail(producer: Celery, tag: str) -> Any:
    return producer.signature("celery_support.app.tail", args=(tag,))


def tails(worker: Processes) -> list[str]:
    return [t.decode() for t in worker.record.lrange(worker.prefix + "tails", 0, -1)]


def ran_or_skipped(results: list[object]) -> bool:
    return all(r == "ran" or is_skipped(r) for r in results) and "ran" in results


def marked(worker: Processes, key: str) -> bool:
    return Mutex(cache_from_url(REDIS_URL), prefix="queued." + worker.prefix).locked(key)


def sent_anew(called: Any, first: Any, *args: Any) -> Any:
    """An equal call, once the first's marker is gone (bounded wait); the new result."""
    again: list[Any] = []

    def answered_by_a_new_call() -> bool:
        again[:] = [called.delay(*args)]
        return again[0].id != first.id

    wait_until(answered_by_a_new_call, GET, "an equal call to be sent anew")
    return again[0]


# -- canvases -------------------------------------------------------------------------


def test_group_of_two_equal_calls_completes(producer, order_id):
    """group(dedup.s(n), dedup.s(n)): both are sent (the second is not swallowed by the
    first), the run-time lock keeps them from overlapping, and the group completes."""
    dedup = task(producer, "dedup_skip")
    got = group(dedup.s(order_id), dedup.s(order_id)).apply_async().get(timeout=GET)
    assert len(got) == 2
    assert ran_or_skipped(got)


def test_chain_whose_head_is_already_queued_sends_its_tail(worker, producer, order_id):
    """An equal call is queued; a chain whose head is that call again still sends its
    head and runs its tail with what the head returned (the real result or the skip
    marker, whichever of the two equal calls took the key first)."""
    dedup = task(producer, "dedup_skip")
    first = dedup.delay(order_id)
    tag = f"chain-{order_id}"
    result = chain(dedup.s(order_id), tail(producer, tag)).apply_async()
    assert result.parent.id != first.id
    got = result.get(timeout=GET)
    assert got["tag"] == tag
    assert ran_or_skipped([first.get(timeout=GET), got["got"]])
    assert tails(worker).count(tag) == 1


def test_chord_of_equal_calls_runs_its_callback(producer, order_id):
    """chord([dedup.s(n), dedup.s(n)], callback): every header call is sent, so the
    callback runs with both results."""
    dedup = task(producer, "dedup_skip")
    tag = f"chord-{order_id}"
    got = chord([dedup.s(order_id)] * 2, tail(producer, tag)).apply_async().get(timeout=GET)
    assert got["tag"] == tag
    assert len(got["got"]) == 2
    assert ran_or_skipped(got["got"])


def test_a_duplicate_with_a_link_or_its_own_id_is_sent(worker, producer, order_id):
    """A call carrying a link, or a task id the caller chose, is sent under that id even
    while an equal call is queued, and its link runs; a plain duplicate still gets the
    queued call's AsyncResult."""
    dedup = task(producer, "dedup_skip")
    first = dedup.delay(order_id)
    assert dedup.delay(order_id).id == first.id  # plain: de-duplicated
    tag = f"link-{order_id}"
    linked = dedup.apply_async((order_id,), link=tail(producer, tag))
    own = dedup.apply_async((order_id,), task_id=f"own-{order_id}-{worker.run}")
    assert linked.id != first.id
    assert own.id == f"own-{order_id}-{worker.run}"
    assert ran_or_skipped([r.get(timeout=GET) for r in (first, linked, own)])
    wait_until(lambda: tag in tails(worker), GET, "the duplicate's link to run")


def test_raise_mode_refuses_the_chain_before_sending_it(worker, producer, order_id):
    """enqueue='raise': a chain whose head equals a queued call raises AlreadyQueuedError
    at send time, saying the canvas stops there; its tail is never sent."""
    refusing = task(producer, "dedup_raise")
    first = refusing.delay(order_id)
    tag = f"refused-{order_id}"
    with pytest.raises(AlreadyQueuedError, match="canvas") as refused:
        chain(refusing.s(order_id), tail(producer, tag)).apply_async()
    assert refused.value.task_id == first.id
    assert first.get(timeout=GET) == "ran"
    assert tag not in tails(worker)


# -- calls the worker refuses ---------------------------------------------------------


def test_unknown_task_clears_its_marker(worker, producer, order_id):
    """The worker does not know the task: it rejects the message and records the call as
    failed (NotRegistered); its marker goes with it, so the next equal call is sent."""
    unknown = task(producer, "not_deployed_yet")
    first = unknown.delay(order_id)
    wait_until(lambda: first.state == "FAILURE", GET, "the worker to refuse the call")
    assert type(first.result).__name__ == "NotRegistered"
    again = sent_anew(unknown, first, order_id)
    wait_until(lambda: again.state == "FAILURE", GET, "the worker to refuse it too")
    wait_until(lambda: not marked(worker, f"nd.{order_id}"), GET, "its marker to go")


def test_message_the_worker_cannot_accept_clears_its_marker(producer, order_id):
    """A message the worker refuses to decode (pickle, where it accepts JSON only) is
    rejected as invalid (task_rejected), and stores no result: the call is over all the
    same, so its marker goes and the next equal call is sent."""
    rejects = task(producer, "rejects")
    refused = rejects.apply_async((order_id, False), serializer="pickle")
    sent_anew(rejects, refused, order_id, False)
    assert refused.state == "PENDING"  # nothing recorded it: only the marker knew


def test_rejected_call_clears_its_marker_but_a_requeued_one_keeps_it(worker, producer, order_id):
    """Reject(requeue=False): the call is over, its marker goes. Reject(requeue=True)
    under acks_late: the message goes back to the queue, so the call is still queued: an
    equal call sent while it runs again is answered by it, and it finishes."""
    rejects = task(producer, "rejects")
    dropped = rejects.delay(order_id, False)  # Celery < 5.7 stores no result for it: PENDING
    sent_anew(rejects, dropped, order_id, False)

    requeued = rejects.delay(order_id + 10**6, True)
    runs = f"{worker.prefix}runs.{order_id + 10**6}"
    wait_until(lambda: int(worker.record.get(runs) or 0) == 2, GET, "the requeued run")
    assert rejects.delay(order_id + 10**6, True).id == requeued.id  # still queued
    worker.record.set(f"{worker.prefix}go.{order_id + 10**6}", 1, ex=60)
    assert requeued.get(timeout=GET) == "ran"
