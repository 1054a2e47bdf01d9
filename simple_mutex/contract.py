"""The conditional-write cache contract that every backend implements.

A cache is a small key/value store with expiry, a version per entry and a counter per key.
It holds **no locking logic**: each method is one non-blocking, compare-then-act step, and
the lock engine (``simple_mutex._core.flows``) builds mutexes and semaphores from them. The
contract is shaped by the weakest backend (S3 has only ``If-None-Match: *`` and
``If-Match: <etag>``), so a new backend needs nothing more than those two conditions.

Writing your own backend
------------------------
Implement the five methods of :class:`ConditionalCache` and pass the shared contract suite
(``tests/contract.py``). The rules:

``get(key)``
    The live entry, or ``None`` when the key is absent, freed or expired.

``put_if_absent(key, value, ttl=...)``
    Write ``value`` if the key has no live entry (absent, freed, or expired by the cache's
    own clock: the server's where it has one). In the same atomic step the key's fence
    becomes max(its previous fence + 1, the clock in µs): a freed tombstone keeps the
    counter for a while, and the clock floor keeps fences growing once it is collected or
    lost (``caches._base.clock_fence``). If a live entry already holds exactly ``value``,
    return it unchanged: it is our own earlier write whose reply was lost, and values carry
    a unique token, so equality proves ownership. Otherwise raise
    ``SimpleCacheConditionError``.

    The entry it returns says ``took_over=True`` when the key was last granted to a
    holder that never freed it (its entry expired, or was renewed until it lapsed), as
    far as the cache still remembers: within the window it keeps an expired key's trace
    (``gc_after`` where the cache has one, the fence window on Redis). A first grant, a
    grant after a ``compare_and_delete``, a grant once the cache forgot the key, and our
    own earlier write returned again say False. Each semaphore slot (``key#N``) is a key
    of its own here. Lock events, spans and the timeline report it as the grant's
    ``took_over``.

``compare_and_set(key, value, ttl=..., version=...)``
    Replace the live entry whose version is ``version`` and restart its expiry; the fence
    does not change; the version does. Raise ``SimpleCacheConditionError`` if the entry is
    absent, expired or has another version.

``compare_and_delete(key, version=...)``
    Free the live entry whose version is ``version`` (keeping the fence counter). Raise
    ``SimpleCacheConditionError`` if it is absent, expired or has another version. Return
    True if the release woke a waiter (a cache that cannot tell returns None): the engine
    then lets that waiter go first instead of barging back in.

    A cache whose driver resends a command after the connection broke (the reply lost,
    the command maybe applied) should remember its releases: a delete at a version the
    key was freed at, with nothing granted since (Redis: or one grant, whose record it
    leaves alone), returns again (False or None) instead of raising, for as long as the
    cache keeps the trace (a freed row, Redis's held mark). Otherwise the engine cannot
    tell the resend that found its own release done from a lease lost before the
    release, and reports the second.

``wait(keys, timeout)``
    Block for at most ``timeout`` seconds, returning early when any of ``keys`` may have
    been freed (a condition variable, a Redis signal list...). Spurious early returns are
    fine: the engine retries and keeps its own deadline. A cache with no notification
    simply sleeps.

``scan(prefix)`` (optional: the :class:`Scannable` capability)
    Yield ``(key, entry)`` for every live entry whose key starts with ``prefix``, each as
    ``get`` would have returned it at some moment during the scan, in no particular
    order. Absent, freed and expired keys are never yielded, nor the cache's own side
    records (fence counters, waiter marks). Every character of ``prefix`` is literal: a
    ``*``, ``%``, ``_``, ``[`` or ``.`` matches only itself (escape it for the backend's
    pattern language, or use a range on the key). A key written or freed while the scan
    runs may or may not show. Operators' tools (``simple_mutex.admin``, the
    ``simple-mutex`` command) need it; locking never calls it.

``index_prefix(prefix)`` (optional)
    A cache that lists from an index of its own rather than its whole keyspace (Redis:
    one per lock prefix) is told which prefixes to index: ``Mutex``, ``Semaphore`` and
    ``Lines`` call it with theirs before they write. ``scan(prefix)`` of a noted prefix
    then lists what any process wrote under it; entries written under no noted prefix
    are not listed by such a cache.

``waited_on(key)`` (optional)
    True if a waiter is blocked on ``key`` now (or was within the last few seconds), as
    far as the cache's own wake-up bookkeeping tells (Redis's waiter mark, the disk
    store's marked rows). Shown by ``simple-mutex watch``; a cache that cannot tell has
    no such method.

``wait_then_put(keys, timeout, key, value, ttl=...)`` (optional; blocking caches)
    ``wait(keys, timeout)``, then ``put_if_absent(key, value, ttl=...)`` in the cache's
    next step with no round trip between them, returning the entry or raising as
    ``put_if_absent`` does. A cache that can fuse them (Redis on its own connections:
    the put is pipelined behind the ``BLPOP``, which the server holds until the
    ``BLPOP`` returns) has it; one that cannot has no such attribute, or sets it to
    None. The engine then waits a single-slot acquire this way: the waiter a release
    wakes holds the key before its releaser can ask again, so it needs no courtesy, and
    a section costs no wake-up plus round trip with the key free. The lease of a grant
    it returns runs from before the wait, so the engine blocks for a quarter of the
    lease at most (``_core.timing.hand_over_block``).

Faults of the driver (connection refused, corrupt file, timeouts) must be raised as
``MalfunctionError`` naming the cache and the operation, never as the driver's own error.
A cache names its driver's error classes in ``driver_errors`` (default: the builtin
``ConnectionError``): the engine maps one of those that escaped to a MalfunctionError.
Anything else raised inside a cache call reaches the caller unchanged: a signal
handler's exception (RQ's job timeout, Celery's soft time limit, an alarm) that lands
while an acquire waits is the caller's, never a backend fault to wait out.

An asyncio backend implements :class:`AsyncConditionalCache`: the same five rules, each
method a coroutine (``redis.asyncio``, psycopg's ``AsyncConnection``, pymongo's
``AsyncMongoClient``). The engine awaits it directly: no thread per operation or waiter.
Its optional ``scan(prefix)`` is a coroutine that returns the whole listing as a list.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

DRIVER_ERRORS: tuple[type[Exception], ...] = (ConnectionError,)
"""What a cache without its own ``driver_errors`` may let escape for a backend fault."""


class Entry(NamedTuple):
    """One live cache entry as a cache returns it (a NamedTuple: cheap on the hot path)."""

    value: str
    """Exactly what the engine wrote (a JSON lock record)."""
    version: str
    """Opaque; changes on every write. The condition of compare-and-set and -delete."""
    fence: int
    """The key's grant counter as of this entry; only ever grows."""
    expires_at: float
    """When the entry lapses, in Unix seconds by the cache's clock."""
    took_over: bool = False
    """Set by ``put_if_absent`` only: this grant replaced a holder that never freed the
    key (its entry lapsed). ``get``, ``compare_and_set`` and ``scan`` always say False."""


@runtime_checkable
class ConditionalCache(Protocol):
    """What the lock engine needs from a cache. See the module docstring for the rules."""

    name: str
    """A short name used in error messages ("memory", "disk", "redis"...)."""

    def get(self, key: str) -> Entry | None: ...

    def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry: ...

    def compare_and_set(self, key: str, value: str, *, ttl: float, version: str) -> Entry: ...

    def compare_and_delete(self, key: str, *, version: str) -> bool | None: ...

    def wait(self, keys: Sequence[str], timeout: float) -> None: ...


@runtime_checkable
class Scannable(Protocol):
    """The optional capability to list live entries by key prefix (module docstring)."""

    def scan(self, prefix: str) -> Iterator[tuple[str, Entry]]: ...


@runtime_checkable
class AsyncConditionalCache(Protocol):
    """The contract for asyncio backends: the same five rules, as coroutines."""

    name: str

    async def get(self, key: str) -> Entry | None: ...

    async def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry: ...

    async def compare_and_set(self, key: str, value: str, *, ttl: float, version: str) -> Entry: ...

    async def compare_and_delete(self, key: str, *, version: str) -> bool | None: ...

    async def wait(self, keys: Sequence[str], timeout: float) -> None: ...


AnyCache = ConditionalCache | AsyncConditionalCache


def is_async(cache: object) -> bool:
    """Is ``cache`` an asyncio backend (its methods coroutines)?"""
    return inspect.iscoroutinefunction(getattr(cache, "put_if_absent", None))
