"""The line of ``on_busy="queue"`` (``docs/design/queue.md``): one JSON record
per key at ``line.<key>``, beside the lock, and every decision taken on it.

* ``record``: the record (``Line``, ``Parked``, ``Running``), its tickets (``Ticket``,
  ``ticket_of``) and its JSON to and from, strictly parsed (``encode``, ``decode``).
* ``collapse``: keep latest and debounce: ``Latest``, ``Debounce`` and the
  ``Superseded`` call that lost its place to a newer one.
* ``decisions``: each step of the design as a pure function of (record, inputs, now),
  and the outcomes they return (``Duplicate``, ``RunLate``, ``Run``, ``Park``,
  ``Publish``, ``Swept``, ``SteppedOver``): no clock, no cache.
* ``store``: the read-modify-write that applies a step (``update``, an engine flow) and
  ``Lines``, which runs it blocking or on asyncio, keys encoded as the locks' are.

Everything is imported from here (``simple_mutex.busy.line``), as when it was one module.
"""

from __future__ import annotations

from .collapse import Collapse, Debounce, Latest, Superseded, collapse_for
from .decisions import (
    Arrival,
    Duplicate,
    Park,
    Publish,
    Run,
    RunLate,
    SteppedOver,
    Swept,
    arrival,
    arrive,
    end,
    park,
    retry,
    revoke,
    send,
    send_collapsed,
    start,
    step_over,
    sweep,
    take,
)
from .record import MAX_TICKET as MAX_TICKET
from .record import VERSION as VERSION
from .record import Line, Parked, Running, Ticket, decode, encode, new_line, ticket_of
from .record import Message as Message
from .store import DEFAULT_PARK_FOR as DEFAULT_PARK_FOR
from .store import UPDATE_WRITES as UPDATE_WRITES
from .store import Change as Change
from .store import Lines, line_prefix, update

__all__ = [
    "Arrival",
    "Collapse",
    "Debounce",
    "Duplicate",
    "Latest",
    "Line",
    "Lines",
    "Park",
    "Parked",
    "Publish",
    "Run",
    "RunLate",
    "Running",
    "SteppedOver",
    "Superseded",
    "Swept",
    "Ticket",
    "arrival",
    "arrive",
    "collapse_for",
    "decode",
    "encode",
    "end",
    "line_prefix",
    "new_line",
    "park",
    "pass_on",
    "report",
    "retry",
    "revoke",
    "send",
    "send_collapsed",
    "start",
    "step_over",
    "sweep",
    "take",
    "ticket_of",
    "update",
]
