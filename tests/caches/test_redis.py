"""RedisCache against real redis-server processes.

* the shared contract, the behaviour suite, and the Redis specifics (scripts, hash tags,
  signal list, errors) against the server at REDIS_URL (default
  redis://127.0.0.1:6379/0). Every key this module writes starts with one random prefix,
  deleted at the end; nothing is flushed. If that server does not answer, the tests
  fail: they never skip.
* servers this module starts and stops itself (``redis-server`` on PATH), for what
  cannot be done to a shared server: a shutdown and restart mid-test, a frozen server,
  a Sentinel, a three-node Cluster.
"""

from __future__ import annotations

import io
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from behaviour import PREFIX as BEHAVIOUR_PREFIX
from behaviour import NotifyBehaviour, SharedBehaviour, assert_each_fails
from contract import CacheContract, ContractSmoke, NotifyContract, NotifySmoke, unique_key
from procs import FORK
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis_acl import lock_user, url_as
from servers import RedisServer, free_port, own_cluster, own_redis
from shared_redis import REDIS_URL, ids_named, shared_client, still_listed
from workers import ReleaseLater

from simple_mutex import (
    ConstraintError,
    MalfunctionError,
    Mutex,
    Semaphore,
    SimpleCacheConditionError,
    SimpleMutexAcquireTimeoutError,
    SimpleMutexLeaseExpiredError,
    cache_from_url,
)
from simple_mutex.admin import live_locks, locks_of
from simple_mutex.admin.commands import load_functions
from simple_mutex.caches.redis import RedisCache, from_url, parse_sentinel_url
from simple_mutex.contract import Entry

pytestmark = pytest.mark.backends

PREFIX = f"t{uuid.uuid4().hex[:8]}:"  # every key of this run starts with it
# A notified waiter is running again within about two round trips; a poll would take its
# whole interval (5 s here). 1 s tells the two apart even on a loaded 2-core machine.
POLL_INTERVAL = 5.0
WAKE_BOUND = 1.0


def new_client(url: str = REDIS_URL, **options: Any) -> redis.Redis:
    return redis.Redis.from_url(url, **options)


@pytest.fixture(scope="module")
def client() -> Iterator[redis.Redis]:
    """A client of the shared server; fails (never skips) when it does not answer."""
    with shared_client(REDIS_URL, PREFIX + "*") as conn:
        yield conn


@pytest.fixture
def cache(client: redis.Redis) -> RedisCache:
    return RedisCache(client, prefix=PREFIX)


@pytest.fixture
def mutex(cache: RedisCache) -> Mutex:
    return Mutex(cache, lease=30, interval=POLL_INTERVAL)


def our_keys(client: redis.Redis, pattern: str = "*") -> set[str]:
    return {k.decode() for k in client.scan_iter(match=PREFIX + pattern, count=1000)}


class TestRedisCacheContract(NotifyContract, CacheContract):
    """RedisCache passes the shared contract against the real server; a release wakes a
    waiter within a few round trips."""

    remembers_releases = True  # its freed record (or held mark) names the version freed

    wake_bound = 0.2


class TestRedisCacheContractDecodedResponses(NotifySmoke, ContractSmoke):
    """...and with a client that decodes replies to str (decode_responses=True)."""

    wake_bound = 0.2

    @pytest.fixture
    def cache(self, client: redis.Redis) -> Iterator[RedisCache]:
        conn = new_client(decode_responses=True)
        yield RedisCache(conn, prefix=PREFIX)
        conn.close()


@pytest.fixture(scope="module")
def lock_url(client: redis.Redis) -> Iterator[str]:
    """REDIS_URL as a user made from nothing but ``RedisCache.acl_rules()`` (plus
    ``resetchannels``): for this module's cache prefix (the contract's keys) and for the
    behaviour suite's Mutex prefix. Redis 7 checks every command a script calls, and its
    keys, against the user: a script touching a key outside the rules fails the suite."""
    rules = (
        RedisCache.acl_rules(prefixes=("",), cache_prefix=PREFIX),
        RedisCache.acl_rules(prefixes=(BEHAVIOUR_PREFIX,)),
    )
    with lock_user(client, *rules) as (user, password):
        yield url_as(REDIS_URL, user, password)


class TestRedisCacheContractAsLockUser(NotifySmoke, ContractSmoke):
    """The shared contract, hand-off included, as the least-privileged lock user."""

    wake_bound = 0.2

    @pytest.fixture
    def cache(self, lock_url: str) -> Iterator[RedisCache]:
        conn = new_client(lock_url)
        yield RedisCache(conn, prefix=PREFIX)
        conn.close()


@pytest.fixture(scope="module")
def function_url(client: redis.Redis) -> Iterator[str]:
    """REDIS_URL as a user made from ``RedisCache.acl_rules(functions=True)`` alone (no
    EVAL*, SCRIPT, SCAN nor SELECT), the library loaded first as an administrator."""
    load_functions(RedisCache(client), io.StringIO())
    rules = RedisCache.acl_rules(prefixes=("",), cache_prefix=PREFIX, functions=True)
    with lock_user(client, rules) as (user, password):
        yield url_as(REDIS_URL, user, password)


class TestRedisCacheContractAsFunctionUser(NotifySmoke, ContractSmoke):
    """The shared contract, hand-off included, by FCALL as the user that may call only
    the loaded functions."""

    wake_bound = 0.2

    @pytest.fixture
    def cache(self, function_url: str) -> Iterator[RedisCache]:
        conn = new_client(function_url)
        yield RedisCache(conn, prefix=PREFIX, functions=True)
        conn.close()


class TestRedisBehaviour(NotifyBehaviour, SharedBehaviour):
    """The behaviour suite against the server at REDIS_URL."""

    @pytest.fixture
    def url(self, client: redis.Redis) -> Iterator[str]:
        yield REDIS_URL
        for key in client.scan_iter(match="{" + BEHAVIOUR_PREFIX + "*", count=1000):
            client.delete(key)

    def write_foreign(self, url: str, cache_key: str) -> str:
        new_client(url).set(f"{{{cache_key}}}", "not a lock entry")
        return url

    def unreachable_url(self, tmp_path: Path) -> str:
        return "redis://127.0.0.1:1/0?socket_connect_timeout=0.5"


class TestRedisBehaviourAsLockUser(TestRedisBehaviour):
    """The behaviour suite (processes, semaphores, asyncio hand-off, a killed holder, a
    foreign entry) with every cache built from a URL of the least-privileged lock user."""

    @pytest.fixture
    def url(self, client: redis.Redis, lock_url: str) -> Iterator[str]:
        yield lock_url
        for key in client.scan_iter(match="{" + BEHAVIOUR_PREFIX + "*", count=1000):
            client.delete(key)


# -- layout: keys, hash tags, what is left behind ---------------------------------------


def test_all_keys_of_a_lock_share_one_cluster_slot(cache: RedisCache, client: redis.Redis):
    """Entry, semaphore slots, their held marks, last fence, waiter mark and signal list
    of one lock key hash to one Cluster slot, so every script (and a BLPOP over all
    slots) runs on Redis Cluster; the slots share one fence sequence; an entry carries
    the server's PX expiry, and its held mark (a grant not freed yet) outlives it; a
    release turns its slot's held mark into the version it freed (kept 60 s: a resent
    release finds it), and if it found a waiter leaves a one-token signal list that
    expires in about 1 s, and the waiter mark within 3 s."""
    key = unique_key()
    entries = {name: cache.put_if_absent(name, "v", ttl=30) for name in (key, f"{key}#1")}
    assert entries[f"{key}#1"].fence > entries[key].fence  # the slots share a sequence
    stem = f"{PREFIX}{{{key}}}"
    assert {stem + ":h", stem + ":h#1"} <= our_keys(client, f"{{{key}}}*")
    with pytest.raises(SimpleCacheConditionError):
        cache.put_if_absent(key, "other", ttl=30)  # marks a waiter...
    cache.compare_and_delete(key, version=entries[key].version)  # ...so this signals
    names = our_keys(client, f"{{{key}}}*")
    side = {stem + ":h", stem + ":h#1", stem + ":f", stem + ":w"}
    assert names == {stem + "#1", stem + ":signal", *side}
    assert len({redis.cluster.key_slot(name.encode()) for name in names}) == 1
    assert 29_000 < client.pttl(stem + "#1") <= 30_000  # Redis itself drops it at the ttl
    assert 59_000 < client.pttl(stem + ":h#1") <= 60_000  # max(2 x ttl, 60 s)
    assert client.get(stem + ":h") == entries[key].version.encode()
    assert 0 < client.pttl(stem + ":h") <= 60_000
    assert client.lrange(stem + ":signal", 0, -1) == [b"1"]
    assert 0 < client.pttl(stem + ":signal") <= 1000
    time.sleep(1.1)
    assert our_keys(client, f"{{{key}}}*") == {stem + "#1", *side}
    assert 0 < client.pttl(stem + ":w") <= 3000


def test_a_renewal_keeps_the_held_mark_as_long_as_the_fence(cache: RedisCache, client):
    """A lease renewed for longer than its grant kept the held mark is still known as
    unfreed when it lapses: each renewal sets the mark's expiry to max(2 x ttl, 60 s)
    from then, so a crash after hours of renewals still reads as a take-over."""
    key = unique_key()
    entry = cache.put_if_absent(key, "v", ttl=1)
    held = f"{PREFIX}{{{key}}}:h"
    assert 59_000 < client.pttl(held) <= 60_000
    cache.compare_and_set(key, "v", ttl=45, version=entry.version)
    assert 89_000 < client.pttl(held) <= 90_000


def test_uncontended_cycles_leave_only_the_last_fence_and_release_and_they_expire(
    mutex: Mutex, client
):
    """After acquire/release with nobody waiting, the keys left are the last fence, kept
    max(2 x lease, 60 s), and the held mark naming the last version freed, kept 60 s (no
    signal list, nothing for waiters)."""
    key = unique_key()
    fences = []
    for _ in range(3):
        lease = mutex.acquire(key)
        fences.append(lease.fence)
        lease.release()
    last, held = f"{PREFIX}{{mutex.{key}}}:f", f"{PREFIX}{{mutex.{key}}}:h"
    assert our_keys(client, f"*{key}*") == {last, held}
    assert int(client.get(last)) == fences[-1]
    assert client.get(held).decode().partition(".")[0] == str(fences[-1])
    assert 0 < client.pttl(last) <= max(2 * mutex.lease, 60) * 1000
    assert 0 < client.pttl(held) <= 60_000


def test_instrumented_and_single_connection_clients_keep_their_own_path(client):
    """The lean command path is for plain pooled clients only: a client whose
    execute_command is overridden (tracing) sees every lock command; a single-connection
    client keeps its lock around its one connection."""
    seen: list[str] = []

    class Traced(redis.Redis):
        def execute_command(self, *args: Any, **options: Any) -> Any:
            seen.append(args[0])
            return super().execute_command(*args, **options)

    for conn in (Traced.from_url(REDIS_URL), new_client(single_connection_client=True)):
        cache = RedisCache(conn, prefix=PREFIX)
        assert cache._execute == conn.execute_command
        key = unique_key()
        entry = cache.put_if_absent(key, "v", ttl=30)
        assert cache.get(key) == entry
        cache.compare_and_delete(key, version=entry.version)
        conn.close()
    assert seen == ["CONFIG GET", "EVALSHA", "GET", "EVALSHA"]  # CONFIG: the eviction check
    assert RedisCache(client)._execute != client.execute_command  # the lean path


def test_an_interrupt_mid_command_never_shifts_replies(client: redis.Redis):
    """The cache's own connection: an exception between sending a command and reading
    its reply (a lease interrupt, Ctrl-C) must not leave that reply to be read as the
    next command's (a stale "held" would read as "granted")."""
    cache = RedisCache(new_client(), prefix=PREFIX)
    key = unique_key()
    entry = cache.put_if_absent(key, "v", ttl=30)
    conn = cache._execute._idle[0]  # type: ignore[attr-defined]
    read = conn.read_response

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        conn.read_response = read
        raise KeyboardInterrupt  # the GET was sent; its reply is on the wire

    conn.read_response = interrupted
    with pytest.raises(KeyboardInterrupt):
        cache.get(key)
    with pytest.raises(SimpleCacheConditionError):
        cache.put_if_absent(key, "other", ttl=30)
    assert cache.get(key) == entry
    cache.client.close()


def test_a_first_grant_runs_no_scan_that_swallows_a_signal():
    """Why a job timeout's alarm was once lost at a cache's first grant (issue 22): redis-py
    8 reads its own version from the installed metadata each time it builds a connection
    from a URL's pool, and the read lists every sys.path folder inside the standard
    library's ``suppress(Exception)`` (importlib.metadata's ``FastPath.children``). A
    signal handler's exception (RQ's JobTimeoutException, Celery's SoftTimeLimitExceeded)
    raised there is swallowed. The cache reads the version once, at import, and gives it
    to the connections it builds, so its first grant lists no folder."""
    probe = f"""
import os, redis
from simple_mutex import Mutex
from simple_mutex.caches.redis import RedisCache
cache = RedisCache(redis.Redis.from_url({REDIS_URL!r}), prefix={PREFIX!r} + "scan:")
listed = []
real = os.listdir
os.listdir = lambda *a: listed.append(a) or real(*a)
Mutex(cache).acquire("k", timeout=5).release()
print(len(listed))
"""
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "0", "the first grant listed folders: " + done.stderr


def test_another_type_at_the_key_is_a_malformed_entry(cache: RedisCache, client: redis.Redis):
    """A hash where an entry belongs (another program's key) follows the malformed-entry
    rule too: a MalfunctionError naming redis, the operation and the key."""
    key = unique_key()
    client.hset(f"{PREFIX}{{{key}}}", "a", "b")
    for operation, call in [
        ("get", lambda: cache.get(key)),
        ("put_if_absent", lambda: cache.put_if_absent(key, "v", ttl=30)),
    ]:
        with pytest.raises(MalfunctionError) as info:
            call()
        assert f"redis cache found a malformed entry for {key!r} during {operation}" in str(
            info.value
        )


# -- construction and URLs --------------------------------------------------------------


def test_constructor_rejects_an_asyncio_client_and_a_bad_prefix(client: redis.Redis):
    """Only sync clients work (the engine calls the cache synchronously), and the prefix
    cannot carry a hash-tag brace."""
    import redis.asyncio

    with pytest.raises(ConstraintError, match="sync redis-py client"):
        RedisCache(redis.asyncio.Redis())
    with pytest.raises(ConstraintError, match="prefix"):
        RedisCache(client, prefix="{app}")


def test_from_url_builds_a_working_cache():
    """redis:// goes through redis.Redis.from_url, options included."""
    cache = from_url(REDIS_URL + ("&" if "?" in REDIS_URL else "?") + "socket_timeout=3")
    assert cache.client.get_connection_kwargs()["socket_timeout"] == 3
    key = unique_key()
    cache = RedisCache(cache.client, prefix=PREFIX)
    entry = cache.put_if_absent(key, "v", ttl=30)
    cache.compare_and_delete(key, version=entry.version)


def test_from_url_rejects_unknown_schemes_and_bad_urls_without_echoing_secrets():
    """Bad URLs raise ConstraintError; the password never appears in the message."""
    with pytest.raises(ConstraintError, match="unknown Redis URL scheme"):
        from_url("http://localhost")
    for url in (
        "redis+sentinel://:s3cret@h1:26379",  # no service name
        "redis+sentinel://:s3cret@h1:26379/m/0?bogus=1",
        "redis+sentinel://:s3cret@h1:x/m",
    ):
        with pytest.raises(ConstraintError) as info:
            from_url(url)
        assert "s3cret" not in str(info.value)


def test_sentinel_url_is_parsed_into_sentinels_service_db_and_options():
    """redis+sentinel://[user:pass@]h1:p1,h2,[::1]:p3/service/db?socket_timeout=..."""
    sentinels, service, options, sentinel_options = parse_sentinel_url(
        "redis+sentinel://app:p%40ss@h1:26380,h2,[::1]:26381/cache/3"
        "?socket_timeout=2&sentinel_password=sp"
    )
    assert sentinels == [("h1", 26380), ("h2", 26379), ("::1", 26381)]
    assert service == "cache"
    assert options == {"db": 3, "socket_timeout": 2.0, "username": "app", "password": "p@ss"}
    assert sentinel_options == {"socket_timeout": 2.0, "password": "sp"}


# -- waiting: hand-off by notification ---------------------------------------------------


def test_one_release_wakes_exactly_one_waiter(cache: RedisCache):
    """No thundering herd: three waiters blocked on a key, one release, one wakes."""
    key = unique_key()
    entry = cache.put_if_absent(key, "holder", ttl=30)
    woke: list[float] = []

    def waiter(n: int) -> None:
        with pytest.raises(SimpleCacheConditionError):
            cache.put_if_absent(key, f"w{n}", ttl=30)
        cache.wait([key], 1.5)
        woke.append(time.monotonic())

    threads = [threading.Thread(target=waiter, args=(n,)) for n in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    released = time.monotonic()
    cache.compare_and_delete(key, version=entry.version)
    time.sleep(0.3)
    assert len(woke) == 1
    assert woke[0] - released < 0.2
    for thread in threads:
        thread.join(3)
    assert len(woke) == 3  # the others came back at their own timeout


# -- a fused wait: the put runs the moment the BLPOP returns ------------------------------


def _blocked_in_blpop(name: str, timeout: float = 5, url: str = REDIS_URL) -> None:
    """Until a connection named ``name`` is blocked in BLPOP (the server's client list;
    the cache's own connections carry their client's name)."""
    admin = new_client(url)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if any(c["name"] == name and c["cmd"] == "blpop" for c in admin.client_list()):
                return
            time.sleep(0.005)
    finally:
        admin.close()
    raise AssertionError(f"no waiter named {name} reached BLPOP")


def _gone(name: str, timeout: float = 5) -> None:
    """Until the server has dropped every connection named ``name``."""
    admin = new_client()
    deadline = time.monotonic() + timeout
    try:
        while any(c["name"] == name for c in admin.client_list()):
            assert time.monotonic() < deadline, f"{name}'s connections outlived it"
            time.sleep(0.005)
    finally:
        admin.close()


def _named_cache(url: str = REDIS_URL) -> tuple[RedisCache, str]:
    name = f"w-{uuid.uuid4().hex[:8]}"
    return RedisCache(new_client(url, client_name=name), prefix=PREFIX), name


def test_a_fused_waiter_holds_the_key_before_its_releaser_can_ask_again(
    cache: RedisCache, client: redis.Redis
):
    """The put is pipelined behind the BLPOP, so the server runs it as the release's
    token wakes the waiter: 20 times in a row, the releaser's put at once after its
    release finds the key held by the waiter. (A plain wait then put loses nearly every
    one of these races: the waiter must be scheduled and send its put first.)"""
    waiter, name = _named_cache()
    assert waiter.wait_then_put is not None
    won: list[Entry] = []
    for _ in range(20):
        key = unique_key()
        entry = cache.put_if_absent(key, "releaser", ttl=30)
        with pytest.raises(SimpleCacheConditionError):
            waiter.put_if_absent(key, "waiter", ttl=30)  # marks the waiter
        thread = threading.Thread(
            target=lambda k=key: won.append(waiter.wait_then_put([k], 5, k, "waiter", ttl=30))
        )
        thread.start()
        _blocked_in_blpop(name)
        assert cache.compare_and_delete(key, version=entry.version) is True  # woke one
        with pytest.raises(SimpleCacheConditionError):
            cache.put_if_absent(key, "releaser", ttl=30)
        thread.join(5)
        assert won[-1].value == "waiter"
        assert won[-1].fence > entry.fence
        assert cache.get(key) == won[-1]


def _wait_in_a_child(key: str, name: str, lease: float, log: str) -> None:
    """Child: acquire ``key`` (a fused wait, a 5 s poll), log what happened to it."""
    conn = new_client(client_name=name)
    mutex = Mutex(RedisCache(conn, prefix=PREFIX), lease=lease, interval=5)
    try:
        with mutex.acquire(key, timeout=30):
            conn.rpush(log, f"{name} in {time.time()}")
            time.sleep(0.2)
            conn.rpush(log, f"{name} out")
    except SimpleMutexLeaseExpiredError:
        conn.rpush(log, f"{name} lapsed")


def _start_waiter(key: str, lease: float, log: str) -> tuple[Any, str]:
    name = f"w-{uuid.uuid4().hex[:8]}"
    proc = FORK.Process(target=_wait_in_a_child, args=(key, name, lease, log))
    proc.start()
    _blocked_in_blpop(name)
    return proc, name


def _held_with_two_waiters(mutex: Mutex, lease: float) -> tuple[Any, str, Any, Any]:
    """A key held here, the log the waiters write, and two waiter children blocked on
    it in that order (each its process and name)."""
    key, log = unique_key(), f"{PREFIX}log.{uuid.uuid4().hex[:6]}"
    held = mutex.acquire(key, timeout=0)
    return held, log, _start_waiter(key, lease, log), _start_waiter(key, lease, log)


def _first_in(client: redis.Redis, log: str) -> tuple[str, float]:
    """The first waiter to enter, and when (Unix time), from the children's log."""
    first = client.blpop([log], timeout=10)
    assert first is not None
    who, _, at = first[1].decode().split(" ")
    return who, float(at)


def test_a_sigkilled_waiter_is_never_handed_the_key(mutex: Mutex, client: redis.Redis):
    """A waiter killed in its fused wait (SIGKILL, a hard time limit, revoke with
    terminate) closes its connection, and the server drops its BLPOP with it: the
    release wakes the live waiter behind it at once (well inside its 2 s block), and
    the dead one's put never runs."""
    lease, log, (dead, dead_name), (live, live_name) = _held_with_two_waiters(mutex, 30)
    try:
        os.kill(dead.pid, signal.SIGKILL)
        dead.join(5)
        _gone(dead_name)
        released = time.time()
        assert lease.release()
        who, at = _first_in(client, log)
        assert who == live_name
        assert at - released < 0.5
        live.join(10)
        assert live.exitcode == 0
        assert client.lrange(log, 0, -1) == [f"{live_name} out".encode()]
    finally:
        for proc in (dead, live):
            proc.kill()
        client.delete(log)


def test_a_paused_waiter_handed_the_key_never_runs_beside_the_next(
    mutex: Mutex, client: redis.Redis
):
    """The trade of a fused wait: a waiter paused inside it (SIGSTOP, a frozen VM) is
    still blocked on a live connection, so a release hands it the key, which it then
    holds, asleep, until its lease runs out (2 s here); only then does the waiter behind
    it get in. Resumed later, the paused one finds its lease lapsed before its work
    began and never enters: its lease ran from before its wait."""
    lease, log, (paused, paused_name), (behind, behind_name) = _held_with_two_waiters(mutex, 2)
    try:
        os.kill(paused.pid, signal.SIGSTOP)
        released = time.time()
        assert lease.release()
        who, at = _first_in(client, log)
        assert who == behind_name
        assert at - released >= 1.5  # the paused waiter's 2 s record ran out first
        behind.join(10)
        os.kill(paused.pid, signal.SIGCONT)
        paused.join(10)
        assert (paused.exitcode, behind.exitcode) == (0, 0)
        assert client.lrange(log, 0, -1) == [
            f"{behind_name} out".encode(),
            f"{paused_name} lapsed".encode(),
        ]
    finally:
        for proc in (paused, behind):
            proc.kill()
        client.delete(log)


def test_a_fused_wait_on_a_key_held_throughout_is_busy_by_its_timeout(cache: RedisCache):
    """No release: the BLPOP runs out, the put finds the key held (and marks the waiter
    again, so the holder's release still wakes someone)."""
    key = unique_key()
    cache.put_if_absent(key, "holder", ttl=30)
    start = time.monotonic()
    with pytest.raises(SimpleCacheConditionError):
        cache.wait_then_put([key], 0.3, key, "waiter", ttl=30)
    assert 0.25 <= time.monotonic() - start < 0.3 + 0.25
    assert cache.waited_on(key)


def test_a_fused_wait_after_the_server_forgot_the_script_loads_it(redis_servers, tmp_path):
    """SCRIPT FLUSH (a restart, a failover) while a waiter blocks: its put is refused as
    NOSCRIPT behind the BLPOP, then loaded and sent again, and wins. (On a server of the
    test's own: SCRIPT FLUSH is server-wide.)"""
    url = f"redis://127.0.0.1:{own_redis(redis_servers, tmp_path, free_port()).port}/0"
    client = new_client(url)
    cache = RedisCache(client, prefix=PREFIX)
    key = unique_key()
    entry = cache.put_if_absent(key, "holder", ttl=30)
    waiter, name = _named_cache(url)
    with pytest.raises(SimpleCacheConditionError):
        waiter.put_if_absent(key, "w", ttl=30)  # marks the waiter
    won: list[Entry] = []
    thread = threading.Thread(
        target=lambda: won.append(waiter.wait_then_put([key], 5, key, "w", ttl=30))
    )
    thread.start()
    _blocked_in_blpop(name, url=url)
    client.script_flush()
    cache.compare_and_delete(key, version=entry.version)
    thread.join(5)
    assert won
    assert won[0].value == "w"
    assert cache.get(key) == won[0]


def test_a_fused_wait_that_fails_still_reports_a_put_that_landed(
    cache: RedisCache, client: redis.Redis
):
    """The BLPOP refused (its signal key of another type) while the put ran: a free key
    is ours all the same; a held one is a MalfunctionError naming the fused wait, which
    the engine answers with a plain wait."""
    first = cache.put_if_absent(unique_key(), "v", ttl=30)  # the eviction check, done
    assert first.value == "v"
    key = unique_key()
    client.set(f"{PREFIX}{{{key}}}:signal", "not a list")
    entry = cache.wait_then_put([key], 1, key, "w", ttl=30)
    assert cache.get(key) == entry
    with pytest.raises(MalfunctionError, match="wait_then_put"):
        cache.wait_then_put([key], 1, key, "other", ttl=30)
    client.delete(f"{PREFIX}{{{key}}}:signal")


def test_only_the_caches_own_connections_fuse_a_wait(client):
    """An instrumented or single-connection client keeps its path, and ``replicas=N``
    must follow a grant with WAIT: none of them has a fused wait, so the engine waits
    the plain way (and keeps the courtesy)."""

    class Traced(redis.Redis):
        def execute_command(self, *args: Any, **options: Any) -> Any:
            return super().execute_command(*args, **options)

    assert RedisCache(Traced.from_url(REDIS_URL)).wait_then_put is None
    assert RedisCache(new_client(single_connection_client=True)).wait_then_put is None
    assert RedisCache(new_client(), replicas=1).wait_then_put is None
    assert Mutex(RedisCache(client))._hands_over


def test_wait_stays_inside_a_short_socket_timeout():
    """A BLPOP longer than the client's socket timeout would look like a dead server:
    wait() blocks at most 80 % of it and returns early instead of raising."""
    conn = new_client(socket_timeout=0.3)
    cache = RedisCache(conn, prefix=PREFIX)
    key = unique_key()
    cache.put_if_absent(key, "holder", ttl=30)
    start = time.monotonic()
    cache.wait([key], 2.0)
    assert 0.1 <= time.monotonic() - start < 0.3
    conn.close()


def test_a_short_socket_timeout_never_turns_a_busy_key_into_a_fault():
    """Redis ends a timed-out BLPOP on its next timer tick (up to 100 ms late at hz 10):
    with ``socket_timeout=0.3`` a block of 80 % of it read a TimeoutError 19 times in 20,
    a busy key reported as a Redis fault. The block leaves 150 ms of the timeout free:
    fused waits on a held key are busy, and a timed acquire times out."""
    conn = new_client(socket_timeout=0.3)
    cache = RedisCache(conn, prefix=PREFIX)
    key = unique_key()
    cache.put_if_absent(key, "holder", ttl=30)
    for _ in range(12):
        with pytest.raises(SimpleCacheConditionError):
            cache.wait_then_put([key], 2.0, key, "waiter", ttl=30)
    mutex = Mutex(cache, lease=30)
    held = mutex.acquire(key, timeout=0)
    waiter = Mutex(RedisCache(new_client(socket_timeout=0.3), prefix=PREFIX), lease=30)
    for _ in range(4):
        with pytest.raises(SimpleMutexAcquireTimeoutError):
            waiter.acquire(key, timeout=0.5)
    assert held.release()
    conn.close()


def test_renew_extends_the_servers_expiry(cache: RedisCache, client: redis.Redis):
    """renew() restarts the entry's PX expiry on the server, keeping the fence."""
    key = unique_key()
    mutex = Mutex(cache, lease=2)
    lease = mutex.acquire(key)
    time.sleep(0.3)
    lease.renew(20)
    assert client.pttl(f"{PREFIX}{{mutex.{key}}}") > 19_000
    assert mutex.holder(key).fence == lease.fence  # type: ignore[union-attr]
    assert lease.release()


# -- servers of our own: restart, freeze, sentinel, cluster ------------------------------


def fragile_client(port: int, socket_timeout: float = 0.5) -> redis.Redis:
    """A client that gives up fast: a 0.5 s socket timeout and a single retry."""
    return redis.Redis(
        port=port,
        socket_timeout=socket_timeout,
        socket_connect_timeout=socket_timeout,
        retry=Retry(NoBackoff(), 1),
    )


def test_server_shutdown_and_restart(redis_servers: list[RedisServer], tmp_path: Path):
    """Redis goes away mid-test: every operation raises MalfunctionError (never a redis
    error), a waiter and a timed acquire end by their deadline plus one socket timeout,
    and locks work again once the server is back (scripts reloaded)."""
    server = own_redis(redis_servers, tmp_path, free_port())
    socket_timeout = 0.5
    cache = RedisCache(fragile_client(server.port, socket_timeout))
    mutex = Mutex(cache, lease=30, interval=POLL_INTERVAL)
    held = mutex.acquire("busy")
    outcome: list[Any] = []

    def waiter() -> None:
        start = time.monotonic()
        try:
            mutex.acquire("busy", timeout=1)
        except Exception as exc:  # the type is what the test checks
            outcome.append((exc, time.monotonic() - start))

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.2)  # blocked in BLPOP
    server.shutdown()
    thread.join(1 + socket_timeout + 1)
    assert not thread.is_alive(), "waiter hung after the server went away"
    error, took = outcome[0]
    assert isinstance(error, MalfunctionError), repr(error)
    assert error.key == "busy"
    assert took <= 1 + socket_timeout + 0.2

    assert_each_fails(cache)

    start = time.monotonic()
    with pytest.raises(MalfunctionError):
        mutex.acquire("other", timeout=1)
    assert time.monotonic() - start <= 1 + socket_timeout
    with pytest.raises(MalfunctionError):
        held.release()

    server.start()  # empty: no data, no scripts, no fence counter
    lease = mutex.acquire("busy", timeout=1)
    assert lease.fence > held.fence  # the server's clock floors a fence it cannot recall
    assert lease.release()
    server.shutdown()


def test_a_frozen_server_does_not_hang_acquire(redis_servers: list[RedisServer], tmp_path: Path):
    """SIGSTOP: the server accepts nothing and answers nothing. A timed acquire still
    raises MalfunctionError within its socket timeouts (one try, one retry, then the
    engine's read-back) instead of hanging."""
    server = own_redis(redis_servers, tmp_path, free_port())
    mutex = Mutex(RedisCache(fragile_client(server.port, 0.3)), lease=30)
    mutex.acquire("warm", timeout=0).release()
    os.kill(server.pid, signal.SIGSTOP)
    start = time.monotonic()
    try:
        with pytest.raises(MalfunctionError):
            mutex.acquire("k", timeout=0.5)
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert time.monotonic() - start < 0.5 + 4 * 0.3 + 0.5


@pytest.mark.parametrize("frozen_at", [0.3, 0.65, 0.85])
def test_a_server_frozen_mid_wait_ends_the_acquire_by_its_timeout_and_one_socket_timeout(
    redis_servers: list[RedisServer], tmp_path: Path, frozen_at: float
):
    """The server SIGSTOPped while a timed acquire waits on a held key: it raises
    MalfunctionError within its timeout plus one socket timeout (docs/guides/redis.md). A
    wait that failed past the deadline ends it; before, a poll pause sized before the
    wait and one more put carried it to 1.6 s for a 1 s timeout."""
    server = own_redis(redis_servers, tmp_path, free_port())
    holder = Mutex(RedisCache(fragile_client(server.port, 5)), lease=60).acquire("k")
    mutex = Mutex(RedisCache(fragile_client(server.port, 0.3)), lease=60)
    freeze = threading.Timer(frozen_at, os.kill, (server.pid, signal.SIGSTOP))
    start = time.monotonic()
    freeze.start()
    try:
        with pytest.raises(MalfunctionError):
            mutex.acquire("k", timeout=1.0)
        elapsed = time.monotonic() - start
    finally:
        freeze.join()
        os.kill(server.pid, signal.SIGCONT)
    assert elapsed <= 1.0 + 0.3 + 0.15
    assert holder.release()


def test_sentinel_url_finds_the_master(
    redis_servers: list[RedisServer], tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """redis+sentinel:// asks a real Sentinel for the master, and locks work through it."""
    master = own_redis(redis_servers, tmp_path, free_port())
    conf = tmp_path / "sentinel.conf"
    conf.write_text(f"sentinel monitor simple 127.0.0.1 {master.port} 1\n")
    sentinel = RedisServer(free_port(), tmp_path, config=conf)
    redis_servers.append(sentinel.start())
    probe = redis.Redis(port=sentinel.port, socket_timeout=0.5)
    deadline = time.monotonic() + 10
    while not probe.sentinel_get_master_addr_by_name("simple"):
        assert time.monotonic() < deadline, "sentinel does not know the master"
        time.sleep(0.05)
    url = f"redis+sentinel://127.0.0.1:{sentinel.port}/simple/0?socket_timeout=2"
    # A Sentinel URL waits for a replica unless told otherwise by name; this master has
    # none, so the grant is refused, naming the setting.
    assert from_url(url).replicas == 1
    with pytest.raises(MalfunctionError, match="replicas=0"):
        Mutex(from_url(url + "&replica_timeout=0.2"), lease=30).acquire("no-replica", timeout=1)
    assert redis.Redis(port=master.port).exists("{mutex.no-replica}") == 0  # withdrawn
    master_client = redis.sentinel.Sentinel([("127.0.0.1", sentinel.port)]).master_for("simple")
    assert RedisCache(master_client).replicas == 1  # a Sentinel's master, given directly
    assert RedisCache(master_client, replicas=0).replicas == 0
    assert RedisCache(redis.Redis(port=master.port)).replicas == 0  # a plain client

    class Traced(type(master_client)):  # type: ignore[misc]
        def execute_command(self, *args: Any, **options: Any) -> Any:
            return super().execute_command(*args, **options)

    traced = Traced(connection_pool=master_client.connection_pool)
    with caplog.at_level(logging.WARNING, logger="simple_mutex"):
        assert RedisCache(traced).replicas == 0  # WAIT cannot follow the write: said
    assert "cannot wait for a replica" in caplog.text
    cache = from_url(url + "&replicas=0")
    mutex = Mutex(cache, lease=30)
    lease = mutex.acquire("via-sentinel", timeout=1)
    assert redis.Redis(port=master.port).exists("{mutex.via-sentinel}") == 1
    assert lease.release()


def test_cluster_mutex_semaphore_and_hand_off(redis_servers: list[RedisServer], tmp_path: Path):
    """A three-master Redis Cluster: scripts and BLPOP run (hash tags keep each lock's
    keys in one slot), a semaphore spans its slots, a waiter wakes on release."""
    ports = own_cluster(redis_servers, tmp_path)
    cluster = redis.RedisCluster(host="127.0.0.1", port=ports[0], socket_timeout=5)
    cache = RedisCache(cluster)
    mutex = Mutex(cache, lease=30, interval=POLL_INTERVAL)
    keys = [f"order.{n}" for n in range(20)]
    nodes = {cluster.get_node_from_key(f"{{mutex.{k}}}").port for k in keys}
    assert len(nodes) > 1  # the locks really are spread over several masters
    for key in keys:
        mutex.acquire(key, timeout=0).release()

    semaphore = Semaphore(cache, permits=2, lease=30, interval=POLL_INTERVAL)
    leases = [semaphore.acquire("pool", timeout=0) for _ in range(2)]
    release = ReleaseLater(0.3, leases[0].release)
    taken = semaphore.acquire("pool", timeout=POLL_INTERVAL * 2)
    assert release.woke() < WAKE_BOUND
    # The operator's view: no index on a Cluster (another slot than the locks'), so
    # list scans every master; show reads the key's slots in its one hash slot.
    assert not cache.index
    assert [lock.slot for lock in locks_of(cache, "pool", "semaphore.")] == sorted(
        lock.slot for lock in live_locks(cache, "semaphore.")
    )
    assert len(live_locks(cache, "semaphore.")) == 2
    for lease in (taken, leases[1]):
        assert lease.release()
    cluster.close()


def _loop_on_one_key(url: str, key: str, rounds: int, ready: str, order: str) -> None:
    """Child: hold, let the parent's waiter block, release and at once ask again."""
    conn = new_client(url)
    mutex = Mutex(RedisCache(conn, prefix=PREFIX), lease=30, interval=POLL_INTERVAL)
    for _ in range(rounds):
        lease = mutex.acquire(key, timeout=5)
        conn.rpush(ready, "holding")
        time.sleep(0.2)
        lease.release()
        with mutex.acquire(key, timeout=5):
            conn.rpush(order, "worker")


def test_a_releaser_that_woke_a_waiter_lets_it_go_first(mutex: Mutex, client: redis.Redis):
    """Hand-off, not barging: a worker (another process) that releases a key someone
    waits for and asks for it again at once gets it only after the woken waiter; else a
    worker looping on one key starves the others (bench/README-redis.md, fairness)."""
    key, ready, order, rounds = unique_key(), f"{PREFIX}ready", f"{PREFIX}order", 4
    args = (REDIS_URL, key, rounds, ready, order)
    proc = FORK.Process(target=_loop_on_one_key, args=args)
    proc.start()
    try:
        for _ in range(rounds):
            assert client.blpop([ready], timeout=5) is not None
            with mutex.acquire(key, timeout=5):  # blocks until the worker's release
                client.rpush(order, "waiter")
                time.sleep(0.05)
    finally:
        proc.join(10)
        proc.kill()
    assert proc.exitcode == 0
    turns = client.lrange(order, 0, -1)
    assert sorted(turns) == sorted([b"waiter", b"worker"] * rounds)
    # Without the fused wait (whose put the server runs as the token wakes it) the
    # worker wins every round here; one late wake-up on a loaded machine is tolerated.
    assert turns[0::2].count(b"waiter") >= rounds - 1, turns


class TestRedisCacheContractOnFakeRedis(ContractSmoke):
    """The same scripts on fakeredis (Lua through lupa): a quick check that they use
    nothing beyond portable Redis commands. The real server above is the proof."""

    @pytest.fixture
    def cache(self) -> RedisCache:
        import fakeredis

        return RedisCache(fakeredis.FakeRedis(), prefix=PREFIX)


def test_unix_socket_urls_in_redis_pys_and_celery_onces_spelling(redis_servers, tmp_path):
    """``unix:///path?db=2`` (redis-py's form) and ``redis+socket:///path?virtual_host=2``
    (celery-once's) reach a server on its Unix socket, in the database named; RedisCache's
    own options ride along in the query."""
    sock = tmp_path / "redis.sock"
    server = own_redis(redis_servers, tmp_path, free_port(), "--unixsocket", str(sock))
    for url in (f"unix://{sock}?db=2", f"redis+socket://{sock}?virtual_host=2&replicas=0"):
        cache = cache_from_url(url + ("&" if "?" in url else "?") + "allow_eviction=true")
        assert isinstance(cache, RedisCache)
        assert cache.allow_eviction
        lease = Mutex(cache).acquire("unix.k", timeout=0)
        assert redis.Redis(port=server.port, db=2).exists("{mutex.unix.k}")
        lease.release()


def _named_client() -> redis.Redis:
    """A client of its own name: the server's client list also shows every other test's
    and process's connections, which come and go meanwhile."""
    return new_client(client_name=f"close-{uuid.uuid4().hex[:8]}")


def _client_ids(client: redis.Redis) -> set[int]:
    """The server's ids of the connections open under ``client``'s name (the cache's own
    connections are built with its settings, so they carry it too)."""
    return ids_named(client, client.connection_pool.connection_kwargs["client_name"])


def _still_open(client: redis.Redis, ids: set[int]) -> set[int]:
    return still_listed(client, client.connection_pool.connection_kwargs["client_name"], ids)


def test_close_disconnects_the_caches_own_connections_and_keeps_the_client() -> None:
    """close(), as on the other caches: the connections the cache opened for its own
    commands leave the server's client list; the client (and a later call) still work."""
    client = _named_client()
    cache = RedisCache(client, prefix=PREFIX)
    before = _client_ids(client)
    Mutex(cache).acquire(unique_key(), timeout=0).release()
    opened = _client_ids(client) - before
    assert opened, "the cache opened no connection of its own"
    cache.close()
    assert not _still_open(client, opened)
    assert client.ping()
    Mutex(cache).acquire(unique_key(), timeout=0).release()  # opens a new one


def test_close_also_disconnects_a_connection_lent_out_when_it_comes_back() -> None:
    """A waiter blocked in BLPOP holds a connection while close() runs: it is
    disconnected when the wait returns, not kept idle (found by review)."""
    client = _named_client()
    before = _client_ids(client)
    cache = RedisCache(client, prefix=PREFIX)
    key = unique_key()
    held = Mutex(cache, lease=30).acquire(key, timeout=0)
    waiter = threading.Thread(target=lambda: Mutex(cache).acquire(key, timeout=10).release())
    waiter.start()
    deadline = time.monotonic() + 10
    while not cache.waited_on("mutex." + key) and time.monotonic() < deadline:
        time.sleep(0.01)
    opened = _client_ids(client) - before  # every connection of this cache, the lent one too
    assert len(opened) >= 2, "the waiter and this thread should each hold one"
    cache.close()
    held.release()
    waiter.join(10)
    assert not _still_open(client, opened), "a connection lent out at close() stayed open"
