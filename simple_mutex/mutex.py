"""Mutex and Semaphore: the user API over a cache. A mutex is a semaphore of one permit."""

from __future__ import annotations

import asyncio
import collections.abc
import os
import random
import secrets
import time
from collections.abc import Callable, Coroutine, Generator
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from . import events
from ._core import flows
from ._core.durations import Duration, positive_seconds, timeout_seconds
from ._core.flows import Flow, Grant
from ._core.keys import check_key, check_prefix, encode_key, is_hashed, slot_key
from ._core.records import (
    EVICTED_BY,
    Holder,
    check_token,
    encode_record,
    holder_of,
    new_token,
    record_token,
)
from ._core.timing import DEFAULT_INTERVAL, DEFAULT_LEASE
from ._runtime import drivers
from ._runtime.drivers import Handoffs, run, run_async
from ._runtime.keeper import keeper
from .caches.adapt import as_cache, index_prefix
from .contract import Entry, is_async
from .errors import (
    ConstraintTypeError,
    MalfunctionError,
    SimpleMutexAcquireTimeoutError,
    bad_input,
)
from .lease import Lease

MAX_PERMITS = 10_000

T = TypeVar("T")

_rng = random.Random()
os.register_at_fork(after_in_child=_rng.seed)  # forked workers must not jitter in step


class _LockSpace:
    """Locks of ``permits`` slots per key, in one cache under one prefix. It checks
    arguments and builds the engine's flows; the engine decides, a driver runs them."""

    def __init__(
        self,
        cache: object,
        *,
        permits: int,
        lease: Duration,
        prefix: str,
        interval: Duration,
        label: str | None,
        name: str,
    ) -> None:
        if (
            isinstance(permits, bool)
            or not isinstance(permits, int)
            or not (1 <= permits <= MAX_PERMITS)
        ):
            raise bad_input(
                permits, int, f"permits must be an int from 1 to {MAX_PERMITS}, got {permits!r}"
            )
        check_label(label)
        if not isinstance(name, str) or not name:
            raise bad_input(
                name, str, f"name must be a non-empty str (a metrics label), got {name!r}"
            )
        self.name = name
        self.cache = as_cache(cache)
        self.permits = permits
        self.lease = positive_seconds(lease, "lease")
        self.interval = positive_seconds(interval, "interval")
        self.prefix = check_prefix(prefix)
        index_prefix(self.cache, self.prefix)  # so `list` finds these locks cheaply
        self.label = label
        self._handoffs = Handoffs()
        self._encoded: dict[str, list[str]] = {}
        self._aio = is_async(self.cache)  # an asyncio cache: only the *_async methods
        # The cache can wait and put in one step (contract: ``wait_then_put``).
        self._hands_over = callable(getattr(self.cache, "wait_then_put", None))

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
        self._sync("acquire")
        claim, flow = self._acquiring(
            key, timeout, interval, renew, label, token, hand_over=self._hands_over
        )
        try:
            lease = claim.granted(run(self.cache, flow))
        except SimpleMutexAcquireTimeoutError as busy:
            if claim.tells_busy:
                self._busy(claim, busy, self.holder(key) if events.subscribers else None)
            raise
        except MalfunctionError as fault:
            self._unclear(claim, fault)
            raise
        except BaseException:
            # An interrupt (an outer lease's, Ctrl-C, a job timeout's signal handler) can
            # land inside a write or just after it: free what we may have written, or it
            # stays held for a lease. Nothing below runs Python code a signal could stop
            # until the caller has the lease in hand.
            run(self.cache, flows.abandon(claim.slot_keys, claim.value))
            raise
        return lease

    def acquire_async(
        self,
        key: str,
        *,
        timeout: Duration | None = None,
        interval: Duration | None = None,
        renew: bool = False,
        label: str | None = None,
        token: str | None = None,
    ) -> Acquiring:
        """``acquire`` for asyncio: waiting does not block the event loop, and an asyncio
        cache is awaited directly (no thread). ``await`` it for the Lease, or use it as
        it is: ``async with mutex.acquire_async(key) as lease:``."""
        claim, flow = self._acquiring(key, timeout, interval, renew, label, token)
        return Acquiring(self._granted_async(claim, flow))

    async def _granted_async(self, claim: _Claim, flow: Flow[Grant]) -> Lease:
        try:
            grant = await run_async(self.cache, flow)
        except SimpleMutexAcquireTimeoutError as busy:
            if claim.tells_busy:
                held = await self.holder_async(claim.key) if events.subscribers else None
                self._busy(claim, busy, held)
            raise
        except MalfunctionError as fault:
            self._unclear(claim, fault)
            raise
        try:
            lease = claim.granted(grant, asyncio.get_running_loop() if self._aio else None)
        except BaseException:
            # A job timeout's signal handler (or a cancellation) landing in the lease's
            # construction or an "acquired" subscriber: the caller never gets the lease,
            # so free the grant, in a task of its own that a second cancel cannot skip.
            abandon = flows.abandon(claim.slot_keys, claim.value)
            await asyncio.shield(drivers.in_background(run_async(self.cache, abandon)))
            raise
        return lease

    def _busy(
        self, claim: _Claim, busy: SimpleMutexAcquireTimeoutError, held: Holder | None
    ) -> None:
        kind = "busy" if claim.timeout == 0 else "timed_out"
        events.emit(events.LockEvent(
            kind, claim.key, self.name, self.cache.name, events.now(),
            holder=held, waited=time.monotonic() - claim.started if claim.started else None,
        ))  # fmt: skip

    async def try_acquire_async(self, key: str, *, renew: bool = False) -> Lease | None:
        """One attempt: the Lease, or None if the lock is busy."""
        try:
            return await self.acquire_async(key, timeout=0, renew=renew)
        except SimpleMutexAcquireTimeoutError:
            return None

    def try_acquire(self, key: str, *, renew: bool = False) -> Lease | None:
        """One attempt: the Lease, or None if the lock is busy."""
        self._sync("try_acquire")
        try:
            return self.acquire(key, timeout=0, renew=renew)
        except SimpleMutexAcquireTimeoutError:
            return None

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
        self._sync("take_over")
        claim = self._claim(key, renew, label, token)
        flow = flows.take_over(
            claim.slot_keys, claim.value, self.lease, self._owned(key, owns), time.monotonic
        )
        grant = self._run(key, flow)
        return None if grant is None else claim.lease(grant)

    def extend(self, key: str, *, token: str, lease: Duration | None = None) -> bool:
        """Restart the permit of ``key`` held with ``token`` for ``lease`` seconds (the
        lock space's lease by default), from any process that knows the token (dmutex's
        ``extend``). False when no permit of ``key`` is held with it (it was released or
        lapsed). It only ever lengthens: a ``lease`` shorter than the permit has left
        keeps what it has, since the holder still counts on that. The holder's own Lease
        stays valid and renews as before; its local deadline is the one it last set
        itself (renew it there to move that)."""
        self._sync("extend")
        check_token(token)
        length = self.lease if lease is None else positive_seconds(lease, "lease")
        wanted = token.encode()

        def held_with_token(held: str) -> bool:
            return secrets.compare_digest(held.encode("utf-8", "surrogatepass"), wanted)

        flow = flows.extend(
            self._slot_keys(key),
            length,
            self._owned(key, held_with_token),
            time.monotonic,
            time.time,
        )
        return self._run(key, flow) is not None

    def held_by(self, key: str, owns: Callable[[str], bool]) -> bool:
        """Whether a permit of ``key`` is held now by a token ``owns`` accepts (an
        integration's own earlier attempt, say); one read of each slot."""
        self._sync("held_by")
        owned = self._owned(key, owns)
        entries = self._run(key, flows.read(self._slot_keys(key)))
        return any(entry is not None and owned(entry) for entry in entries)

    def release_where(self, key: str, owns: Callable[[str], bool]) -> bool:
        """Free every permit of ``key`` whose holder's token ``owns`` accepts, from any
        process (a worker's parent freeing a killed child's lock). A record that changed
        in between is left alone."""
        self._sync("release_where")
        flow = flows.release_where(self._slot_keys(key), self._owned(key, owns))
        return self._run(key, flow) > 0

    def evict(self, key: str, owns: Callable[[str], bool], *, by: str) -> bool:
        """Free every permit of ``key`` whose holder's token ``owns`` accepts while that
        holder may still be running (``on_busy="replace"`` stopping it): its own release,
        when it comes, reports the lost lease instead of taking the eviction for its own.
        ``by`` names the evicting call in the record that stands for a moment in the
        holder's place. A record that changed in between is left alone."""
        self._sync("evict")
        check_label(by)
        slot_keys = self._slot_keys(key)
        spelled = key if is_hashed(slot_keys[0][len(self.prefix) :]) else None
        aside = encode_record(new_token(), EVICTED_BY + by, time.time(), spelled)
        return self._run(key, flows.evict(slot_keys, self._owned(key, owns), aside)) > 0

    def holders(self, key: str) -> list[Holder]:
        """Who holds the key's permits now (never their tokens)."""
        return self._read_holders(key, "holders")

    def _read_holders(self, key: str, method: str) -> list[Holder]:
        self._sync(method)  # the error names the method the user called
        return self._holders(key, self._run(key, flows.read(self._slot_keys(key))))

    async def holders_async(self, key: str) -> list[Holder]:
        """``holders`` for asyncio."""
        return self._holders(key, await self._run_async(key, flows.read(self._slot_keys(key))))

    def _holders(self, key: str, entries: list[Entry | None]) -> list[Holder]:
        return [
            holder_of(entry, self.cache.name, key, slot)
            for slot, entry in enumerate(entries)
            if entry is not None
        ]

    def holder(self, key: str) -> Holder | None:
        """A holder of the key, or None when it is free."""
        found = self._read_holders(key, "holder")
        return found[0] if found else None

    async def holder_async(self, key: str) -> Holder | None:
        """``holder`` for asyncio."""
        found = await self.holders_async(key)
        return found[0] if found else None

    def locked(self, key: str) -> bool:
        """True if an acquire now would have to wait (every permit is taken)."""
        return len(self._read_holders(key, "locked")) >= self.permits

    async def locked_async(self, key: str) -> bool:
        """``locked`` for asyncio."""
        return len(await self.holders_async(key)) >= self.permits

    def _sync(self, method: str) -> None:
        """Refuse a blocking call on an asyncio cache, naming the method to await."""
        if self._aio:
            raise ConstraintTypeError(
                f"{type(self).__name__}.{method}() cannot run on the asyncio cache "
                f"{type(self.cache).__name__}: use `await {method}_async(...)`"
            )

    # -- building and running flows -------------------------------------------------------

    def _claim(self, key: str, renew: bool, label: str | None, token: str | None) -> _Claim:
        check_renew(renew)
        check_label(label)
        slot_keys = self._slot_keys(key)
        token = new_token() if token is None else check_token(token)
        # A hashed cache key cannot be read back as the user's key: the record carries it.
        spelled = key if is_hashed(slot_keys[0][len(self.prefix) :]) else None
        value = encode_record(token, self.label if label is None else label, time.time(), spelled)
        # Does anyone listen to lock events? Decided once per acquire, for the whole lease.
        if events.subscribers:
            return _Claim(self, key, slot_keys, token, value, renew, time.monotonic(), True)
        return _Claim(self, key, slot_keys, token, value, renew, 0.0, False)

    def _acquiring(
        self,
        key: str,
        timeout: Duration | None,
        interval: Duration | None,
        renew: bool,
        label: str | None,
        token: str | None,
        *,
        hand_over: bool = False,
    ) -> tuple[_Claim, Flow[Grant]]:
        """What both faces of ``acquire`` run: the claim, and the flow that waits for it."""
        claim = self._claim(key, renew, label, token)
        claim.timeout = timeout_seconds(timeout)
        return claim, flows.acquire(
            key=claim.key,
            slot_keys=claim.slot_keys,
            value=claim.value,
            lease=self.lease,
            timeout=claim.timeout,
            interval=self.interval if interval is None else positive_seconds(interval, "interval"),
            now=time.monotonic,
            rng=_rng,
            courtesy=self._handoffs.courtesy(claim.slot_keys),
            hand_over=hand_over,
        )

    def _unclear(self, claim: _Claim, fault: MalfunctionError) -> None:
        """An acquire failed: our write may have landed all the same (its reply lost).
        Free it in the background, so it does not hold the key for a lease."""
        fault.about(claim.key, claim.slot_keys)  # the user's key, verbatim, for grepping logs
        if fault.unsent:
            return
        abandon = flows.abandon(claim.slot_keys, claim.value)
        if self._aio:
            drivers.in_background(run_async(self.cache, abandon))
        else:
            keeper().submit(run, self.cache, abandon)

    def _owned(self, key: str, owns: Callable[[str], bool]) -> flows.Owns:
        def owned(entry: Entry) -> bool:
            return owns(record_token(entry, self.cache.name, key))

        return owned

    def _run(self, key: str, flow: Flow[T]) -> T:
        try:
            return run(self.cache, flow)
        except MalfunctionError as exc:
            exc.about(key, self._slot_keys(key))  # the user's key, verbatim
            raise

    async def _run_async(self, key: str, flow: Flow[T]) -> T:
        try:
            return await run_async(self.cache, flow)
        except MalfunctionError as exc:
            exc.about(key, self._slot_keys(key))
            raise


class Acquiring(collections.abc.Coroutine[Any, Any, Lease]):
    """What ``acquire_async`` returns: ``await`` it for the Lease, or enter it directly
    (``async with mutex.acquire_async(key) as lease:``), which acquires on entry and
    releases on exit. It is a coroutine too (``asyncio.run``, ``create_task`` take it)."""

    __slots__ = ("_granting", "_lease")

    def __init__(self, granting: Coroutine[Any, Any, Lease]) -> None:
        self._granting = granting
        self._lease: Lease | None = None

    def __await__(self) -> Generator[Any, None, Lease]:
        return self._granting.__await__()

    def send(self, value: Any) -> Any:
        return self._granting.send(value)

    def throw(self, *exc: Any) -> Any:
        return self._granting.throw(*exc)

    def close(self) -> None:
        self._granting.close()

    def __enter__(self) -> NoReturn:
        self._granting.close()  # never awaited: no "coroutine was never awaited" warning
        raise ConstraintTypeError(
            "acquire_async() is entered with `async with mutex.acquire_async(key)` inside a "
            "coroutine (or awaited: `lease = await mutex.acquire_async(key)`); outside "
            "asyncio, use `with mutex.acquire(key)`"
        )

    def __exit__(self, *exc: object) -> None:  # a `with` looks it up before __enter__
        raise AssertionError("unreachable: __enter__ always raises")

    async def __aenter__(self) -> Lease:
        self._lease = await self._granting
        return await self._lease.__aenter__()

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        assert self._lease is not None
        await self._lease.__aexit__(exc_type, exc, tb)


@dataclass(slots=True)
class _Claim:
    """What one acquire or take-over writes, and what its Lease needs once granted."""

    space: _LockSpace
    key: str
    slot_keys: list[str]
    token: str
    value: str
    renew: bool
    started: float  # monotonic, for the event's ``waited`` (0 when nobody listens)
    listening: bool
    timeout: float | None = None

    def lease(self, grant: Grant, loop: asyncio.AbstractEventLoop | None = None) -> Lease:
        return Lease(self, grant, loop)

    def granted(self, grant: Grant, loop: asyncio.AbstractEventLoop | None = None) -> Lease:
        """An acquire's Lease, its "acquired" event told when someone listens (a take-over
        tells none)."""
        lease = Lease(self, grant, loop)
        if self.listening:
            lease._report("acquired", waited=time.monotonic() - self.started)
        return lease

    @property
    def tells_busy(self) -> bool:
        """Whether a busy or timed-out acquire is told as an event."""
        return self.listening or events.wanted("timed_out")


def check_label(label: object) -> None:
    if label is not None and not isinstance(label, str):
        raise ConstraintTypeError(f"label must be a str or None, got {label!r}")


def check_renew(renew: object) -> None:
    if not isinstance(renew, bool):
        raise ConstraintTypeError(f"renew must be True or False, got {renew!r}")


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
        name: str = "mutex",
    ) -> None:
        super().__init__(
            cache, permits=1, lease=lease, prefix=prefix, interval=interval, label=label,
            name=name,
        )  # fmt: skip


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
        name: str = "semaphore",
    ) -> None:
        super().__init__(
            cache, permits=permits, lease=lease, prefix=prefix, interval=interval, label=label,
            name=name,
        )  # fmt: skip
