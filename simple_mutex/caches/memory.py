"""InMemoryCache: one process. A dict of entries under a condition variable.

* Releases wake waiters at once: threads through the condition, asyncio waiters through
  their loop (``wait_async``).
* Fences come from one counter for the whole cache, so they grow per key too, and a freed
  key is dropped (no tombstone): nothing outlives a release. An expired entry stays
  ``gc_after`` seconds past its expiry (60 by default), so that the next grant can say it
  took over from a holder that never freed the key; a sweep every few thousand writes
  drops older ones. The counter starts at the wall clock in µs, so fences keep growing
  across process restarts (for a store that outlives us).
* Expiry follows a monotonic clock anchored once to Unix time.

Rationale: docs/design/memory.md.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from simple_mutex.contract import Entry
from simple_mutex.errors import SimpleCacheConditionError

from ._base import DEFAULT_GC_AFTER, CacheBase, clock_fence, gc_after_seconds

_SWEEP_EVERY = 4096

# Expiry must not follow the wall clock (an NTP step or a resumed VM would end leases
# early, while their holders' monotonic deadlines still run): a monotonic clock, anchored
# once to Unix time so that expires_at still reads as a date in holder().
_ANCHOR = time.time() - time.monotonic()


def steady_time() -> float:
    return _ANCHOR + time.monotonic()


class InMemoryCache(CacheBase):
    name = "memory"
    nonblocking = True  # asyncio drivers call it on the loop: no operation ever waits

    def __init__(
        self,
        *,
        clock: Callable[[], float] = steady_time,
        gc_after: float | None = DEFAULT_GC_AFTER,
    ) -> None:
        """``gc_after``: seconds an expired entry is remembered (None: until the key is
        granted again), so that its key's next grant says it took over."""
        self.gc_after = gc_after_seconds("InMemoryCache", gc_after)
        super().__init__()
        self._clock = clock
        # Enter the lock itself on hot paths: a Condition's own __enter__ is Python code.
        self._cond = threading.Condition(self._guard)
        self._entries: dict[str, Entry] = {}
        # Started at the wall clock in µs. Each write (a grant or a renewal) takes more than
        # a µs, so the counter never outruns that clock, and the cache of the next process
        # (or a new cache) starts above every fence this one granted.
        self._counter = itertools.count(clock_fence(time.time()))
        self._writes = 0
        self._sleepers = 0
        self._async_waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = set()

    def _after_fork(self) -> None:
        # The parent's waiting threads and event loops do not exist here.
        self._cond = threading.Condition(self._guard)
        self._sleepers = 0
        self._async_waiters = set()

    def _live(self, key: str, now: float) -> Entry | None:
        entry = self._entries.get(key)
        return entry if entry is not None and entry.expires_at > now else None

    def get(self, key: str) -> Entry | None:
        with self._guard:
            return self._live(key, self._clock())

    def scan(self, prefix: str) -> Iterator[tuple[str, Entry]]:
        """Live entries under ``prefix``: a copy taken under the lock, so the caller may
        lock and release while it iterates."""
        with self._guard:
            now = self._clock()
            found = [
                (key, entry)
                for key, entry in self._entries.items()
                if key.startswith(prefix) and entry.expires_at > now
            ]
        return iter(found)

    def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:
        with self._guard:
            now = self._clock()
            # Still here, though expired: its holder never freed it (a release drops it).
            lapsed = self._entries.get(key)
            if lapsed is not None and lapsed.expires_at > now:
                if lapsed.value == value:
                    return lapsed
                raise SimpleCacheConditionError(f"memory: {key!r} is held")
            fence = next(self._counter)
            entry = Entry(value, str(fence), fence, now + ttl)
            self._entries[key] = entry
            self._writes += 1
            if self._writes % _SWEEP_EVERY == 0:
                self._sweep(now)
            return entry if lapsed is None else entry._replace(took_over=True)

    def compare_and_set(self, key: str, value: str, *, ttl: float, version: str) -> Entry:
        with self._guard:
            now = self._clock()
            current = self._live(key, now)
            if current is None or current.version != version:
                raise SimpleCacheConditionError(f"memory: {key!r} is not at version {version}")
            entry = Entry(value, str(next(self._counter)), current.fence, now + ttl)
            self._entries[key] = entry
            return entry

    def compare_and_delete(self, key: str, *, version: str) -> None:
        with self._guard:
            current = self._live(key, self._clock())
            if current is None or current.version != version:
                raise SimpleCacheConditionError(f"memory: {key!r} is not at version {version}")
            del self._entries[key]
            if self._sleepers:  # notify_all is Python code: skip it when nobody waits
                self._cond.notify_all()
            waiters, self._async_waiters = self._async_waiters, set()
        for loop, future in waiters:
            loop.call_soon_threadsafe(_resolve, future)

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        with self._guard:
            pause = self._pause(keys, timeout)
            if pause > 0:
                self._sleepers += 1
                try:
                    self._cond.wait(pause)
                finally:
                    self._sleepers -= 1

    async def wait_async(self, keys: Sequence[str], timeout: float) -> None:
        """The asyncio form of ``wait``: parks on a future instead of a thread."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        waiter = (loop, future)
        with self._guard:
            pause = self._pause(keys, timeout)
            if pause <= 0:
                return
            self._async_waiters.add(waiter)
        try:
            await asyncio.wait_for(future, pause)
        except asyncio.TimeoutError:
            pass
        finally:
            with self._guard:
                self._async_waiters.discard(waiter)

    def _pause(self, keys: Sequence[str], timeout: float) -> float:
        """How long to sleep (caller holds the lock): 0 if a key is already free, since a
        release between the caller's failed attempt and now would otherwise be missed; never
        past the earliest expiry, which frees a key without any notification."""
        now = self._clock()
        earliest = timeout
        for key in keys:
            entry = self._live(key, now)
            if entry is None:
                return 0.0
            earliest = min(earliest, entry.expires_at - now)
        return earliest

    def _sweep(self, now: float) -> None:
        if self.gc_after is None:
            return
        before = now - self.gc_after
        expired = [k for k, e in self._entries.items() if e.expires_at <= before]
        for key in expired:
            del self._entries[key]


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def from_url(url: str) -> InMemoryCache:
    """``memory://``: a new lock space of this process."""
    return InMemoryCache()
