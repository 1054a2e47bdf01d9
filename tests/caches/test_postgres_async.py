"""AsyncPostgresCache against the real PostgreSQL at POSTGRES_URL
(test_postgres's): the shared contract through a blocking
face (tests/async_facade.py), then what only asyncio shows: Mutex wraps psycopg's async
connection and pool, OS processes of many coroutines exclude each other exactly, 500
waiting coroutines start no thread, and a session ended mid-wait is a prompt answer.

Tables are named ``a<random>_...`` and dropped at the end. If the server does not answer,
the tests fail: they never skip.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from async_crowds import LIMIT, contend, count_under_lock, os_threads
from async_facade import BlockingFace
from contract import CacheContract, ContractSmoke, NotifyContract, NotifySmoke, unique_key
from psycopg_pool import AsyncConnectionPool
from servers import PostgresServer
from test_postgres import (  # noqa: F401  (own_server: a fixture)
    GENEROUS,
    POSTGRES_URL,
    SYNC_BOUND,
    _row,
    _standby_gone,
    admin_of,
    own_server,
)

from simple_mutex import ConstraintError, MalfunctionError, Mutex, Semaphore
from simple_mutex.caches import as_cache
from simple_mutex.caches.postgres import AsyncPostgresCache, PostgresCache
from simple_mutex.contract import AsyncConditionalCache, is_async

pytestmark = pytest.mark.backends

RUN = f"a{uuid.uuid4().hex[:8]}"
TABLE = f"{RUN}_locks"


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, LIMIT))


admin = admin_of(RUN)


@pytest.fixture
def cache(admin: psycopg.Connection[Any]) -> Iterator[BlockingFace]:
    face = BlockingFace(AsyncPostgresCache(POSTGRES_URL, table=TABLE))
    yield face
    face.close()


class TestAsyncPostgresContract(NotifyContract, CacheContract):
    """The shared contract, on a connection the cache opens (a release NOTIFYs waiters)."""

    remembers_releases = True  # its freed record (or held mark) names the version freed

    wake_bound = 0.5


class TestAsyncPostgresContractOnGivenConnection(NotifySmoke, ContractSmoke):
    """...on an autocommit psycopg AsyncConnection the caller opened on the same loop."""

    wake_bound = 0.5

    @pytest.fixture
    def cache(self, admin: psycopg.Connection[Any]) -> Iterator[BlockingFace]:
        given: list[psycopg.AsyncConnection[Any]] = []

        async def build() -> AsyncPostgresCache:
            given.append(await psycopg.AsyncConnection.connect(POSTGRES_URL, autocommit=True))
            return AsyncPostgresCache(given[0], table=TABLE)

        face = BlockingFace.built(build)
        yield face
        face.close(*given)


class TestAsyncPostgresContractOnPool(NotifySmoke, ContractSmoke):
    """...on a psycopg_pool AsyncConnectionPool (transactional connections, a new table)."""

    wake_bound = 0.5

    @pytest.fixture
    def cache(self, admin: psycopg.Connection[Any]) -> Iterator[BlockingFace]:
        pools: list[AsyncConnectionPool[Any]] = []

        async def build() -> AsyncPostgresCache:
            pools.append(AsyncConnectionPool(POSTGRES_URL, min_size=1, max_size=2, open=False))
            await pools[0].open()
            return AsyncPostgresCache(pools[0], table=f"{RUN}_pool")

        face = BlockingFace.built(build)
        yield face
        face.close(*pools)


# -- what only asyncio shows -------------------------------------------------------------


def test_the_cache_is_an_asyncio_cache() -> None:
    """Its five methods are coroutines: the engine awaits them, no thread."""
    cache = AsyncPostgresCache(POSTGRES_URL, table=TABLE)
    assert is_async(cache)
    assert isinstance(cache, AsyncConditionalCache)


def test_mutex_wraps_an_async_connection_and_an_async_pool(admin: psycopg.Connection[Any]) -> None:
    """Mutex(psycopg.AsyncConnection) and Mutex(AsyncConnectionPool) lock through an
    AsyncPostgresCache; both see one lock; a transactional connection is refused."""

    async def main() -> None:
        conn = await psycopg.AsyncConnection.connect(POSTGRES_URL, autocommit=True)
        async with AsyncConnectionPool(POSTGRES_URL, min_size=1, max_size=2) as pool:
            assert isinstance(as_cache(conn), AsyncPostgresCache)
            assert isinstance(as_cache(pool), AsyncPostgresCache)
            by_conn, by_pool = Mutex(conn, lease=30), Mutex(pool, lease=30)
            key = unique_key("wrap")
            async with by_conn.acquire_async(key) as lease:  # no await: the first form
                assert await by_pool.locked_async(key)
                assert await by_pool.try_acquire_async(key) is None
            again = await by_pool.acquire_async(key, timeout=5)
            assert again.fence > lease.fence
            await again.release_async()
        await conn.close()
        plain = await psycopg.AsyncConnection.connect(POSTGRES_URL)
        with pytest.raises(ConstraintError, match="autocommit"):
            Mutex(plain)
        await plain.close()

    run(main())


def test_a_pooled_session_the_server_ended_is_replaced_on_the_next_call(
    admin: psycopg.Connection[Any],
) -> None:
    """The server ends the pool's idle session: the next statement, which never ran, is
    sent once more on a fresh session the pool opens, and succeeds."""

    async def main() -> None:
        async with AsyncConnectionPool(POSTGRES_URL, min_size=1, max_size=1) as pool:
            cache = AsyncPostgresCache(pool, table=TABLE)
            key = unique_key("ended")
            entry = await cache.put_if_absent(key, "v", ttl=30)
            async with pool.connection() as conn:
                ended = conn.info.backend_pid
            await asyncio.to_thread(admin.execute, "SELECT pg_terminate_backend(%s)", (ended,))
            assert await cache.get(key) == entry
            async with pool.connection() as conn:
                assert conn.info.backend_pid != ended
            await cache.compare_and_delete(key, version=entry.version)
            await cache.close()

    run(main())


def test_a_put_a_cancellation_cut_short_never_lands_after_the_clean_up(admin) -> None:
    """The asyncio face of test_postgres's alarm case: ``asyncio.wait_for`` cancels an
    acquire whose insert waits on a table lock. The cancelled put must not land after the
    clean-up looked: once the lock goes, the key is free. (Here the clean-up is a task of
    its own, whose session waits behind the same lock, so it holds even without the
    ended session of the blocking face.)"""
    key = unique_key()
    blocker = psycopg.connect(POSTGRES_URL, autocommit=True)

    async def scenario() -> bool:
        cache = AsyncPostgresCache(POSTGRES_URL, table=TABLE)
        mutex = Mutex(cache, lease=60)
        await (await mutex.acquire_async(key, timeout=0)).release_async()
        with blocker.transaction():
            blocker.execute(f'LOCK TABLE "{TABLE}" IN SHARE ROW EXCLUSIVE MODE')
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(mutex.acquire_async(key, timeout=5), 0.3)
            await asyncio.sleep(0.1)  # a clean-up in a task of its own gets its turn
        await asyncio.sleep(0.3)  # an insert still alive would have landed by now
        locked = await mutex.locked_async(key)
        await cache.close()
        return locked

    try:
        assert not run(scenario()), "the cancelled put landed after the clean-up"
    finally:
        blocker.close()


def test_a_blocking_call_on_the_async_cache_names_the_async_method(
    admin: psycopg.Connection[Any],
) -> None:
    """mutex.acquire() on an asyncio cache is refused, pointing at acquire_async."""
    mutex = Mutex(AsyncPostgresCache(POSTGRES_URL, table=TABLE))
    with pytest.raises(ConstraintError, match="acquire_async"):
        mutex.acquire(unique_key())


def test_async_and_blocking_caches_on_one_table_exclude_each_other(
    admin: psycopg.Connection[Any],
) -> None:
    """The same rows: a lock taken by the asyncio cache holds off the blocking one."""
    blocking = Mutex(PostgresCache(POSTGRES_URL, table=TABLE), lease=30)
    key = unique_key("mixed")

    async def main() -> None:
        mutex = Mutex(AsyncPostgresCache(POSTGRES_URL, table=TABLE), lease=30)
        lease = await mutex.acquire_async(key, timeout=5)
        assert blocking.try_acquire(key) is None
        await lease.release_async()
        assert blocking.try_acquire(key) is not None

    run(main())


def _contend(url: str, table: str, key: str, tasks: int, rounds: int, shared: Any) -> None:
    """One OS process of coroutines counting under one lock."""

    async def main() -> None:
        cache = AsyncPostgresCache(url, table=table)
        await count_under_lock(Mutex(cache, lease=30), key, tasks, rounds, shared)
        await cache.close()

    asyncio.run(main())


def test_processes_of_many_coroutines_exclude_each_other_exactly(
    admin: psycopg.Connection[Any],
) -> None:
    """3 processes x 20 coroutines x 4 rounds on one key: every increment counted, never
    two holders inside at once."""
    procs, tasks, rounds = 3, 20, 4
    key = unique_key("contend")
    *exits, total, overlaps, inside = contend(
        _contend, (POSTGRES_URL, TABLE, key, tasks, rounds), procs
    )
    assert exits == [0] * procs
    assert (total, overlaps, inside) == (procs * tasks * rounds, 0, 0)


def test_a_crowd_of_waiting_coroutines_starts_no_thread(admin: psycopg.Connection[Any]) -> None:
    """200 coroutines wait on a held key: the thread count stays as it was; released,
    they get the lock one at a time, never two at once, until their wait runs out (8 s:
    each hand-off is a notification and a statement, and with a second suite on the same
    server a crowd's full round of hand-offs once took more than a minute)."""
    key = unique_key("crowd")
    holding: list[int] = []
    granted: list[int] = []
    seen_threads: list[int] = []

    async def main() -> list[BaseException | None]:
        cache = AsyncPostgresCache(POSTGRES_URL, table=TABLE)
        mutex = Mutex(cache, lease=30)
        # The connections (a host name is resolved in the loop's default executor), the
        # table, and the process's one lease keeper, before counting.
        async with mutex.acquire_async(unique_key("warm-up")) as warm:
            await cache.wait([f"mutex.{warm.key}"], 0.01)  # opens the listening session
        before = os_threads()
        lease = await mutex.acquire_async(key)

        async def waiter() -> None:
            async with mutex.acquire_async(key, timeout=8.0, interval=1.0):
                holding.append(1)
                assert len(holding) == 1
                granted.append(1)
                holding.pop()

        crowd = [asyncio.ensure_future(waiter()) for _ in range(200)]
        for _ in range(10):
            await asyncio.sleep(0.05)
            seen_threads.append(len(os_threads() - before))
        assert not any(task.done() for task in crowd)
        await lease.release_async()
        outcomes = await asyncio.gather(*crowd, return_exceptions=True)
        seen_threads.append(len(os_threads() - before))
        await cache.close()
        return outcomes

    outcomes = run(main())
    assert seen_threads == [0] * 11
    others = [o for o in outcomes if o is not None and not isinstance(o, TimeoutError)]
    assert others == [], others[:3]  # each got the lock alone, or its wait ran out
    assert granted, "nobody got the lock after its release"


@pytest.mark.parametrize("session", ["listener", "statements"])
def test_a_session_ended_mid_wait_is_answered_promptly(
    admin: psycopg.Connection[Any], session: str
) -> None:
    """pg_terminate_backend on the waiter's listening session, or on its statement
    session, while it waits: the acquire ends in a MalfunctionError or in the lock once
    the holder lets go (the statement is retried on a fresh session), well before its
    timeout, never a hang."""
    key = unique_key("terminate")
    holder = PostgresCache(POSTGRES_URL, table=TABLE)
    held = holder.put_if_absent(f"mutex.{key}", "someone", ttl=30)

    async def main() -> tuple[str, float]:
        cache = AsyncPostgresCache(POSTGRES_URL, table=TABLE)
        mutex = Mutex(cache, lease=30)
        waiting = asyncio.ensure_future(mutex.acquire_async(key, timeout=20, interval=5))
        sessions = cache._here()  # this loop's sessions
        for _ in range(200):  # until the waiter listens (its first wait)
            await asyncio.sleep(0.01)
            if sessions.listener is not None and sessions.listening.locked():
                break
        target = sessions.listener if session == "listener" else sessions.conn
        assert target is not None
        pid = target.info.backend_pid
        await asyncio.to_thread(admin.execute, "SELECT pg_terminate_backend(%s)", (pid,))
        ended = time.monotonic()
        threading.Timer(
            0.3, lambda: holder.compare_and_delete(f"mutex.{key}", version=held.version)
        ).start()
        try:
            lease = await asyncio.wait_for(waiting, 10)
        except MalfunctionError as exc:
            return f"fault: {exc}", time.monotonic() - ended
        await lease.release_async()
        await cache.close()
        return "lock", time.monotonic() - ended

    outcome, took = run(main())
    holder.close()
    assert outcome == "lock" or outcome.startswith("fault: postgres cache failed"), outcome
    assert took < 5.0  # the poll interval is 5 s: a notification or a fault came first


def test_one_cache_serves_one_loop_after_another(admin: psycopg.Connection[Any]) -> None:
    """asyncio.run twice with one cache (a script, a test suite): the second loop gets
    sessions and locks of its own instead of waiting on the first, closed one."""
    cache = AsyncPostgresCache(POSTGRES_URL, table=TABLE)
    mutex = Mutex(cache, lease=30)
    key = unique_key("loops")

    async def cycle() -> int:
        async with mutex.acquire_async(key, timeout=5) as lease:
            return lease.fence

    first = run(cycle())
    assert run(cycle()) > first
    run(cache.close())


def test_a_semaphore_on_the_async_cache_caps_its_holders(admin: psycopg.Connection[Any]) -> None:
    """Semaphore(AsyncConnection, permits=2): 12 coroutines, never more than 2 inside, and
    every one gets in (a waiter watches every slot)."""
    inside: list[int] = []
    peak = 0
    done = 0

    async def main() -> None:
        nonlocal peak, done
        conn = await psycopg.AsyncConnection.connect(POSTGRES_URL, autocommit=True)
        semaphore = Semaphore(conn, permits=2, lease=30)
        key = unique_key("permits")

        async def worker() -> None:
            nonlocal peak, done
            async with semaphore.acquire_async(key, timeout=LIMIT, interval=0.05):
                inside.append(1)
                peak = max(peak, len(inside))
                await asyncio.sleep(0.02)
                inside.pop()
                done += 1

        await asyncio.gather(*(worker() for _ in range(12)))
        await conn.close()

    run(main())
    assert (peak, done) == (2, 12)


def test_threads_each_running_event_loops_share_one_cache(admin: psycopg.Connection[Any]) -> None:
    """A pool of sync workers, each calling ``asyncio.run`` for every job, sharing one
    AsyncPostgresCache: four threads, five loops each, every loop taking keys the other
    threads contend for (with waits, so the listener is used too). Each loop has
    sessions of its own: no acquire outlasts its timeout, every release frees its lock,
    nothing fails, and no key is left held."""
    cache = AsyncPostgresCache(POSTGRES_URL, table=TABLE)
    mutex = Mutex(cache, lease=30)
    keys = [unique_key("threads") for _ in range(2)]
    failures: list[str] = []
    slow: list[float] = []
    released: list[bool] = []
    lock = threading.Lock()

    async def job(worker: int, turn: int) -> None:
        for step in range(4):
            key = keys[(worker + turn + step) % len(keys)]
            started = time.monotonic()
            try:
                lease = await mutex.acquire_async(key, timeout=5, interval=0.05)
            except Exception as exc:  # every failure is recorded
                with lock:
                    failures.append(f"acquire: {exc!r}")
                continue
            took = time.monotonic() - started
            await asyncio.sleep(0.01)
            freed = await lease.release_async()
            with lock:
                released.append(freed)
                if took > 5 + 1:
                    slow.append(took)

    def worker(number: int) -> None:
        for turn in range(5):
            try:
                asyncio.run(asyncio.wait_for(job(number, turn), 30))
            except BaseException as exc:
                with lock:
                    failures.append(f"loop: {exc!r}")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads), "a worker hung"
    assert failures == []
    assert slow == [], f"acquires outlasted their timeout: {slow}"
    assert released == [True] * (4 * 5 * 4)
    holder = PostgresCache(POSTGRES_URL, table=TABLE)
    assert [holder.get(f"mutex.{key}") for key in keys] == [None, None]
    holder.close()


def test_a_given_connection_serves_one_loop_at_a_time(admin: psycopg.Connection[Any]) -> None:
    """An AsyncConnection passed to the cache belongs to the loop that uses it: another
    loop using the cache while that one is still open is refused at once with a
    ConstraintError naming the fix (nothing is written); once the first loop has
    closed, the next one may take the connection over."""
    first = asyncio.new_event_loop()
    thread = threading.Thread(target=first.run_forever, daemon=True)
    thread.start()
    key = unique_key("given")

    async def build() -> tuple[psycopg.AsyncConnection[Any], Mutex]:
        conn = await psycopg.AsyncConnection.connect(POSTGRES_URL, autocommit=True)
        mutex = Mutex(AsyncPostgresCache(conn, table=TABLE), lease=30)
        await (await mutex.acquire_async(key, timeout=5)).release_async()
        return conn, mutex

    async def cycle(mutex: Mutex) -> int:
        async with mutex.acquire_async(key, timeout=5) as lease:
            return lease.fence

    conn, mutex = asyncio.run_coroutine_threadsafe(build(), first).result(30)
    started = time.monotonic()
    with pytest.raises(ConstraintError, match="conninfo or URL"):
        run(cycle(mutex))
    assert time.monotonic() - started < 2
    holder = PostgresCache(POSTGRES_URL, table=TABLE)
    assert holder.get(f"mutex.{key}") is None
    first.call_soon_threadsafe(first.stop)
    thread.join(5)
    first.close()
    assert run(cycle(mutex)) > 0  # the first loop has closed: this one takes it over
    run(conn.close())
    holder.close()


def test_with_its_synchronous_standby_gone_an_async_try_acquire_ends_within_its_bound(
    own_server: PostgresServer,  # noqa: F811  (the fixture, imported above)
) -> None:
    """As test_postgres.py's: the commit's wait for a standby that is gone is cancelled
    at the call's bound by a timer on the loop; the grant is withdrawn and reported, a
    renewal does not count, a release counts."""
    url = f"{own_server.url}?options=-c%20statement_timeout%3D1000"

    async def main() -> None:
        cache = AsyncPostgresCache(url)
        assert cache.commit_bound == SYNC_BOUND
        mutex = Mutex(cache, lease=30)
        held = await mutex.acquire_async("held", timeout=5)
        _standby_gone(own_server)
        bound = SYNC_BOUND + GENEROUS
        start = time.monotonic()
        with pytest.raises(MalfunctionError, match=r"no synchronous standby .* grant"):
            await asyncio.wait_for(mutex.try_acquire_async("new"), bound)
        assert time.monotonic() - start < bound
        with pytest.raises(MalfunctionError, match="renewal"):
            await asyncio.wait_for(held.renew_async(lease=60), bound)
        assert await asyncio.wait_for(held.release_async(), bound) is True
        await cache.close()

    run(main())
    assert _row(own_server, "mutex.new") == (None,)  # committed locally, then withdrawn
    assert _row(own_server, "mutex.held") == (None,)
