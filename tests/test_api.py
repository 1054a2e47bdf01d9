"""The user API over the local caches: keys and prefixes, timeouts, holder() and locked(),
a semaphore's holders, caches from URLs, unclear writes, tokens, take-over and
release_where. Grant, busy, fences, stale holders and wake-ups are the behaviour suite's
(tests/behaviour.py), run on every tier."""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from datetime import datetime, timedelta, timezone

import pytest

from simple_mutex import (
    ConstraintError,
    Holder,
    InMemoryCache,
    MalfunctionError,
    Mutex,
    Semaphore,
    SimpleMutexAcquireTimeoutError,
    cache_from_url,
)
from simple_mutex._core.keys import encode_key

pytestmark = pytest.mark.fast

# -- keys, prefixes, timeouts (grant, busy, release, fences: tests/behaviour.py) ------


def test_prefixes_and_key_encoding_keep_locks_apart(memory_cache, key):
    """The same key under two prefixes is two locks; so are keys differing only in
    characters the encoding must escape ('a/b', 'a%2Fb', 'a*b', 'a#1'), long keys, and a
    key that spells out a long key's hashed form."""
    a, b = Mutex(memory_cache, prefix="a."), Mutex(memory_cache, prefix="b.")
    assert a.try_acquire(key) is not None
    assert b.try_acquire(key) is not None
    assert a.try_acquire(key) is None
    long_a, long_b = "x" * 300 + "a", "x" * 300 + "b"
    lookalike = encode_key(long_a)  # a key spelling out long_a's hashed form
    keys = ["a/b", "a%2Fb", "a*b", "a#1", "a", "ü", long_a, long_b, lookalike]
    leases = [a.acquire(k, timeout=0) for k in keys]
    assert [lease.key for lease in leases] == keys
    assert all(a.locked(k) for k in keys)


def test_a_key_past_the_limit_is_refused_with_a_short_message(memory_cache):
    """A lock key of at most MAX_USER_KEY characters is taken; a longer one (a 10 MB one
    was stored whole in every record) is refused wherever a key enters, by a
    ConstraintValueError that names the limit and the fix and quotes only the key's
    start; no error message, whatever it quotes, runs past MAX_MESSAGE."""
    from simple_mutex import ConstraintValueError, with_simple_mutex
    from simple_mutex._core.keys import MAX_USER_KEY
    from simple_mutex.busy.line import Lines
    from simple_mutex.errors import MAX_MESSAGE

    mutex, semaphore = Mutex(memory_cache), Semaphore(memory_cache, permits=2)
    with mutex.acquire("k" * MAX_USER_KEY) as lease:
        assert lease.key == "k" * MAX_USER_KEY
    huge = "k" * 10_000_000

    @with_simple_mutex(cache=memory_cache, key="order.{order_id}")
    def charge(order_id: str) -> None:
        raise AssertionError("never runs")

    attempts = [
        lambda: mutex.acquire(huge),
        lambda: mutex.try_acquire(huge),
        lambda: mutex.holder(huge),
        lambda: semaphore.acquire(huge),
        lambda: Lines(memory_cache, lease=10).take(huge),
        lambda: charge(huge),
    ]
    for attempt in attempts:
        with pytest.raises(ConstraintValueError, match=f"at most {MAX_USER_KEY} characters") as e:
            attempt()
        assert "hexdigest" in str(e.value)
        assert len(str(e.value)) < 400
    assert len(str(MalfunctionError("x" * 1_000_000))) <= MAX_MESSAGE
    assert len(str(ConstraintError(f"bad prefix {huge!r}"))) <= MAX_MESSAGE


@pytest.mark.parametrize(
    "timeout",
    [0, 0.2, timedelta(milliseconds=200), {"milliseconds": 200}],
    ids=["zero", "seconds", "timedelta", "mapping"],
)
def test_acquire_on_a_busy_key_times_out_after_about_the_timeout(any_cache, key, timeout):
    """A busy key makes acquire(timeout=t) raise SimpleMutexAcquireTimeoutError, with the
    key, after about t (at once for 0); t may be seconds, a timedelta or a mapping."""
    mutex = Mutex(any_cache, lease={"minutes": 1})
    holder = mutex.acquire(key)
    seconds = 0.0 if timeout == 0 else 0.2
    start = time.monotonic()
    with pytest.raises(SimpleMutexAcquireTimeoutError) as info:
        mutex.acquire(key, timeout=timeout, interval=0.05)
    elapsed = time.monotonic() - start
    assert seconds - 0.01 <= elapsed < seconds + 0.5
    assert info.value.key == key
    assert holder.release() is True


# -- holder() --------------------------------------------------------------------------


def test_holder_describes_the_holder_with_aware_utc_times(any_cache, key):
    """holder() is None (holders() empty) for a free key; held, it gives host, pid, label
    (acquire's, else the Mutex's), fence and UTC-aware acquired/expiry times."""
    mutex = Mutex(any_cache, lease=60, label="default")
    assert mutex.holder(key) is None
    assert mutex.holders(key) == []
    before = datetime.now(timezone.utc)
    lease = mutex.acquire(key, label="nightly-report")
    after = datetime.now(timezone.utc)
    holder = mutex.holder(key)
    assert isinstance(holder, Holder)
    assert mutex.holders(key) == [holder]
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
    lease.release()
    assert mutex.holder(key) is None
    mutex.acquire(key)
    assert mutex.holder(key).label == "default"  # type: ignore[union-attr]


def test_holder_is_a_frozen_snapshot_that_never_reveals_the_token(any_cache, key):
    """The secret token is in no field of Holder, nor in its repr, nor in the Lease repr;
    Holder is immutable."""
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
    with pytest.raises(dataclasses.FrozenInstanceError):
        holder.pid = 1  # type: ignore[misc]


def test_tokens_are_unique_per_acquire(memory_cache):
    """Every grant gets its own unguessable token."""
    mutex = Mutex(memory_cache)
    tokens = {mutex.acquire(f"k{i}").token for i in range(200)}
    assert len(tokens) == 200


# -- Semaphore (permits, slots, fences, wake-ups: tests/behaviour.py) ------------------


def test_semaphore_locked_means_no_permit_is_free_and_holders_lists_each(any_cache, key):
    """locked() is False while any permit is free, True only when all are taken;
    holders() names each taken permit with its slot and fence."""
    sem = Semaphore(any_cache, permits=2)
    assert sem.locked(key) is False
    a = sem.acquire(key, timeout=0)
    assert sem.locked(key) is False
    b = sem.acquire(key, timeout=0)
    assert sem.locked(key) is True
    assert sorted((h.slot, h.fence) for h in sem.holders(key)) == sorted(
        (lease.slot, lease.fence) for lease in (a, b)
    )
    a.release()
    assert sem.locked(key) is False
    c = sem.acquire(key, timeout=0)
    assert c.slot == a.slot
    assert {b.slot, c.slot} == {0, 1}


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


class LostReply(InMemoryCache):
    """The first put lands, but its caller sees a timeout (the reply was lost)."""

    name = "lossy"
    driver_errors = (TimeoutError,)  # its driver's socket timeouts escape it raw
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
