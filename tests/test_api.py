"""The user API: Mutex and Semaphore over the local caches, holder() and locked(),
fences across holders, waiting with a timeout, and hand-off by notification."""

from __future__ import annotations

import dataclasses
import itertools
import os
import socket
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest

from simple_mutex import (
    ConstraintError,
    Holder,
    InMemoryCache,
    Lease,
    MalfunctionError,
    Mutex,
    Semaphore,
    SimpleMutexAcquireTimeoutError,
    cache_from_url,
)


def utc_now() -> datetime:
    return datetime.now(timezone.utc)


# -- acquire, release, locked ----------------------------------------------------------


def test_acquire_returns_a_lease_and_locks_the_key(any_cache, key):
    """acquire() on a free key returns a Lease; the key is then locked until released."""
    mutex = Mutex(any_cache)
    assert mutex.locked(key) is False
    lease = mutex.acquire(key, timeout=0)
    assert isinstance(lease, Lease)
    assert lease.key == key
    assert lease.slot == 0
    assert mutex.locked(key) is True
    assert lease.release() is True
    assert mutex.locked(key) is False


def test_try_acquire_returns_none_when_busy_and_a_lease_when_free(any_cache, key):
    """try_acquire makes one attempt and never raises for a busy key."""
    mutex = Mutex(any_cache)
    first = mutex.try_acquire(key)
    assert first is not None
    assert mutex.try_acquire(key) is None
    first.release()
    second = mutex.try_acquire(key)
    assert second is not None
    assert second.fence > first.fence


def test_two_mutex_objects_on_one_cache_exclude_each_other(any_cache, key):
    """Exclusion comes from the cache, not the Mutex object."""
    a, b = Mutex(any_cache), Mutex(any_cache)
    lease = a.acquire(key, timeout=0)
    assert b.try_acquire(key) is None
    assert b.locked(key)
    lease.release()
    assert b.try_acquire(key) is not None


def test_prefixes_separate_lock_spaces(memory_cache, key):
    """The same key under two prefixes is two different locks."""
    a = Mutex(memory_cache, prefix="a.")
    b = Mutex(memory_cache, prefix="b.")
    assert a.try_acquire(key) is not None
    assert b.try_acquire(key) is not None
    assert a.try_acquire(key) is None


def test_keys_differing_only_in_unsafe_characters_are_distinct_locks(memory_cache):
    """Encoding keeps keys apart: 'a/b', 'a%2Fb', 'a*b', 'a#1' and a long key each lock alone."""
    mutex = Mutex(memory_cache)
    long_a, long_b = "x" * 300 + "a", "x" * 300 + "b"
    keys = ["a/b", "a%2Fb", "a*b", "a#1", "a", "ü", long_a, long_b]
    leases = [mutex.acquire(k, timeout=0) for k in keys]
    assert [lease.key for lease in leases] == keys
    for k in keys:
        assert mutex.locked(k)


def test_acquire_with_timeout_raises_after_about_the_timeout(memory_cache, key):
    """A busy key makes acquire(timeout=t) raise SimpleMutexAcquireTimeoutError after ~t."""
    mutex = Mutex(memory_cache)
    holder = mutex.acquire(key)
    start = time.monotonic()
    with pytest.raises(SimpleMutexAcquireTimeoutError) as info:
        mutex.acquire(key, timeout=0.2, interval=0.05)
    elapsed = time.monotonic() - start
    assert 0.19 <= elapsed < 1.0
    assert info.value.key == key
    assert holder.release() is True


def test_acquire_timeout_zero_raises_at_once(any_cache, key):
    """timeout=0 on a busy key raises immediately."""
    mutex = Mutex(any_cache)
    mutex.acquire(key)
    start = time.monotonic()
    with pytest.raises(SimpleMutexAcquireTimeoutError):
        mutex.acquire(key, timeout=0)
    assert time.monotonic() - start < 0.5


def test_timeout_accepts_timedelta_and_mapping(memory_cache, key):
    """Wait bounds accept timedelta and {'milliseconds': n} like every duration."""
    mutex = Mutex(memory_cache, lease={"minutes": 1})
    mutex.acquire(key)
    for timeout in (timedelta(milliseconds=50), {"milliseconds": 50}):
        start = time.monotonic()
        with pytest.raises(SimpleMutexAcquireTimeoutError):
            mutex.acquire(key, timeout=timeout, interval=0.01)
        assert 0.045 <= time.monotonic() - start < 1.0


def test_waiter_gets_the_lock_by_notification_not_by_polling(memory_cache, key):
    """With a 10 s poll interval, a waiter still takes the lock within ms of the release."""
    mutex = Mutex(memory_cache)
    first = mutex.acquire(key)
    got: list[tuple[float, Lease]] = []

    def waiter() -> None:
        lease = mutex.acquire(key, timeout=5, interval=10)
        got.append((time.monotonic(), lease))

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    time.sleep(0.05)
    assert got == []
    released_at = time.monotonic()
    first.release()
    thread.join(5)
    assert got, "the waiter never got the lock"
    acquired_at, lease = got[0]
    assert acquired_at - released_at < 0.1
    assert lease.fence > first.fence


def test_waiter_on_disk_cache_gets_the_lock_after_a_release(disk_cache, key):
    """DiskCache has no notification: a waiter gets the lock by polling within ~interval."""
    mutex = Mutex(disk_cache)
    first = mutex.acquire(key)
    threading.Timer(0.1, first.release).start()
    start = time.monotonic()
    lease = mutex.acquire(key, timeout=2, interval=0.02)
    assert 0.09 <= time.monotonic() - start < 1.0
    assert lease.fence > first.fence


def test_threads_never_overlap_under_a_mutex(memory_cache, key):
    """Many threads doing read-modify-write under one key end exact with no overlap."""
    mutex = Mutex(memory_cache, interval=0.01)
    state = {"count": 0, "inside": 0, "overlaps": 0}

    def worker() -> None:
        for _ in range(50):
            with mutex.acquire(key, timeout=10):
                state["inside"] += 1
                if state["inside"] > 1:
                    state["overlaps"] += 1
                value = state["count"]
                time.sleep(0)
                state["count"] = value + 1
                state["inside"] -= 1

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert state == {"count": 300, "inside": 0, "overlaps": 0}


# -- fences ----------------------------------------------------------------------------


def test_fence_strictly_increases_across_release(any_cache, key):
    """Each grant of a key carries a larger fence than the one before, across holders."""
    a, b = Mutex(any_cache), Mutex(any_cache)
    fences = []
    for mutex in (a, b, a, a, b):
        lease = mutex.acquire(key, timeout=0)
        fences.append(lease.fence)
        lease.release()
    assert all(x < y for x, y in itertools.pairwise(fences)), fences


def test_fence_increases_when_a_lapsed_lease_is_taken_over(any_cache, key):
    """A holder that lets its lease lapse is taken over with a larger fence."""
    mutex = Mutex(any_cache, lease=0.1)
    first = mutex.acquire(key)
    time.sleep(0.15)
    second = mutex.acquire(key, timeout=0)
    assert second.fence > first.fence
    holder = mutex.holder(key)
    assert holder is not None
    assert holder.fence == second.fence


def test_lapsed_holder_release_returns_false_and_keeps_the_new_holder(any_cache, key):
    """After a takeover, the stale holder's release() is False and removes nothing."""
    mutex = Mutex(any_cache, lease=0.1)
    stale = mutex.acquire(key)
    time.sleep(0.15)
    fresh = mutex.acquire(key, timeout=0)
    assert stale.release() is False
    assert mutex.locked(key)
    holder = mutex.holder(key)
    assert holder is not None
    assert holder.fence == fresh.fence
    assert fresh.release() is True


# -- holder() --------------------------------------------------------------------------


def test_holder_is_none_for_a_free_key(any_cache, key):
    """holder() of a free (or released) key is None; holders() is empty."""
    mutex = Mutex(any_cache)
    assert mutex.holder(key) is None
    assert mutex.holders(key) == []
    mutex.acquire(key).release()
    assert mutex.holder(key) is None


def test_holder_describes_the_holder_with_aware_utc_times(any_cache, key):
    """holder() gives host, pid, label, fence and UTC-aware acquired/expiry times."""
    mutex = Mutex(any_cache, lease=60, label="nightly-report")
    before = utc_now()
    lease = mutex.acquire(key)
    after = utc_now()
    holder = mutex.holder(key)
    assert isinstance(holder, Holder)
    assert holder.host == socket.gethostname()
    assert holder.pid == os.getpid()
    assert holder.label == "nightly-report"
    assert holder.fence == lease.fence
    assert holder.slot == 0
    for moment in (holder.acquired_at, holder.expires_at, lease.expires_at):
        assert moment.tzinfo is not None
        assert moment.utcoffset() == timedelta(0)
    slack = timedelta(seconds=1)
    assert before - slack <= holder.acquired_at <= after + slack
    assert holder.expires_at - holder.acquired_at == pytest.approx(
        timedelta(seconds=60), abs=timedelta(seconds=1)
    )
    assert lease.expires_at == pytest.approx(holder.expires_at, abs=timedelta(seconds=1))


def test_acquire_label_overrides_the_mutex_label(memory_cache, key):
    """A label given to acquire() is the one holder() reports."""
    mutex = Mutex(memory_cache, label="default")
    mutex.acquire(key, label="job-42")
    holder = mutex.holder(key)
    assert holder is not None
    assert holder.label == "job-42"


def test_holder_never_reveals_the_token(any_cache, key):
    """The secret token is in no field of Holder, nor in its repr, nor in the Lease repr."""
    mutex = Mutex(any_cache, label="x")
    lease = mutex.acquire(key)
    assert len(lease.token) >= 16
    holder = mutex.holder(key)
    assert holder is not None
    assert lease.token not in repr(holder)
    assert lease.token not in str(holder)
    for field in dataclasses.fields(holder):
        assert lease.token not in str(getattr(holder, field.name))
    assert "token" not in {f.name for f in dataclasses.fields(holder)}
    assert lease.token not in repr(lease)


def test_tokens_are_unique_per_acquire(memory_cache):
    """Every grant gets its own unguessable token."""
    mutex = Mutex(memory_cache)
    tokens = {mutex.acquire(f"k{i}").token for i in range(200)}
    assert len(tokens) == 200


def test_holder_is_frozen(memory_cache, key):
    """Holder is an immutable snapshot."""
    mutex = Mutex(memory_cache)
    mutex.acquire(key)
    holder = mutex.holder(key)
    with pytest.raises(dataclasses.FrozenInstanceError):
        holder.pid = 1  # type: ignore[misc,union-attr]


# -- Semaphore -------------------------------------------------------------------------


def test_semaphore_grants_at_most_permits_leases_on_distinct_slots(any_cache, key):
    """Semaphore(permits=3) grants three leases on slots 0..2 and refuses a fourth."""
    sem = Semaphore(any_cache, permits=3)
    leases = [sem.acquire(key, timeout=0) for _ in range(3)]
    assert sorted(lease.slot for lease in leases) == [0, 1, 2]
    assert sem.try_acquire(key) is None
    with pytest.raises(SimpleMutexAcquireTimeoutError):
        sem.acquire(key, timeout=0)


def test_semaphore_locked_means_no_permit_is_free(any_cache, key):
    """locked() is False while any permit is free, True only when all are taken."""
    sem = Semaphore(any_cache, permits=2)
    assert sem.locked(key) is False
    a = sem.acquire(key, timeout=0)
    assert sem.locked(key) is False
    b = sem.acquire(key, timeout=0)
    assert sem.locked(key) is True
    a.release()
    assert sem.locked(key) is False
    c = sem.acquire(key, timeout=0)
    assert c.slot == a.slot
    assert {b.slot, c.slot} == {0, 1}


def test_semaphore_holders_lists_every_permit(any_cache, key):
    """holders() names each taken permit with its slot and fence."""
    sem = Semaphore(any_cache, permits=3)
    leases = [sem.acquire(key, timeout=0) for _ in range(2)]
    holders = sem.holders(key)
    assert sorted((h.slot, h.fence) for h in holders) == sorted(
        (lease.slot, lease.fence) for lease in leases
    )


def test_semaphore_fence_grows_per_slot_across_release(memory_cache, key):
    """Re-granting a freed permit gives it a larger fence."""
    sem = Semaphore(memory_cache, permits=2)
    a = sem.acquire(key)
    b = sem.acquire(key)
    a.release()
    c = sem.acquire(key, timeout=0)
    assert c.slot == a.slot
    assert c.fence > a.fence
    assert b.release() is True


def test_semaphore_bounds_concurrency_of_threads(memory_cache, key):
    """Threads under Semaphore(permits=2) never run more than two at once."""
    sem = Semaphore(memory_cache, permits=2, interval=0.01)
    lock = threading.Lock()
    active = 0
    peak = 0

    def worker() -> None:
        nonlocal active, peak
        for _ in range(5):
            with sem.acquire(key, timeout=10):
                with lock:
                    active += 1
                    peak = max(peak, active)
                time.sleep(0.005)
                with lock:
                    active -= 1

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert peak <= 2
    assert active == 0
    assert not sem.locked(key)
    assert sem.holders(key) == []


def test_semaphore_waiter_is_woken_by_the_release_of_any_permit(memory_cache, key):
    """A waiter on a full semaphore takes the permit freed by a release, promptly."""
    sem = Semaphore(memory_cache, permits=2)
    a = sem.acquire(key)
    sem.acquire(key)
    threading.Timer(0.05, a.release).start()
    start = time.monotonic()
    lease = sem.acquire(key, timeout=5, interval=10)
    assert time.monotonic() - start < 1.0
    assert lease.slot == a.slot


def test_mutex_is_a_one_permit_space(memory_cache, key):
    """A Mutex is locked after a single acquire (one permit)."""
    mutex = Mutex(memory_cache)
    mutex.acquire(key)
    assert mutex.locked(key)
    assert len(mutex.holders(key)) == 1


# -- caches from URLs and objects ------------------------------------------------------


def test_cache_from_url_memory_and_file(tmp_path, key):
    """memory:// and file:/// build caches; two file caches on one path share locks."""
    memory = cache_from_url("memory://")
    assert isinstance(memory, InMemoryCache)
    assert Mutex(memory).try_acquire(key) is not None
    url = f"file://{tmp_path / 'locks'}"
    first, second = cache_from_url(url), cache_from_url(url)
    assert Mutex(first).try_acquire(key) is not None
    assert Mutex(second).try_acquire(key) is None


def test_an_object_that_is_not_a_cache_is_refused(key):
    """Mutex refuses an object that lacks the contract, naming what to pass."""
    with pytest.raises(ConstraintError, match="ConditionalCache"):
        Mutex(object())


class LostReply(InMemoryCache):
    """The first put lands, but its caller sees a timeout (the reply was lost)."""

    name = "lossy"
    lose = 1

    def put_if_absent(self, key, value, *, ttl):
        entry = super().put_if_absent(key, value, ttl=ttl)
        if self.lose:
            self.lose -= 1
            raise TimeoutError("reply lost")
        return entry


def test_write_whose_reply_was_lost_is_recognised_as_ours(key):
    """Within the wait, a put that landed but whose reply was lost is read back and
    granted."""
    cache = LostReply()
    mutex = Mutex(cache)
    lease = mutex.acquire(key, timeout=5)
    assert cache.lose == 0
    holder = mutex.holder(key)
    assert holder is not None
    assert holder.fence == lease.fence
    assert lease.release() is True
    assert not mutex.locked(key)


def test_a_lost_reply_past_the_deadline_is_a_malfunction_freed_in_the_background(key):
    """With no time left to read back (try once), the fault is raised at once, and the
    write that landed is freed behind the caller's back instead of holding the key for a
    lease."""
    cache = LostReply()
    mutex = Mutex(cache, lease=60)
    with pytest.raises(MalfunctionError) as info:
        mutex.acquire(key, timeout=0)
    assert info.value.key == key
    deadline = time.monotonic() + 5
    while mutex.locked(key) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not mutex.locked(key)
    mutex.acquire(key, timeout=0).release()


def test_failed_write_on_a_held_key_is_a_malfunction_not_a_grant(key):
    """A failed put on a key someone else holds is a MalfunctionError, not a grant."""

    class FailingPut(InMemoryCache):
        name = "failing"
        fail = False

        def put_if_absent(self, key, value, *, ttl):
            if self.fail:
                raise ConnectionResetError("reset")
            return super().put_if_absent(key, value, ttl=ttl)

    cache = FailingPut()
    mutex = Mutex(cache)
    held = mutex.acquire(key)
    cache.fail = True
    with pytest.raises(MalfunctionError) as info:
        mutex.acquire(key, timeout=0)
    assert info.value.key == key
    assert "failing" in str(info.value)
    assert mutex.holder(key).fence == held.fence  # type: ignore[union-attr]


def test_a_chosen_token_marks_the_lease_and_is_checked():
    """acquire(token=...) carries the caller's owner token; a token that could break the
    JSON record is refused without being echoed."""
    mutex = Mutex(InMemoryCache(), lease=30)
    lease = mutex.acquire("k", token="task-1.0")
    assert lease.token == "task-1.0"
    lease.release()
    with pytest.raises(ConstraintError) as refused:
        mutex.acquire("k", token='x"}, "pid": 1, "y": "')
    assert '"pid"' not in str(refused.value)


def test_take_over_replaces_only_a_record_its_owner_test_accepts():
    """take_over swaps an accepted holder's record for ours (same fence); the old lease
    can no longer release; a holder the test rejects is left alone."""
    mutex = Mutex(InMemoryCache(), lease=30)
    first = mutex.acquire("k", token="task-1.0")
    assert mutex.take_over("k", token="task-2.0", owns=lambda t: t.startswith("task-2")) is None
    second = mutex.take_over("k", token="task-1.1", owns=lambda t: t == "task-1.0")
    assert second is not None
    assert second.fence == first.fence
    assert first.release() is False
    assert mutex.locked("k")
    assert second.release() is True


def test_release_where_frees_only_accepted_holders():
    """release_where frees the permits whose token the test accepts, from any lease-less
    caller (a worker's parent), and leaves the others."""
    semaphore = Semaphore(InMemoryCache(), permits=2, lease=30)
    semaphore.acquire("k", token="dead-child.0")
    alive = semaphore.acquire("k", token="live-child.0")
    assert semaphore.release_where("k", lambda t: t.startswith("dead-child")) is True
    assert [h.slot for h in semaphore.holders("k")] == [alive.slot]
    assert semaphore.release_where("k", lambda t: t.startswith("dead-child")) is False
