"""AsyncMongoCache: MongoCache on pymongo's asyncio client (``AsyncMongoClient``).

The same documents, statements, clocks, fences, TTL index and fault mapping as
``MongoCache``: every operation is a flow of ``core.py``, which this module only
awaits. ``Mutex(AsyncMongoClient)``, ``Mutex(AsyncDatabase)`` and
``Mutex(AsyncCollection)`` wrap the object in this cache.

* Needs pymongo >= 4.13, whose asyncio API is no longer a beta (``MIN_PYMONGO``); an
  older pymongo is refused with the version to install.
* ``wait`` sleeps on the loop (``asyncio.sleep``): the engine's jittered poll finds
  releases and expiries, as with MongoCache. No thread.
* Given a client factory (a function returning a new ``AsyncMongoClient``), it calls it
  on first use in each process, a forked child too. A client given as it is stays bound
  to the event loop it was first used on: a forked child running a loop of its own is
  refused with a ``ConstraintError`` (pymongo's "different event loop") naming the
  factory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, TypeVar

from simple_mutex._runtime.steps import drive_async
from simple_mutex.caches._base import driver_imports
from simple_mutex.contract import Entry
from simple_mutex.errors import ConstraintError

from .core import Call, Flow, MongoCore

with driver_imports("mongo"):
    import pymongo

MIN_PYMONGO = (4, 13)
T = TypeVar("T")


def _async_kinds() -> tuple[Any, Any, Any]:
    """pymongo's asyncio client, database and collection classes, or the version to
    install when this pymongo has none (or only their beta)."""
    if tuple(pymongo.version_tuple[:2]) < MIN_PYMONGO:
        raise ConstraintError(
            f"AsyncMongoCache needs pymongo >= {'.'.join(map(str, MIN_PYMONGO))} "
            f"(AsyncMongoClient), found {pymongo.version}: pip install 'pymongo>=4.13'"
        )
    from pymongo.asynchronous.collection import AsyncCollection
    from pymongo.asynchronous.database import AsyncDatabase

    return pymongo.AsyncMongoClient, AsyncDatabase, AsyncCollection


class AsyncMongoCache(MongoCore):
    """An AsyncConditionalCache over a pymongo ``AsyncMongoClient``, ``AsyncDatabase`` or
    ``AsyncCollection``, or a function of no arguments that returns a new one (called in
    each process, as ``MongoCache``'s factory is); options as for ``MongoCache``, and
    both may share a collection."""

    def _kinds(self) -> tuple[Any, Any, Any]:
        return _async_kinds()

    async def close(self) -> None:
        """Close the client this cache's factory made; the next use makes another."""
        client, self._client = self._client, None
        if client is not None:
            self._coll = None
            await client.close()

    async def ready(self, operation: str = "ready", key: str = "") -> None:
        """As ``MongoCache.ready``: the TTL index, and the check of the server's clock."""
        await drive_async(self._readying(operation, key), self._perform, self._failed)

    async def _run(self, operation: str, key: str, flow: Flow[T]) -> T:
        if not self._ready:
            await self.ready(operation, key)  # idempotent: coroutines racing here do no harm
        return await drive_async(flow, self._perform, self._failed)

    async def _perform(self, call: Call) -> Any:
        method = getattr(self._collection(), call.method)
        if call.method == "find":
            return await method(*call.args, **call.kwargs).to_list(None)  # the whole cursor
        return await method(*call.args, **call.kwargs)

    # -- the contract --------------------------------------------------------------------

    async def get(self, key: str) -> Entry | None:
        return await self._run("get", key, self._reading("get", key))

    async def scan(self, prefix: str) -> list[tuple[str, Entry]]:
        """As ``MongoCache.scan``, awaited: the whole listing at once."""
        return await self._run("scan", prefix, self._scanning(prefix))

    async def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:
        return await self._run("put_if_absent", key, self._putting(key, value, ttl=ttl))

    async def compare_and_set(self, key: str, value: str, *, ttl: float, version: str) -> Entry:
        flow = self._setting(key, value, ttl=ttl, version=version)
        return await self._run("compare_and_set", key, flow)

    async def compare_and_delete(self, key: str, *, version: str) -> None:
        await self._run("compare_and_delete", key, self._deleting(key, version=version))

    async def wait(self, keys: Sequence[str], timeout: float) -> None:
        await asyncio.sleep(max(timeout, 0.0))
