"""What the metric and trace sinks share: the acquire outcomes, the histogram buckets, and
which leases a sink saw granted.

A sink may start listening while leases are already held: their ``released`` or ``lost``
would otherwise take a held gauge below zero, or end a span that never started. A lease is
told apart by (cache, key, slot, fence): the fence is new on every grant of a key.
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

from simple_mutex.events import LockEvent

V = TypeVar("V")

ACQUIRE_OUTCOMES = ("acquired", "busy", "timed_out")
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
"""Seconds an acquire took: a try-once is about one round trip, a wait up to its timeout."""
HOLD_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 1800, 3600)
"""Seconds a lease was held: a short section up to the default 30 min lease and beyond."""

LeaseId = tuple[str, str, int | None, int | None]


def lease_id(event: LockEvent) -> LeaseId:
    return event.cache, event.key, event.slot, event.fence


class Granted(Generic[V]):
    """Leases granted while listening, each with what the sink keeps for it until it ends."""

    def __init__(self) -> None:
        self._open: dict[LeaseId, V] = {}
        self._lock = threading.Lock()  # released and lost arrive from other threads

    def add(self, event: LockEvent, value: V) -> None:
        with self._lock:
            self._open[lease_id(event)] = value

    def pop(self, event: LockEvent) -> V | None:
        """What was kept for the lease this event ends, or None if its grant was not seen."""
        with self._lock:
            return self._open.pop(lease_id(event), None)

    def drain(self) -> list[V]:
        """Everything still kept, forgotten here."""
        with self._lock:
            kept, self._open = list(self._open.values()), {}
        return kept
