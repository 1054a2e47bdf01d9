"""An asyncio face of the contract over an InMemoryCache, for tests that need an asyncio
cache (a lease renewed on its loop) without a server; its waiters are futures on the loop."""

from __future__ import annotations

from collections.abc import Sequence

from simple_mutex import InMemoryCache
from simple_mutex.contract import Entry


class AsyncMemory:
    name = "async-memory"

    def __init__(self) -> None:
        self.sync = InMemoryCache()

    async def get(self, key: str) -> Entry | None:
        return self.sync.get(key)

    async def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:
        return self.sync.put_if_absent(key, value, ttl=ttl)

    async def compare_and_set(self, key: str, value: str, *, ttl: float, version: str) -> Entry:
        return self.sync.compare_and_set(key, value, ttl=ttl, version=version)

    async def compare_and_delete(self, key: str, *, version: str) -> bool | None:
        return self.sync.compare_and_delete(key, version=version)

    async def wait(self, keys: Sequence[str], timeout: float) -> None:
        await self.sync.wait_async(keys, timeout)
