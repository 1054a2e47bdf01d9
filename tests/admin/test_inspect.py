"""simple_mutex.admin on the local caches: cache keys map back to the user's keys
exactly, semaphore slots are separate holders, and release frees exactly the holder read."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from simple_mutex import ConstraintError, DiskCache, InMemoryCache, Mutex, Semaphore
from simple_mutex._core.keys import MAX_KEY_CHARS, decode_key, encode_key
from simple_mutex.admin import live_locks, locks_of, release, waited_on

pytestmark = pytest.mark.fast

ODD_KEYS = [
    "report.daily",
    "a#b",  # the slot separator, inside a key
    "100% done",
    "ü/ß {tag} [x]*?",
    "x" * 300,  # hashed: the record carries the key
    "é" * 150,  # hashed after percent-encoding
    "mutex.nested",
]


@pytest.mark.parametrize("key", ODD_KEYS)
def test_decode_key_inverts_encode_key_or_says_it_cannot(key: str) -> None:
    """Unhashed keys decode exactly; hashed ones decode to None (never to a wrong key)."""
    encoded = encode_key(key)
    assert decode_key(encoded) == (key if len(encoded) <= MAX_KEY_CHARS else None)


def test_decode_key_refuses_what_encode_key_never_makes() -> None:
    """A lower-case escape, an escape of a safe character, or a stray % is not ours."""
    assert decode_key("a%2b") is None
    assert decode_key("%41") is None
    assert decode_key("%") is None


def test_live_locks_lists_every_key_exactly_as_the_user_spelled_it(any_cache) -> None:
    """Mutex keys of every shape come back verbatim, with their holders and fences."""
    mutex = Mutex(any_cache, label="inspect")
    leases = {key: mutex.acquire(key, timeout=0) for key in ODD_KEYS}
    found = live_locks(any_cache)
    assert [lock.key for lock in found] == sorted(ODD_KEYS)
    for lock in found:
        assert lock.slot == 0
        assert lock.fence == leases[lock.key].fence
        assert lock.holder.label == "inspect"
        assert lock.expires_at == mutex.holder(lock.key).expires_at  # type: ignore[union-attr]


def test_semaphore_slots_are_separate_holders_of_one_key(any_cache) -> None:
    """Three permits held of five: three LiveLocks of one key, one per slot; a key that
    merely starts with the same text is not among them."""
    sem = Semaphore(any_cache, permits=5)
    leases = [sem.acquire("pool", timeout=0) for _ in range(3)]
    sem.acquire("pool-2", timeout=0)
    found = locks_of(any_cache, "pool", prefix="semaphore.")
    assert [(lock.key, lock.slot, lock.fence) for lock in found] == sorted(
        ("pool", lease.slot, lease.fence) for lease in leases
    )
    assert {lock.key for lock in live_locks(any_cache, "semaphore.")} == {"pool", "pool-2"}


def test_freed_and_lapsed_locks_are_not_listed(any_cache) -> None:
    """Only live leases are listed."""
    mutex = Mutex(any_cache, lease=0.05)
    mutex.acquire("lapses", timeout=0)
    Mutex(any_cache).acquire("freed", timeout=0).release()
    kept = Mutex(any_cache).acquire("kept", timeout=0)
    time.sleep(0.1)
    assert [(lock.key, lock.fence) for lock in live_locks(any_cache)] == [("kept", kept.fence)]


def test_foreign_entries_under_the_prefix_are_left_out() -> None:
    """Entries no lock of this library could have written (a malformed slot, an escape
    encode_key never makes) are not shown as locks."""
    cache = InMemoryCache()
    Mutex(cache).acquire("real", timeout=0)
    record = '{"v":1,"token":"t","host":"h","pid":1,"label":null,"acquired_at":0}'
    for foreign in ("mutex.real#x", "mutex.real#0", "mutex.%zz", "mutex.a%2f"):
        cache.put_if_absent(foreign, record, ttl=30)
    assert [lock.key for lock in live_locks(cache)] == ["real"]


def test_release_frees_exactly_the_holder_read_and_logs_it(any_cache, caplog) -> None:
    """The holder read is freed (its own release then finds it gone); a log record says
    who was freed."""
    mutex = Mutex(any_cache)
    lease = mutex.acquire("k", timeout=0)
    (lock,) = locks_of(any_cache, "k")
    with caplog.at_level(logging.WARNING, logger="simple_mutex"):
        assert release(any_cache, lock, by="a test")
    assert "a test freed lock 'k' slot 0" in caplog.text
    assert mutex.holder("k") is None
    assert lease.release() is False


def test_release_refuses_a_new_holder(any_cache) -> None:
    """Read, then the holder releases and another takes the key: nothing is freed."""
    mutex = Mutex(any_cache)
    mutex.acquire("k", timeout=0).release()
    first = mutex.acquire("k", timeout=0)
    (lock,) = locks_of(any_cache, "k")
    first.release()
    second = mutex.acquire("k", timeout=0)
    assert not release(any_cache, lock)
    assert mutex.holder("k").fence == second.fence  # type: ignore[union-attr]


def test_release_still_frees_the_same_holder_after_a_renewal(any_cache) -> None:
    """A renewal changes the version but not the grant (the fence): still freed."""
    mutex = Mutex(any_cache)
    lease = mutex.acquire("k", timeout=0)
    (lock,) = locks_of(any_cache, "k")
    lease.renew()
    assert release(any_cache, lock)
    assert mutex.holder("k") is None


def test_release_refuses_a_take_over_that_kept_the_fence(any_cache) -> None:
    """A take-over (a Celery retry in another worker) keeps the fence but is another
    owner: the operator who read the first holder frees nothing."""
    mutex = Mutex(any_cache, lease=30)
    mutex.acquire("k", token="task-1.0", label="attempt 0")
    (lock,) = locks_of(any_cache, "k")
    mutex.take_over("k", token="task-1.1", owns=lambda t: t == "task-1.0", label="attempt 1")
    assert mutex.holder("k").fence == lock.fence  # type: ignore[union-attr]
    assert not release(any_cache, lock)
    assert mutex.holder("k").label == "attempt 1"  # type: ignore[union-attr]


def test_waited_on_tells_a_blocked_waiter_where_the_cache_can(tmp_path) -> None:
    """DiskCache marks rows its waiters block on; InMemoryCache cannot tell (None)."""
    disk = DiskCache(tmp_path / "locks")
    mutex = Mutex(disk)
    held = mutex.acquire("k", timeout=0)
    (lock,) = locks_of(disk, "k")
    assert waited_on(disk, lock) is False
    waiter = threading.Thread(target=lambda: mutex.acquire("k", timeout=10).release())
    waiter.start()
    deadline = time.monotonic() + 10
    while not waited_on(disk, lock) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert waited_on(disk, lock) is True
    held.release()
    waiter.join(10)
    memory = InMemoryCache()
    Mutex(memory).acquire("k", timeout=0)
    assert waited_on(memory, live_locks(memory)[0]) is None


def test_a_cache_without_scan_is_refused_with_the_caches_that_can() -> None:
    """A cache of the five methods only: ConstraintError naming the caches that scan."""

    class Plain:
        name = "plain"

    with pytest.raises(ConstraintError, match="RedisCache"):
        live_locks(Plain())


def test_an_asyncio_cache_is_refused_naming_the_blocking_one():
    """The operators' tools read blocking caches; an asyncio cache (whose scan is a
    coroutine) gets a ConstraintError naming what to pass, not a coroutine never awaited."""

    class AsyncOnly:
        name = "async-only"

        async def put_if_absent(self, key: str, value: str, *, ttl: float) -> None: ...

        async def scan(self, prefix: str) -> list[tuple[str, object]]:
            return []

    with pytest.raises(ConstraintError, match=r"asyncio cache.*blocking cache"):
        live_locks(AsyncOnly())
