"""The cache contract (with its wake-ups) run against the local caches, the behaviour suite
on InMemoryCache (DiskCache's is in test_disk_processes.py), and what only the local caches
promise: no lost wake-up even without a failed put, a wake-up on expiry, asyncio waits,
and expiry on the cache's own clock."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from contextlib import closing
from pathlib import Path

import pytest
from behaviour import LockBehaviour, NotifyBehaviour
from contract import CacheContract, NotifyContract, unique_key
from workers import ReleaseLater

from simple_mutex import DiskCache, InMemoryCache, SimpleCacheConditionError
from simple_mutex.caches.disk import FILENAME

pytestmark = pytest.mark.fast

# How soon after a release a notified waiter must be running again. A poll would take the
# whole wait timeout (5 s below); a notification takes microseconds. 50 ms leaves room for
# a loaded 2-core machine while still telling the two apart by two orders of magnitude.
WAKE_BOUND = 0.05
LONG_WAIT = 5.0


class TestInMemoryCacheContract(NotifyContract, CacheContract):
    """InMemoryCache passes the shared contract; a release wakes waiters (a condition)."""

    @pytest.fixture
    def cache(self) -> InMemoryCache:
        return InMemoryCache()


class TestDiskCacheContract(NotifyContract, CacheContract):
    """DiskCache passes the shared contract; a release wakes waiters (a futex gate)."""

    @pytest.fixture
    def cache(self, tmp_path: Path) -> DiskCache:
        return DiskCache(tmp_path / "locks")


class TestMemoryBehaviour(NotifyBehaviour, LockBehaviour):
    """The behaviour suite on one process's InMemoryCache (threads and asyncio)."""

    @pytest.fixture
    def url(self) -> str:
        return "memory://"


def test_wait_returns_at_once_when_any_key_is_free(any_cache):
    """No lost wake-up on the local caches even without a failed put first: a key freed
    before wait() was entered, or one of several keys free, returns at once."""
    cache = any_cache
    key, held = unique_key(), unique_key()
    cache.compare_and_delete(key, version=cache.put_if_absent(key, "v1", ttl=60).version)
    cache.put_if_absent(held, "v1", ttl=60)
    for keys in ([key], [held, key]):
        start = time.monotonic()
        cache.wait(keys, LONG_WAIT)
        assert time.monotonic() - start < WAKE_BOUND


def test_wait_returns_when_the_entry_expires(any_cache):
    """Expiry frees a key without any release: wait() must not sleep past it."""
    cache = any_cache
    key = unique_key()
    cache.put_if_absent(key, "v1", ttl=0.1)
    start = time.monotonic()
    cache.wait([key], LONG_WAIT)
    assert time.monotonic() - start < 0.1 + WAKE_BOUND + 0.1


@pytest.mark.parametrize("store", ["new", "from before waiter marks"])
def test_a_disk_release_says_whether_it_woke_a_waiter(tmp_path: Path, store: str):
    """compare_and_delete is True when a waiter was blocked on the key (the engine then
    lets it go first), False when nobody waited; a store an older version wrote (no
    ``waiting`` column) is brought up to date on first use."""
    if store != "new":
        (tmp_path / "locks").mkdir()
        with closing(sqlite3.connect(tmp_path / "locks" / FILENAME)) as conn:
            conn.execute(
                "CREATE TABLE entries (key TEXT PRIMARY KEY, value TEXT, version TEXT NOT NULL, "
                "fence INTEGER NOT NULL, expires_at REAL NOT NULL) WITHOUT ROWID"
            )
    cache, key = DiskCache(tmp_path / "locks"), unique_key()
    entry = cache.put_if_absent(key, "v1", ttl=60)
    assert cache.compare_and_delete(key, version=entry.version) is False
    entry = cache.put_if_absent(key, "v2", ttl=60)
    waiter = threading.Thread(target=cache.wait, args=([key], LONG_WAIT))
    waiter.start()
    time.sleep(0.1)
    assert cache.compare_and_delete(key, version=entry.version) is True
    waiter.join(WAKE_BOUND)
    assert not waiter.is_alive()


def test_memory_wait_async_is_woken_by_a_release_and_returns_at_once_on_a_free_key():
    """wait_async parks on the event loop and wakes as soon as a thread releases; on a
    free key it returns without waiting (no lost wake-up)."""
    cache = InMemoryCache()
    key = unique_key()
    entry = cache.put_if_absent(key, "v1", ttl=60)

    async def main() -> tuple[float, float]:
        release = ReleaseLater(0.05, lambda: cache.compare_and_delete(key, version=entry.version))
        await cache.wait_async([key], LONG_WAIT)
        woken = release.woke()
        start = time.monotonic()
        await cache.wait_async([key], LONG_WAIT)
        return woken, time.monotonic() - start

    assert max(asyncio.run(main())) < WAKE_BOUND


def test_memory_fence_survives_dropping_freed_keys():
    """InMemoryCache drops freed keys, yet a key's next grant still has a larger fence."""
    cache = InMemoryCache()
    key = unique_key()
    first = cache.put_if_absent(key, "v1", ttl=60)
    cache.compare_and_delete(key, version=first.version)
    assert cache.get(key) is None
    for i in range(50):  # other keys' traffic in between must not reset anything
        other = unique_key()
        entry = cache.put_if_absent(other, f"o{i}", ttl=60)
        cache.compare_and_delete(other, version=entry.version)
    assert cache.put_if_absent(key, "v2", ttl=60).fence > first.fence


class SettableClock:
    """A wall clock that only moves when told to."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_expiry_follows_the_caches_own_clock(kind: str, tmp_path: Path):
    """Expiry follows the cache's clock: live until it passes expires_at, then gone."""
    clock = SettableClock()
    cache = InMemoryCache(clock=clock) if kind == "memory" else DiskCache(tmp_path, clock=clock)
    key = unique_key()
    entry = cache.put_if_absent(key, "v1", ttl=10)
    assert entry.expires_at == clock.now + 10
    clock.now += 9.999
    assert cache.get(key) == entry
    with pytest.raises(SimpleCacheConditionError):
        cache.put_if_absent(key, "v2", ttl=10)
    renewed = cache.compare_and_set(key, "v1", ttl=10, version=entry.version)
    clock.now += 9.999  # past the first expiry, inside the renewed one
    assert cache.get(key) == renewed
    clock.now += 0.002
    assert cache.get(key) is None
    with pytest.raises(SimpleCacheConditionError):
        cache.compare_and_delete(key, version=renewed.version)
    taken = cache.put_if_absent(key, "v2", ttl=10)
    assert taken.fence > entry.fence
