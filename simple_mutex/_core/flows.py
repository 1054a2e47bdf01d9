"""The lock engine: every cache decision, and no I/O (``tests/test_layers.py`` checks that
this module imports nothing that sleeps, blocks or touches a socket or a file).

A decision is a *flow*: a generator that yields cache operations (small immutable values)
and receives their results, or has the cache's error thrown in. A driver
(``simple_mutex._runtime.drivers``) runs the operations: ``run`` blocks, ``run_async``
awaits. Tests drive flows on a fake clock.

=============  ==============================================  ==========================
flow           decides                                         returns
=============  ==============================================  ==========================
acquire        put-if-absent on each slot; wait; the deadline  Grant, or raises timeout
renew          compare-and-set our record                      Renewed, or None when gone
release        compare-and-delete our record                   Released
take_over      compare-and-set a record that ``owns`` accepts  Grant, or None
extend         the same, keeping the record's value            Grant, or None
release_where  compare-and-delete records ``owns`` accepts     how many were freed
abandon        free any slot that holds our value              None; never raises
read           the live entry of each slot                     list of Entry or None
=============  ==============================================  ==========================

One rule for an unclear outcome (``settle``): a write may land although its caller saw a
fault (the reply was lost) or a version miss (the driver retried a write that had landed).
One read settles it: the entry is ours if and only if it holds our value, since every
value carries a unique token.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from simple_mutex._core.timing import FAULT_RIDE_OUT, hand_over_block, poll_pause
from simple_mutex.contract import AnyCache, AsyncConditionalCache, ConditionalCache, Entry
from simple_mutex.errors import (
    MalfunctionError,
    SimpleCacheConditionError,
    SimpleMutexAcquireTimeoutError,
    SimpleMutexError,
)

if TYPE_CHECKING:
    import random

# Operations are small values, each knowing the one cache method it stands for. Slotted
# dataclasses: built twice per lock cycle, they cost half what a NamedTuple does.


# A cache that answers outside the contract (a write reported done that returns no
# entry, or someone else's) is a fault of that backend, named, never a bare error later.


def _found(cache: AnyCache, op: Get, found: object) -> Entry | None:
    if found is None or isinstance(found, Entry):
        return found
    raise _broke_contract(cache, op, found)


def _written(
    cache: AnyCache, op: PutIfAbsent | CompareAndSet | WaitThenPut, entry: object
) -> Entry:
    if isinstance(entry, Entry) and entry.value == op.value:
        return entry
    raise _broke_contract(cache, op, entry)


def _broke_contract(
    cache: AnyCache, op: Get | PutIfAbsent | CompareAndSet | WaitThenPut, answer: object
) -> MalfunctionError:
    what = "an Entry or None" if isinstance(op, Get) else "the Entry it wrote"
    shown = type(answer).__name__ if isinstance(answer, Entry) else repr(answer)[:80]
    return MalfunctionError(
        f"{getattr(cache, 'name', type(cache).__name__)} cache broke the cache contract: "
        f"{type(op).__name__} on {op.key!r} returned {shown}, not {what} "
        "(simple_mutex.contract describes what each method must return)",
        lasting=True,  # the backend's code is wrong: waiting does not fix it
    )


@dataclass(slots=True)
class Get:
    key: str

    def apply(self, cache: ConditionalCache) -> Entry | None:
        return _found(cache, self, cache.get(self.key))

    async def apply_async(self, cache: AsyncConditionalCache) -> Entry | None:
        return _found(cache, self, await cache.get(self.key))


@dataclass(slots=True)
class PutIfAbsent:
    key: str
    value: str
    ttl: float

    def apply(self, cache: ConditionalCache) -> Entry:
        return _written(cache, self, cache.put_if_absent(self.key, self.value, ttl=self.ttl))

    async def apply_async(self, cache: AsyncConditionalCache) -> Entry:
        entry = await cache.put_if_absent(self.key, self.value, ttl=self.ttl)
        return _written(cache, self, entry)


@dataclass(slots=True)
class CompareAndSet:
    key: str
    value: str
    ttl: float
    version: str

    def apply(self, cache: ConditionalCache) -> Entry:
        entry = cache.compare_and_set(self.key, self.value, ttl=self.ttl, version=self.version)
        return _written(cache, self, entry)

    async def apply_async(self, cache: AsyncConditionalCache) -> Entry:
        entry = await cache.compare_and_set(
            self.key, self.value, ttl=self.ttl, version=self.version
        )
        return _written(cache, self, entry)


@dataclass(slots=True)
class CompareAndDelete:
    key: str
    version: str

    def apply(self, cache: ConditionalCache) -> bool:
        return bool(cache.compare_and_delete(self.key, version=self.version))

    async def apply_async(self, cache: AsyncConditionalCache) -> bool:
        return bool(await cache.compare_and_delete(self.key, version=self.version))


@dataclass(slots=True)
class Wait:
    keys: tuple[str, ...]
    seconds: float

    def apply(self, cache: ConditionalCache) -> None:
        cache.wait(self.keys, self.seconds)

    async def apply_async(self, cache: AsyncConditionalCache) -> None:
        await cache.wait(self.keys, self.seconds)


@dataclass(slots=True)
class WaitThenPut:
    """A wait, then a put-if-absent of ``key`` in the cache's next step, with no round
    trip between them (the optional ``wait_then_put``: Redis runs the put the moment its
    BLPOP returns). The waiter a release wakes has the key before the releaser's reply
    is even read: nobody can barge in, and no wake-up plus round trip is spent with the
    key free."""

    keys: tuple[str, ...]
    seconds: float
    key: str
    value: str
    ttl: float

    def apply(self, cache: ConditionalCache) -> Entry:
        entry = cache.wait_then_put(  # type: ignore[attr-defined]
            self.keys, self.seconds, self.key, self.value, ttl=self.ttl
        )
        return _written(cache, self, entry)

    async def apply_async(self, cache: AsyncConditionalCache) -> Entry:
        entry = await cache.wait_then_put(  # type: ignore[attr-defined]
            self.keys, self.seconds, self.key, self.value, ttl=self.ttl
        )
        return _written(cache, self, entry)


@dataclass(slots=True)
class Pause:
    """Sleep without asking the cache anything (the hand-off courtesy, a broken wake-up
    channel's poll): the drivers sleep, blocking or on the loop."""

    seconds: float


Call = Get | PutIfAbsent | CompareAndSet | CompareAndDelete | Wait | WaitThenPut
"""An operation that asks the cache; a driver runs it."""
Op = Call | Pause
T = TypeVar("T")
Flow = Generator[Op, Any, T]
Owns = Callable[[Entry], bool]


@dataclass(slots=True)
class Grant:
    slot: int
    entry: Entry
    started: float
    """The monotonic time just before the winning write was sent: the lease runs from here
    on the holder's side, which is never later than the cache's own start."""


class Released(NamedTuple):
    freed: bool
    """Our record was there, and is freed now."""
    woke: bool
    """The cache woke a waiter with this release."""


# The three possible outcomes, built once (the release flow returns one on every cycle).
FREED = Released(freed=True, woke=False)
HANDED_OFF = Released(freed=True, woke=True)
NOT_FREED = Released(freed=False, woke=False)


# -- flows --------------------------------------------------------------------------------


def settle(cache_key: str, value: str) -> Flow[Entry | None]:
    """The entry at ``cache_key`` if it holds our value, else None."""
    entry = yield Get(cache_key)
    return entry if entry is not None and entry.value == value else None


def acquire(
    *,
    key: str,
    slot_keys: Sequence[str],
    value: str,
    lease: float,
    timeout: float | None,
    interval: float,
    now: Callable[[], float],
    rng: random.Random,
    courtesy: float = 0.0,
    hand_over: bool = False,
) -> Flow[Grant]:
    """Put-if-absent on each slot, starting at a random one; when all are held, wait for a
    release notification (at most a jittered poll interval) until the deadline. Whether
    the grant took over from a holder that never freed the slot is the cache's to say
    (``Entry.took_over``): a clock cannot tell a lapse from a release.

    ``hand_over``: the cache fuses a wait with the put after it (``WaitThenPut``); a
    single slot then waits that way, and the courtesy is not needed: the waiter a release
    wakes holds the key before its releaser can ask again.

    Faults: until the cache has answered (said the key is held), a fault is raised at
    once. After that a waiter rides faults out (``ride_out``): an election or a failover
    is a pause in its wait, not its end."""
    deadline = None if timeout is None else now() + timeout
    count = len(slot_keys)
    fused = hand_over and count == 1
    wait_failed = False
    put_tried = False  # the last fused wait already tried the put
    answered = False  # the cache said the key is held: from here on faults are ridden out
    faulty_since: float | None = None  # the first of the faults in a row being ridden out

    def ride_out(fault: MalfunctionError) -> float | None:
        """How long to pause before trying again, or None to raise ``fault``: never
        before an answer, for a refusal that does not pass by itself (``lasting``:
        permission denied, a malformed record), for a write the server took but that
        must not count (it is being withdrawn), past the deadline, or after
        FAULT_RIDE_OUT of faults in a row."""
        nonlocal faulty_since
        moment = now()
        faulty_since = moment if faulty_since is None else faulty_since
        left = None if deadline is None else deadline - moment
        if not answered or fault.lasting or fault.withheld or (left is not None and left <= 0):
            return None
        if moment - faulty_since >= FAULT_RIDE_OUT:
            return None
        pause = poll_pause(interval, rng)
        return pause if left is None else min(pause, left)

    if courtesy > 0 and timeout != 0 and not fused:
        # We just handed this key to a waiter we woke: let it go first.
        yield Pause(courtesy if timeout is None else min(courtesy, timeout))
    while True:
        # A random first slot spreads semaphore holders instead of piling on slot 0.
        first = rng.randrange(count) if count > 1 else 0
        ridden = False
        for step in range(count if not put_tried else 0):
            slot = (first + step) % count
            started = now()
            try:
                entry = yield PutIfAbsent(slot_keys[slot], value, lease)
            except SimpleCacheConditionError:
                answered, faulty_since = True, None
                continue
            except MalfunctionError as fault:
                try:
                    found = yield from _unclear_put(slot_keys[slot], value, fault, deadline, now)
                except MalfunctionError as unsettled:
                    found, fault = None, unsettled
                if found is None:
                    pause_for = ride_out(fault)
                    if pause_for is None:
                        raise fault
                    yield Pause(pause_for)
                    ridden = True
                    break
                entry = found
            return Grant(slot, entry, started)
        if ridden:
            continue  # every slot again, from the top
        put_tried = False
        remaining = None if deadline is None else deadline - now()
        if remaining is not None and remaining <= 0:
            raise SimpleMutexAcquireTimeoutError(
                f"lock {key!r} stayed busy for the whole timeout of {timeout:g} s; raise "
                "timeout, or treat this as 'another worker is already on it'",
                key=key,
            )
        pause = poll_pause(interval, rng)
        pause = pause if remaining is None else min(pause, remaining)
        if fused and not wait_failed:
            # The lease runs from before the wait: block for a share of it at most.
            started = now()
            try:
                entry = yield WaitThenPut(
                    tuple(slot_keys), min(pause, hand_over_block(lease)), slot_keys[0], value,
                    lease,
                )  # fmt: skip
            except SimpleCacheConditionError:
                put_tried = True
                continue
            except MalfunctionError as fault:
                # The wait or the put failed; the put may have landed all the same. Not
                # ours: wait the plain way once, which tells a broken wake-up channel
                # (poll) from a server that is gone (the put raises). A lasting refusal
                # is raised at once, as the plain put would raise it.
                if fault.lasting:
                    raise
                found = None
                if not fault.unsent:
                    try:
                        found = yield from _unclear_put(slot_keys[0], value, fault, deadline, now)
                    except MalfunctionError as unsettled:
                        pause_for = ride_out(unsettled)
                        if pause_for is None:
                            raise
                        yield Pause(pause_for)
                if found is None:
                    wait_failed = True
                    continue
                entry = found
            return Grant(0, entry, started)
        try:
            yield Wait(tuple(slot_keys), pause)
            wait_failed = False
        except MalfunctionError:
            # Waking is only a shortcut (a LISTEN session the server ended, a failed
            # BLPOP). Put again at once: that tells whether the server itself is gone. If
            # waiting fails again, poll instead, so a broken channel cannot spin. A wait
            # that failed past the deadline (a frozen server: it took a socket timeout)
            # ends the acquire: one more put would cost another.
            left = None if deadline is None else deadline - now()
            if left is not None and left <= 0:
                raise
            if wait_failed:
                yield Pause(pause if left is None else min(pause, left))
            wait_failed = True


def _unclear_put(
    cache_key: str,
    value: str,
    fault: MalfunctionError,
    deadline: float | None,
    now: Callable[[], float],
) -> Flow[Entry | None]:
    """A put that failed may have landed (its reply lost): our entry if it did, None if
    not. Raises ``fault`` without settling when the put was never sent, the fault is
    lasting (a refused put; a read would meet the same refusal or record), or the wait is
    over (a read-back may cost another socket timeout): the caller then frees what may
    have landed, in the background (Mutex.acquire)."""
    if fault.unsent or fault.withheld or fault.lasting:
        raise fault
    if deadline is not None and now() >= deadline:
        raise fault
    return (yield from settle(cache_key, value))


class Renewed(NamedTuple):
    entry: Entry
    started: float
    """The monotonic time just before the write that landed was sent."""


RENEW_WRITES = 3
"""Writes one renewal may send: the second and third only after an earlier write of ours
landed unseen, which takes a lost reply or a driver's retry each time."""


def renew(
    cache_key: str, value: str, version: str, lease: float, now: Callable[[], float]
) -> Flow[Renewed | None]:
    """Restart our record's expiry; None when it is gone or another owner's.

    The deadline is taken only from a write whose outcome we saw (lifecycle rule 15). A
    compare-and-set that misses on a record holding our value at another version met a
    write of ours that landed unseen (a lost reply, a driver's retry): its length and its
    start are not known here, so it cannot set the deadline. Write once more from the
    version found; that write's own start and length do."""
    for _ in range(RENEW_WRITES):
        started = now()
        try:
            entry: Entry = yield CompareAndSet(cache_key, value, lease, version)
        except SimpleCacheConditionError:
            found = yield from settle(cache_key, value)
            if found is None or found.version == version:
                # Gone, another owner's, or still at our version but expired by the
                # cache's clock (a compare-and-set only replaces a live entry).
                return None
            version = found.version
            continue
        return Renewed(entry, started)
    raise MalfunctionError(
        f"renewing {cache_key!r}: our record changed under each of {RENEW_WRITES} writes "
        "(is another process renewing it with the same token?)"
    )


def release(cache_key: str, value: str, version: str, fence: int) -> Flow[Released]:
    """Free our record by compare-and-delete; never another holder's.

    A delete whose reply was lost may have landed. A cache that resends it finds its own
    release there (the contract's rule: a trace names the version freed) and says freed;
    a fault raised to us instead is settled by one read. No record, or another holder's
    under a new fence (a waiter granted the key since): our delete landed (the caller
    judges, by its own clock, whether the lease could have lapsed first). Another
    holder's under our fence (``fence``): it was taken over, never freed by us, so not
    freed. Our record still there is freed now. Only a fault on that read too reaches
    the caller."""
    try:
        woke = yield CompareAndDelete(cache_key, version)
    except MalfunctionError as fault:
        if fault.unsent:
            raise
        try:
            entry = yield Get(cache_key)
            if entry is not None and entry.value != value:
                # A take-over (on_busy="replace") keeps the fence; a grant after a
                # release writes a new one.
                return NOT_FREED if entry.fence == fence else FREED
            if entry is None:
                return FREED
            woke = yield CompareAndDelete(cache_key, entry.version)
        except (MalfunctionError, SimpleCacheConditionError):
            raise fault  # noqa: B904 (the first fault is the one to report)
    except SimpleCacheConditionError:
        # A renewal whose reply was lost may have landed: our record then has a version we
        # never saw.
        entry = yield from settle(cache_key, value)
        if entry is None:
            return NOT_FREED
        try:
            woke = yield CompareAndDelete(cache_key, entry.version)
        except SimpleCacheConditionError:
            return NOT_FREED  # it expired in between
    return HANDED_OFF if woke else FREED


def take_over(
    slot_keys: Sequence[str], value: str, lease: float, owns: Owns, now: Callable[[], float]
) -> Flow[Grant | None]:
    """Replace the first record ``owns`` accepts with ours (the fence stays)."""
    for slot, cache_key in enumerate(slot_keys):
        entry = yield Get(cache_key)
        if entry is None or not owns(entry):
            continue
        started = now()
        try:
            new = yield CompareAndSet(cache_key, value, lease, entry.version)
        except SimpleCacheConditionError:
            new = yield from settle(cache_key, value)
            if new is None:
                continue  # freed or changed meanwhile
        return Grant(slot, new, started)
    return None


def extend(
    slot_keys: Sequence[str],
    lease: float,
    owns: Owns,
    now: Callable[[], float],
    wall: Callable[[], float],
) -> Flow[Grant | None]:
    """Restart the expiry of the first record ``owns`` accepts (its holder's token), on
    behalf of that holder: the value stays, so the holder's own handle stays valid (its
    next renewal misses the version, finds its value, and writes from there).

    Never shorter than the record has left (``wall``: Unix time, the clock of an Entry's
    ``expires_at``): the holder knows nothing of the extension and keeps counting on the
    time it was given, so a shorter record would let another holder in beside it."""
    for slot, cache_key in enumerate(slot_keys):
        for _ in range(RENEW_WRITES):
            entry = yield Get(cache_key)
            if entry is None or not owns(entry):
                break
            length = max(lease, entry.expires_at - wall())
            started = now()
            try:
                extended = yield CompareAndSet(cache_key, entry.value, length, entry.version)
            except SimpleCacheConditionError:
                continue  # renewed or freed in between: read it again
            return Grant(slot, extended, started)
    return None


def release_where(slot_keys: Sequence[str], owns: Owns) -> Flow[int]:
    """Free every record ``owns`` accepts, on the version read: a record that changed in
    between is left alone. A plain compare-and-delete, not ``free_for``: its callers free
    markers and dead holders' records many times a second, and a record moved aside
    would be read meanwhile as a live holder (a de-duplicated send answered with it)."""
    freed = 0
    for cache_key in slot_keys:
        entry = yield Get(cache_key)
        if entry is None or not owns(entry):
            continue
        try:
            yield CompareAndDelete(cache_key, entry.version)
        except SimpleCacheConditionError:
            continue
        freed += 1
    return freed


def evict(slot_keys: Sequence[str], owns: Owns, value: str) -> Flow[int]:
    """Free every record ``owns`` accepts whose holder may still be running (a newer call
    replacing it), each as ``free_for`` frees: moved to ``value`` first, then deleted. The
    holder's own release, when it comes, then misses and reports the loss; a plain
    compare-and-delete would let a cache that remembers its releases answer that release
    as if it were the holder's own."""
    freed = 0
    for cache_key in slot_keys:
        entry = yield Get(cache_key)
        if entry is None or not owns(entry):
            continue
        if (yield from free_for(cache_key, entry.version, value)):
            freed += 1
    return freed


FREEING_LEASE = 5.0
"""How long a record moved aside by ``free_for`` lives if its delete never comes."""


def free_for(cache_key: str, version: str, value: str) -> Flow[bool]:
    """Free the record at ``version`` on its holder's behalf (an operator, a parent
    whose child died): first move it to ``value``, a record of our own at a version of
    its own, then delete that. A cache's trace of a release then names our version, so
    the holder's own release, if it still comes, misses and reports the loss; it can
    never take our release for its own (a release resent after a lost reply does, by
    design). False when the record changed since ``version`` was read."""
    try:
        moved: Entry = yield CompareAndSet(cache_key, value, FREEING_LEASE, version)
    except SimpleCacheConditionError:
        return False
    try:
        yield CompareAndDelete(cache_key, moved.version)
    except SimpleCacheConditionError:
        return True  # lapsed in between: freed all the same
    return True


def abandon(slot_keys: Sequence[str], value: str) -> Flow[None]:
    """Best effort, for an acquire or release cut short by an interrupt: free any slot
    that holds our value."""
    for cache_key in slot_keys:
        try:
            entry = yield from settle(cache_key, value)
            if entry is not None:
                yield CompareAndDelete(cache_key, entry.version)
        except SimpleMutexError:
            pass


def read(slot_keys: Sequence[str]) -> Flow[list[Entry | None]]:
    entries = []
    for cache_key in slot_keys:
        entries.append((yield Get(cache_key)))
    return entries
