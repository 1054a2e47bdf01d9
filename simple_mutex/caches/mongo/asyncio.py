"""AsyncMongoCache: MongoCache on pymongo's asyncio client (``AsyncMongoClient``).

The same documents, statements, clocks, fences, TTL index and fault mapping as
``MongoCache``: every operation is a flow of ``core.py``, which this module only
awaits. ``Mutex(AsyncMongoClient)``, ``Mutex(AsyncDatabase)`` and
``Mutex(AsyncCollection)`` wrap the object in this cache.

* Needs pymongo >= 4.13, whose asyncio API is no longer a beta (``MIN_PYMONGO``); an
  older pymongo is refused with the version to install.
* ``wait`` sleeps on the loop (``asyncio.sleep``): the engine's jittered poll finds
  releases and expiries, as with MongoCache. No thread.
* A forked child opens its own client (pymongo's ``_duplicate`` of the one given).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, TypeVar

from simple_mutex.caches._base import driver_imports
from simple_mutex.contract import Entry
from simple_mutex.errors import ConstraintError, ConstraintTypeError

from .core import Call, Flow, MongoCore, scanned

with driver_imports("mongo"):
    import pymongo
    from pymongo.errors import PyMongoError

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
    ``AsyncCollection``; options as for ``MongoCache``, and both may share a collection."""

    def _kinds(self) -> tuple[Any, Any, Any]:
        return _async_kinds()

    async def close(self) -> None:
        """Close the client this cache opened itself (in a forked child)."""
        client, self._client = self._client, None
        if client is not None:
            self._coll = None
            await client.close()

    async def ready(self, operation: str = "ready", key: str = "") -> None:
        """As ``MongoCache.ready``: the TTL index, and the check of the server's clock."""
        await self._drive(self._readying(operation, key))

    async def _run(self, operation: str, key: str, flow: Flow[T]) -> T:
        if not self._ready:
            await self.ready(operation, key)  # idempotent: coroutines racing here do no harm
        return await self._drive(flow)

    async def _drive(self, flow: Flow[T]) -> T:
        """Run a flow: each call awaited on the collection, each pause on the loop."""
        reply: Any = None
        error: Exception | None = None
        while True:
            try:
                step = flow.send(reply) if error is None else flow.throw(error)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            reply, error = None, None
            if not isinstance(step, Call):
                await asyncio.sleep(step.seconds)
                continue
            try:
                method = getattr(self._collection(), step.method)
                reply = await method(*step.args, **step.kwargs)
            except PyMongoError as exc:
                error = self._failed(step, exc)
            except RuntimeError as exc:
                if "different event loop" not in str(exc):
                    raise
                # pymongo binds a client to the first loop that used it, and refuses any
                # other before it sends anything: the caller's to fix, not a fault.
                raise ConstraintTypeError(
                    f"AsyncMongoCache: its AsyncMongoClient is bound to the event loop it was "
                    f"first used on ({exc}); build the client and the cache inside each event "
                    "loop (each asyncio.run, each thread running a loop)"
                ) from exc

    # -- the contract --------------------------------------------------------------------

    async def get(self, key: str) -> Entry | None:
        return await self._run("get", key, self._reading("get", key))

    async def scan(self, prefix: str) -> list[tuple[str, Entry]]:
        """As ``MongoCache.scan``, awaited: the whole listing at once."""
        if not self._ready:
            await self.ready("scan", prefix)
        call = self._scanning(prefix)
        try:  # the cursor is read here, inside the fault mapping
            docs = await getattr(self._collection(), call.method)(*call.args).to_list(None)
        except PyMongoError as exc:
            raise self._failed(call, exc) from exc
        return scanned(docs, prefix)

    async def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:
        return await self._run("put_if_absent", key, self._putting(key, value, ttl=ttl))

    async def compare_and_set(self, key: str, value: str, *, ttl: float, version: str) -> Entry:
        flow = self._setting(key, value, ttl=ttl, version=version)
        return await self._run("compare_and_set", key, flow)

    async def compare_and_delete(self, key: str, *, version: str) -> None:
        await self._run("compare_and_delete", key, self._deleting(key, version=version))

    async def wait(self, keys: Sequence[str], timeout: float) -> None:  # type: ignore[override]
        await asyncio.sleep(max(timeout, 0.0))
