"""The line's lock events (issue 24, item 5): ``parked`` where a call parks (at its send
behind a ticket ahead, and at its arrival), ``promoted`` with its wait where it is
published for its turn. In-process, on a real line in Redis (DB 9); the broker is
kombu's memory transport (the publish really sends)."""

from __future__ import annotations

import time
import uuid

import pytest
from celery import Celery

from celery_mutex import MutexTask
from celery_mutex import line as celery_line
from celery_mutex.acquire import before_start
from celery_mutex.config import config_of
from simple_mutex import events
from simple_mutex.journal import parse_line, to_json

pytestmark = pytest.mark.integrations

URL = "redis://127.0.0.1:6379/9"


def test_parked_and_promoted_events_carry_the_ticket_and_the_wait(
    mutex_events: list[events.LockEvent],
) -> None:
    app = Celery("line_events", set_as_current=False)
    prefix = f"lineevents.{uuid.uuid4().hex[:10]}."
    app.conf.update(broker_url="memory://", mutex_cache=URL, mutex_prefix=prefix)

    @app.task(base=MutexTask, mutex={"key": "pe.{run}", "on_busy": "queue"}, shared=False)
    def step(run: str, n: int) -> int:
        return n

    run, key = "r", "pe.r"
    for n in (1, 2, 3):
        step.apply_async(args=(run, n))
    lines = config_of(step).lines
    parked = [e for e in mutex_events if e.kind == "parked"]
    assert [(e.key, e.ticket, e.name) for e in parked] == [(key, 2, step.name), (key, 3, step.name)]
    assert parked[0].cache == "redis"

    time.sleep(0.2)  # the wait the promoted event must report, at least
    line = lines.read(key)
    assert line is not None
    first = line.ticket(1)
    assert type(lines.start(key, first)).__name__ == "Run"
    celery_line.publish(step, key, lines.end(key, first), by="end")
    promoted = [e for e in mutex_events if e.kind == "promoted"]
    assert [(e.key, e.ticket, e.reason) for e in promoted] == [(key, 2, "end")]
    waited = promoted[0].waited
    assert waited is not None
    assert 0.2 <= waited <= (promoted[0].at - parked[0].at).total_seconds() + 0.05

    # An arrival before its turn parks too (ticket 4 was sent, and arrives behind 2 and 3).
    fourth = lines.take(key)
    header = {"epoch": fourth.epoch, "number": fourth.number}
    step.push_request(id="t4", args=[run, 4], kwargs={}, delivery_info={},
                      mutex_line=header)  # fmt: skip
    try:
        with pytest.raises(celery_line.Ignore):  # the worker's path: before_start
            before_start(step, "t4", (run, 4), {})
    finally:
        step.pop_request()
    assert [(e.ticket, e.kind) for e in mutex_events if e.ticket == 4] == [(4, "parked")]
    now = lines.read(key)
    assert now is not None
    assert 4 in now.parked

    # The journal keeps the ticket, so the timeline can pair a park with its promotion.
    again = parse_line(to_json(promoted[0], "h", 1)).event
    assert (again.kind, again.ticket, again.waited, again.reason) == ("promoted", 2, waited, "end")
