"""What the operator's commands cost on a Redis full of keys the library never wrote:
``show`` reads the key's own records, ``list`` and ``watch`` read the index of their
prefix, and the index itself never decides a grant.

Each test runs its own redis-server (a free port), so the server's command counts
(``INFO commandstats``) are this test's alone.
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest
import redis
from servers import RedisServer, free_port, own_redis

from simple_mutex import Mutex, Semaphore, SimpleMutexAcquireTimeoutError
from simple_mutex.admin import commands, live_locks
from simple_mutex.caches import RedisCache

pytestmark = pytest.mark.backends

UNRELATED = 50_000  # a SCAN of 1,000 a call took 50 calls per pass over them


def _filled(redis_servers: list[RedisServer], tmp_path: Path) -> tuple[str, redis.Redis]:
    url = f"redis://127.0.0.1:{own_redis(redis_servers, tmp_path, free_port()).port}/0"
    admin = redis.Redis.from_url(url)
    for start in range(0, UNRELATED, 10_000):
        admin.mset({f"broker:{n}": "x" for n in range(start, start + 10_000)})
    return url, admin


def _sent(admin: redis.Redis) -> dict[str, int]:
    """The commands the server ran since the last reset, by name, INFO's own left out."""
    stats = admin.info("commandstats")
    found = {name.removeprefix("cmdstat_"): int(s["calls"]) for name, s in stats.items()}
    return {name: n for name, n in found.items() if name not in ("info", "config|resetstat")}


def test_show_reads_the_keys_own_records_and_no_scan(redis_servers, tmp_path: Path) -> None:
    """``show`` of a mutex and of a 3-permit semaphore (its holders on random slots)
    among 50,000 unrelated keys: every holder shown, no SCAN, a handful of commands (the
    slots read by MGET) however large the database."""
    url, admin = _filled(redis_servers, tmp_path)
    cache = RedisCache(redis.Redis.from_url(url))
    held = [Mutex(cache, lease=60).acquire("report")]
    pool = Semaphore(cache, permits=3, lease=60, prefix="mutex.")
    held += [pool.acquire("pool", label=f"worker {n}") for n in range(3)]
    viewer = RedisCache(redis.Redis.from_url(url))  # the operator's: no prefix noted
    for key, holders in (("report", 1), ("pool", 3)):
        admin.config_resetstat()
        out = io.StringIO()
        assert commands.show_lock(viewer, key, "mutex.", out) == 0
        sent = _sent(admin)
        assert out.getvalue().count(f"key:         {key}\n") == holders, out.getvalue()
        assert "scan" not in sent, sent
        assert sum(sent.values()) <= 15, sent  # was 2 x 50 SCANs and more
    for lease in held:
        lease.release()


def test_list_and_watch_read_the_index_not_the_database(redis_servers, tmp_path: Path) -> None:
    """``list`` and three ``watch`` frames over five locks among 50,000 unrelated keys
    send no SCAN and a number of commands that follows the locks; a lock freed leaves
    the index at once, and the index goes with the last lock."""
    url, admin = _filled(redis_servers, tmp_path)
    cache = RedisCache(redis.Redis.from_url(url))
    mutex = Mutex(cache, lease=60)
    held = [mutex.acquire(f"job.{n}") for n in range(5)]
    viewer = RedisCache(redis.Redis.from_url(url))
    admin.config_resetstat()
    out = io.StringIO()
    assert commands.list_locks(viewer, "mutex.", out) == 0
    sent = _sent(admin)
    assert all(f"job.{n}" in out.getvalue() for n in range(5)), out.getvalue()
    assert "scan" not in sent, sent
    assert sum(sent.values()) <= 12, sent
    admin.config_resetstat()
    commands.watch_locks(viewer, "mutex.", io.StringIO(), interval=0, refreshes=3,
                         sleep=lambda _: None)  # fmt: skip
    sent = _sent(admin)
    assert "scan" not in sent, sent
    assert sum(sent.values()) <= 3 * (12 + 5), sent
    held.pop().release()
    assert admin.zcard("{mutex.}:index") == 4
    assert len(live_locks(viewer, "mutex.")) == 4
    for lease in held:
        lease.release()
    assert not admin.exists("{mutex.}:index")


def test_a_lapsed_lock_leaves_the_index_by_the_next_write_or_read(
    redis_servers, tmp_path: Path
) -> None:
    """A holder that never frees its key: the member stays until its lease lapses, then
    the next grant under the prefix (or the next listing) drops it; the index expires."""
    url, admin = _filled(redis_servers, tmp_path)
    mutex = Mutex(RedisCache(redis.Redis.from_url(url)), lease=0.3)
    mutex.acquire("crashed")
    assert admin.zrange("{mutex.}:index", 0, -1) == [b"{mutex.crashed}"]
    time.sleep(0.6)
    mutex.acquire("next")
    assert admin.zrange("{mutex.}:index", 0, -1) == [b"{mutex.next}"]
    assert 0 < admin.pttl("{mutex.}:index") <= 60_000
    time.sleep(0.6)
    assert live_locks(RedisCache(redis.Redis.from_url(url)), "mutex.") == []
    assert not admin.exists("{mutex.}:index")


def test_a_broken_index_never_fails_nor_blocks_a_grant(redis_servers, tmp_path: Path) -> None:
    """Another program's string where the index would be: grants, renewals and releases
    go on exactly as before (the index is for listing only)."""
    url, admin = _filled(redis_servers, tmp_path)
    admin.set("{mutex.}:index", "not ours")
    mutex = Mutex(RedisCache(redis.Redis.from_url(url)), lease=30)
    lease = mutex.acquire("k")
    with pytest.raises(SimpleMutexAcquireTimeoutError):
        mutex.acquire("k", timeout=0)
    lease.renew()
    assert lease.release()
    assert admin.get("{mutex.}:index") == b"not ours"
    again = mutex.acquire("k", timeout=0)
    assert again.release()
