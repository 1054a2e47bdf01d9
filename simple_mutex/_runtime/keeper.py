"""One background thread per process that keeps lease deadlines and starts renewals.

Why one thread and not one per lease: a worker may hold hundreds of leases, and a thread
each (python-redis-lock's design) costs memory and start-up time on every acquire. Why a
thread and not the event loop: sync holders have no loop, and an async holder's loop may be
blocked by the very work we must interrupt.

On time, whatever the I/O does: the thread itself never waits on a cache. At a lease's
deadline it marks the lease lost and interrupts the holder; renewals and on-lost callbacks
run in a small pool beside it, so a stalled backend delays no deadline, its own lease's
included.

Threads do not survive ``fork()``: Celery's prefork pool and RQ's work horses fork after
import. The child gets a fresh keeper (started lazily on first use); leases the parent
holds stay the parent's to renew.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from .forksafe import OnePerProcess

log = logging.getLogger("simple_mutex")


class Watched(Protocol):
    def _keeper_visit(self, now: float, when: float) -> float | None:
        """Do what is due, without blocking; return the next visit (monotonic), or None.
        ``when`` is the visit this call was booked for: one superseded by an earlier
        booking answers None."""

    def _keeper_booking(self) -> float | None:
        """The visit booked now. Read without locking: heap entries for other times are
        stale."""


class Keeper:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # entered directly on the hot path (watch)
        self._cond = threading.Condition(self._lock)
        self._heap: list[tuple[float, int, weakref.ref[Watched]]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="simple-mutex-io")

    def watch(self, item: Watched, when: float) -> None:
        with self._lock:
            # Released leases leave stale entries behind (removal from a heap is O(n));
            # drop them in one pass when they pile up.
            if len(self._heap) > 1024 and len(self._heap) % 1024 == 0:
                self._compact()
            wake = not self._heap or when < self._heap[0][0]
            heapq.heappush(self._heap, (when, next(self._seq), weakref.ref(item)))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="simple-mutex-keeper", daemon=True
                )
                self._thread.start()
            elif wake:
                self._cond.notify()

    def submit(self, work: Callable[..., Any], *args: Any) -> None:
        """Run ``work`` (a renewal, a callback: anything that may block) in the pool."""
        try:
            self._pool.submit(_logged, work, *args)
        except RuntimeError as exc:
            # The interpreter is exiting: its thread pools take no new work once threading
            # shut down, while atexit handlers may still run for a while. The work would
            # die with the process anyway, and a lease not renewed lapses as designed.
            if "interpreter shutdown" not in str(exc):
                raise

    def _compact(self) -> None:
        live = [
            e for e in self._heap if (item := e[2]()) is not None and item._keeper_booking() == e[0]
        ]
        heapq.heapify(live)
        self._heap = live

    def _run(self) -> None:
        while True:
            with self._lock:
                while True:
                    now = time.monotonic()
                    if self._heap and self._heap[0][0] <= now:
                        when, _, ref = heapq.heappop(self._heap)
                        break
                    self._cond.wait(None if not self._heap else self._heap[0][0] - now)
            item = ref()
            if item is None:
                continue  # dropped without release: not renewed, it lapses within a lease
            again = _logged(item._keeper_visit, now, when)
            if again is not None:
                self.watch(item, again)


def _logged(work: Callable[..., Any], *args: Any) -> Any:
    try:
        return work(*args)
    except Exception:  # the keeper must outlive any one lease's bug
        log.exception("simple-mutex keeper: unexpected error while looking after a lease")
        return None


_keeper = OnePerProcess(Keeper)  # a forked child starts over: the parent's thread is not here


def keeper() -> Keeper:
    """This process's keeper, created on first use."""
    return _keeper.get()
