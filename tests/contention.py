"""A contention run whose outcome the caller counts itself, for the sinks' tests: what the
metrics and spans report must equal what the lock's callers saw.

``contend`` races threads of try-once acquires on one key (some get it, the rest find it
busy), times one waiting acquire out, and lets some leases lapse inside their block
(lost). Each count comes from the callers' own results, never from the event stream.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest
from workers import spin

from simple_mutex import Mutex, SimpleMutexAcquireTimeoutError, SimpleMutexLeaseExpiredError


@dataclass
class Seen:
    """What the callers saw."""

    acquired: int = 0
    busy: int = 0
    timed_out: int = 0
    lost: int = 0

    @property
    def released(self) -> int:
        return self.acquired - self.lost


def contend(cache: object, name: str, key: str, *, threads: int = 6, rounds: int = 4,
            lost: int = 2) -> Seen:  # fmt: skip
    """``rounds`` times, ``threads`` threads try once on ``key`` at the same instant; a
    winner holds it 50 ms. Then one acquire with a 50 ms timeout meets a held key, and
    ``lost`` leases of 0.2 s lapse while their block spins. All events are named ``name``."""
    mutex = Mutex(cache, name=name, lease=30)
    seen = Seen()
    tally = threading.Lock()
    for _ in range(rounds):
        start = threading.Barrier(threads)

        def attempt(start: threading.Barrier = start) -> None:
            start.wait(5)
            lease = mutex.try_acquire(key)
            with tally:
                if lease is None:
                    seen.busy += 1
                else:
                    seen.acquired += 1
            if lease is not None:
                spin(0.05)
                lease.release()

        workers = [threading.Thread(target=attempt) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(10)
    with mutex.acquire(key):
        seen.acquired += 1
        with pytest.raises(SimpleMutexAcquireTimeoutError):
            mutex.acquire(key, timeout=0.05)
        seen.timed_out += 1
    short = Mutex(cache, name=name, lease=0.2)
    for n in range(lost):
        lease = short.acquire(f"{key}.lost.{n}")
        seen.acquired += 1
        with pytest.raises(SimpleMutexLeaseExpiredError), lease:
            spin(5)
        seen.lost += 1
    assert seen.busy > 0, "nobody found the key busy: the run did not contend"
    return seen
