"""Guarantees under faults, on real servers behind a fault proxy (tests/faults.py).

Each test breaks the link between one holder and its server (blackhole, delay, reset,
refuse) while the holder works inside ``with mutex.acquire(key, renew=True)``; a second
client on a healthy link keeps trying to take the key. What must hold:

* the holder is interrupted within 50 ms of its own deadline, however its renewal hangs;
* nobody else is granted the key before the holder is interrupted.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from faults import FaultProxy

from simple_mutex import Mutex, SimpleMutexLeaseExpiredError, cache_from_url
from simple_mutex.interrupt import LeaseInterrupt

LEASE = 2.0
ON_TIME = 0.05  # the bound: interrupted at most this long after the holder's deadline
GUARD = 15.0  # a broken interrupt spins this long and fails the test


@dataclass
class Tier:
    name: str
    port: int
    url: Callable[[int], str]  # port -> a cache URL whose client times out in about 1 s


TIERS = [
    Tier("redis", 6379, lambda port: f"redis://127.0.0.1:{port}/0?socket_timeout=1"),
    Tier(
        "postgres",
        5432,
        lambda port: f"postgresql://postgres@127.0.0.1:{port}/test?connect_timeout=1",
    ),
]


@pytest.fixture(params=TIERS, ids=[t.name for t in TIERS])
def tier(request: pytest.FixtureRequest) -> Tier:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def key() -> str:
    return f"faults.{uuid.uuid4().hex[:12]}"


class Taker(threading.Thread):
    """Tries the key every 5 ms on a healthy link; records the wall time it got it."""

    def __init__(self, mutex: Mutex, key: str) -> None:
        super().__init__(daemon=True)
        self.mutex, self.key = mutex, key
        self.granted_at: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            lease = self.mutex.try_acquire(self.key)
            if lease is not None:
                self.granted_at = time.time()
                lease.release()
                return
            time.sleep(0.005)


@pytest.fixture
def taker_for(tier: Tier, key: str) -> Iterator[Callable[[], Taker]]:
    takers: list[Taker] = []

    def start() -> Taker:
        taker = Taker(Mutex(cache_from_url(tier.url(tier.port)), lease=LEASE), key)
        takers.append(taker)
        taker.start()
        return taker

    yield start
    for taker in takers:
        taker.stop.set()
        taker.join(5)


def spin_until_interrupted(heal: Callable[[], None]) -> float:
    """Pure-Python work; returns the wall time at which the interrupt landed, after
    ``heal`` mends the link (so the block's release on exit goes through)."""
    end = time.monotonic() + GUARD
    try:
        while time.monotonic() < end:
            pass
    except LeaseInterrupt:
        landed = time.time()
        heal()
        return landed
    raise AssertionError(f"the work ran {GUARD} s without being interrupted")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "delay"), [("blackhole", 0), ("delay", 1.5), ("reset", 0), ("refuse", 0)]
)
def test_a_broken_link_cannot_postpone_the_lapse_interrupt(tier, key, taker_for, mode, delay):
    """The link breaks just after the grant; renewals hang or fail. The holder is
    interrupted within 50 ms after its deadline, before anyone else holds the key."""
    with FaultProxy(tier.port) as proxy:
        mutex = Mutex(cache_from_url(tier.url(proxy.port)), lease=LEASE)
        lease = mutex.acquire(key, renew=True)
        deadline = lease.expires_at.timestamp()
        proxy.set(mode, delay)
        taker = taker_for()
        with pytest.raises(SimpleMutexLeaseExpiredError), lease:
            interrupted_at = spin_until_interrupted(heal=lambda: proxy.set("pass"))
        taker.join(GUARD)
    late = interrupted_at - deadline
    print(f"{tier.name} {mode}: interrupted {late * 1000:+.1f} ms after the deadline")
    assert 0 <= late <= ON_TIME, f"interrupted {late:.3f} s after the deadline"
    assert taker.granted_at is not None, "the key was never taken over"
    assert taker.granted_at > interrupted_at, "another holder got the key before the interrupt"
