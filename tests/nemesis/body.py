"""Body steps: writes to the fenced store made and recorded by a thread of their own, so
that a lease interrupt (or a time limit) landing in the body cannot cut a write or its
record in half. Shared by the library clients (``workload``) and the task-queue apps."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from nemesis.history import Recorder
from nemesis.store import open_store

FINISH = 5.0  # seconds an interrupted step waits for its write (the store is never faulted)


def _finish(done: threading.Event) -> None:
    deadline = time.monotonic() + FINISH
    while not done.is_set() and time.monotonic() < deadline:
        try:
            done.wait(0.05)
        except BaseException:  # a second interrupt: the first one is on its way already
            continue


class Steps:
    def __init__(self, rec: Recorder, store_url: str) -> None:
        self.rec, self.store_url = rec, store_url
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._thread: threading.Thread | None = None

    def step(self, op: str, key: str, lease: Any, n: int, **fields: Any) -> None:
        """Write ``lease``'s fence to ``key``'s slot and record it as step ``n`` of ``op``;
        waits in short slices, where an interrupt can land."""
        if self._thread is None or not self._thread.is_alive():  # first use, or forked
            self._jobs = queue.Queue()
            self._thread = threading.Thread(target=self._writer, daemon=True, name="nem-store")
            self._thread.start()
        done = threading.Event()
        self._jobs.put((done, op, key, lease, n, fields))
        try:
            while not done.wait(0.05):
                pass
        except BaseException:
            # An interrupt (a lapse, a time limit, a revoke's SIGTERM) landed while the
            # write was in flight: the body unwinds and its lock is freed next. Let the
            # write finish first, as one made by the body's own thread is ordered before
            # its release; left running, it lands after the next holder's grant and reads
            # as an overlap that only this thread made.
            _finish(done)
            raise

    def _writer(self) -> None:
        store = open_store(self.store_url)  # its connection belongs to this thread
        while True:
            done, op, key, lease, n, fields = self._jobs.get()
            t0 = time.monotonic()
            try:
                accepted, last = store.write(f"{key}/{lease.slot}", lease.fence, f"{op}:{n}")
            except Exception as exc:  # the store is never faulted: say so loudly
                self.rec("store-error", id=op, error=repr(exc)[:300])
                done.set()
                continue
            t = time.monotonic()
            self.rec(
                "step", t=t, id=op, key=key, fence=lease.fence, slot=lease.slot, n=n, t0=t0,
                deadline=lease._deadline, accepted=accepted, last=last, **fields,
            )  # fmt: skip
            done.set()
