"""A granted lease: who holds it, until when, and the ways it ends.

A lease ends in exactly one of three ways: ``release()`` by its holder, a lapse (the local
deadline passed without renewal), or a loss discovered by renewal (the record was gone or
had another owner). Once ended it never becomes live again: ``_core/lifecycle.py`` holds
the lease's state as one value and the only moves between its values.

Timeline of the race a local deadline guards against::

    holder A: acquire ──── work ........................ (paused: GC, swap, SIGSTOP)
    cache:    A's record ─────────────── expires ─── B's record (fence + 1)
    holder B:                                  acquire ── work
    A's keeper:                      deadline ─► interrupt A's work

The deadline runs from the instant *before* A sent its write, less a small margin
(``lapse_margin``), so the interrupt lands before the cache's own expiry (on equal clock
rates). A may still act in the gap if it is paused at the wrong moment: only a downstream
check of ``fence`` closes that gap.

A lease keeps state, renewal scheduling and interruption. Its cache decisions are the
engine's flows (``flows.release``, ``flows.renew``), run by the blocking or the asyncio
driver, and no lock of the lease is held while a cache is called: the keeper's deadline
check never waits behind I/O.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Protocol

from . import events
from ._core import flows
from ._core.durations import positive_seconds
from ._core.flows import Flow, Grant
from ._core.lifecycle import (
    HELD,
    LET_GO,
    RELEASED,
    RELEASING,
    Held,
    Lost,
    Released,
    Releasing,
    State,
    step,
)
from ._core.records import holder_of
from ._core.timing import lapse_margin, renew_after, retry_renew_after
from ._runtime import forksafe
from ._runtime.drivers import Handoffs, in_background, run, run_async
from ._runtime.interrupt import (
    LeaseInterrupt,
    cancel_pending,
    interrupt_class,
    pre_empted_signal,
    raise_in_thread,
)
from ._runtime.keeper import keeper
from .contract import AnyCache, ConditionalCache, Entry
from .errors import (
    ConstraintError,
    ConstraintTypeError,
    MalfunctionError,
    SimpleMutexLeaseExpiredError,
    add_note,
    displaced_by,
    passes_through,
)

log = logging.getLogger("simple_mutex")
# How a lease was lost (``Lost.reason``, ``Released.loss``): named once, so the hint the
# holder's error gives (``Lease._loss_hint``) follows the reason, not its wording.
LAPSED = "it lapsed"  # the start of every lapse's reason: "it lapsed after 30 s", ...
GONE_AT_RENEWAL = "its record was gone or held by another owner at renewal"
# A release that came in time freed nothing: the record was already gone (freed by force,
# a cache that lost it) or another owner's. (Past the deadline: a lapse.)
GONE_AT_RELEASE = "its record was gone or held by another owner at release"
LOOP_CLOSED = "its event loop closed while it was held"


class Space(Protocol):
    """What a lease needs of its lock space (simple_mutex.mutex)."""

    @property
    def cache(self) -> AnyCache: ...

    @property
    def lease(self) -> float: ...

    @property
    def name(self) -> str: ...

    @property
    def _handoffs(self) -> Handoffs: ...


class Claim(Protocol):
    """What one acquire wrote (simple_mutex.mutex): the lease is built from it."""

    @property
    def space(self) -> Space: ...

    key: str
    slot_keys: list[str]
    token: str
    value: str
    renew: bool
    listening: bool


_SUSPENDABLE = inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE
_LOSS_REPORTS = threading.RLock()  # see Lease._report_loss


class Lease:
    """A held lock (or semaphore permit). Use it as a context manager, or call
    ``release()`` yourself.

    ``key`` is your key verbatim; ``token`` the secret that proves ownership; ``fence`` an
    integer that strictly increases on every grant of this key (pass it to a downstream
    store and have it reject writes carrying a lower one); ``slot`` the semaphore permit
    (0 for a mutex); ``expires_at`` the UTC time the lease lapses unless renewed.
    """

    # State that most leases never change lives on the class: a lease is built on every
    # acquire, and each attribute set in __init__ costs on that hot path.

    # Where the lease stands: held, releasing, lost or released (_core/lifecycle.py).
    # Replaced whole, only by _move, under _lock.
    _state: State = HELD
    # The protected block: the thread a loss interrupts, the interrupt sent to it, and
    # who else hears of a loss.
    _armed_thread: int | None = None
    _interrupt_sent: type[LeaseInterrupt] | None = None
    _cancelled_by_loss = False  # our on-lost callback cancelled the `async with` task
    _on_lost: tuple[Callable[[], None], ...] = ()
    # The keeper's schedule and the renewals.
    _booked: float | None = None  # the keeper's next visit
    _renewing = False  # a background renewal is in flight
    _renewing_sync: threading.Lock | None = None  # held by the renewal in flight
    _renewing_async: asyncio.Lock | None = None  # the same, for a lease renewed on a loop
    # Fixed at the grant.
    _loop: asyncio.AbstractEventLoop | None = None  # an asyncio cache's lease: its loop
    _listening = False  # someone listened to lock events when it was acquired
    _took_over = False  # the grant replaced a holder that never freed the slot
    _loss_reported = False  # the "lost" event is out (once; under _LOSS_REPORTS)

    def __init__(
        self, claim: Claim, grant: Grant, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        space = claim.space
        self.key = claim.key
        self.token = claim.token
        self.slot = grant.slot
        self.fence = grant.entry.fence
        self._space = space  # its cache, hand-off marks and name (for events)
        self._cache = space.cache
        self._cache_key = claim.slot_keys[grant.slot]
        self._value = claim.value
        self._version = grant.entry.version
        self._renew = claim.renew
        if loop is not None:  # an asyncio cache's lease: renewed on its loop, never a thread
            self._loop = loop
        self._granted = grant.started
        if claim.listening:  # reported from acquire to release or loss, as one story
            self._listening = True
            self._took_over = grant.entry.took_over
        self._lock = threading.Lock()  # guards state only; never held across a cache call
        self._generation = forksafe.generation  # a forked child's copy is not the holder
        self._set_deadline(grant.started, space.lease)
        if claim.renew:
            self._book(self._renew_at)

    # -- state --------------------------------------------------------------------------

    def _set_deadline(self, started: float, length: float) -> None:
        self._length = length
        self._deadline = started + length - lapse_margin(length)
        self._renew_at = started + renew_after(length)
        self._expires_wall = time.time() - time.monotonic() + self._deadline

    @property
    def expires_at(self) -> datetime:
        """When the lease lapses unless renewed (UTC), as seen from this holder."""
        return datetime.fromtimestamp(self._expires_wall, timezone.utc)

    def _move(self, to: State) -> None:
        """Take the lifecycle's step towards ``to`` (``lifecycle.step`` decides; a move it
        does not allow leaves the state as it is). The caller holds ``_lock``, or is a
        forked child's copy (see ``_let_go``). Readers need no lock: the state is one
        immutable value, replaced whole."""
        self._state = step(self._state, to)

    @property
    def lost(self) -> bool:
        """True once the lease is known gone: lapsed, taken over, or not renewable."""
        state = self._state
        return state.loss is not None or (
            not isinstance(state, Released) and time.monotonic() >= self._deadline
        )

    @property
    def _renews(self) -> bool:
        """Renewed in the background: asked for, and not being let go or ended."""
        return self._renew and isinstance(self._state, Held)

    @property
    def _inherited(self) -> bool:
        """True in a child forked while the lease was held: a copy, never the holder."""
        return self._generation != forksafe.generation

    @property
    def length(self) -> float:
        """The lease length in seconds (changed by ``renew(lease)``)."""
        return self._length

    def __repr__(self) -> str:
        state = self._state
        shown = (
            "released" if isinstance(state, Released)
            else "lost" if self.lost
            else "releasing" if isinstance(state, Releasing)
            else "held"
        )  # fmt: skip
        return f"<Lease key={self.key!r} fence={self.fence} slot={self.slot} {shown}>"

    # -- release ------------------------------------------------------------------------

    def release(self) -> bool:
        """Free the lock if it is still ours. Returns False if the lease had lapsed (the
        record is then left alone or, if still ours in the cache, freed all the same).
        Never removes another holder's lock. Calling it again returns False."""
        self._sync("release")
        try:
            return run(self._blocking(), self._release_flow())
        except MalfunctionError:
            raise
        except BaseException:
            # An interrupt (Ctrl-C, a lease's, a job timeout's signal handler) landed
            # before or after our delete was sent: make sure it was, or the lock outlives
            # us by a whole lease.
            run(self._blocking(), flows.abandon([self._cache_key], self._value))
            self._let_go()
            raise

    async def release_async(self) -> bool:
        """``release`` for asyncio: the event loop is not blocked."""
        try:
            return await run_async(self._cache, self._release_flow())
        except MalfunctionError:
            raise
        except BaseException:
            # Cancelled (or interrupted) before or after our delete was sent, as in
            # release(): make sure it is sent, in a task a second cancel cannot skip.
            in_background(run_async(self._cache, flows.abandon([self._cache_key], self._value)))
            self._let_go()
            raise

    def _release_flow(self) -> Flow[bool]:
        if isinstance(self._state, Released):
            return False
        if self._inherited:
            self._let_go()  # this copy lets go; the holder's record is the holder's
            return False
        with self._lock:
            state = self._state
            if isinstance(state, Lost) and state.record_gone:
                self._move(LET_GO)
                return False
            # A lapsed lease still frees its record if the cache kept it (the cache's clock
            # may run behind ours): compare-and-delete cannot touch another holder's.
            in_time = state.live and time.monotonic() < self._deadline
            self._move(RELEASING)  # no more background renewals: we mean to let go
        try:
            outcome = yield from flows.release(
                self._cache_key, self._value, self._version, self.fence
            )
        except MalfunctionError as exc:
            if not in_time:
                with self._lock:
                    self._move(Released(in_time=False, loss=f"{LAPSED} before release"))
                self._report_loss()  # as a release that reached the cache reports it
                return False  # best effort: the lease was over anyway, and lapses alone
            # Not released: the record may still be ours, so a retry must reach it. It stays
            # Releasing (not renewed): if nobody retries, it lapses.
            exc.about(self.key, [self._cache_key])
            raise
        if not outcome.freed and in_time:
            ending = Released(in_time=False, loss=GONE_AT_RELEASE)
        elif in_time:
            ending = RELEASED
        else:
            ending = Released(in_time=False, loss=f"{LAPSED} before release")
        in_time = ending.in_time
        with self._lock:
            self._move(ending)
        if outcome.woke:
            self._space._handoffs.woke(self._cache_key)
        if not in_time:
            self._report_loss()
        elif self._listening:
            self._report("released")
        return in_time

    # -- renewal ------------------------------------------------------------------------

    def renew(self, lease: object = None) -> None:
        """Restart the lease from now (with a new length if given, like dmutex's
        ``extend(ttl)``; later background renewals keep that length). Raises
        ``SimpleMutexLeaseExpiredError`` if it was already lost."""
        self._sync("renew")
        self._renew_blocking(None if lease is None else positive_seconds(lease, "lease"))

    async def renew_async(self, lease: object = None) -> None:
        """``renew`` for asyncio: the event loop is not blocked."""
        length = None if lease is None else positive_seconds(lease, "lease")
        if self._loop is None:
            # A blocking cache's lease: its background renewals run in the keeper's
            # threads, so this one takes its turn among them in a thread too.
            await asyncio.to_thread(self._renew_blocking, length)
            return
        if self._renewing_async is None:
            self._renewing_async = asyncio.Lock()
        async with self._renewing_async:
            try:
                await run_async(self._cache, self._renew_flow(length))
            finally:
                self._fire()

    def _renew_blocking(self, length: float | None) -> None:
        with self._lock:
            if self._renewing_sync is None:
                self._renewing_sync = threading.Lock()
            turn = self._renewing_sync
        with turn:  # one renewal at a time (lifecycle rule 15); never held by the keeper
            try:
                run(self._blocking(), self._renew_flow(length))
            finally:
                self._fire()

    def _renew_flow(self, new_length: float | None) -> Flow[None]:
        """One renewal; the caller makes sure it is the only one of this lease in flight.
        Two at once would each read the other's write back as their own and take their
        own length for the deadline: a holder believing in 60 s of a record kept for 1."""
        if self._inherited:
            raise ConstraintError(
                f"the lease on {self.key!r} belongs to the process that acquired it; this "
                "forked child has only a copy and cannot renew it (acquire in the child)"
            )
        with self._lock:
            if self._state.live and time.monotonic() >= self._deadline:
                self._mark_lost(f"{LAPSED} after {self._length:g} s")
            if not self._state.live:
                raise self._ended_error()
            version = self._version
            length = self._length if new_length is None else new_length
        sent = time.monotonic()
        try:
            renewed = yield from flows.renew(
                self._cache_key, self._value, version, length, time.monotonic
            )
        except MalfunctionError as exc:
            # The write may have landed all the same (its reply lost), and a shorter
            # length would then hold in the cache: the deadline may only come closer.
            self._pull_deadline(sent, length)
            exc.about(self.key, [self._cache_key])
            raise
        with self._lock:
            if renewed is None:
                self._mark_lost(GONE_AT_RENEWAL, record_gone=True)
                raise self._ended_error()
            kept = self._state.live
            if kept:
                self._version = renewed.entry.version
                self._set_deadline(renewed.started, length)
                self._book_next()
        if kept:
            if self._listening:
                self._report("renewed")
            return
        # The renewal landed after this lease was released or declared lost: give back
        # the record it extended, or the key stays held for a lease with nobody in it.
        yield from flows.abandon([self._cache_key], self._value)
        raise self._ended_error()

    def _pull_deadline(self, started: float, length: float) -> None:
        """A write of ``length`` sent at ``started`` may have landed: the deadline becomes
        the earlier of the two (and the keeper comes by then)."""
        with self._lock:
            deadline = started + length - lapse_margin(length)
            if not self._state.live or deadline >= self._deadline:
                return
            self._deadline = deadline
            self._expires_wall = time.time() - time.monotonic() + deadline
            self._book_next()

    def _renew_in_background(self) -> None:
        """The keeper's renewal: in its pool, or on the loop of an asyncio cache's lease."""
        if self._loop is None:
            self._renewed(self._outcome_of(self.renew))
            return
        renewal = self._renew_on_loop()
        try:
            self._loop.call_soon_threadsafe(in_background, renewal)
        except RuntimeError:
            # The loop is closed (asyncio.run returned with the lease held): nothing can
            # renew, release or interrupt it any more. Mark it lost, so the keeper stops
            # visiting (it would retry at once, for up to the whole lease); the record
            # lapses in the cache.
            renewal.close()
            with self._lock:
                self._renewing = False
                self._mark_lost(LOOP_CLOSED)
            self._fire()

    async def _renew_on_loop(self) -> None:
        try:
            await self.renew_async()
            failed = False
        except SimpleMutexLeaseExpiredError:
            failed = False
        except MalfunctionError as exc:
            failed = self._renewal_failed(exc)
        self._renewed(failed)

    def _outcome_of(self, renew: Callable[[], None]) -> bool:
        """Run a renewal; True when it hit a fault worth retrying."""
        try:
            renew()
        except SimpleMutexLeaseExpiredError:
            return False  # lost (marked, interrupted, called back) or released
        except MalfunctionError as exc:
            return self._renewal_failed(exc)
        return False

    def _renewal_failed(self, exc: MalfunctionError) -> bool:
        log.warning("renewing lease on %r failed, will retry: %s", self.key, exc)
        return True

    def _renewed(self, failed: bool) -> None:
        with self._lock:
            self._renewing = False
            if failed:
                # Counted from now, after the call: a stalled call is not retried at once.
                self._renew_at = time.monotonic() + retry_renew_after(self._length)
            self._book_next()

    # -- loss ---------------------------------------------------------------------------

    def _mark_lost(self, reason: str, *, record_gone: bool = False) -> None:
        """Record the loss and interrupt the protected block (caller holds ``_lock``). A
        lease already ended keeps its first ending, and is not interrupted again."""
        was_live = self._state.live
        self._move(Lost(reason, record_gone))
        if was_live and self._armed_thread is not None:
            self._interrupt_sent = interrupt_class(self.key, self._message())
            raise_in_thread(self._armed_thread, self._interrupt_sent)

    def on_lost(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from a keeper thread) when the lease is found lost."""
        with self._lock:
            self._on_lost = (*self._on_lost, callback)
            self._book_next()
        self._fire()

    def _fire(self) -> None:
        """Report a loss and run on-lost callbacks, outside ``_lock`` (they may call back
        into the lease)."""
        if self._state.loss is None:
            return
        self._report_loss()
        callbacks, self._on_lost = self._on_lost, ()
        for callback in callbacks:
            callback()

    def _report_loss(self) -> None:
        # The keeper's pool and the holder's own release may both get here; whoever comes
        # second waits until the event is out, so once the holder sees its error, the
        # "lost" event has reached every subscriber. Losses are rare: one lock for all.
        with _LOSS_REPORTS:
            reason = self._state.loss
            if self._loss_reported or reason is None:
                return
            self._loss_reported = True
            if self._listening or events.wanted("lost"):
                self._report("lost", reason=reason)

    def _report(self, kind: str, *, waited: float | None = None, reason: str | None = None) -> None:
        """Emit a lock event about this lease (only called when someone listens); an event
        that ends the hold says how long it lasted."""
        held = time.monotonic() - self._granted if kind in ("released", "lost") else None
        record = Entry(self._value, self._version, self.fence, self._expires_wall)
        events.emit(events.LockEvent(
            kind, self.key, self._space.name, self._cache.name, events.now(),
            fence=self.fence, slot=self.slot,
            holder=holder_of(record, self._cache.name, self.key, self.slot),
            waited=waited, held=held, reason=reason,
            took_over=kind == "acquired" and self._took_over,
        ))  # fmt: skip

    def _message(self) -> str:
        return (
            f"lease on {self.key!r} was lost while the work ran ({self._state.loss}); "
            f"another holder may have entered. {self._loss_hint()}"
        )

    def _loss_hint(self) -> str:
        """What to look at, by how the lease was lost: only a lease that was not renewed
        is fixed by a longer lease or renewals."""
        loss = self._state.loss or ""
        if loss.startswith(LAPSED) and not self._renew:
            return "Raise the lease above the work's worst case, or pass renew=True"
        if loss.startswith(LAPSED):
            return (
                "Its renewals did not get through in time: its process was paused (a stop "
                "signal, a long pause, a blocked event loop), or the cache was slow or out "
                "of reach (the log's warnings say so); raising the lease gives a renewal "
                "longer"
            )
        if loss in (GONE_AT_RENEWAL, GONE_AT_RELEASE):
            return (
                "It was freed or taken while it still had time: by a newer call taking "
                'it over (on_busy="replace"), by an operator (simple-mutex release), by '
                "code freeing the key by force, or by a cache that lost its data (a "
                "restart without persistence, a failover)"
            )
        if loss == LOOP_CLOSED:
            return "Keep its event loop running while the lease is held"
        return "Its lease lapsed, or it was freed by force, and another holder took it"

    def _expired_error(self) -> SimpleMutexLeaseExpiredError:
        return SimpleMutexLeaseExpiredError(self._message(), key=self.key)

    def _ended_error(self) -> SimpleMutexLeaseExpiredError:
        if self._state.loss is None:
            return SimpleMutexLeaseExpiredError(
                f"lease on {self.key!r} was already released; acquire it again", key=self.key
            )
        return self._expired_error()

    # -- the keeper's side --------------------------------------------------------------

    def _next_visit(self) -> float | None:
        """When the keeper must look next (caller holds ``_lock``): the renewal time, and
        the deadline whenever someone must hear of a lapse."""
        if not self._state.live:
            return None
        if self._renews and not self._renewing:
            return min(self._renew_at, self._deadline)
        if self._renews or self._armed_thread is not None or self._on_lost:
            return self._deadline
        return None

    def _book_next(self) -> None:
        when = self._next_visit()
        if when is not None:
            self._book(when)

    def _book(self, when: float) -> None:
        """Ask the keeper to visit by ``when`` (caller holds ``_lock``, or the lease is
        new). A later visit than the one booked needs nothing: that one comes first and
        books the next."""
        if self._booked is None or when < self._booked:
            self._booked = when
            keeper().watch(self, when)

    def _keeper_booking(self) -> float | None:
        return self._booked

    def _keeper_visit(self, now: float, when: float) -> float | None:
        # Runs on the keeper's own thread: no I/O here, so deadlines are kept on time.
        with self._lock:
            if when != self._booked:
                return None  # superseded by an earlier booking
            self._booked = None
            if not self._state.live:
                return None
            if now >= self._deadline:
                self._mark_lost(f"{LAPSED} after {self._length:g} s")
                keeper().submit(self._fire)
                return None
            if self._renews and not self._renewing and now >= self._renew_at:
                self._renewing = True
                keeper().submit(self._renew_in_background)
            self._booked = self._next_visit()
            return self._booked

    # -- context manager ----------------------------------------------------------------

    def __enter__(self) -> Lease:
        # A `with` inside a coroutine or generator can be suspended: the thread would then
        # be interrupted while running someone else's code (another task, the event loop).
        self._sync("__enter__")
        if self._inherited:
            raise ConstraintError(
                f"the lease on {self.key!r} belongs to the process that acquired it; a "
                "forked child cannot enter it (acquire in the child)"
            )
        if sys._getframe(1).f_code.co_flags & _SUSPENDABLE:
            raise ConstraintTypeError(
                f"`with lease:` on {self.key!r} inside a coroutine or generator cannot be "
                "interrupted safely; use `async with lease:` (or with_simple_mutex)"
            )
        try:
            with self._lock:
                if self._state.live and time.monotonic() >= self._deadline:
                    self._mark_lost(f"{LAPSED} after {self._length:g} s, before the work began")
                if self._state.live:
                    self._armed_thread = threading.get_ident()
                    self._book_next()
                    return self
        except BaseException:
            # An interrupt (Ctrl-C, a signal handler's exception, a lease's) landed here:
            # no __exit__ follows a failed __enter__, so end the lease here.
            self.let_go_at_the_door()
            raise
        raise self._ended_error()

    def let_go_at_the_door(self) -> None:
        """For code that runs ``with lease:`` right after the acquire: an exception that
        left before the block was entered (a signal handler's, landing at ``__enter__``'s
        first line, where no ``__exit__`` follows) must still free the record. Call it
        from an ``except BaseException:`` around the acquire's ``with`` block; after a
        block that ran, the lease is already released and this does nothing."""
        if isinstance(self._state, Released) or self._inherited:
            return
        self._disarm()
        try:
            self.release()
        except MalfunctionError as fault:  # the exception in flight is the one to report
            log.warning("could not release %r after an interrupt: %s", self.key, fault)

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if self._inherited:  # a forked child leaving the parent's block: not the holder
            self._armed_thread = None
            self._let_go()
            return
        try:
            foreign = self._disarm()
        except BaseException:
            self.release()  # an interrupt (Ctrl-C) before disarming: still let go
            raise
        try:
            # Released early, inside the block, in time: not a loss (its result stands).
            early = self._released_early()
            released = self.release() if early is None else early
        except MalfunctionError as fault:
            released = self._release_failed(exc, fault)
        if foreign is not None and not passes_through(exc):
            raise foreign
        self._leave(released, exc)

    def _leave(self, released: bool, exc: BaseException | None) -> None:
        """How a block ends once the lease is let go: quietly if it was held to the end;
        else SimpleMutexLeaseExpiredError, unless the block ends by an exception a lock
        must not replace (our own interrupt, Ctrl-C, SystemExit, a cancellation): that one
        leaves carrying a note of the loss (lifecycle rule 13)."""
        if self._is_ours(exc):
            assert exc is not None
            _deliver_pre_empted_signal(exc, self._message())
            displaced = displaced_by(exc)
            if displaced is not None:  # our interrupt landed while Ctrl-C/SystemExit unwound
                add_note(
                    displaced, f"simple-mutex: while this unwound the block, {self._message()}"
                )
                raise displaced from None
            return
        if released:
            return
        if passes_through(exc):
            assert exc is not None
            log.warning("%s; passing on %s", self._message(), type(exc).__name__)
            add_note(exc, f"simple-mutex: {self._message()}")
            return
        raise self._expired_error() from exc

    def _release_failed(self, exc: BaseException | None, fault: MalfunctionError) -> bool:
        """Releasing at the block's end failed. After work that succeeded, that is the
        error to raise; after work that failed, the work's own error leaves, carrying the
        release's fault as a note (both reach the caller: the seed's rule)."""
        if exc is None:
            raise MalfunctionError(
                f"the work under {self.key!r} finished, but releasing the lock failed; "
                f"it frees when its lease lapses. Cause: {fault}",
                key=self.key,
            ) from fault
        log.warning("could not release %r after the work failed: %s", self.key, fault)
        add_note(
            exc,
            f"simple-mutex: releasing the lock on {self.key!r} also failed; it frees when "
            f"its lease lapses. Cause: {fault}",
        )
        return True  # the work's own error is the one to report

    async def __aenter__(self) -> Lease:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None

        def cancel() -> None:
            self._cancelled_by_loss = True
            task.cancel()

        def on_lost() -> None:
            loop.call_soon_threadsafe(cancel)

        self.on_lost(on_lost)
        return self

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if self._inherited:  # a forked child leaving the parent's block: not the holder
            self._let_go()
            return
        # Shielded: a second cancel must not skip the release.
        try:
            early = self._released_early()
            released = await self._release_shielded() if early is None else early
        except MalfunctionError as fault:
            released = self._release_failed(exc, fault)
        if not released and self._cancelled_by_loss:
            # Our own cancellation becomes the loss error, unless someone else cancelled the
            # task too: that cancellation then passes through, with a note.
            task = asyncio.current_task()
            uncancel = getattr(task, "uncancel", None)  # Python 3.11+
            others = 0 if uncancel is None else uncancel()
            if others == 0 and isinstance(exc, asyncio.CancelledError):
                raise self._expired_error() from exc
        self._leave(released, exc)

    async def _release_shielded(self) -> bool:
        """``release_async`` in a task of its own. If our own loss cancels this task while
        that release is in flight (the deadline passed meanwhile), the release's outcome
        decides the block's end, as in a ``with`` block: wait for it. Anyone else's
        cancellation passes through (the release still completes)."""
        releasing = in_background(self.release_async())
        try:
            return await asyncio.shield(releasing)
        except asyncio.CancelledError:
            if not self._cancelled_by_loss:
                raise
            uncancel = getattr(asyncio.current_task(), "uncancel", None)  # Python 3.11+
            if uncancel is not None and uncancel() > 0:
                raise  # someone else cancelled the task too
            return bool(await releasing)

    def _released_early(self) -> bool | None:
        """What ``release()`` returned if the holder has let go already (inside the block),
        else None."""
        state = self._state
        return state.in_time if isinstance(state, Released) else None

    def _let_go(self) -> None:
        """End the lease with no word to the cache: its record was abandoned, or this is a
        forked child's copy (the holder's record is the holder's)."""
        if self._inherited:
            # Only this copy: the lock may have been held, at the instant of fork, by a
            # thread that does not exist here, and nothing else in the child touches it.
            self._move(LET_GO)
            return
        with self._lock:
            self._move(LET_GO)

    def _blocking(self) -> ConditionalCache:
        return self._cache  # type: ignore[return-value]  # _sync() refused an asyncio one

    def _sync(self, method: str) -> None:
        """Refuse a blocking call on an asyncio cache's lease, naming what to await."""
        if self._loop is not None:
            instead = "async with lease" if method == "__enter__" else f"await {method}_async()"
            raise ConstraintTypeError(
                f"{method}() of a lease on {self.key!r} would block on an asyncio cache: "
                f"use `{instead}`"
            )

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


def _deliver_pre_empted_signal(exc: BaseException, message: str) -> None:
    """Our interrupt landed on a signal handler before it ran (a SIGTERM as the lease
    lapsed): deliver that signal again, so what its handler raises (SIGTERM's
    SystemExit) leaves instead of the loss, carrying the loss as a note (lifecycle
    rule 13). Python runs handlers in the main thread only, where this code then runs."""
    signum = pre_empted_signal(exc)
    if signum is None or threading.current_thread() is not threading.main_thread():
        return
    try:
        signal.raise_signal(signum)  # its handler runs as this call returns
    except BaseException as raised:
        if passes_through(raised):
            add_note(raised, f"simple-mutex: while this signal was handled, {message}")
        raise
