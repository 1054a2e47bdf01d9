"""Keep latest and debounce: a line that holds at most one waiting call per
key, where a newer call takes the waiting one's place instead of queueing behind it.

``Latest`` and ``Debounce`` say how a line collapses (``None``: it does not: the
queue); the decisions (``decisions.send_collapsed``, ``arrive``/``arrival`` and
``start`` given ``collapse=``) apply them and report each call that lost its place as a
``Superseded``, whose result the integration then stores as the skip marker.

A newer call sent while one waits takes its ticket (the waiting one's message is
replaced in place), so a burst of any size costs the record one entry, not a ticket each.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeAlias

from simple_mutex.busy.policy import BusyPolicy

from .record import Message


@dataclass(frozen=True)
class Latest:
    """At most one running call plus one waiting call per key: a newer call replaces the
    waiting one (its message, its own task id, takes the waiting place)."""


@dataclass(frozen=True)
class Debounce:
    """Like ``Latest``, and the waiting call is published no earlier than ``period``
    after the last call of its burst, and no later than ``max_delay`` after the first
    (give or take a sweep: the sweep publishes it when due)."""

    period: float
    max_delay: float

    def due(self, first: float, now: float) -> float:
        """When a call sent at ``now``, in a burst that began at ``first``, is due."""
        return min(now + self.period, first + self.max_delay)


Collapse: TypeAlias = Latest | Debounce | None


def collapse_for(policy: BusyPolicy) -> Collapse:
    """How a task's or job's line collapses, by its policy: ``Latest``, ``Debounce``, or
    None (the queue, or no line)."""
    match policy.on_busy:
        case "latest":
            return Latest()
        case "debounce":
            period, max_delay = policy.debounce.period, policy.debounce.max_delay
            assert period is not None  # from_options checked both
            assert max_delay is not None
            return Debounce(period, max_delay)
        case _:
            return None


@dataclass(frozen=True)
class Superseded:
    """A call that will not run: a newer call of its key took its place (``by``, whose
    message is ``by_message``). The integration resolves its result (the skip marker,
    reason ``superseded``). Also an arrival's outcome: then the arriving call is the one
    superseded."""

    ticket: int
    message: Message
    by: int
    by_message: Message


def identity(message: Message) -> object:
    """What tells two calls apart in a message: its ``id`` (Celery's task id, RQ's job
    id) when it is a mapping that has one, else the whole message."""
    if isinstance(message, Mapping) and "id" in message:
        return message["id"]
    return message
