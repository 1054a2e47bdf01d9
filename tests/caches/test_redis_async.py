"""AsyncRedisCache (redis.asyncio) against the real server at REDIS_URL.

* The shared contract suite (tests/contract.py), through a blocking face that runs each
  coroutine on a private event loop (tests/async_facade.py): the same rules as RedisCache.
* Natively on the loop: ``Mutex(redis.asyncio.Redis(...))`` wraps the client; a thousand
  waiting coroutines start no thread and share a bounded number of connections; a release
  wakes one waiter (not its poll), in this process or another; a lost lease cancels its
  holder's task on time, even while a renewal hangs; OS processes running coroutines
  exclude each other; faults are MalfunctionErrors; a cancelled command never shifts
  replies; a cache survives a change of event loop.

Every key starts with one random prefix, deleted at the end; nothing is flushed.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
from async_facade import BlockingFace
from contract import CacheContract, ContractSmoke, NotifyContract, NotifySmoke, unique_key
from procs import FORK
from redis_acl import lock_user, url_as
from servers import free_port, own_cluster, own_redis
from shared_redis import REDIS_URL, ids_named, shared_client, still_listed

from simple_mutex import (
    ConstraintError,
    MalfunctionError,
    Mutex,
    Semaphore,
    SimpleCacheConditionError,
    SimpleMutexLeaseExpiredError,
    cache_from_url,
)
from simple_mutex.admin.commands import load_functions
from simple_mutex.caches import AsyncRedisCache, RedisCache, as_cache
from simple_mutex.contract import Entry, is_async

pytestmark = pytest.mark.backends

PREFIX = f"ta{uuid.uuid4().hex[:8]}:"  # every key of this run starts with it
POLL = 5.0  # waiters' poll interval: a hand-off by poll would take seconds
WAKE_BOUND = 1.0  # a notified waiter runs well within this on a loaded 2-core machine


def run(coro: Any, limit: float = 60) -> Any:
    return asyncio.run(asyncio.wait_for(coro, limit))


@pytest.fixture(scope="module")
def client() -> Iterator[redis.Redis]:
    """A sync client of the shared server, to look behind the cache's back; fails (never
    skips) when the server does not answer."""
    with shared_client(REDIS_URL, PREFIX + "*") as conn:
        yield conn


@contextlib.contextmanager
def async_face(
    url: str = REDIS_URL, *, functions: bool = False, **options: Any
) -> Iterator[BlockingFace]:
    """An AsyncRedisCache on its own asyncio client, behind the blocking face."""
    aio = redis.asyncio.Redis.from_url(url, **options)
    face = BlockingFace(AsyncRedisCache(aio, prefix=PREFIX, functions=functions))
    yield face
    face.call(face.cache.aclose())
    # redis-py before 5.0.1 (the lower bounds run 4.6) names it close.
    face.call(aio.aclose() if hasattr(aio, "aclose") else aio.close())
    face.close()


@pytest.fixture
def face(client: redis.Redis) -> Iterator[BlockingFace]:
    with async_face() as face:
        yield face


class TestAsyncRedisCacheContract(NotifyContract, CacheContract):
    """AsyncRedisCache passes the shared contract (through the blocking face); a release
    wakes a waiter parked on the loop within a few round trips."""

    remembers_releases = True  # its freed record (or held mark) names the version freed

    wake_bound = 0.2

    @pytest.fixture
    def cache(self, face: BlockingFace) -> BlockingFace:
        return face


class TestAsyncRedisCacheContractAsLockUser(NotifySmoke, ContractSmoke):
    """...and as a user made from nothing but ``RedisCache.acl_rules()`` plus
    ``resetchannels``: the loop's wake-up listener (its own SET, LPUSH, PEXPIRE, BLPOP)
    and every script stay inside the rules."""

    wake_bound = 0.2

    @pytest.fixture
    def cache(self, client: redis.Redis) -> Iterator[BlockingFace]:
        rules = RedisCache.acl_rules(prefixes=("",), cache_prefix=PREFIX)
        with (
            lock_user(client, rules) as (user, password),
            async_face(url_as(REDIS_URL, user, password)) as face,
        ):
            yield face


class TestAsyncRedisCacheContractAsFunctionUser(NotifySmoke, ContractSmoke):
    """...and by FCALL, as a user made from ``acl_rules(functions=True)``: no Lua of its
    own, no SCAN, no SELECT (the library loaded first, as an administrator)."""

    wake_bound = 0.2

    @pytest.fixture
    def cache(self, client: redis.Redis) -> Iterator[BlockingFace]:
        load_functions(RedisCache(client), io.StringIO())
        rules = RedisCache.acl_rules(prefixes=("",), cache_prefix=PREFIX, functions=True)
        with (
            lock_user(client, rules) as (user, password),
            async_face(url_as(REDIS_URL, user, password), functions=True) as face,
        ):
            yield face


class TestAsyncRedisCacheContractDecodedResponses(NotifySmoke, ContractSmoke):
    """...and with a client that decodes replies to str (decode_responses=True)."""

    wake_bound = 0.2

    @pytest.fixture
    def cache(self, client: redis.Redis) -> Iterator[BlockingFace]:
        with async_face(decode_responses=True) as face:
            yield face


def new_mutex(**options: Any) -> Mutex:
    options.setdefault("lease", 30)
    options.setdefault("interval", POLL)
    cache = AsyncRedisCache(redis.asyncio.Redis.from_url(REDIS_URL), prefix=PREFIX)
    return Mutex(cache, prefix="m.", **options)


# -- wiring ------------------------------------------------------------------------------


def test_a_redis_asyncio_client_is_wrapped_in_the_async_cache(client: redis.Redis):
    """Mutex(redis.asyncio.Redis(...)) takes the asyncio client for what it is (not for a
    sync redis.Redis, whose class has the same name); a sync client still gets RedisCache;
    cache_from_url builds the async one on request; each refuses the other's client."""
    aio = redis.asyncio.Redis.from_url(REDIS_URL)
    assert type(as_cache(aio)) is AsyncRedisCache
    assert type(as_cache(redis.asyncio.RedisCluster(startup_nodes=[], host="h"))) is (
        AsyncRedisCache
    )
    assert type(as_cache(client)) is RedisCache
    assert is_async(Mutex(aio).cache)
    built = cache_from_url(REDIS_URL + "?asyncio=true&allow_eviction=true")
    assert type(built) is AsyncRedisCache
    assert built.allow_eviction
    assert type(cache_from_url(REDIS_URL)) is RedisCache
    with pytest.raises(ConstraintError, match="AsyncRedisCache"):
        RedisCache(aio)
    with pytest.raises(ConstraintError, match="RedisCache"):
        AsyncRedisCache(client)
    with pytest.raises(ConstraintError, match="replicas"):
        AsyncRedisCache(aio, replicas=-1)
    with pytest.raises(ConstraintError, match="acquire_async"):
        Mutex(aio).acquire("k")


def test_the_async_cache_writes_what_the_sync_one_reads(client: redis.Redis):
    """One layout for both: a lock taken through redis.asyncio is busy for a sync
    Mutex on the same server, holder() reads it, and its release frees it for both."""
    key = unique_key()
    sync = Mutex(RedisCache(client, prefix=PREFIX), lease=30, prefix="m.")
    mutex = new_mutex()

    async def main() -> None:
        lease = await mutex.acquire_async(key)
        assert sync.try_acquire(key) is None
        held = sync.holder(key)
        assert held is not None
        assert held.fence == lease.fence
        assert await lease.release_async()
        again = sync.acquire(key, timeout=0)
        assert again.fence > lease.fence
        assert await mutex.try_acquire_async(key) is None
        again.release()

    run(main())


# -- waiting on the loop -------------------------------------------------------------------


def test_a_thousand_waiting_coroutines_start_no_thread_and_share_few_sockets(
    client: redis.Redis,
):
    """1000 coroutines contending for 4 keys: while they wait, the thread count does not
    move and the cache holds at most 16 command connections plus one listener per key;
    every key's critical sections are counted exactly and never overlap."""
    name = f"aio-crowd-{uuid.uuid4().hex[:8]}"
    aio = redis.asyncio.Redis.from_url(REDIS_URL, client_name=name)
    mutex = Mutex(AsyncRedisCache(aio, prefix=PREFIX), lease=30, interval=POLL, prefix="m.")
    base = unique_key("crowd")
    inside = dict.fromkeys(range(4), 0)
    counts = dict.fromkeys(range(4), 0)
    overlaps = 0

    async def one(n: int) -> None:
        nonlocal overlaps
        async with mutex.acquire_async(f"{base}.{n % 4}"):
            inside[n % 4] += 1
            overlaps += inside[n % 4] > 1
            await asyncio.sleep(0)
            counts[n % 4] += 1
            inside[n % 4] -= 1

    def sockets() -> int:
        return sum(1 for c in client.client_list() if c.get("name") == name)

    def threads() -> set[threading.Thread]:
        return set(threading.enumerate())

    async def main() -> tuple[set[threading.Thread], set[threading.Thread], int]:
        warm = await mutex.acquire_async("warm", renew=True)  # the keeper exists from here
        await warm.release_async()
        before = threads()
        tasks = [asyncio.ensure_future(one(n)) for n in range(1000)]
        await asyncio.sleep(0.3)
        during, connected = threads(), sockets()
        await asyncio.gather(*tasks)
        return before, during, connected

    before, during, connected = run(main(), 120)
    # No thread started while they waited. (Counting threads failed once: an earlier
    # test's threads ended meanwhile, 9 before and 7 during.)
    assert during - before == set()
    assert connected <= 16 + 4
    assert counts == dict.fromkeys(range(4), 250)
    assert overlaps == 0


def test_a_release_wakes_one_waiter_on_the_loop_not_its_poll():
    """Three coroutines wait on a held key (poll 5 s); one release lets exactly one in,
    within WAKE_BOUND; each later release hands on to the next."""
    mutex = new_mutex()
    key = unique_key()

    async def main() -> list[float]:
        lease = await mutex.acquire_async(key)
        got: list[float] = []

        async def waiter() -> None:
            inner = await mutex.acquire_async(key, timeout=30)
            got.append(time.monotonic())
            await asyncio.sleep(0.3)
            await inner.release_async()

        tasks = [asyncio.ensure_future(waiter()) for _ in range(3)]
        await asyncio.sleep(0.3)
        released = time.monotonic()
        await lease.release_async()
        await asyncio.sleep(0.15)
        assert len(got) == 1  # one release, one waiter
        await asyncio.gather(*tasks)
        return [at - released for at in got]

    gaps = run(main())
    assert gaps[0] < WAKE_BOUND
    for before, after in itertools.pairwise(gaps):
        assert after - before < 0.3 + WAKE_BOUND  # handed on, not polled


def test_a_waiter_parked_past_the_marks_life_is_still_woken():
    """A waiter with a 20 s poll parks on the loop for all of it: it puts once before
    parking and once when woken, no re-put every BLPOP. Its listener keeps the 3 s waiter
    mark alive, so a release after 4 s still signals it within WAKE_BOUND."""
    mutex = new_mutex(interval=20)
    key = unique_key()
    puts = 0
    put = mutex.cache.put_if_absent

    async def counted(*args: Any, **kwargs: Any) -> Entry:
        nonlocal puts
        puts += 1
        return await put(*args, **kwargs)  # type: ignore[no-any-return, misc]

    mutex.cache.put_if_absent = counted  # type: ignore[method-assign]

    async def main() -> float:
        lease = await mutex.acquire_async(key)
        waiter = asyncio.ensure_future(mutex.acquire_async(key, timeout=30))
        await asyncio.sleep(4.0)
        released = time.monotonic()
        await lease.release_async()
        await (await waiter).release_async()
        return time.monotonic() - released

    assert run(main()) < WAKE_BOUND
    assert puts == 3  # the holder's, the waiter's refused one, the waiter's winning one


def _release_later(key: str, version: str, delay: float) -> None:
    time.sleep(delay)
    RedisCache(redis.Redis.from_url(REDIS_URL), prefix=PREFIX).compare_and_delete(
        key, version=version
    )


def test_a_release_in_another_process_wakes_an_async_waiter(client: redis.Redis):
    """The hand-off crosses processes: a sync holder elsewhere releases, the coroutine
    waiting here (poll 5 s) holds within WAKE_BOUND."""
    mutex = new_mutex()
    key = unique_key()
    holder = RedisCache(client, prefix=PREFIX).put_if_absent(f"m.{key}", "holder", ttl=30)
    child = FORK.Process(target=_release_later, args=(f"m.{key}", holder.version, 0.5))

    async def main() -> float:
        child.start()
        lease = await mutex.acquire_async(key, timeout=30)
        at = time.monotonic()
        await lease.release_async()
        return at

    started = time.monotonic()
    got = run(main())
    child.join(10)
    assert child.exitcode == 0
    assert got - started < 0.5 + WAKE_BOUND


def test_a_token_whose_waiter_gave_up_is_passed_on(client: redis.Redis):
    """A waiter that timed out just before its wake-up arrived must not swallow it: the
    token goes back on the list, where a waiter in another process finds it."""
    cache = AsyncRedisCache(redis.asyncio.Redis.from_url(REDIS_URL), prefix=PREFIX)
    key = unique_key()
    signal = f"{PREFIX}{{{key}}}:signal"

    async def main() -> None:
        entry = await cache.put_if_absent(key, "holder", ttl=30)
        with pytest.raises(SimpleCacheConditionError):
            await cache.put_if_absent(key, "waiter", ttl=30)  # marks a waiter
        waiting = asyncio.ensure_future(cache.wait([key], 0.3))
        await asyncio.sleep(0.05)  # the listener is blocked in BLPOP now
        await waiting  # the waiter gives up; the listener still blocks
        await cache.compare_and_delete(key, version=entry.version)  # pushes a token
        await asyncio.sleep(0.2)

    run(main())
    assert client.lrange(signal, 0, -1) == [b"1"]


# -- holding: lapses cancel on time ----------------------------------------------------------


def test_a_lost_lease_cancels_its_holder_on_time(client: redis.Redis):
    """The record is deleted behind the holder's back: the next renewal finds it gone and
    the block raises SimpleMutexLeaseExpiredError, long before the 5 s sleep ends."""
    mutex = new_mutex(lease=0.6)
    key = unique_key()

    async def hold() -> None:
        async with mutex.acquire_async(key, renew=True):
            client.delete(f"{PREFIX}{{m.{key}}}")
            await asyncio.sleep(5)

    async def main() -> float:
        started = time.monotonic()
        with pytest.raises(SimpleMutexLeaseExpiredError):
            await hold()
        return time.monotonic() - started

    assert run(main()) < 2.0


def test_a_hung_renewal_does_not_postpone_the_lapse():
    """The renewal's command hangs (a frozen server): the holder's task is still
    cancelled at its own deadline, not when the renewal gives up."""
    cache = AsyncRedisCache(redis.asyncio.Redis.from_url(REDIS_URL), prefix=PREFIX)

    async def hang(*args: Any, **kwargs: Any) -> Entry:
        await asyncio.sleep(60)
        raise AssertionError("unreachable")

    cache.compare_and_set = hang  # type: ignore[method-assign]
    mutex = Mutex(cache, lease=0.6)
    key = unique_key()

    started = time.monotonic()
    with pytest.raises(SimpleMutexLeaseExpiredError):
        run(_hold_until_lapse(mutex, key))
    assert time.monotonic() - started < 0.6 + 0.5


async def _hold_until_lapse(mutex: Mutex, key: str) -> None:
    async with mutex.acquire_async(key, renew=True):
        await asyncio.sleep(5)


# -- processes ---------------------------------------------------------------------------


def _charge(key: str, ledger: str, rounds: int, coroutines: int) -> None:
    """In a child process: ``coroutines`` coroutines each add 1 to ``ledger``
    ``rounds`` times by read-modify-write under the lock, logging their spans."""
    store = redis.asyncio.Redis.from_url(REDIS_URL)
    mutex = Mutex(AsyncRedisCache(store, prefix=PREFIX), lease=30, interval=POLL, prefix="m.")

    async def one() -> None:
        for _ in range(rounds):
            async with mutex.acquire_async(key, timeout=60) as lease:
                started = time.time()
                value = int(await store.get(ledger) or 0)
                await asyncio.sleep(0.002)
                await store.set(ledger, value + 1)
                await store.rpush(ledger + ":spans", f"{started} {time.time()} {lease.fence}")

    async def main() -> None:
        await asyncio.gather(*(one() for _ in range(coroutines)))

    asyncio.run(main())


def test_processes_of_coroutines_exclude_each_other(client: redis.Redis):
    """Three OS processes of ten coroutines each, five rounds each, on one key: the
    ledger is exact, no two critical sections overlap, fences grow in span order."""
    key, ledger = unique_key(), f"{PREFIX}ledger.{uuid.uuid4().hex}"
    children = [FORK.Process(target=_charge, args=(key, ledger, 5, 10)) for _ in range(3)]
    for child in children:
        child.start()
    for child in children:
        child.join(120)
    assert [child.exitcode for child in children] == [0, 0, 0]
    assert int(client.get(ledger)) == 150
    spans = sorted(
        (float(a), float(b), int(f))
        for a, b, f in (line.split() for line in client.lrange(ledger + ":spans", 0, -1))
    )
    assert len(spans) == 150
    for before, after in itertools.pairwise(spans):
        assert after[0] >= before[1], "two critical sections overlapped"
        assert after[2] > before[2], "fences out of order"


def test_a_semaphore_on_the_loop_admits_its_permits():
    """Semaphore(redis.asyncio.Redis, permits=3): 30 coroutines, never more than 3 inside,
    every one gets in. Each stays inside until as many are in as may be (up to 5 s): with
    a fixed 10 ms, a loaded machine once never had 3 in at once."""
    cache = AsyncRedisCache(redis.asyncio.Redis.from_url(REDIS_URL), prefix=PREFIX)
    semaphore = Semaphore(cache, permits=3, lease=30, interval=POLL, prefix="s.")
    key = unique_key()
    inside = most = done = 0

    async def one() -> None:
        nonlocal inside, most, done
        async with semaphore.acquire_async(key, timeout=60):
            inside += 1
            most = max(most, inside)
            deadline = asyncio.get_running_loop().time() + 5
            while inside < min(3, 30 - done) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.005)
            inside -= 1
            done += 1

    async def main() -> None:
        await asyncio.gather(*(one() for _ in range(30)))

    run(main())
    assert most == 3
    assert done == 30


# -- faults and the connection path ------------------------------------------------------


def test_an_unreachable_server_is_a_prompt_malfunction():
    """Nothing listens on port 1: a MalfunctionError naming redis, the operation and the
    key, within seconds (redis-py's own connect retries take about three)."""
    cache = AsyncRedisCache(redis.asyncio.Redis(port=1, socket_connect_timeout=0.5), prefix=PREFIX)
    mutex = Mutex(cache, lease=30)

    async def main() -> MalfunctionError:
        with pytest.raises(MalfunctionError) as info:
            await mutex.acquire_async("k", timeout=1)
        return info.value

    started = time.monotonic()
    error = run(main())
    assert time.monotonic() - started < 6
    assert "redis cache" in str(error)
    assert "put_if_absent on 'k'" in str(error)
    assert error.key == "k"


def test_a_cancelled_command_never_shifts_replies():
    """A task cancelled between sending a command and reading its reply must not leave
    that reply for the next command on the connection (a stale 'held' would read as
    'granted')."""
    cache = AsyncRedisCache(redis.asyncio.Redis.from_url(REDIS_URL), prefix=PREFIX)
    key = unique_key()

    async def main() -> None:
        entry = await cache.put_if_absent(key, "v", ttl=30)
        for _ in range(20):
            task = asyncio.ensure_future(cache.get(key))
            await asyncio.sleep(0)  # sent, maybe; cancelled before the reply is read
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            with pytest.raises(SimpleCacheConditionError):
                await cache.put_if_absent(key, "other", ttl=30)
            assert await cache.get(key) == entry

    run(main())


def test_an_instrumented_client_keeps_its_own_path():
    """A client whose execute_command is overridden (tracing) sees every lock command,
    and each of its waiters blocks in a BLPOP of its own."""
    seen: list[str] = []

    class Traced(redis.asyncio.Redis):
        async def execute_command(self, *args: Any, **options: Any) -> Any:
            seen.append(args[0])
            return await super().execute_command(*args, **options)

    cache = AsyncRedisCache(Traced.from_url(REDIS_URL), prefix=PREFIX)
    mutex = Mutex(cache, lease=30, interval=POLL)
    key = unique_key()

    async def main() -> None:
        lease = await mutex.acquire_async(key)
        waiter = asyncio.ensure_future(mutex.acquire_async(key, timeout=10))
        await asyncio.sleep(0.2)
        await lease.release_async()
        await (await waiter).release_async()

    run(main())
    assert {"EVALSHA", "BLPOP"} <= set(seen)


def test_one_cache_serves_successive_event_loops():
    """asyncio.run twice with one cache (a script, then a test): the second loop gets
    connections of its own instead of the first loop's dead ones."""
    mutex = new_mutex()
    key = unique_key()

    async def cycle() -> int:
        lease = await mutex.acquire_async(key)
        await lease.release_async()
        return lease.fence

    first = run(cycle())
    assert run(cycle()) > first


def test_cluster_mutex_semaphore_and_hand_off(redis_servers: list[Any], tmp_path: Path):
    """A three-master Redis Cluster through redis.asyncio.RedisCluster: scripts and BLPOP
    run on the masters that own each lock's hash tag, a semaphore spans its slots, a
    waiter wakes on release (by a BLPOP of its own: a cluster client keeps its path)."""
    ports = own_cluster(redis_servers, tmp_path)
    cluster = redis.asyncio.RedisCluster(host="127.0.0.1", port=ports[0], socket_timeout=5)
    cache = as_cache(cluster)
    assert type(cache) is AsyncRedisCache
    mutex = Mutex(cache, lease=30, interval=POLL)
    semaphore = Semaphore(cache, permits=2, lease=30, interval=POLL)
    keys = [f"order.{n}" for n in range(20)]

    async def main() -> float:
        await cluster.initialize()
        nodes = {cluster.get_node_from_key(f"{{mutex.{k}}}").port for k in keys}
        assert len(nodes) > 1  # the locks really are spread over several masters
        for key in keys:
            await (await mutex.acquire_async(key, timeout=0)).release_async()
        leases = [await semaphore.acquire_async("pool", timeout=0) for _ in range(2)]
        waiter = asyncio.ensure_future(semaphore.acquire_async("pool", timeout=POLL * 2))
        await asyncio.sleep(0.3)
        released = time.monotonic()
        await leases[0].release_async()
        taken = await waiter
        woke = time.monotonic() - released
        for lease in (taken, leases[1]):
            assert await lease.release_async()
        await cluster.aclose()
        return woke

    assert run(main()) < WAKE_BOUND


def test_a_connection_the_server_closed_is_reopened_at_once(client: redis.Redis):
    """The server drops the cache's idle connections (a restart, an idle timeout): the
    next command finds its socket closed and is retried once, at once, on a new one."""
    name = f"aio-kill-{uuid.uuid4().hex[:8]}"
    aio = redis.asyncio.Redis.from_url(REDIS_URL, client_name=name)
    cache = AsyncRedisCache(aio, prefix=PREFIX)
    key = unique_key()

    async def main() -> None:
        entry = await cache.put_if_absent(key, "v", ttl=30)
        for info in client.client_list():
            if info.get("name") == name:
                client.client_kill(info["addr"])
        await asyncio.sleep(0.05)
        assert await cache.get(key) == entry
        assert await cache.compare_and_delete(key, version=entry.version) is False

    run(main())


def test_a_redis_that_may_evict_lock_keys_is_refused_unless_allowed(
    redis_servers: list[Any], tmp_path: Path
):
    """The eviction check of RedisCache, on the asyncio cache's own command path, in RESP2
    and RESP3 (CONFIG GET answers a flat list in one, a map in the other): refused at
    first use with the fix named; allow_eviction=True proceeds."""
    port = free_port()
    own_redis(
        redis_servers, tmp_path, port, "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"
    )

    async def main() -> None:
        for protocol in (2, 3):
            aio = redis.asyncio.Redis(port=port, protocol=protocol)
            with pytest.raises(ConstraintError, match="maxmemory-policy noeviction"):
                await Mutex(aio).acquire_async("k", timeout=0)
            allowed = Mutex(AsyncRedisCache(aio, allow_eviction=True))
            await (await allowed.acquire_async("k", timeout=0)).release_async()
            await aio.aclose()

    run(main())


def test_replicas_counts_a_grant_only_once_replicas_have_it(client: redis.Redis):
    """replicas=1 against a server with no replica: WAIT (on the write's own connection)
    times out, so the grant is withdrawn and reported as a MalfunctionError naming the
    fix; the key is free again. A renewal is refused the same way."""
    aio = redis.asyncio.Redis.from_url(REDIS_URL)
    cache = AsyncRedisCache(aio, prefix=PREFIX, replicas=1, replica_timeout=0.1)
    plain = AsyncRedisCache(aio, prefix=PREFIX)
    key = unique_key()

    async def main() -> None:
        with pytest.raises(MalfunctionError, match="withdrawn") as info:
            await cache.put_if_absent(key, "v", ttl=30)
        assert info.value.unsent
        assert await plain.get(key) is None
        entry = await plain.put_if_absent(key, "v", ttl=30)
        with pytest.raises(MalfunctionError, match="renewal"):
            await cache.compare_and_set(key, "v", ttl=30, version=entry.version)
        with pytest.raises(ConstraintError, match="same connection"):
            AsyncRedisCache(
                redis.asyncio.Redis.from_url(REDIS_URL, single_connection_client=True), replicas=1
            )

    run(main())


@pytest.mark.parametrize("face", ["async", "sync"])
def test_a_wait_that_times_out_never_becomes_a_grant(face: str):
    """replicas=1 with a socket timeout below replica_timeout: WAIT's reply times out
    instead of answering 0. That is no acknowledgement either: the acquire is refused
    (the grant withdrawn, never read back as ours) and the key stays free."""
    key = unique_key()
    if face == "sync":
        blocking = redis.Redis.from_url(REDIS_URL, socket_timeout=0.3)
        cache = RedisCache(blocking, prefix=PREFIX, replicas=1, replica_timeout=1.0)
        with pytest.raises(MalfunctionError, match="replica"):
            Mutex(cache).acquire(key, timeout=5)
        assert Mutex(RedisCache(blocking, prefix=PREFIX)).holder(key) is None
        return

    async def main() -> None:
        aio = redis.asyncio.Redis.from_url(REDIS_URL, socket_timeout=0.3)
        cache = AsyncRedisCache(aio, prefix=PREFIX, replicas=1, replica_timeout=1.0)
        with pytest.raises(MalfunctionError, match="replica"):
            await Mutex(cache).acquire_async(key, timeout=5)
        assert await Mutex(AsyncRedisCache(aio, prefix=PREFIX)).holder_async(key) is None
        await aio.aclose()

    run(main())


def test_each_event_loop_keeps_its_own_connections_and_closed_loops_leak_none():
    """Two live event loops (each in its own thread) take turns with one cache: each
    keeps its own connections, so turn after turn opens none (16 per loop at most);
    then loop after loop (asyncio.run) on a client capped at 40 connections: each loop
    opens 16 of the cache's own, a closed loop's are dropped with it, and the client's
    pool lends none (the cache leaves it to the user's own commands)."""
    cache = AsyncRedisCache(redis.asyncio.Redis.from_url(REDIS_URL), prefix=PREFIX)
    mutex = Mutex(cache, lease=30)
    loops = [asyncio.new_event_loop() for _ in range(2)]
    threads = [threading.Thread(target=loop.run_forever, daemon=True) for loop in loops]
    for thread in threads:
        thread.start()

    async def burst(tag: str) -> int:
        async def one(i: int) -> None:
            await (await mutex.acquire_async(f"{tag}.{i}", timeout=1)).release_async()

        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(40))), 10)
        return sum(own.opened for own in cache._own._loops.values())  # type: ignore[union-attr]

    try:
        in_use = [
            asyncio.run_coroutine_threadsafe(burst(f"t{turn}"), loops[turn % 2]).result(30)
            for turn in range(6)
        ]
    finally:
        for loop, thread in zip(loops, threads, strict=True):
            loop.call_soon_threadsafe(loop.stop)
            thread.join(5)
    assert max(in_use) <= 2 * 16
    assert in_use[-2:] == in_use[2:4]  # each loop's own connections: nothing new per turn

    capped = AsyncRedisCache(redis.asyncio.Redis.from_url(REDIS_URL, max_connections=40))

    async def many_gets() -> tuple[int, int, int]:
        await asyncio.gather(*(capped.get(f"{PREFIX}leak.{i}") for i in range(50)))
        own = capped._own._loops  # type: ignore[union-attr]
        here = own[asyncio.get_running_loop()].opened
        return len(own), here, len(capped.client.connection_pool._in_use_connections)

    assert [asyncio.run(many_gets()) for _ in range(4)] == [(1, 16, 0)] * 4


def test_threads_each_running_event_loops_at_once_share_one_cache():
    """Sync workers that each call ``asyncio.run`` share one AsyncRedisCache, their
    loops running at the same time: the cache's connections are its own, per loop, so
    no loop waits on a lock or a connection of another (redis-py's asyncio pool binds
    its lock to one loop: borrowing from it failed with "attached to a different loop"
    and "Event loop is closed"). Every acquire and release succeeds."""
    cache = AsyncRedisCache(redis.asyncio.Redis.from_url(REDIS_URL), prefix=PREFIX)
    mutex = Mutex(cache, lease=30)
    keys = [unique_key("threads") for _ in range(3)]
    failures: list[str] = []
    released: list[bool] = []

    async def job() -> None:
        for i in range(30):
            lease = await mutex.acquire_async(keys[i % 3], timeout=5, interval=0.05)
            await asyncio.sleep(0.001)
            released.append(await lease.release_async())

    def worker() -> None:
        for _ in range(4):
            try:
                asyncio.run(asyncio.wait_for(job(), 30))
            except BaseException as exc:  # every failure is recorded
                failures.append(repr(exc))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert failures == []
    assert released == [True] * (4 * 4 * 30)


def test_close_and_waited_on_on_the_asyncio_cache(client: redis.Redis) -> None:
    """The asyncio face's close() (aclose() its old name) drops the cache's own
    connections on the loop; waited_on() sees a waiter blocked on the key, as the sync
    face's does."""
    # Only connections under this test's own name count: the server's client list also
    # shows every other test's and process's connections, which come and go meanwhile.
    name = f"aio-close-{uuid.uuid4().hex[:8]}"
    ids = lambda: ids_named(client, name)  # noqa: E731

    async def main() -> None:
        aio = redis.asyncio.Redis.from_url(REDIS_URL, client_name=name)
        cache = AsyncRedisCache(aio, prefix=PREFIX)
        mutex, key = Mutex(cache, lease=30), unique_key()
        stored = "mutex." + key  # the cache's key: the Mutex's prefix and the lock's key
        before = ids()
        held = await mutex.acquire_async(key, timeout=0)
        assert await cache.waited_on(stored) is False
        waiter = asyncio.ensure_future(mutex.acquire_async(key, timeout=10))
        deadline = time.monotonic() + 10
        while not await cache.waited_on(stored) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert await cache.waited_on(stored) is True
        await held.release_async()
        await (await waiter).release_async()
        opened = ids() - before
        assert opened, "the cache opened no connection of its own"
        await cache.close()
        assert not still_listed(client, name, opened)
        assert cache.aclose == cache.close
        await aio.aclose()

    run(main())
