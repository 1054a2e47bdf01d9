"""Celery's per-call state (``celery_mutex.call_state``): one typed object per request,
and what the line's port leaves in it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from celery_mutex import call_state
from celery_mutex.line import TaskCall
from simple_mutex.busy.line import Ticket

pytestmark = pytest.mark.fast


def test_a_request_gets_one_state_and_a_direct_call_a_fresh_one() -> None:
    request = SimpleNamespace()
    state = call_state.of(request)
    assert call_state.of(request) is state
    state.running = True
    fresh = call_state.fresh(request, running=state.running)
    assert call_state.of(request) is fresh is not state
    assert (fresh.running, fresh.lease, fresh.done) == (True, None, False)


def test_a_call_parked_and_then_handed_its_own_turn_is_no_longer_parked() -> None:
    """Its delivery runs the call after all, so its end frees what a parked call's keeps
    (the enqueue marker): ``started`` clears the mark ``parked`` set."""
    task = SimpleNamespace(name="t", request=SimpleNamespace(id="id-1"))
    call = TaskCall(task, cfg=None)  # type: ignore[arg-type]  (no bounds read here)
    ticket = Ticket("e" * 16, 1)
    call.parked("k", ticket)
    assert call_state.of(task.request).parked
    call.started("k", ticket)
    assert not call_state.of(task.request).parked
