"""Test helpers for code that takes simple-mutex locks: faults on demand, isolated caches.

::

    from simple_mutex import InMemoryCache, Mutex
    from simple_mutex.testing import FaultyCache

    cache = FaultyCache(InMemoryCache())
    cache.fail("compare_and_set", times=3)      # renewals fail: a renewing holder is lost
    cache.lose_reply("put_if_absent")           # the write lands, the caller sees a fault
    cache.delay("wait", 0.5)                    # every wait takes half a second longer
    cache.expire("order.7")                     # the holder's record lapses now

Operation names are the contract's: ``get``, ``put_if_absent``, ``compare_and_set``,
``compare_and_delete``, ``wait``. ``FaultyCache`` of an asyncio cache is an asyncio cache.
The pytest plugin (``simple_mutex.pytest_plugin``, loaded by pytest on its own) gives
fixtures built on these: ``mutex_cache``, ``faulty_cache``, ``mutex_events``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import Any

from ._core.keys import check_key, check_prefix, encode_key
from .caches.adapt import as_cache
from .contract import DRIVER_ERRORS, AnyCache, Entry, is_async
from .errors import ConstraintValueError, MalfunctionError, SimpleCacheConditionError, bad_input

OPERATIONS = ("get", "put_if_absent", "compare_and_set", "compare_and_delete", "wait")


def _check_operation(op: object) -> str:
    if op not in OPERATIONS:
        raise ConstraintValueError(f"operation must be one of {', '.join(OPERATIONS)}, got {op!r}")
    return str(op)


def _check_times(times: object) -> int:
    if isinstance(times, bool) or not isinstance(times, int) or times < 1:
        raise bad_input(times, int, f"times must be an int >= 1, got {times!r}")
    return times


class Faults:
    """What is planned for each operation; shared by both faces, safe across threads."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._fail: dict[str, int] = {}
        self._lose: dict[str, int] = {}
        self._delay: dict[str, float] = {}
        self.calls: dict[str, int] = dict.fromkeys(OPERATIONS, 0)

    def fail(self, op: str, times: int = 1) -> None:
        with self._lock:
            self._fail[_check_operation(op)] = _check_times(times)

    def lose_reply(self, op: str, times: int = 1) -> None:
        if op in ("get", "wait"):
            raise ConstraintValueError(f"lose_reply is for writes; {op} writes nothing (use fail)")
        with self._lock:
            self._lose[_check_operation(op)] = _check_times(times)

    def delay(self, op: str, seconds: float) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0:
            raise bad_input(seconds, (int, float), f"delay must be seconds >= 0, got {seconds!r}")
        with self._lock:
            self._delay[_check_operation(op)] = float(seconds)

    def clear(self) -> None:
        """Forget every planned fault."""
        with self._lock:
            self._fail.clear()
            self._lose.clear()
            self._delay.clear()

    def before(self, op: str, key: str) -> tuple[float, bool]:
        """Count the call; raise a planned failure; return (delay, lose the reply)."""
        with self._lock:
            self.calls[op] += 1
            if self._take(self._fail, op):
                raise self.fault(op, key, "injected failure")
            return self._delay.get(op, 0.0), self._take(self._lose, op)

    def fault(self, op: str, key: str, what: str) -> MalfunctionError:
        return MalfunctionError(f"{self.name} cache failed during {op} on {key!r}: {what}")

    @staticmethod
    def _take(planned: dict[str, int], op: str) -> bool:
        left = planned.get(op, 0)
        if left:
            planned[op] = left - 1
        return bool(left)


class FaultyCache:
    """Wrap any cache (or raw client) so that tests can inject faults by operation name:
    ``fail(op, times=1)``, ``lose_reply(op, times=1)``, ``delay(op, seconds)``,
    ``expire(key)``, ``clear()``, and ``calls`` (how often each operation ran).

    ``FaultyCache(asyncio_cache)`` is an :class:`AsyncFaultyCache` (the same controls, the
    contract's methods coroutines), so ``isinstance(x, FaultyCache)`` holds for both."""

    def __new__(cls, cache: object) -> FaultyCache:
        inner = as_cache(cache)
        if cls is FaultyCache and is_async(inner):
            cls = AsyncFaultyCache
        faulty = super().__new__(cls)
        faulty.cache = inner
        return faulty

    def __init__(self, cache: object) -> None:
        # __new__ has wrapped ``cache`` (a raw client becomes its cache) into self.cache.
        self.name = self.cache.name
        self.faults = Faults(self.cache.name)
        self._keys: set[str] = set()  # cache keys written through it (for expire)
        self._lapsed: set[str] = set()  # cache keys expire() lapsed, not granted since

    cache: Any

    @property
    def driver_errors(self) -> tuple[type[Exception], ...]:
        """The wrapped cache's: a fault it lets escape stays a fault through the wrapper."""
        return getattr(self.cache, "driver_errors", DRIVER_ERRORS)

    def fail(self, op: str, times: int = 1) -> None:
        """The next ``times`` calls of ``op`` raise MalfunctionError (nothing is written)."""
        self.faults.fail(op, times)

    def lose_reply(self, op: str, times: int = 1) -> None:
        """The next ``times`` writes of ``op`` land, then raise MalfunctionError, as a reply
        lost to a timeout or a reset would."""
        self.faults.lose_reply(op, times)

    def delay(self, op: str, seconds: float) -> None:
        """Every call of ``op`` takes ``seconds`` longer (0 stops it)."""
        self.faults.delay(op, seconds)

    def clear(self) -> None:
        """No more injected faults."""
        self.faults.clear()

    @property
    def calls(self) -> dict[str, int]:
        """How many times each operation was called."""
        return self.faults.calls

    def _matching(self, key: str, prefix: str | None) -> list[str]:
        """Cache keys written here for the lock ``key``: under ``prefix``, or the Mutex and
        Semaphore defaults; every slot of a semaphore."""
        encoded = encode_key(check_key(key))
        prefixes = ("mutex.", "semaphore.", "") if prefix is None else (check_prefix(prefix),)
        bases = {p + encoded for p in prefixes}
        return sorted(k for k in self._keys if k.partition("#")[0] in bases)

    def _call(self, op: str, key: str, write: Any) -> Any:
        delay, lose = self.faults.before(op, key)
        if delay:
            time.sleep(delay)
        result = write()
        if lose:
            raise self.faults.fault(op, key, "reply lost (the write landed)")
        return result

    def get(self, key: str) -> Entry | None:
        return self._call("get", key, lambda: self.cache.get(key))  # type: ignore[no-any-return]

    def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:
        self._keys.add(key)
        entry = self._call(
            "put_if_absent", key, lambda: self.cache.put_if_absent(key, value, ttl=ttl)
        )
        return self._granted(key, entry)

    def _granted(self, key: str, entry: Entry) -> Entry:
        """The first grant after ``expire`` took over from the holder it lapsed, as after
        a real lapse. (``expire`` frees the record: a record written to lapse a moment
        later could be renewed by its holder in that moment.)"""
        if key not in self._lapsed:
            return entry
        self._lapsed.discard(key)
        return entry._replace(took_over=True)

    def compare_and_set(self, key: str, value: str, *, ttl: float, version: str) -> Entry:
        return self._call(  # type: ignore[no-any-return]
            "compare_and_set", key,
            lambda: self.cache.compare_and_set(key, value, ttl=ttl, version=version),
        )  # fmt: skip

    def compare_and_delete(self, key: str, *, version: str) -> bool | None:
        return self._call(  # type: ignore[no-any-return]
            "compare_and_delete", key, lambda: self.cache.compare_and_delete(key, version=version)
        )

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        self._call("wait", keys[0] if keys else "", lambda: self.cache.wait(keys, timeout))

    def expire(self, key: str, prefix: str | None = None) -> int:
        """The record of the lock ``key`` (your key; ``prefix`` if the Mutex has its own)
        lapses now, as if its lease had run out: a renewing holder learns it at its next
        renewal, and anyone may take the key at once (that grant says it took over).
        Returns how many records lapsed."""
        lapsed = 0
        for cache_key in self._matching(key, prefix):
            entry = self.cache.get(cache_key)
            if entry is not None:
                try:
                    self.cache.compare_and_delete(cache_key, version=entry.version)
                    self._lapsed.add(cache_key)
                    lapsed += 1
                except SimpleCacheConditionError:
                    pass  # released in between
        return lapsed


class AsyncFaultyCache(FaultyCache):
    """A FaultyCache over an asyncio cache: the contract's methods are coroutines."""

    async def _call(self, op: str, key: str, write: Any) -> Any:
        delay, lose = self.faults.before(op, key)
        if delay:
            await asyncio.sleep(delay)
        result = await write()
        if lose:
            raise self.faults.fault(op, key, "reply lost (the write landed)")
        return result

    async def get(self, key: str) -> Entry | None:  # type: ignore[override]
        return await self._call("get", key, lambda: self.cache.get(key))  # type: ignore[no-any-return]

    async def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:  # type: ignore[override]
        self._keys.add(key)
        entry = await self._call(
            "put_if_absent", key, lambda: self.cache.put_if_absent(key, value, ttl=ttl)
        )
        return self._granted(key, entry)

    async def compare_and_set(  # type: ignore[override]
        self, key: str, value: str, *, ttl: float, version: str
    ) -> Entry:
        return await self._call(  # type: ignore[no-any-return]
            "compare_and_set", key,
            lambda: self.cache.compare_and_set(key, value, ttl=ttl, version=version),
        )  # fmt: skip

    async def compare_and_delete(self, key: str, *, version: str) -> bool | None:  # type: ignore[override]
        return await self._call(  # type: ignore[no-any-return]
            "compare_and_delete", key, lambda: self.cache.compare_and_delete(key, version=version)
        )

    async def wait(self, keys: Sequence[str], timeout: float) -> None:  # type: ignore[override]
        await self._call("wait", keys[0] if keys else "", lambda: self.cache.wait(keys, timeout))

    async def expire(self, key: str, prefix: str | None = None) -> int:  # type: ignore[override]
        """``expire`` of the blocking face, awaited."""
        lapsed = 0
        for cache_key in self._matching(key, prefix):
            entry = await self.cache.get(cache_key)
            if entry is not None:
                try:
                    await self.cache.compare_and_delete(cache_key, version=entry.version)
                    self._lapsed.add(cache_key)
                    lapsed += 1
                except SimpleCacheConditionError:
                    pass
        return lapsed


def isolated(cache: object, prefix: str) -> AnyCache:
    """``cache`` with every key under ``prefix``: tests sharing one server cannot meet."""
    inner = as_cache(cache)
    check_prefix(prefix)
    return (_AsyncPrefixed if is_async(inner) else _Prefixed)(inner, prefix)


class _Prefixed:
    def __init__(self, cache: Any, prefix: str) -> None:
        self.cache, self.prefix, self.name = cache, prefix, cache.name
        self.driver_errors = getattr(cache, "driver_errors", DRIVER_ERRORS)

    def get(self, key: str) -> Entry | None:
        return self.cache.get(self.prefix + key)  # type: ignore[no-any-return]

    def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:
        return self.cache.put_if_absent(self.prefix + key, value, ttl=ttl)  # type: ignore[no-any-return]

    def compare_and_set(self, key: str, value: str, *, ttl: float, version: str) -> Entry:
        return self.cache.compare_and_set(self.prefix + key, value, ttl=ttl, version=version)  # type: ignore[no-any-return]

    def compare_and_delete(self, key: str, *, version: str) -> bool | None:
        return self.cache.compare_and_delete(self.prefix + key, version=version)  # type: ignore[no-any-return]

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        self.cache.wait([self.prefix + key for key in keys], timeout)


class _AsyncPrefixed(_Prefixed):
    async def get(self, key: str) -> Entry | None:  # type: ignore[override]
        return await self.cache.get(self.prefix + key)  # type: ignore[no-any-return]

    async def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:  # type: ignore[override]
        return await self.cache.put_if_absent(self.prefix + key, value, ttl=ttl)  # type: ignore[no-any-return]

    async def compare_and_set(  # type: ignore[override]
        self, key: str, value: str, *, ttl: float, version: str
    ) -> Entry:
        return await self.cache.compare_and_set(  # type: ignore[no-any-return]
            self.prefix + key, value, ttl=ttl, version=version
        )

    async def compare_and_delete(self, key: str, *, version: str) -> bool | None:  # type: ignore[override]
        return await self.cache.compare_and_delete(self.prefix + key, version=version)  # type: ignore[no-any-return]

    async def wait(self, keys: Sequence[str], timeout: float) -> None:  # type: ignore[override]
        await self.cache.wait([self.prefix + key for key in keys], timeout)
