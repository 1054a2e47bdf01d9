"""A job's own timeout lands while ``acquire`` waits, or while it writes (issue 20.7).

RQ's ``job_timeout``, Celery's ``soft_time_limit`` and a plain ``signal.alarm`` raise an
ordinary exception from a signal handler. Only a cache's driver errors are backend
faults; this one must reach the caller at once (never be waited out, after which the
body ran anyway), and a record the interrupted call may have written must not stay
behind. Real servers: the Redis at REDIS_URL, the PostgreSQL at POSTGRES_URL, and a
DiskCache (a missing server fails the test). The RQ and Celery cases, with real
workers, are in test_rq.py and test_celery_timeouts.py."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from alarms import Alarm

from simple_mutex import DiskCache, Mutex, cache_from_url

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES_URL = os.environ.get("POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


@pytest.fixture(params=["disk", "redis", "postgres"])
def mutex(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Mutex]:
    url = {
        "disk": f"file://{tmp_path / 'locks'}",
        "redis": REDIS_URL,
        "postgres": POSTGRES_URL,
    }[request.param]
    return Mutex(cache_from_url(url), lease=30, prefix=f"alarm-{uuid.uuid4().hex[:8]}.")


def test_an_alarm_while_waiting_reaches_the_caller_at_once(mutex, alarm):
    """The key is held; the acquire waits (timeout 10 s); the alarm at 0.3 s leaves the
    acquire as itself within a second, and the cache works on afterwards."""
    holder = Mutex(mutex.cache, prefix=mutex.prefix).acquire("k")
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    started = time.monotonic()
    with pytest.raises(Alarm):
        mutex.acquire("k", timeout=10, interval=0.05)
    waited = time.monotonic() - started
    assert waited < 2.0, f"the alarm was waited out ({waited:.2f} s)"
    assert holder.release() is True
    lease = mutex.acquire("k", timeout=5)  # the cache (its connection) still works
    lease.release()


def test_an_alarm_at_any_moment_of_a_cycle_leaves_no_record(mutex, alarm):
    """Alarms at random moments of acquire/release cycles, wherever they land inside the
    library (before, inside or after a write, in the lease's construction, in a release):
    the key is never left held by the interrupted caller. (A caller that got its lease
    releases it: the lease is in hand as soon as acquire returns.)"""
    rng = random.Random(20)
    interrupted = 0
    for _ in range(40):
        lease = None
        signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.0002, 0.004))
        # Bounded: an alarm the library swallowed would loop here for ever (a CI run once
        # hung in this loop on Redis, cycling normally: the alarm was lost, cause unknown).
        give_up = time.monotonic() + 20
        try:
            while time.monotonic() < give_up:
                lease = mutex.acquire("k", timeout=5)
                lease.release()
                lease = None
        except Alarm:
            interrupted += 1
        signal.setitimer(signal.ITIMER_REAL, 0)
        if lease is not None:
            lease.release()  # acquire had returned: the lease was the caller's to free
        assert not mutex.locked("k"), "an interrupted acquire or release left its record"
    assert interrupted == 40


def test_a_disk_wait_is_cut_short_by_the_alarm_too(tmp_path, alarm):
    """DiskCache blocks on its futex gate: the alarm still ends the wait promptly."""
    cache = DiskCache(tmp_path / "gate")
    Mutex(cache).acquire("k")
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    started = time.monotonic()
    with pytest.raises(Alarm):
        Mutex(cache).acquire("k", timeout=10)
    assert time.monotonic() - started < 2.0


@pytest.mark.parametrize("where", ["_sync", "_book_next"])
def test_an_interrupt_at_the_blocks_door_leaves_no_record(mutex, monkeypatch, where):
    """A signal handler's exception landing in ``Lease.__enter__`` (at its first line,
    ``_sync``, where no ``__exit__`` follows; or inside it, ``_book_next``, where the
    reviewer's alarms landed): ``with_simple_mutex`` frees the record before the
    exception leaves. Before, the key stayed held for the whole lease."""
    from simple_mutex import Lease, with_simple_mutex

    original = getattr(Lease, where)
    fired = []

    def ring_once(self, *args):  # type: ignore[no-untyped-def]
        if not fired:
            fired.append(1)
            raise Alarm("time is up")
        return original(self, *args)

    monkeypatch.setattr(Lease, where, ring_once)
    guarded = with_simple_mutex(lambda: "ran", key="k", cache=mutex.cache, lease=30)
    with pytest.raises(Alarm):
        guarded()
    assert fired == [1]
    assert not Mutex(mutex.cache).locked("k"), "the interrupted call left its record"


def test_an_interrupt_as_postgres_enters_a_session_leaves_the_cache_usable():
    """A signal handler's exception can land as a ``@contextmanager``'s ``__enter__``
    returns (CPython runs pending signal handlers when a call returns). Raised there, at
    each such point of the library an acquire and release pass through, its traceback
    kept alive (a log record, a stored failure, as RQ and Celery keep them): the next call
    on the cache still answers. Before, PostgresCache took its session guard inside the
    generator, which then sat suspended holding it, and every later call hung (so the
    probe runs in a process of its own, which a hang cannot take the suite down with)."""
    probe = Path(__file__).with_name("enter_probe.py")
    try:
        done = subprocess.run(
            [sys.executable, str(probe), POSTGRES_URL], capture_output=True, text=True, timeout=90
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the probe hung: an interrupted call left the cache's guard held")
    assert done.returncode == 0, done.stdout + done.stderr
    points = int(done.stdout.split()[-1])
    assert points >= 1, "no interrupt landed: the probe no longer reaches the session"
