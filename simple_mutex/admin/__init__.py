"""Look at live locks from outside the processes that hold them, and free one: what the
``simple-mutex`` command and ``celery mutex`` are built on.

It reads a cache through the optional ``scan(prefix)`` capability (``contract.Scannable``)
and maps each cache key back to the user's key exactly: ``prefix + encoded(key)`` for a
mutex and slot 0 of a semaphore, ``...#N`` for slot N (keys.py). A key too long to decode
(its tail hashed) is read from its record, which carries it. Tokens never leave this
module: a ``LiveLock`` keeps the entry's version (the condition of the one write it may
make, a compare-and-delete) and never prints it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from simple_mutex._core import flows
from simple_mutex._core.keys import (
    check_key,
    check_prefix,
    decode_key,
    encode_key,
    slot_key,
    split_slot,
)
from simple_mutex._core.records import Holder, encode_record, holder_of, new_token, record_key
from simple_mutex._runtime.drivers import run
from simple_mutex.busy.line import DEFAULT_PARK_FOR, Line, Lines, SteppedOver
from simple_mutex.contract import ConditionalCache, Entry, Scannable, is_async
from simple_mutex.errors import ConstraintTypeError, MalfunctionError
from simple_mutex.mutex import MAX_PERMITS

DEFAULT_PREFIX = "mutex."
"""The prefix of ``Mutex`` (and of Celery and RQ locks unless configured otherwise)."""

log = logging.getLogger("simple_mutex")


@dataclass(frozen=True)
class LiveLock:
    """One held permit: the user's key, its slot (0 for a mutex) and who holds it."""

    key: str
    slot: int
    holder: Holder
    cache_key: str = field(repr=False)
    version: str = field(repr=False, compare=False)  # the condition of release()
    record: str = field(repr=False, compare=False, default="")
    """The record as read (it holds the owner's token: never print it). A renewal keeps
    it; a take-over (a Celery retry, same fence) writes another."""

    @property
    def fence(self) -> int:
        return self.holder.fence

    @property
    def acquired_at(self) -> datetime:
        return self.holder.acquired_at

    @property
    def expires_at(self) -> datetime:
        return self.holder.expires_at


def scannable(cache: object) -> Scannable:
    """``cache`` if it can list its entries, else a ConstraintError naming what can."""
    if is_async(cache):
        raise ConstraintTypeError(
            f"{type(cache).__name__} is an asyncio cache; inspect locks through the blocking "
            "cache of the same server (RedisCache, PostgresCache, MongoCache on its URL)"
        )
    if not isinstance(cache, Scannable):
        raise ConstraintTypeError(
            f"{type(cache).__name__} cannot list its locks (no scan(prefix)); every cache "
            "of simple_mutex.caches can: InMemoryCache, DiskCache, RedisCache, "
            "PostgresCache, MongoCache, S3Cache"
        )
    return cache


def live_locks(cache: object, prefix: str = DEFAULT_PREFIX) -> list[LiveLock]:
    """Every live lock under ``prefix`` (the ``prefix=`` of the Mutex or Semaphore), in
    key then slot order. A cache key under the prefix that no lock of this library could
    have written (another program's, or a longer prefix's with a ``#``) is left out."""
    check_prefix(prefix)
    found = scannable(cache).scan(prefix)
    return _sorted(_decoded(cache, prefix, found))


def locks_of(cache: object, key: str, prefix: str = DEFAULT_PREFIX) -> list[LiveLock]:
    """The live permits of one ``key`` (every slot of a semaphore), in slot order. A
    cache that reads many keys at once (``get_many``: Redis) reads that key's slots
    only, every slot a semaphore may have (``MAX_PERMITS``: the permit count is the
    holders' to know, and a holder takes a random free slot); others list them by
    ``scan``, which each of them answers from an index of its keys."""
    check_prefix(prefix)
    base = prefix + encode_key(check_key(key))
    checked = scannable(cache)
    read_many = getattr(cache, "get_many", None)
    if callable(read_many):
        slots = [slot_key(base, slot) for slot in range(MAX_PERMITS)]
        found: Iterable[tuple[str, Entry]] = [
            (slot, entry) for slot, entry in zip(slots, read_many(slots), strict=True) if entry
        ]
    else:
        found = checked.scan(base)
    return _sorted(lock for lock in _decoded(cache, prefix, found) if lock.key == key)


def lines_by_key(cache: object, prefix: str = DEFAULT_PREFIX) -> dict[str, Line]:
    """Every line beside the locks under ``prefix`` (``on_busy="queue"``, ``"latest"``,
    ``"debounce"``, of Celery and RQ alike), by key."""
    lines = Lines(scannable(cache), lease=1, lock_prefix=prefix)
    found: dict[str, Line] = {}
    with _unless_denied(lines.prefix):
        for key in lines.keys():  # noqa: SIM118  (a scan, not a mapping's keys)
            line = lines.read(key)
            if line is not None:  # else it expired between the listing and the read
                found[key] = line
    return found


@contextlib.contextmanager
def _unless_denied(where: str) -> Iterator[None]:
    """Lines are read beside the locks, and a Redis user may have rights on the locks'
    prefix only: a line it may not read is one it does not show (logged), not a
    failure of the whole listing."""
    try:
        yield
    except MalfunctionError as refused:
        if not refused.denied:
            raise
        log.info("no rights to read the lines under %r: %s", where, refused.message)


def step_over(
    cache: object,
    key: str,
    ticket: int,
    prefix: str = DEFAULT_PREFIX,
    *,
    by: str = "an operator",
    call: str | None = None,
) -> SteppedOver:
    """Step over ticket ``ticket`` of ``key``'s line (``decisions.step_over``): that call
    never runs, and the calls behind it go on once a worker's sweep publishes the next
    (within its ``sweep_every``, 5 s by default). A running ticket is refused, and so,
    given ``call`` (what ``call_of`` named when the operator was asked), is a ticket
    whose call is another now (a keep-latest line's newer call took its place). A record
    goes to the ``simple_mutex`` logger, naming the call when the line holds its message.
    The record keeps at least the time it had left to live."""
    checked = scannable(cache)  # a blocking cache: an asyncio one is refused, naming the fix
    cache_key = Lines(checked, lease=1, lock_prefix=prefix).cache_key(key)
    [found] = run(checked, flows.read([cache_key]))  # type: ignore[arg-type]
    left = 0.0 if found is None else found.expires_at - time.time()
    lines = Lines(checked, lease=1, park_for=max(DEFAULT_PARK_FOR, left), lock_prefix=prefix)
    accepts = None if call is None else (lambda message: call_of(message) == call)
    done = lines.step_over(key, ticket, accepts=accepts)
    if done.done:
        log.warning("%s stepped over ticket %d (%s) of the line of %r", by, ticket,
                    call_of(done.message), key)  # fmt: skip
    return done


def named_tickets(line: Line) -> list[int]:
    """The tickets of ``line`` still to run or running, in order: those its record names,
    not every number up to ``next`` (a record's numbers are its writers' word: one far
    ahead must not cost a loop of that length)."""
    running = line.running.ticket if line.running is not None else None
    named = {*line.parked, *line.issued, *([running] if running is not None else [])}
    return sorted(t for t in named if line.turn <= t < line.next)


def calls_in(line: Line, limit: int) -> list[dict[str, Any]]:
    """The first ``limit`` calls of ``line`` in ticket order, each with its ``ticket``,
    ``state`` (``running``, ``parked``, or ``sent``: handed a ticket, not arrived),
    ``since`` (Unix time) and ``call`` (what its message names; None for one sent); a
    parked one also with ``promoted`` and ``due``."""
    found = (call_at(line, number) for number in named_tickets(line)[:limit])
    return [call for call in found if call is not None]


def call_at(line: Line, number: int) -> dict[str, Any] | None:
    """Ticket ``number`` of ``line`` as ``calls_in`` gives it; None when it is none of
    running, parked or sent."""
    running, entry = line.running, line.parked.get(number)
    if running is not None and number == running.ticket:
        known = entry.message if entry else line.copies.get(number)
        return {"ticket": number, "state": "running", "since": running.since,
                "call": None if known is None else call_of(known)}  # fmt: skip
    if entry is not None:
        return {"ticket": number, "state": "parked", "since": entry.at,
                "promoted": entry.promoted, "due": entry.due,
                "call": call_of(entry.message)}  # fmt: skip
    if number in line.issued:
        copy = line.copies.get(number)  # a call sent with a copy: the line knows it
        return {"ticket": number, "state": "sent", "since": line.issued[number],
                "call": None if copy is None else call_of(copy)}  # fmt: skip
    return None


def call_of(message: object) -> str:
    """What a line's message names: ``task[id]`` (Celery), ``job id`` (RQ), else "?"
    (a ticket sent that never arrived: the line has no message of it)."""
    if not isinstance(message, Mapping):
        return "?"
    task, call = message.get("task"), message.get("id")
    if isinstance(task, str) and isinstance(call, str):
        return f"{task}[{call}]"
    return f"job {call}" if isinstance(call, str) else "?"


def line_of(cache: object, key: str, prefix: str = DEFAULT_PREFIX) -> Line | None:
    """The line of ``key`` beside the locks under ``prefix``, if it has one: its record
    read directly. None too where the cache refuses this user the line's prefix (a
    Redis user limited to its lock prefix)."""
    checked = scannable(cache)
    lines = Lines(checked, lease=1, lock_prefix=prefix)
    with _unless_denied(lines.prefix):
        return lines.read(key)
    return None


def waiting_in(line: Line) -> int:
    """How many calls wait parked in ``line``: a parked copy of the running ticket (its
    broker's redelivery, kept in case the holder died) is not a waiting call."""
    running = line.running.ticket if line.running is not None else None
    return sum(1 for t in line.parked if t != running)


def parked_by_key(cache: object, prefix: str = DEFAULT_PREFIX) -> dict[str, int]:
    """Per key that has a line beside the locks under ``prefix``: how many calls wait
    parked in it (``waiting_in``). Keys with no line are absent."""
    return {key: waiting_in(line) for key, line in lines_by_key(cache, prefix).items()}


def waited_on(cache: object, lock: LiveLock) -> bool | None:
    """Is a waiter blocked on the lock's key? None where the cache cannot tell."""
    ask = getattr(cache, "waited_on", None)
    return None if ask is None else bool(ask(lock.cache_key))


def release(
    cache: ConditionalCache, lock: LiveLock, *, by: str = "an operator", attempts: int = 3
) -> bool:
    """Free exactly the holder ``lock`` was read with; False, and nothing freed, when the
    permit was freed or changed hands since. A record goes to the ``simple_mutex`` logger
    either way.

    The holder is one owner's record: a renewal keeps it (new version, same record), a
    take-over keeps the fence but writes another owner's record. So: compare-and-delete
    on the version read; if that misses because the same record was renewed meanwhile (a
    ``renew=True`` holder does that every third of its lease, maybe while a person reads
    the prompt), again on the new version. Any other miss refuses. Freed as
    ``flows.free_for`` frees (moved to a record of ours first), so the holder's own
    release still reports the loss."""
    who = _describe(lock)
    version = lock.version
    aside = encode_record(new_token(), f"freed by {by}", time.time())
    for _ in range(attempts):
        if run(cache, flows.free_for(lock.cache_key, version, aside)):
            log.warning("%s freed %s", by, who)
            return True
        now = cache.get(lock.cache_key)
        if now is None or now.fence != lock.fence or now.value != lock.record:
            break
        version = now.version  # the same holder, renewed: still the one to free
    log.warning("%s did not free %s: it was freed or changed hands since it was read", by, who)
    return False


def _describe(lock: LiveLock) -> str:
    held = lock.holder
    label = f" ({held.label})" if held.label else ""
    return (
        f"lock {lock.key!r} slot {lock.slot} held by {held.host} pid {held.pid}{label} "
        f"with fence {held.fence}"
    )


def _decoded(cache: object, prefix: str, found: Iterable[tuple[str, Entry]]) -> Iterable[LiveLock]:
    name = str(getattr(cache, "name", type(cache).__name__))
    for cache_key, entry in found:
        if not cache_key.startswith(prefix):
            continue
        parts = split_slot(cache_key[len(prefix) :])
        if parts is None:
            continue
        encoded, slot = parts
        key = decode_key(encoded)
        if key is None:
            # A hashed key: its record carries the key, which must encode to this one.
            key = record_key(entry, name, cache_key)
            if key is None or encode_key(key) != encoded:
                continue
        holder = holder_of(entry, name, key, slot)
        yield LiveLock(key, slot, holder, cache_key, entry.version, entry.value)


def _sorted(locks: Iterable[LiveLock]) -> list[LiveLock]:
    return sorted(locks, key=lambda lock: (lock.key, lock.slot))
