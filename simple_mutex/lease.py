"""A granted lease: who holds it, until when, and the ways it ends.

A lease ends in exactly one of three ways: ``release()`` by its holder, a lapse (the local
deadline passed without renewal), or a loss discovered by renewal (the record was gone or
had another owner). Once ended it never becomes live again.

Timeline of the race a local deadline guards against::

    holder A: acquire ──── work ........................ (paused: GC, swap, SIGSTOP)
    cache:    A's record ─────────────── expires ─── B's record (fence + 1)
    holder B:                                  acquire ── work
    A's keeper:                      deadline ─► interrupt A's work

The deadline runs from the instant *before* A sent its write, so it passes no later than
the cache's own expiry (on equal clock rates). A may still act in the gap if it is paused
at the wrong moment: only a downstream check of ``fence`` closes that gap.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from types import TracebackType

from .contract import ConditionalCache, Entry
from .durations import positive_seconds
from .engine import (
    HANDOFF_COURTESY,
    CompareAndDelete,
    CompareAndSet,
    Get,
    Grant,
    execute,
    renew_after,
    retry_renew_after,
)
from .errors import (
    ConstraintError,
    MalfunctionError,
    SimpleCacheConditionError,
    SimpleMutexError,
    SimpleMutexLeaseExpiredError,
)
from .interrupt import LeaseInterrupt, cancel_pending, interrupt_class, raise_in_thread
from .keeper import keeper

log = logging.getLogger("simple_mutex")

_SUSPENDABLE = inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


class Lease:
    """A held lock (or semaphore permit). Use it as a context manager, or call
    ``release()`` yourself.

    ``key`` is your key verbatim; ``token`` the secret that proves ownership; ``fence`` an
    integer that strictly increases on every grant of this key (pass it to a downstream
    store and have it reject writes carrying a lower one); ``slot`` the semaphore permit
    (0 for a mutex); ``expires_at`` the UTC time the lease lapses unless renewed.
    """

    def __init__(
        self,
        *,
        key: str,
        cache: ConditionalCache,
        cache_key: str,
        value: str,
        token: str,
        grant: Grant,
        length: float,
        renew: bool,
        handoffs: dict[str, float] | None = None,
    ) -> None:
        self.key = key
        self.token = token
        self.slot = grant.slot
        self.fence = grant.entry.fence
        self._cache = cache
        self._cache_key = cache_key
        self._value = value
        self._version = grant.entry.version
        self._renew = renew
        self._handoffs = handoffs
        self._lock = threading.Lock()
        self._released = False
        self._lost_reason: str | None = None
        self._record_gone = False  # known freed or taken over: nothing left to release
        self._armed_thread: int | None = None
        self._interrupt_sent: type[LeaseInterrupt] | None = None
        self._on_lost: list[Callable[[], None]] = []
        self._next_check: float | None = None
        self._set_deadline(grant.started, length)
        if renew:
            self._schedule(self._renew_at)

    # -- state --------------------------------------------------------------------------

    def _set_deadline(self, started: float, length: float) -> None:
        self._length = length
        self._deadline = started + length
        self._renew_at = started + renew_after(length)
        self._expires_wall = time.time() - (time.monotonic() - started) + length

    @property
    def expires_at(self) -> datetime:
        """When the lease lapses unless renewed (UTC), as seen from this holder."""
        return datetime.fromtimestamp(self._expires_wall, timezone.utc)

    @property
    def _done(self) -> bool:
        return self._released or self._lost_reason is not None

    @property
    def lost(self) -> bool:
        """True once the lease is known gone: lapsed, taken over, or not renewable."""
        return self._lost_reason is not None or (
            not self._released and time.monotonic() >= self._deadline
        )

    @property
    def length(self) -> float:
        """The lease length in seconds (changed by ``renew(lease)``)."""
        return self._length

    def __repr__(self) -> str:
        state = "released" if self._released else "lost" if self.lost else "held"
        return f"<Lease key={self.key!r} fence={self.fence} slot={self.slot} {state}>"

    # -- ending and extending -----------------------------------------------------------

    def release(self) -> bool:
        """Free the lock if it is still ours. Returns False if the lease had lapsed (the
        record is then left alone or, if still ours in the cache, freed all the same).
        Never removes another holder's lock. Calling it again returns False."""
        with self._lock:
            if self._released:
                return False
            if self._record_gone:
                self._released = True
                return False
            # A lapsed lease still frees its record if the cache kept it (the cache's clock
            # may run behind ours): compare-and-delete cannot touch another holder's.
            in_time = self._lost_reason is None and time.monotonic() < self._deadline
            try:
                try:
                    woke = execute(self._cache, CompareAndDelete(self._cache_key, self._version))
                except SimpleCacheConditionError:
                    # A renewal whose reply was lost may have landed: our record then has
                    # a version we never saw. Our value proves it is ours.
                    entry = self._read_back()
                    if entry is None:
                        raise
                    woke = execute(self._cache, CompareAndDelete(self._cache_key, entry.version))
            except (KeyboardInterrupt, LeaseInterrupt):
                # Landed before or after our delete was sent: make sure it was, or the lock
                # outlives us by a whole lease. (A repeat misses harmlessly.)
                with contextlib.suppress(SimpleMutexError):
                    execute(self._cache, CompareAndDelete(self._cache_key, self._version))
                self._released = True
                raise
            except SimpleCacheConditionError:
                self._released = True
                self._record_gone = True
                self._lost_reason = self._lost_reason or "taken over before release"
                return False
            except MalfunctionError as exc:
                if not in_time:
                    self._released = True
                    self._lost_reason = self._lost_reason or "it lapsed before release"
                    return False  # best effort: the lease was over anyway, and lapses alone
                # Not released: the record may still be ours, so a retry must reach it. Stop
                # renewing, though: we meant to let go, and if nobody retries, it lapses.
                self._renew = False
                exc.key = self.key
                raise
            self._released = True
            if not in_time:
                self._lost_reason = self._lost_reason or "it lapsed before release"
            if woke and self._handoffs is not None:
                if len(self._handoffs) > 1024:  # marks of keys never taken again
                    self._handoffs.clear()
                self._handoffs[self._cache_key] = time.monotonic() + HANDOFF_COURTESY
        log.debug("released %r (fence %d)", self.key, self.fence)
        return in_time

    def renew(self, lease: object = None) -> None:
        """Restart the lease from now (with a new length if given, like dmutex's
        ``extend(ttl)``). Raises ``SimpleMutexLeaseExpiredError`` if it was already lost."""
        length = self._length if lease is None else positive_seconds(lease, "lease")
        with self._lock:
            self._renew_locked(length)
        self._fire()

    def _renew_locked(self, length: float) -> None:
        if self._released:
            raise SimpleMutexLeaseExpiredError(
                f"lease on {self.key!r} was already released; acquire it again", key=self.key
            )
        if self._lost_reason is None and time.monotonic() >= self._deadline:
            self._mark_lost(f"it lapsed after {self._length:g} s")
        if self._lost_reason is not None:
            raise self._expired_error()
        started = time.monotonic()
        try:
            entry = execute(
                self._cache,
                CompareAndSet(self._cache_key, self._value, length, self._version),
            )
        except SimpleCacheConditionError:
            # A driver's retry of a renewal that landed (its reply lost) misses its own
            # new version: read back; our value carries our token, so equality proves it.
            entry = self._read_back()
            if entry is None:
                self._record_gone = True
                self._mark_lost("its record was gone or held by another owner at renewal")
                raise self._expired_error() from None
        except MalfunctionError as exc:
            exc.key = self.key
            raise
        self._version = entry.version
        self._set_deadline(started, length)
        if self._renew:
            self._schedule(self._renew_at)
        elif self._armed_thread is not None or self._on_lost:
            self._schedule(self._deadline)

    def _read_back(self) -> Entry | None:
        try:
            entry: Entry | None = execute(self._cache, Get(self._cache_key))
        except MalfunctionError:
            return None
        if entry is None or entry.value != self._value or entry.fence != self.fence:
            return None
        return entry

    def _mark_lost(self, reason: str) -> None:
        """Record the loss and interrupt the protected block (caller holds ``_lock``)."""
        if self._lost_reason is not None:
            return
        self._lost_reason = reason
        log.warning("lease on %r (fence %d) lost: %s", self.key, self.fence, reason)
        if self._armed_thread is not None:
            self._interrupt_sent = interrupt_class(self.key, self._message())
            raise_in_thread(self._armed_thread, self._interrupt_sent)

    def _fire(self) -> None:
        """Run on-lost callbacks, outside ``_lock`` (they may call back into the lease)."""
        if self._lost_reason is None or not self._on_lost:
            return
        callbacks, self._on_lost = self._on_lost, []
        for callback in callbacks:
            callback()

    def _message(self) -> str:
        return (
            f"lease on {self.key!r} was lost while the work ran ({self._lost_reason}); "
            "another holder may have entered. Raise the lease above the work's worst case, "
            "or pass renew=True"
        )

    def _expired_error(self) -> SimpleMutexLeaseExpiredError:
        return SimpleMutexLeaseExpiredError(self._message(), key=self.key)

    # -- the keeper's side ------------------------------------------------------------

    def _schedule(self, when: float) -> None:
        """Ask the keeper to look at this lease by ``when`` (caller holds ``_lock``, or the
        lease is new). A later check than the one booked needs nothing: that one comes
        first and books the next."""
        if self._next_check is None or when < self._next_check:
            self._next_check = when
            keeper().watch(self, when)

    def _keeper_tick(self, now: float, when: float) -> float | None:
        with self._lock:
            if when != self._next_check:
                return None  # superseded by an earlier booking
            result = self._next_check = self._tick_locked(now)
        self._fire()
        return result

    def _tick_locked(self, now: float) -> float | None:
        if self._done:
            return None
        if now >= self._deadline:
            self._mark_lost(f"it lapsed after {self._length:g} s")
            return None
        if not self._renew:
            return self._deadline
        if now < self._renew_at:
            return self._renew_at
        try:
            self._renew_locked(self._length)
        except SimpleMutexLeaseExpiredError:
            return None
        except MalfunctionError as exc:
            log.warning("renewing lease on %r failed, will retry: %s", self.key, exc)
            return min(now + retry_renew_after(self._length), self._deadline)
        return self._renew_at

    def on_lost(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from the keeper thread) when the lease is found lost."""
        with self._lock:
            self._on_lost.append(callback)
            if not self._renew:
                self._schedule(self._deadline)
        self._fire()

    # -- context manager ----------------------------------------------------------------

    def __enter__(self) -> Lease:
        # A `with` inside a coroutine or generator can be suspended: the thread would then
        # be interrupted while running someone else's code (another task, the event loop).
        if sys._getframe(1).f_code.co_flags & _SUSPENDABLE:
            raise ConstraintError(
                f"`with lease:` on {self.key!r} inside a coroutine or generator cannot be "
                "interrupted safely; use `async with lease:` (or with_simple_mutex)"
            )
        try:
            with self._lock:
                if not self._done and time.monotonic() >= self._deadline:
                    self._mark_lost(f"it lapsed after {self._length:g} s, before the work began")
                if self._lost_reason is None and not self._released:
                    self._armed_thread = threading.get_ident()
                    if not self._renew:
                        self._schedule(self._deadline)
                    return self
        except (KeyboardInterrupt, LeaseInterrupt):
            # No __exit__ follows a failed __enter__: end the lease here.
            self._disarm()
            self.release()
            raise
        if self._released:
            raise SimpleMutexLeaseExpiredError(
                f"lease on {self.key!r} was already released", key=self.key
            )
        raise self._expired_error()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            foreign = self._disarm()
        except BaseException:
            self.release()  # an interrupt (Ctrl-C) before disarming: still let go
            raise
        try:
            released = self.release()
        except MalfunctionError as fault:
            if exc is not None:
                log.warning("could not release %r after the work failed: %s", self.key, fault)
                released = True  # the work's own error is the one to report
            else:
                raise MalfunctionError(
                    f"the work under {self.key!r} finished, but releasing the lock failed; "
                    f"it frees when its lease lapses. Cause: {fault}",
                    key=self.key,
                ) from fault
        if foreign is not None:
            raise foreign
        if released or self._is_ours(exc):
            return
        raise self._expired_error() from exc

    async def __aenter__(self) -> Lease:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self._cancelled_by_loss = False

        def cancel() -> None:
            self._cancelled_by_loss = True
            task.cancel()

        def on_lost() -> None:
            loop.call_soon_threadsafe(cancel)

        self.on_lost(on_lost)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Shielded: a second cancel must not skip the release.
        released = await asyncio.shield(asyncio.to_thread(self.release))
        if released:
            return
        if getattr(self, "_cancelled_by_loss", False):
            task = asyncio.current_task()
            uncancel = getattr(task, "uncancel", None)  # Python 3.11+
            if uncancel is not None:
                uncancel()
        raise self._expired_error() from exc

    def _is_ours(self, exc: BaseException | None) -> bool:
        return self._interrupt_sent is not None and type(exc) is self._interrupt_sent

    def _disarm(self) -> LeaseInterrupt | None:
        """Stop interrupts for this block. Returns an outer lease's interrupt if one landed
        here, so the caller can re-raise it once this lease is released."""
        # The keeper may have scheduled our interrupt just before the block ended; it can
        # then land anywhere in here. Loop until disarmed without being interrupted.
        foreign: LeaseInterrupt | None = None
        while True:
            try:
                with self._lock:
                    if self._interrupt_sent is not None and self._armed_thread is not None:
                        cancel_pending(self._armed_thread)
                    self._armed_thread = None
                return foreign
            except LeaseInterrupt as exc:
                if type(exc) is not self._interrupt_sent:
                    foreign = exc
