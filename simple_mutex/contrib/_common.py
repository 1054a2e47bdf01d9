"""What the metric and trace sinks share: the acquire outcomes, the histogram buckets, and
which leases a sink saw granted.

A sink may start listening while leases are already held: their ``released`` or ``lost``
would otherwise take a held gauge below zero, or end a span that never started. A lease is
told apart by (cache, key, slot, fence): the fence is new on every grant of a key.

A lease nobody releases and nobody watches (``try_acquire`` used as a throttle, left to
lapse) ends with no event at all: it is forgotten once it has been expired for
``SWEEP_GRACE`` seconds, so a long-running process neither leaks nor counts it held forever.
"""

from __future__ import annotations

import threading
import time
from typing import Generic, TypeVar

from simple_mutex.events import LockEvent

V = TypeVar("V")

ACQUIRE_OUTCOMES = ("acquired", "busy", "timed_out")
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
"""Seconds an acquire took: a try-once is about one round trip, a wait up to its timeout."""
HOLD_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 1800, 3600)
"""Seconds a lease was held: a short section up to the default 30 min lease and beyond."""
SWEEP_GRACE = 10.0
"""Seconds past its expiry before an unreported lease is forgotten: a release or loss
reported later than that is counted as of a lease not seen granted."""
SWEEP_EVERY = 1.0

LeaseId = tuple[str, str, int | None, int | None]


def lease_id(event: LockEvent) -> LeaseId:
    return event.cache, event.key, event.slot, event.fence


def _expiry(event: LockEvent) -> float:
    """When the lease the event is about lapses (wall clock), or never if unknown."""
    holder = event.holder
    return float("inf") if holder is None else holder.expires_at.timestamp()


class Granted(Generic[V]):
    """Leases granted while listening, each with what the sink keeps for it until it ends."""

    def __init__(self) -> None:
        self._open: dict[LeaseId, tuple[V, float]] = {}
        self._lock = threading.Lock()  # released and lost arrive from other threads
        self._next_sweep = 0.0

    def add(self, event: LockEvent, value: V) -> list[tuple[V, float]]:
        """Keep ``value`` for the lease ``event`` granted. Returns what was kept for leases
        forgotten now (expired for ``SWEEP_GRACE`` with no release or loss reported), each
        with when it expired (wall clock)."""
        now = time.time()
        with self._lock:
            self._open[lease_id(event)] = (value, _expiry(event))
            if now < self._next_sweep:
                return []
            self._next_sweep = now + SWEEP_EVERY
            lapsed = [k for k, (_, expiry) in self._open.items() if expiry + SWEEP_GRACE < now]
            return [self._open.pop(k) for k in lapsed]

    def renew(self, event: LockEvent) -> None:
        """A renewal moved the lease's expiry."""
        with self._lock:
            kept = self._open.get(lease_id(event))
            if kept is not None:
                self._open[lease_id(event)] = (kept[0], _expiry(event))

    def pop(self, event: LockEvent) -> V | None:
        """What was kept for the lease this event ends, or None if its grant was not seen."""
        with self._lock:
            kept = self._open.pop(lease_id(event), None)
        return None if kept is None else kept[0]

    def drain(self) -> list[V]:
        """Everything still kept, forgotten here."""
        with self._lock:
            kept, self._open = [value for value, _ in self._open.values()], {}
        return kept
