"""The behaviour suite: what a Mutex and a Semaphore promise, checked on every tier.

Like ``contract.py`` for the cache contract, a tier's test module subclasses the classes
that apply to it and provides a ``url`` fixture; every cache, here and in the child
processes, is built from that URL with ``cache_from_url``:

``LockBehaviour``
    every tier: grant and busy, a stale holder refused, semaphore permits, and
    ``import simple_mutex`` importing no driver (building the tier's cache: only its own).
``NotifyBehaviour``
    tiers that wake waiters: a release hands the lock on within ``WAKE_BOUND``, not after
    the 5 s poll (a mutex, a semaphore's freed slot, an asyncio waiter).
``SharedBehaviour``
    tiers shared between processes: spawned OS processes exclude each other (and a
    semaphore admits its permits); a SIGKILLed holder's lock is taken over after its
    lease with a larger fence; an entry another program wrote and an unreachable store
    are each a prompt ``MalfunctionError`` naming the backend, operation and key. Hooks:
    ``write_foreign(url, cache_key) -> url`` and ``unreachable_url(tmp_path)``.

Every lock key starts with ``PREFIX`` (the Mutex prefix), one per run, so a tier module
can find and drop what this suite wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import procs
import pytest
from workers import ReleaseLater

from simple_mutex import (
    ConditionalCache,
    MalfunctionError,
    Mutex,
    Semaphore,
    SimpleMutexAcquireTimeoutError,
    SimpleMutexLeaseExpiredError,
    cache_from_url,
    events,
)
from simple_mutex.caches import registry
from simple_mutex.events import LockEvent

PREFIX = f"b{uuid.uuid4().hex[:8]}."
POLL = 5.0  # the poll interval of notified waiters: a hand-off by poll would take seconds
WAKE_BOUND = POLL / 2  # a notified waiter runs within this after the release; a poll: POLL
PROCESSES = 4


def new_key() -> str:
    return f"k{uuid.uuid4().hex[:12]}"


@contextlib.contextmanager
def granted() -> Iterator[list[LockEvent]]:
    """The ``acquired`` events emitted inside the block, in order."""
    seen: list[LockEvent] = []
    stop = events.subscribe(lambda event: seen.append(event) if event.kind == "acquired" else None)
    try:
        yield seen
    finally:
        stop()


def assert_each_fails(cache: ConditionalCache, *operations: str, within: float = 5.0) -> None:
    """Each named cache operation on key "k" raises a MalfunctionError naming the cache,
    the operation and the key, within ``within`` seconds."""
    calls = {
        "get": lambda: cache.get("k"),
        "put_if_absent": lambda: cache.put_if_absent("k", "v", ttl=1),
        "compare_and_set": lambda: cache.compare_and_set("k", "v", ttl=1, version="1.1"),
        "compare_and_delete": lambda: cache.compare_and_delete("k", version="1.1"),
        "wait": lambda: cache.wait(["k"], 0.1),
    }
    for operation in operations or calls:
        start = time.monotonic()
        with pytest.raises(MalfunctionError) as info:
            calls[operation]()
        assert time.monotonic() - start < within
        assert f"{cache.name} cache" in str(info.value)
        assert f"failed during {operation} on 'k'" in str(info.value)


class LockBehaviour:
    """Every tier. Subclass me and define a ``url`` fixture."""

    lapse_wait = 1.0
    """How long a new holder may wait for a lapsed 0.3 s lease to come free (seconds):
    longer where the server rounds leases up (etcd: whole seconds)."""

    @pytest.fixture
    def url(self) -> str:  # pragma: no cover - always overridden
        raise NotImplementedError

    @pytest.fixture
    def cache(self, url: str) -> Iterator[ConditionalCache]:
        cache = cache_from_url(url)
        yield cache
        close = getattr(cache, "close", None)
        if callable(close):
            close()

    def test_a_mutex_grants_refuses_and_frees(self, cache: ConditionalCache) -> None:
        """Grant (slot 0, the key verbatim), busy for a caller with a Mutex of its own,
        holder() names us, release frees, and the next grant has a larger fence."""
        mutex, key = Mutex(cache, lease=30, prefix=PREFIX), new_key()
        assert not mutex.locked(key)
        first = mutex.acquire(key, timeout=5)
        assert (first.key, first.slot) == (key, 0)
        assert Mutex(cache, prefix=PREFIX).try_acquire(key) is None
        assert mutex.locked(key)
        holder = mutex.holder(key)
        assert holder is not None
        assert (holder.pid, holder.fence) == (os.getpid(), first.fence)
        assert first.release() is True
        assert not mutex.locked(key)
        second = mutex.acquire(key, timeout=0)
        assert second.fence > first.fence
        assert second.release() is True

    def test_a_stale_holders_release_and_renew_are_refused(self, cache: ConditionalCache) -> None:
        """A holder whose lease lapsed (paused past it) can neither free nor extend the new
        holder's lock, and the new holder's fence is larger."""
        key = new_key()
        short = Mutex(cache, lease=0.3, interval=0.05, prefix=PREFIX)
        stale = short.acquire(key, timeout=5)
        time.sleep(0.45)
        fresh = Mutex(cache, lease=30, prefix=PREFIX).acquire(key, timeout=self.lapse_wait)
        assert fresh.fence > stale.fence
        assert stale.release() is False
        with pytest.raises(SimpleMutexLeaseExpiredError):
            stale.renew()
        holder = short.holder(key)
        assert holder is not None
        assert holder.fence == fresh.fence
        assert fresh.release() is True
        assert short.holder(key) is None

    def test_a_grant_after_a_lapse_reports_that_it_took_over(self, cache: ConditionalCache) -> None:
        """took_over means the same on every tier: an acquire made after a holder left its
        lease to lapse (nobody was waiting on it) says it took over; a first grant and a
        grant after a release do not."""
        key = new_key()
        mutex = Mutex(cache, lease=0.3, prefix=PREFIX)
        with granted() as grants:
            crashed = mutex.acquire(key, timeout=5)  # never released: it lapses
            # Until an acquire would not wait (a tier's lapse margin grows on a loaded
            # machine: a fixed 0.5 s once left the next acquire waiting, not taking over).
            deadline = time.monotonic() + 10
            while mutex.locked(key) and time.monotonic() < deadline:
                time.sleep(0.05)
            mutex.acquire(key, timeout=5).release()
            mutex.acquire(key, timeout=5).release()
        assert [e.took_over for e in grants] == [False, True, False]
        assert grants[0].fence == crashed.fence

    def test_a_semaphore_admits_its_permits_and_no_more(self, cache: ConditionalCache) -> None:
        """Three permits: three holders on distinct slots, a fourth is refused or times out;
        a release lets a blocked fourth in on the freed slot, with a larger fence."""
        key = new_key()
        semaphore = Semaphore(cache, permits=3, lease=30, interval=0.05, prefix=PREFIX)
        leases = [semaphore.acquire(key, timeout=0) for _ in range(3)]
        assert sorted(lease.slot for lease in leases) == [0, 1, 2]
        assert semaphore.try_acquire(key) is None
        with pytest.raises(SimpleMutexAcquireTimeoutError):
            semaphore.acquire(key, timeout=0.2)
        ReleaseLater(0.1, leases[1].release)
        fourth = semaphore.acquire(key, timeout=5)
        assert fourth.slot == leases[1].slot
        assert fourth.fence > leases[1].fence
        assert not leases[1].lost
        for lease in [leases[0], leases[2], fourth]:
            assert lease.release() is True

    @pytest.mark.backends
    def test_only_the_tiers_own_driver_is_imported(self, url: str) -> None:
        """``import simple_mutex`` imports no driver; building this tier's cache imports its
        own driver and no other backend's."""
        scheme = url.partition(":")[0]
        own = {d for b in registry.BACKENDS if scheme in b.schemes for d in b.drivers}
        every = sorted({d for b in registry.BACKENDS for d in b.drivers})
        code = (
            "import json, sys, simple_mutex, simple_mutex.caches\n"
            f"before = [d for d in {every!r} if d in sys.modules]\n"
            f"simple_mutex.cache_from_url({url!r})\n"
            f"print(json.dumps([before, [d for d in {every!r} if d in sys.modules]]))\n"
        )
        run = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=False
        )
        assert run.returncode == 0, run.stderr
        before, after = json.loads(run.stdout)
        assert before == []
        assert set(after) <= own
        assert bool(after) == bool(own)


class NotifyBehaviour:
    """Tiers that wake waiters on release. Mix in with LockBehaviour."""

    def test_a_release_wakes_a_blocked_waiter_not_its_poll(self, cache: ConditionalCache) -> None:
        """A waiter blocked in acquire (poll 5 s) holds the lock well within WAKE_BOUND of
        the release."""
        mutex, key = Mutex(cache, lease=30, interval=POLL, prefix=PREFIX), new_key()
        release = ReleaseLater(0.3, mutex.acquire(key).release)
        taken = mutex.acquire(key, timeout=2 * POLL)
        assert release.woke() < WAKE_BOUND
        assert taken.release() is True

    def test_a_semaphore_release_wakes_a_waiter_on_any_slot(self, cache: ConditionalCache) -> None:
        """Both permits held; a waiter blocked on both slots gets the one freed, at once."""
        key = new_key()
        semaphore = Semaphore(cache, permits=2, lease=30, interval=POLL, prefix=PREFIX)
        leases = [semaphore.acquire(key, timeout=0) for _ in range(2)]
        release = ReleaseLater(0.3, leases[1].release)
        third = semaphore.acquire(key, timeout=2 * POLL)
        assert release.woke() < WAKE_BOUND
        assert third.slot == leases[1].slot
        assert third.fence > leases[1].fence
        assert third.release() is True
        assert leases[0].release() is True

    def test_an_async_waiter_is_woken_by_the_release(self, cache: ConditionalCache) -> None:
        """acquire_async blocks without holding the event loop and takes the lock within
        WAKE_BOUND of a release, not after its 5 s poll."""
        mutex, key = Mutex(cache, lease=30, interval=POLL, prefix=PREFIX), new_key()

        async def scenario() -> float:
            held = await mutex.acquire_async(key)
            waiter = asyncio.create_task(mutex.acquire_async(key, timeout=2 * POLL))
            await asyncio.sleep(0.3)  # the waiter is blocked by now
            released = time.monotonic()
            await asyncio.to_thread(held.release)
            lease = await asyncio.wait_for(waiter, 2 * POLL)
            took = time.monotonic() - released
            await asyncio.to_thread(lease.release)
            return took

        assert asyncio.run(scenario()) < WAKE_BOUND


class SharedBehaviour(LockBehaviour):
    """Tiers shared between processes (disk and the servers)."""

    takeover_slack = 0.5
    """How soon after a dead holder's lease ends the lock must be taken over (seconds)."""

    def write_foreign(self, url: str, cache_key: str) -> str:  # pragma: no cover
        """Write, as another program would, an entry this library cannot have written at
        ``cache_key``; return the URL of the cache that now holds it."""
        raise NotImplementedError

    def unreachable_url(self, tmp_path: Path) -> str:  # pragma: no cover
        """A URL of this tier whose store does not answer."""
        raise NotImplementedError

    def contend(
        self, url: str, tmp_path: Path, children: list[Any], permits: int, runs: int, hold: float
    ) -> list[procs.Row]:
        """PROCESSES spawned processes, ``runs`` sections each on one key; their rows."""
        counter = tmp_path / "counter"
        counter.write_text("0")
        logs = [tmp_path / f"log-{n}" for n in range(PROCESSES)]
        barrier = procs.CTX.Barrier(PROCESSES)
        key = new_key()
        for log in logs:
            args = (url, PREFIX, key, permits, runs, hold, str(counter), str(log), barrier)
            children.append(procs.start(procs.contend, *args))
        procs.join_all(children, timeout=120)
        rows = procs.read_rows(logs)
        assert len(rows) == PROCESSES * runs
        assert [row for row in rows if row.lost] == []  # a 30 s lease cannot lapse here
        assert len({row.pid for row in rows}) == PROCESSES
        return rows

    @pytest.mark.backends
    def test_processes_exclude_each_other(self, url: str, tmp_path: Path, children) -> None:
        """4 processes x 30 read-modify-writes of one counter file under one mutex: no
        increment lost, no two sections overlap, each read the count the one before wrote,
        the lock changed hands often, and fences grow in the order the sections ran."""
        rows = self.contend(url, tmp_path, children, permits=1, runs=30, hold=0.001)
        assert [(a, b) for a, b in itertools.pairwise(rows) if b.start < a.end] == []
        assert [row.seen for row in rows] == list(range(len(rows)))
        assert (tmp_path / "counter").read_text() == str(len(rows))
        handoffs = sum(a.pid != b.pid for a, b in itertools.pairwise(rows))
        assert handoffs >= PROCESSES * 3, f"only {handoffs} hand-offs: processes ran in turn"
        fences = [row.fence for row in rows]
        assert all(a < b for a, b in itertools.pairwise(fences)), fences

    @pytest.mark.backends
    def test_a_semaphore_admits_two_processes_at_most(
        self, url: str, tmp_path: Path, children
    ) -> None:
        """4 processes under Semaphore(permits=2): never more than two sections at once,
        two did run at once, and each permit's fences grow."""
        rows = self.contend(url, tmp_path, children, permits=2, runs=10, hold=0.02)
        assert procs.max_overlap(rows) == 2
        assert {row.slot for row in rows} == {0, 1}
        for slot in (0, 1):
            fences = [row.fence for row in rows if row.slot == slot]
            assert all(a < b for a, b in itertools.pairwise(fences)), (slot, fences)

    def killed_holder(
        self, url: str, key: str, lease: float, tmp_path: Path, children: list[Any]
    ) -> dict[str, Any]:
        """A spawned process takes ``key`` for ``lease`` seconds (no renewal) and is
        SIGKILLed holding it: what it reported (pid, fence, monotonic time granted)."""
        info = tmp_path / "holder.json"
        holder_proc = procs.start(procs.hold_forever, url, PREFIX, key, lease, str(info))
        children.append(holder_proc)
        assert procs.wait_for_file(info, timeout=30), "the holder never reported its lease"
        held: dict[str, Any] = procs.read_json(info)
        os.kill(holder_proc.pid, signal.SIGKILL)
        holder_proc.join(5)
        return held

    @pytest.mark.backends
    def test_a_sigkilled_holders_lock_is_taken_over_after_its_lease(
        self, url: str, cache: ConditionalCache, tmp_path: Path, children
    ) -> None:
        """A holder killed with SIGKILL never releases: its lock stays held (holder() names
        the dead pid) until its 1 s lease ends, then it is taken over soon after, with a
        larger fence."""
        key, lease = new_key(), 1.0
        held = self.killed_holder(url, key, lease, tmp_path, children)
        mutex = Mutex(cache, lease=30, interval=0.05, prefix=PREFIX)
        seen = mutex.holder(key)
        assert seen is not None
        assert (seen.pid, seen.fence) == (held["pid"], held["fence"])
        assert mutex.try_acquire(key) is None
        # Try every 20 ms: the last try that found it busy says until when the dead
        # holder's lock held, whatever the machine's load (a try delayed on its way only
        # reaches the server later, when the lock is more likely free, never earlier).
        last_busy, deadline = time.monotonic(), time.monotonic() + 10
        taken = None
        while taken is None:
            assert time.monotonic() < deadline, "the dead holder's lock never freed"
            asked = time.monotonic()
            taken = mutex.try_acquire(key)
            if taken is None:
                last_busy = asked
                time.sleep(0.02)
        at = time.monotonic()
        # The record's expiry counts from a clock read during the acquire's request: not
        # before it was asked for (a slow server makes the reply come well after).
        assert at >= held["asked"] + lease - 0.05
        assert last_busy < held["granted"] + lease + self.takeover_slack
        assert taken.fence > held["fence"]
        assert taken.release() is True
        assert not mutex.locked(key)

    @pytest.mark.backends
    def test_an_acquire_after_a_sigkilled_holder_reports_that_it_took_over(
        self, url: str, cache: ConditionalCache, tmp_path: Path, children
    ) -> None:
        """A holder in another process is SIGKILLed and nobody waits for its lock: the
        first acquire after its lease ended says took_over (events, spans, timeline), and
        the next one, after a release, does not."""
        key, lease = new_key(), 0.5
        held = self.killed_holder(url, key, lease, tmp_path, children)
        time.sleep(max(0.0, held["granted"] + lease + 0.3 - time.monotonic()))
        mutex = Mutex(cache, lease=30, prefix=PREFIX)
        with granted() as grants:
            taken = mutex.acquire(key, timeout=5)
            assert taken.release() is True
            mutex.acquire(key, timeout=5).release()
        assert [e.took_over for e in grants] == [True, False]
        assert grants[0].fence == taken.fence > held["fence"]

    def test_an_entry_another_program_wrote_is_a_malfunction(self, url: str) -> None:
        """One rule on every tier: an entry this library did not write is a MalfunctionError
        naming the backend, the key and the likely cause, from acquire and holder() alike;
        never a busy key, which would hide it behind timeouts."""
        key = new_key()
        cache = cache_from_url(self.write_foreign(url, PREFIX + key))
        mutex = Mutex(cache, lease=30, prefix=PREFIX)
        for call in (lambda: mutex.acquire(key, timeout=0), lambda: mutex.holder(key)):
            with pytest.raises(MalfunctionError) as info:
                call()
            assert info.value.key == key
            assert f"{cache.name} cache found a malformed entry for " in str(info.value)
            assert key in str(info.value)
            assert "another program" in str(info.value)

    def test_an_unreachable_store_is_a_prompt_malfunction(self, tmp_path: Path) -> None:
        """A store that does not answer: each operation raises MalfunctionError naming the
        backend, the operation and the key, and a timed acquire fails within seconds."""
        cache = cache_from_url(self.unreachable_url(tmp_path))
        assert_each_fails(cache, "get", "put_if_absent", within=3.0)
        start = time.monotonic()
        with pytest.raises(MalfunctionError) as info:
            Mutex(cache, prefix=PREFIX).acquire("job", timeout=1)
        assert info.value.key == "job"
        assert time.monotonic() - start < 3.0
