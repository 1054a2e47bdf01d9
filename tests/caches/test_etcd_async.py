"""AsyncEtcdCache (aetcd) against test_etcd's real three-member cluster: the shared
contract through a blocking face (tests/async_facade.py) on a client given as it is, on
clients for every member made by a factory, and what only asyncio shows: Mutex wraps
aetcd's client and excludes EtcdCache's holders on the same keys, OS processes of many
coroutines exclude each other exactly, a forked child never uses the parent's gRPC
channel, a down member is passed over, every failure is a MalfunctionError naming etcd.

A missing ``etcd`` binary fails the tests (scripts/lib.sh ``ensure_etcd``); nothing skips.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import aetcd
import pytest
import test_etcd
from async_crowds import LIMIT, contend, count_under_lock
from async_facade import BlockingFace, refused_in_forked_children
from contract import CacheContract, ContractSmoke, NotifyContract, NotifySmoke, unique_key
from procs import CTX, forked
from servers import EtcdCluster, free_port
from test_etcd import RUN, EtcdTimings, raw

from simple_mutex import ConstraintError, MalfunctionError, Mutex
from simple_mutex.caches import as_cache
from simple_mutex.caches.etcd import AsyncEtcdCache, EtcdCache
from simple_mutex.contract import AsyncConditionalCache, is_async

pytestmark = pytest.mark.backends

cluster = test_etcd.cluster  # the same fixture: the session's three members


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, LIMIT))


def connect(endpoint: str, timeout: int = 5) -> aetcd.Client:
    host, _, port = endpoint.rpartition(":")
    return aetcd.Client(host=host, port=int(port), timeout=timeout)


class Members:
    """A client factory: one aetcd client per member, recording each call's process."""

    def __init__(self, endpoints: list[str]) -> None:
        self.endpoints = endpoints
        self.made: list[tuple[int, list[aetcd.Client]]] = []

    def __call__(self) -> list[aetcd.Client]:
        self.made.append((os.getpid(), [connect(e) for e in self.endpoints]))
        return self.made[-1][1]


GIVEN = "give the cache a function that makes the client instead"
USED_BEFORE_FORK = "lock only in the forked children, never in the parent before it forks"


def refused_in_children(cache: BlockingFace, message: str) -> None:
    refused_in_forked_children(cache, unique_key("fork"), ConstraintError, message)


class TestAsyncEtcdContract(EtcdTimings, NotifyContract, CacheContract):
    """The contract (a watch wakes waiters) on one member's client, given as it is."""

    @pytest.fixture
    def cache(self, cluster: EtcdCluster) -> Iterator[BlockingFace]:
        async def build() -> AsyncEtcdCache:
            return AsyncEtcdCache(connect(cluster.endpoints[1]), prefix=RUN, close_clients=True)

        face = BlockingFace.built(build)
        yield face
        face.close()

    def test_a_forked_child_uses_the_cache_on_its_own(self, cache: BlockingFace) -> None:
        """In place of the contract's test: a gRPC channel must not be used after fork(),
        so a forked child is refused at once with the ConstraintError naming the client
        factory. (test_a_client_factory_is_called_once_in_each_process: the fork a
        factory serves.)"""
        refused_in_children(cache, GIVEN)


class TestAsyncEtcdContractFactory(EtcdTimings, NotifySmoke, ContractSmoke):
    """...on clients for all three members, made by a factory in each process."""

    @pytest.fixture
    def cache(self, cluster: EtcdCluster) -> Iterator[BlockingFace]:
        face = BlockingFace(AsyncEtcdCache(Members(cluster.endpoints), prefix=RUN))
        yield face
        face.close()

    def test_a_forked_child_uses_the_cache_on_its_own(self, cache: BlockingFace) -> None:
        """In place of the contract's test: the parent used gRPC before the fork, and
        gRPC cannot run in such a child at all (its first call hangs, or it dies of
        SIGSEGV): refused at once, naming the fix. A parent that forks before locking:
        test_a_client_factory_is_called_once_in_each_process."""
        refused_in_children(cache, USED_BEFORE_FORK)


# -- what only asyncio shows -------------------------------------------------------------


def test_mutex_wraps_the_aetcd_client_beside_the_blocking_cache(cluster: EtcdCluster) -> None:
    """Mutex(aetcd.Client) locks through an AsyncEtcdCache, on the keys an EtcdCache of
    the same prefix uses: each excludes the other's holder, with the same fence."""
    blocking = Mutex(EtcdCache(raw(cluster)), lease=30)

    async def main() -> None:
        client = connect(cluster.endpoints[0])
        cache = as_cache(client)
        assert isinstance(cache, AsyncEtcdCache)
        assert is_async(cache)
        assert isinstance(cache, AsyncConditionalCache)
        mutex = Mutex(client, lease=30)
        key = unique_key("wrap")
        async with mutex.acquire_async(key, timeout=5) as lease:
            assert blocking.try_acquire(key) is None
            assert (await mutex.holder_async(key)).fence == lease.fence
            assert blocking.holder(key).fence == lease.fence  # type: ignore[union-attr]
        assert not await mutex.locked_async(key)
        held = blocking.acquire(key)  # no `with`: a blocking block is not a coroutine's
        assert (await mutex.try_acquire_async(key)) is None
        assert (await mutex.holder_async(key)).fence == held.fence
        held.release()
        await client.close()

    run(main())


def _contend(
    endpoints: list[str], prefix: str, key: str, tasks: int, rounds: int, shared: Any
) -> None:
    """One OS process of coroutines counting under one lock, on clients of its own."""

    async def main() -> None:
        cache = AsyncEtcdCache(Members(endpoints), prefix=prefix)
        await count_under_lock(Mutex(cache, lease=30), key, tasks, rounds, shared)
        await cache.close()

    asyncio.run(main())


def test_processes_of_many_coroutines_exclude_each_other_exactly(cluster: EtcdCluster) -> None:
    """3 processes x 10 coroutines x 3 rounds on one key: every increment counted, never
    two holders inside at once. The processes are fresh interpreters (spawned): this
    one has used gRPC, which no forked child of it could."""
    procs, tasks, rounds = 3, 10, 3
    key = unique_key("contend")
    args = (cluster.endpoints, RUN, key, tasks, rounds)
    *exits, total, overlaps, inside = contend(_contend, args, procs, context=CTX)
    assert exits == [0] * procs
    assert (total, overlaps, inside) == (procs * tasks * rounds, 0, 0)


def _use_factory(face: BlockingFace, factory: Members, key: str) -> None:
    """In a forked child: the factory is called once more, here, and only its clients
    are used."""
    face.take_and_free(key, "child")
    (child, _), *more = factory.made
    assert (child, more) == (os.getpid(), [])


def _forking_parent(endpoints: list[str], prefix: str, key: str) -> None:
    """A fresh process that never used gRPC (a Celery prefork parent): it forks two
    children before locking, each calls the factory and locks on its own clients; then
    it locks too, on the one its own call made."""
    factory = Members(endpoints)
    face = BlockingFace(AsyncEtcdCache(factory, prefix=prefix))
    assert forked(_use_factory, [(face, factory, f"{key}.{n}") for n in range(2)], 30) == [0, 0]
    assert factory.made == []  # the children's calls were theirs
    face.take_and_free(key, "p")
    assert [pid for pid, _ in factory.made] == [os.getpid()]
    face.close()


def test_a_client_factory_is_called_once_in_each_process(cluster: EtcdCluster) -> None:
    """Lazily, on first use, once per process: forked children of a parent that has not
    locked yet each call it, and the parent's own first use calls it once."""
    parent = CTX.Process(target=_forking_parent, args=(cluster.endpoints, RUN, unique_key()))
    parent.start()
    parent.join(60)
    assert parent.exitcode == 0


def test_a_child_of_a_parent_that_used_grpc_is_refused(cluster: EtcdCluster) -> None:
    """A parent that locked before forking, even with its clients closed since: its
    children are refused at once, naming the fix (gRPC's poller thread outlives a closed
    channel until it is collected; such a child hung or died of SIGSEGV in one run of
    three when it was let through)."""
    face = BlockingFace(AsyncEtcdCache(Members(cluster.endpoints), prefix=RUN))
    face.take_and_free(unique_key("used"), "p")
    face.call(face.cache.close())
    refused_in_children(face, USED_BEFORE_FORK)
    face.close()


def test_a_client_is_bound_to_its_first_loop_and_others_are_refused_at_once(
    cluster: EtcdCluster,
) -> None:
    """A gRPC channel belongs to the event loop it was opened on. Another loop using the
    cache (a second asyncio.run once the first closed, or a thread running its own loop
    while the first still runs) fails at once with a ConstraintError naming the fix,
    never hangs, and leaves nothing held. It is refused before a call is made: gRPC
    would refuse it too, but only after making a coroutine it never awaits (CI's log
    showed its RuntimeWarning)."""
    key = unique_key("bound")

    def bound() -> Mutex:
        return Mutex(AsyncEtcdCache(connect(cluster.endpoints[0]), prefix=RUN), lease=30)

    async def cycle(mutex: Mutex) -> None:
        await (await mutex.acquire_async(key, timeout=2)).release_async()

    def refused(mutex: Mutex) -> None:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with pytest.raises(ConstraintError, match="build the client and the cache inside each"):
                run(cycle(mutex))
            gc.collect()
        assert not [str(w.message) for w in seen if "never awaited" in str(w.message)]

    first = bound()
    run(cycle(first))  # binds the client to this loop, now closed
    refused(first)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    running = bound()
    asyncio.run_coroutine_threadsafe(cycle(running), loop).result(LIMIT)
    refused(running)  # this thread's loop, while the other one runs
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    assert EtcdCache(raw(cluster), prefix=RUN).get(f"mutex.{key}") is None


def test_a_factory_cache_closed_on_one_loop_serves_the_next(cluster: EtcdCluster) -> None:
    """A cache given a factory and closed at the end of each asyncio.run makes new
    clients on the next loop, bound to that one: the refusal is for clients still open."""
    mutex = Mutex(AsyncEtcdCache(lambda: connect(cluster.endpoints[0]), prefix=RUN), lease=30)
    key = unique_key("next-loop")

    async def cycle_then_close() -> None:
        await (await mutex.acquire_async(key, timeout=2)).release_async()
        await mutex.cache.close()

    for _ in range(3):
        run(cycle_then_close())
    assert EtcdCache(raw(cluster), prefix=RUN).get(f"mutex.{key}") is None


def test_a_factory_that_returns_no_client_is_refused(cluster: EtcdCluster) -> None:
    face = BlockingFace(AsyncEtcdCache(lambda: "not a client", prefix=RUN))
    with pytest.raises(ConstraintError, match="must return an aetcd Client"):
        face.get("k")
    face.close()
    with pytest.raises(ConstraintError, match="aetcd Client"):
        AsyncEtcdCache("not a client")


def test_a_down_member_is_passed_over(cluster: EtcdCluster) -> None:
    """The first member refuses (nobody listens): the next one answers, the watch too."""
    endpoints = [f"127.0.0.1:{free_port()}", cluster.endpoints[0]]
    face = BlockingFace(AsyncEtcdCache(Members(endpoints), prefix=RUN))
    key = unique_key()
    entry = face.put_if_absent(key, "v", ttl=30)
    assert face.get(key) == entry
    face.wait([key], 0.1)
    face.close()


def test_every_operation_on_a_dead_cluster_is_a_malfunction() -> None:
    """Each of the five, and the watch of ``wait``, names etcd, the operation and the key."""
    face = BlockingFace(AsyncEtcdCache(Members([f"127.0.0.1:{free_port()}"]), prefix=RUN))
    for call, operation in [
        (lambda: face.get("k"), "get"),
        (lambda: face.put_if_absent("k", "v", ttl=1), "put_if_absent"),
        (lambda: face.compare_and_set("k", "v", ttl=1, version="7"), "compare_and_set"),
        (lambda: face.compare_and_delete("k", version="7"), "compare_and_delete"),
        (lambda: face.wait(["k"], 1), "wait"),
    ]:
        with pytest.raises(MalfunctionError, match=f"etcd cache failed during {operation} on 'k'"):
            call()
    face.close()


def test_opening_the_watch_counts_against_the_waits_timeout(cluster: EtcdCluster) -> None:
    """The asyncio face's twin of test_etcd's: a 0.5 s open eats into ``wait(keys, 0.5)``."""

    async def main() -> float:
        cache = AsyncEtcdCache(connect(cluster.endpoints[0]), prefix=RUN, close_clients=True)
        try:
            key = unique_key()
            await cache.put_if_absent(key, "holder", ttl=30)
            on_a_member = cache._on_a_member

            async def slowly(call: Any) -> Any:
                await asyncio.sleep(0.5)
                return await on_a_member(call)

            cache._on_a_member = slowly  # type: ignore[method-assign]
            start = asyncio.get_running_loop().time()
            await cache.wait([key], 0.5)
            return asyncio.get_running_loop().time() - start
        finally:
            await cache.close()

    assert run(main()) < 0.85  # 1.0 s or more when the open is not counted
