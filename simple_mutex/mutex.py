"""Mutex and Semaphore: the user API over a cache. A mutex is a semaphore of one permit."""

from __future__ import annotations

import functools
import os
import random
import time
from collections.abc import Callable
from typing import NamedTuple, TypeVar

from .caches.adapt import as_cache
from .contract import Entry
from .durations import Duration, positive_seconds, timeout_seconds
from .engine import (
    CompareAndDelete,
    CompareAndSet,
    Flow,
    Get,
    Grant,
    acquire_flow,
    execute,
    run,
    run_async,
)
from .errors import (
    ConstraintError,
    MalfunctionError,
    SimpleCacheConditionError,
    SimpleMutexAcquireTimeoutError,
    SimpleMutexError,
)
from .keys import check_key, check_prefix, encode_key, slot_key
from .lease import Lease
from .records import Holder, check_token, encode_record, holder_of, new_token, record_token

DEFAULT_LEASE = 30 * 60.0
DEFAULT_INTERVAL = 1.0
MAX_PERMITS = 10_000

T = TypeVar("T")

_rng = random.Random()
os.register_at_fork(after_in_child=_rng.seed)  # forked workers must not jitter in step


class _LockSpace:
    """Locks of ``permits`` slots per key, in one cache under one prefix."""

    def __init__(
        self,
        cache: object,
        *,
        permits: int,
        lease: Duration,
        prefix: str,
        interval: Duration,
        label: str | None,
    ) -> None:
        if (
            isinstance(permits, bool)
            or not isinstance(permits, int)
            or not (1 <= permits <= MAX_PERMITS)
        ):
            raise ConstraintError(
                f"permits must be an int from 1 to {MAX_PERMITS}, got {permits!r}"
            )
        check_label(label)
        self.cache = as_cache(cache)
        self.permits = permits
        self.lease = positive_seconds(lease, "lease")
        self.interval = positive_seconds(interval, "interval")
        self.prefix = check_prefix(prefix)
        self.label = label
        # cache key -> monotonic time until which we let the waiter we woke go first
        self._handoffs: dict[str, float] = {}
        self._encoded: dict[str, list[str]] = {}

    def _slot_keys(self, key: str) -> list[str]:
        # Hot keys recur (a worker locks the same few entities): remember their encoding.
        found = self._encoded.get(key)
        if found is None:
            base = self.prefix + encode_key(check_key(key))
            found = [slot_key(base, slot) for slot in range(self.permits)]
            if len(self._encoded) >= 1024:
                self._encoded.clear()
            self._encoded[key] = found
        return found

    def acquire(
        self,
        key: str,
        *,
        timeout: Duration | None = None,
        interval: Duration | None = None,
        renew: bool = False,
        label: str | None = None,
        token: str | None = None,
    ) -> Lease:
        """Wait for the lock and return its Lease. ``timeout=None`` waits forever, ``0``
        tries once; when the wait runs out it raises SimpleMutexAcquireTimeoutError.
        ``renew=True`` keeps the lease alive from a background thread while it is held.
        ``token`` is for integrations that need an owner another process can recognize
        (a task id); by default it is 128 random bits."""
        attempt = self._attempt(key, timeout, interval, renew, label, token)
        try:
            return attempt.lease(self._guard(key, lambda: run(self.cache, attempt.flow)))
        except BaseException as exc:
            # An outer lease's interrupt or a KeyboardInterrupt can land just after our
            # write succeeded: free what we may have written, or it stays held for a lease.
            if not isinstance(exc, (SimpleMutexAcquireTimeoutError, MalfunctionError)):
                attempt.abandon()
            raise

    async def acquire_async(
        self,
        key: str,
        *,
        timeout: Duration | None = None,
        interval: Duration | None = None,
        renew: bool = False,
        label: str | None = None,
    ) -> Lease:
        """``acquire`` for asyncio: waiting does not block the event loop."""
        attempt = self._attempt(key, timeout, interval, renew, label, None)
        try:
            grant = await run_async(self.cache, attempt.flow)
        except MalfunctionError as exc:
            exc.key = key
            raise
        return attempt.lease(grant)

    def _attempt(
        self,
        key: str,
        timeout: Duration | None,
        interval: Duration | None,
        renew: bool,
        label: str | None,
        token: str | None,
    ) -> _Attempt:
        wait = timeout_seconds(timeout)
        pause = self.interval if interval is None else positive_seconds(interval, "interval")
        check_renew(renew)
        check_label(label)
        slot_keys = self._slot_keys(key)
        token = new_token() if token is None else check_token(token)
        value = encode_record(token, self.label if label is None else label, time.time())
        courtesy = 0.0
        if self._handoffs:
            courtesy = max(self._handoffs.pop(k, 0.0) for k in slot_keys) - time.monotonic()
        flow = acquire_flow(
            key=key,
            slot_keys=slot_keys,
            value=value,
            lease=self.lease,
            timeout=wait,
            interval=pause,
            now=time.monotonic,
            rng=_rng,
            courtesy=courtesy,
        )
        return _Attempt(self, key, slot_keys, token, value, renew, flow)

    def take_over(
        self,
        key: str,
        *,
        token: str,
        owns: Callable[[str], bool],
        renew: bool = False,
        label: str | None = None,
    ) -> Lease | None:
        """Take over a permit of ``key`` whose holder's token ``owns`` accepts (an earlier
        attempt of the same owner, e.g. a retried task), by compare-and-set: the new lease
        carries ``token`` and the fence stays. None when no such permit is held."""
        attempt = self._attempt(key, None, None, renew, label, token)
        for slot, cache_key in enumerate(attempt.slot_keys):
            entry = self._read(key, cache_key)
            if entry is None or not owns(record_token(entry, self.cache.name, key)):
                continue
            started = time.monotonic()
            change = CompareAndSet(cache_key, attempt.value, self.lease, entry.version)
            try:
                new = self._guard(key, functools.partial(execute, self.cache, change))
            except SimpleCacheConditionError:
                continue  # freed or changed meanwhile
            return attempt.lease(Grant(slot, new, started))
        return None

    def release_where(self, key: str, owns: Callable[[str], bool]) -> bool:
        """Free every permit of ``key`` whose holder's token ``owns`` accepts, from any
        process (a worker's parent freeing a killed child's lock). Compare-and-delete on
        the version read: a record that changed in between is left alone."""
        freed = False
        for cache_key in self._slot_keys(key):
            entry = self._read(key, cache_key)
            if entry is None or not owns(record_token(entry, self.cache.name, key)):
                continue
            delete = CompareAndDelete(cache_key, entry.version)
            try:
                self._guard(key, functools.partial(execute, self.cache, delete))
            except SimpleCacheConditionError:
                continue
            freed = True
        return freed

    def _read(self, key: str, cache_key: str) -> Entry | None:
        entry: Entry | None = self._guard(
            key, functools.partial(execute, self.cache, Get(cache_key))
        )
        return entry

    def try_acquire(self, key: str, *, renew: bool = False) -> Lease | None:
        """One attempt: the Lease, or None if the lock is busy."""
        try:
            return self.acquire(key, timeout=0, renew=renew)
        except SimpleMutexAcquireTimeoutError:
            return None

    def holders(self, key: str) -> list[Holder]:
        """Who holds the key's permits now (never their tokens)."""
        found = []
        for slot, cache_key in enumerate(self._slot_keys(key)):
            entry = self._read(key, cache_key)
            if entry is not None:
                found.append(holder_of(entry, self.cache.name, key, slot))
        return found

    def holder(self, key: str) -> Holder | None:
        """A holder of the key, or None when it is free."""
        found = self.holders(key)
        return found[0] if found else None

    def locked(self, key: str) -> bool:
        """True if an acquire now would have to wait (every permit is taken)."""
        return len(self.holders(key)) >= self.permits

    @staticmethod
    def _guard(key: str, call: Callable[[], T]) -> T:
        try:
            return call()
        except MalfunctionError as exc:
            exc.key = key  # the user's key, verbatim, for grepping logs
            raise


class _Attempt(NamedTuple):
    """One acquire in progress: its flow, and what the Lease needs once it is granted."""

    space: _LockSpace
    key: str
    slot_keys: list[str]
    token: str
    value: str
    renew: bool
    flow: Flow

    def abandon(self) -> None:
        """Best effort: free any slot that holds our record."""
        for cache_key in self.slot_keys:
            try:
                entry = execute(self.space.cache, Get(cache_key))
                if entry is not None and entry.value == self.value:
                    execute(self.space.cache, CompareAndDelete(cache_key, entry.version))
            except SimpleMutexError:
                pass

    def lease(self, grant: Grant) -> Lease:
        return Lease(
            key=self.key,
            cache=self.space.cache,
            cache_key=self.slot_keys[grant.slot],
            value=self.value,
            token=self.token,
            grant=grant,
            length=self.space.lease,
            renew=self.renew,
            handoffs=self.space._handoffs,
        )


def check_label(label: object) -> None:
    if label is not None and not isinstance(label, str):
        raise ConstraintError(f"label must be a str or None, got {label!r}")


def check_renew(renew: object) -> None:
    if not isinstance(renew, bool):
        raise ConstraintError(f"renew must be True or False, got {renew!r}")


class Mutex(_LockSpace):
    """One holder per key at a time, in the scope of ``cache``."""

    def __init__(
        self,
        cache: object,
        *,
        lease: Duration = DEFAULT_LEASE,
        prefix: str = "mutex.",
        interval: Duration = DEFAULT_INTERVAL,
        label: str | None = None,
    ) -> None:
        super().__init__(
            cache, permits=1, lease=lease, prefix=prefix, interval=interval, label=label
        )


class Semaphore(_LockSpace):
    """At most ``permits`` holders per key at a time; ``Lease.slot`` says which permit."""

    def __init__(
        self,
        cache: object,
        *,
        permits: int,
        lease: Duration = DEFAULT_LEASE,
        prefix: str = "semaphore.",
        interval: Duration = DEFAULT_INTERVAL,
        label: str | None = None,
    ) -> None:
        super().__init__(
            cache, permits=permits, lease=lease, prefix=prefix, interval=interval, label=label
        )
