"""AsyncMongoCache over the MongoDB wire protocol (test_mongo's server: MONGODB_URL, or a
secantusd-py this run starts): the shared contract through a blocking face
(tests/async_facade.py) with the server's clock and the client's, then what only asyncio
shows: Mutex wraps pymongo's asyncio objects, OS processes of many coroutines exclude
each other exactly, 500 waiting coroutines start no thread, and an old pymongo is
refused with the version to install. Every test writes into one database of this run,
dropped at the end; if no server answers, the tests fail, never skip.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pymongo
import pytest
import test_mongo
from async_crowds import LIMIT, contend, count_under_lock, os_threads
from async_facade import BlockingFace, refused_in_forked_children
from contract import CacheContract, ContractSmoke, unique_key
from procs import forked
from pymongo import AsyncMongoClient

from simple_mutex import ConstraintError, Mutex
from simple_mutex.caches import as_cache
from simple_mutex.caches.mongo import AsyncMongoCache, MongoCache
from simple_mutex.contract import AsyncConditionalCache, is_async
from simple_mutex.errors import ConstraintTypeError

pytestmark = pytest.mark.backends

DB = f"smx_async_{uuid.uuid4().hex[:8]}"
server_url = test_mongo.server_url  # the same fixture: MONGODB_URL or a server of our own


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, LIMIT))


def connect(url: str) -> AsyncMongoClient[Any]:
    return AsyncMongoClient(url, serverSelectionTimeoutMS=5000, socketTimeoutMS=10_000)


@pytest.fixture(scope="module")
def client(server_url: str) -> Iterator[pymongo.MongoClient[Any]]:
    """A blocking client; drops this run's database at the end."""
    conn: pymongo.MongoClient[Any] = pymongo.MongoClient(server_url, serverSelectionTimeoutMS=5000)
    yield conn
    conn.drop_database(DB)
    conn.close()


def face_on(url: str, *, factory: bool = False, **options: Any) -> BlockingFace:
    """An AsyncMongoCache on an AsyncMongoClient opened on the face's own loop: given to
    it, or made by its client factory (``factory``) on first use."""
    clients: list[AsyncMongoClient[Any]] = []

    def make() -> AsyncMongoClient[Any]:
        clients.append(connect(url))
        return clients[-1]

    async def build() -> AsyncMongoCache:
        return AsyncMongoCache(make if factory else make(), database=DB, **options)

    face = BlockingFace.built(build)
    face.clients = clients  # type: ignore[attr-defined]
    return face


@pytest.fixture
def cache(server_url: str, client: pymongo.MongoClient[Any]) -> Iterator[BlockingFace]:
    face = face_on(server_url)
    yield face
    face.close(*face.clients)  # type: ignore[attr-defined]


# -- the contract -----------------------------------------------------------------------


class GivenClient:
    """An AsyncMongoCache over a client given as it is."""

    def test_a_forked_child_uses_the_cache_on_its_own(self, cache: BlockingFace) -> None:
        """In place of the contract's test: pymongo binds an AsyncMongoClient to the loop
        it was first used on (its at-fork reset leaves that), so a forked child, whose
        loop is its own, is refused at once with the ConstraintError naming the client
        factory, and writes nothing; the parent keeps working. (A cache given a factory
        passes the contract's test: TestAsyncMongoContractFactory.)"""
        refused_in_forked_children(
            cache, unique_key("fork"), ConstraintError,
            "give the cache a function that makes the client",
        )  # fmt: skip


class TestAsyncMongoContractServerClock(GivenClient, CacheContract):
    """The contract over the wire, expiry judged by the server's $$NOW (the default)."""

    remembers_releases = True  # its freed record (or held mark) names the version freed

    expiry_slack = 0.15


class TestAsyncMongoContractClientClock(GivenClient, ContractSmoke):
    """...and with clock="client"."""

    expiry_slack = 0.15

    @pytest.fixture
    def cache(self, server_url: str, client: pymongo.MongoClient[Any]) -> Iterator[BlockingFace]:
        face = face_on(server_url, collection="locks_client", clock="client")
        yield face
        face.close(*face.clients)  # type: ignore[attr-defined]


class TestAsyncMongoContractFactory(ContractSmoke):
    """...and on a client its factory makes in each process (the forked children too)."""

    expiry_slack = 0.15

    @pytest.fixture
    def cache(self, server_url: str, client: pymongo.MongoClient[Any]) -> Iterator[BlockingFace]:
        face = face_on(server_url, factory=True, collection="locks_factory")
        yield face
        face.close(*face.clients)  # type: ignore[attr-defined]


# -- what only asyncio shows -------------------------------------------------------------


def test_mutex_wraps_the_async_client_database_and_collection(
    server_url: str, client: pymongo.MongoClient[Any]
) -> None:
    """Mutex(AsyncMongoClient / AsyncDatabase / AsyncCollection) locks through an
    AsyncMongoCache, in one collection with a blocking MongoCache."""
    blocking = Mutex(MongoCache(client, database=DB), lease=30)

    async def main() -> None:
        conn = connect(server_url)
        assert isinstance(as_cache(conn), AsyncMongoCache)
        assert isinstance(as_cache(conn[DB]), AsyncMongoCache)
        cache = as_cache(conn[DB]["locks"])
        assert isinstance(cache, AsyncMongoCache)
        assert is_async(cache)
        assert isinstance(cache, AsyncConditionalCache)
        mutex = Mutex(conn[DB], lease=30)
        key = unique_key("wrap")
        async with mutex.acquire_async(key, timeout=5) as lease:  # no await: the first form
            assert blocking.try_acquire(key) is None
            assert (await mutex.holder_async(key)).fence == lease.fence
        assert not await mutex.locked_async(key)
        await conn.close()

    run(main())


def test_an_old_pymongo_is_refused_with_the_version_to_install(
    client: pymongo.MongoClient[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before pymongo 4.13 the asyncio API was a beta: AsyncMongoCache says what to install."""
    monkeypatch.setattr(pymongo, "version_tuple", (4, 9, 0))
    with pytest.raises(ConstraintError, match=r"pymongo>=4\.13"):
        AsyncMongoCache(client[DB]["locks"])


def test_a_blocking_call_on_the_async_cache_names_the_async_method(server_url: str) -> None:
    mutex = Mutex(AsyncMongoCache(connect(server_url), database=DB))
    with pytest.raises(ConstraintError, match="acquire_async"):
        mutex.acquire(unique_key())


def _contend(url: str, key: str, tasks: int, rounds: int, shared: Any) -> None:
    """One OS process of coroutines counting under one lock."""

    async def main() -> None:
        conn = connect(url)
        mutex = Mutex(AsyncMongoCache(conn, database=DB), lease=30)
        await count_under_lock(mutex, key, tasks, rounds, shared)
        await conn.close()

    asyncio.run(main())


def test_processes_of_many_coroutines_exclude_each_other_exactly(
    server_url: str, client: pymongo.MongoClient[Any]
) -> None:
    """3 processes x 10 coroutines x 3 rounds on one key: every increment counted, never
    two holders inside at once."""
    procs, tasks, rounds = 3, 10, 3
    key = unique_key("contend")
    *exits, total, overlaps, inside = contend(_contend, (server_url, key, tasks, rounds), procs)
    assert exits == [0] * procs
    assert (total, overlaps, inside) == (procs * tasks * rounds, 0, 0)


def test_a_crowd_of_waiting_coroutines_starts_no_thread(
    server_url: str, client: pymongo.MongoClient[Any]
) -> None:
    """200 coroutines wait on a held key: the thread count stays as it was; then they give
    up in time (500 on 8 connections beside a second loaded suite once met a fault
    instead). Counted after a burst of as many reads: pymongo's monitors start with the
    client, and each connection its pool opens resolves the host in the loop's default
    executor (a few threads at most, however many wait), so a warm client is measured, its
    pool capped (8) so that the burst opened every connection the crowd will use: a pool
    still growing under a loaded machine's timing showed pymongo's threads, not ours."""
    key = unique_key("crowd")
    seen_threads: list[int] = []

    async def main() -> None:
        conn = AsyncMongoClient(
            server_url, serverSelectionTimeoutMS=5000, socketTimeoutMS=10_000, maxPoolSize=8
        )
        mutex = Mutex(AsyncMongoCache(conn, database=DB), lease=30)
        async with mutex.acquire_async(unique_key("warm-up")):
            pass  # the process's lease keeper
        await asyncio.gather(*(mutex.locked_async(key) for _ in range(200)))  # the pool
        before = os_threads()
        lease = await mutex.acquire_async(key)
        crowd = [
            asyncio.ensure_future(mutex.acquire_async(key, timeout=1.5, interval=0.5))
            for _ in range(200)
        ]
        for _ in range(10):
            await asyncio.sleep(0.05)
            seen_threads.append(len(os_threads() - before))
        outcomes = await asyncio.gather(*crowd, return_exceptions=True)
        others = [o for o in outcomes if not isinstance(o, TimeoutError)]
        assert others == [], others[:3]
        await lease.release_async()
        await conn.close()

    run(main())
    assert seen_threads == [0] * 10


def test_a_client_is_bound_to_its_first_loop_and_others_are_refused_at_once(
    server_url: str, client: pymongo.MongoClient[Any]
) -> None:
    """pymongo binds an AsyncMongoClient to the event loop it was first used on. Another
    loop using the cache (a second asyncio.run, or a thread running its own loop while
    the first one is open) fails at once with a ConstraintError quoting pymongo's
    "different event loop" and naming the fix, never
    hangs, and leaves nothing held (issue 21, item 6: what AsyncPostgresCache did)."""
    cache = AsyncMongoCache(connect(server_url), database=DB)
    mutex = Mutex(cache, lease=30)
    key = f"bound.{uuid.uuid4().hex[:8]}"

    async def cycle() -> None:
        await (await mutex.acquire_async(key, timeout=2)).release_async()

    run(cycle())  # binds the client to this (now closed) loop
    outcomes: list[tuple[str, float]] = []

    def elsewhere() -> None:
        started = time.monotonic()
        try:
            run(cycle())
            outcomes.append(("granted", time.monotonic() - started))
        except ConstraintError as exc:  # the caller's to fix: a client per loop
            outcomes.append((str(exc), time.monotonic() - started))

    elsewhere()  # a second asyncio.run in this thread
    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join(30)
    assert len(outcomes) == 2
    for message, took in outcomes:
        assert "different event loop" in message
        assert took < 2
    assert MongoCache(client, database=DB).get(f"mutex.{key}") is None


class AsyncFactory:
    """An AsyncMongoClient factory that records, per call, the process and the client."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.made: list[tuple[int, AsyncMongoClient[Any]]] = []

    def __call__(self) -> AsyncMongoClient[Any]:
        self.made.append((os.getpid(), connect(self.url)))
        return self.made[-1][1]


def _use_factory(face: BlockingFace, factory: AsyncFactory, key: str) -> None:
    """In a forked child (the face runs a loop of its own): the factory is called once
    more, here, and the cache uses only the client it made."""
    face.take_and_free(key, "child")
    (parent, parents_client), (child, own) = factory.made
    assert (parent, child) == (os.getppid(), os.getpid())
    assert face.cache._collection().database.client is own is not parents_client


def test_an_async_client_factory_is_called_once_in_each_process(
    server_url: str, client: pymongo.MongoClient[Any]
) -> None:
    """Lazily, on first use, once per process: a forked child calls it again and locks
    on its own client, the parent's calls stay one."""
    factory = AsyncFactory(server_url)
    face = BlockingFace(AsyncMongoCache(factory, database=DB))
    assert factory.made == []
    key = unique_key("factory")
    face.take_and_free(key, "p")
    assert [pid for pid, _ in factory.made] == [os.getpid()]
    assert forked(_use_factory, [(face, factory, f"{key}.{n}") for n in range(2)], 20) == [0, 0]
    assert len(factory.made) == 1
    face.close()  # the cache closes the client its factory made


def test_an_async_client_factory_returning_a_blocking_client_is_refused(server_url: str) -> None:
    """The factory's result is checked as an object given is: a blocking MongoClient is
    a ConstraintTypeError naming the asyncio classes, on first use."""
    blocking: list[pymongo.MongoClient[Any]] = []

    def wrong() -> pymongo.MongoClient[Any]:
        blocking.append(pymongo.MongoClient(server_url, connect=False))
        return blocking[-1]

    cache = AsyncMongoCache(wrong)
    with pytest.raises(ConstraintTypeError) as info:
        run(cache.put_if_absent(unique_key(), "v", ttl=30))
    message = str(info.value)
    assert "must return a pymongo AsyncMongoClient, AsyncDatabase or AsyncCollection" in message
    assert "got MongoClient" in message
    blocking[0].close()
