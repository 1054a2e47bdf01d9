"""Enqueue de-duplication (``mutex={"enqueue": ...}``) inside Celery canvases, with the
in-process worker of ``celery_support.inproc`` (thread pool) on a real Redis.

A canvas has given each of its calls a task id that something waits on (the group's
result, the chord's counter, the chain's message carrying its tail, a link): another
call's AsyncResult cannot stand in for it. So in ``"return"`` mode such a call is sent
anyway and the run-time lock decides (``on_busy``); in ``"raise"`` mode it raises
AlreadyQueuedError at send time, before anything else of the canvas goes out.
"""

from __future__ import annotations

import time

import pytest
import test_celery_inproc
from celery import chain, chord, group
from celery_support import inproc
from celery_support.inproc import RUNS

# isort: split
from celery_mutex import AlreadyQueuedError, is_skipped

GET = 10  # seconds any single result may take


# test_celery_inproc's fixtures: the in-process worker (8 threads), a fresh order id.
mutex_worker, order_id = test_celery_inproc.mutex_worker, test_celery_inproc.order_id


def ran_or_skipped(results: list[object]) -> bool:
    return all(r == "ran" or is_skipped(r) for r in results) and "ran" in results


def test_group_of_two_equal_calls_completes(mutex_worker, order_id):
    """group(dedup.s(n), dedup.s(n)): both are sent (the second is not swallowed by the
    first), the run-time lock keeps them from overlapping, and the group completes."""
    results = group(inproc.dedup_skip.s(order_id), inproc.dedup_skip.s(order_id)).apply_async()
    got = results.get(timeout=GET)
    assert len(got) == 2
    assert ran_or_skipped(got)


def test_chain_whose_head_is_already_queued_sends_its_tail(mutex_worker, order_id):
    """An equal call is queued; a chain whose head is that call again still sends its
    head and runs its tail with what the head returned (the real result or the skip
    marker, whichever of the two equal calls took the key first)."""
    first = inproc.dedup_skip.delay(order_id)
    tag = f"chain-{order_id}"
    result = chain(inproc.dedup_skip.s(order_id), inproc.tail.s(tag)).apply_async()
    assert result.parent.id != first.id
    got = result.get(timeout=GET)
    assert got["tag"] == tag
    assert ran_or_skipped([first.get(timeout=GET), got["got"]])


def test_chord_of_equal_calls_runs_its_callback(mutex_worker, order_id):
    """chord([dedup.s(n), dedup.s(n)], callback): every header call is sent, so the
    callback runs with both results."""
    tag = f"chord-{order_id}"
    result = chord([inproc.dedup_skip.s(order_id)] * 2, inproc.tail.s(tag)).apply_async()
    got = result.get(timeout=GET)
    assert got["tag"] == tag
    assert len(got["got"]) == 2
    assert ran_or_skipped(got["got"])


def test_a_duplicate_with_a_link_or_its_own_id_is_sent(mutex_worker, order_id):
    """A call carrying a link, or a task id the caller chose, is sent under that id even
    while an equal call is queued, and its link runs; a plain duplicate still gets the
    queued call's AsyncResult."""
    first = inproc.dedup_skip.delay(order_id)
    assert inproc.dedup_skip.delay(order_id).id == first.id  # plain: de-duplicated
    tag = f"link-{order_id}"
    linked = inproc.dedup_skip.apply_async((order_id,), link=inproc.tail.s(tag))
    own = inproc.dedup_skip.apply_async((order_id,), task_id=f"own-{order_id}")
    assert linked.id != first.id
    assert own.id == f"own-{order_id}"
    for result in (linked, own):
        assert result.get(timeout=GET) == "ran" or is_skipped(result.result)
    deadline = time.monotonic() + GET
    while ("tail", tag) not in RUNS:
        assert time.monotonic() < deadline, "the duplicate's link never ran"
        time.sleep(0.05)


def test_raise_mode_refuses_the_canvas_before_sending_it(mutex_worker, order_id):
    """enqueue='raise': a chain whose head equals a queued call raises AlreadyQueuedError
    at send time, saying the canvas was stopped; its tail is never sent."""
    first = inproc.queued_raise.delay(order_id)
    tag = f"refused-{order_id}"
    with pytest.raises(AlreadyQueuedError, match="canvas") as refused:
        chain(inproc.queued_raise.s(order_id), inproc.tail.s(tag)).apply_async()
    assert refused.value.task_id == first.id
    assert first.get(timeout=GET) == "ran"
    assert ("tail", tag) not in RUNS
