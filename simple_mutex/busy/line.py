"""The line of ``on_busy="queue"`` (issue 24, ``docs/design/queue.md``): one JSON record
per key at ``line.<key>``, beside the lock, and every decision taken on it.

Two halves:

* **The record and its decisions, without I/O.** ``Line`` is the record (frozen; JSON to
  and from, never pickle; a malformed one is a ``MalfunctionError`` naming the key). Each
  step of the design is a pure function of (record, inputs, now) that returns the new
  record and what the caller must do: ``take`` (a send), ``arrive`` (a worker got the
  message: ``Duplicate``, ``RunLate``, ``Run`` or ``Park``), ``park``, ``start``, ``end``,
  ``retry``, ``revoke`` and ``sweep``. They never read a clock or a cache: tests drive
  them exhaustively.
* **The read-modify-write.** ``update`` is an engine flow (``simple_mutex._core.flows``):
  read the record (and, for the decisions that need it, the lock *after* it), apply a
  pure change, compare-and-set it (put-if-absent when missing); a lost race re-reads and
  applies the change again. ``Lines`` runs it blocking or on asyncio, one method pair
  per step, from the same flow.

Tickets carry the line's ``epoch`` (random, set when the record is created): a record
that expired and was created again starts over at ticket 1, and a message of the old one
must not be taken for a duplicate of the new one's ticket (it runs, late, said so).

Why reading the lock after the record is enough: a task marks itself running (``start``)
only after it took the lock, and that mark is a write to the record. A change decided on
"the lock is free" lands only if the record did not change since it was read, so no task
started in between; one that took the lock after the read finds the new record when it
writes ``start``, which decides again (and may tell it to park).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NamedTuple, TypeAlias, TypeVar

from simple_mutex._core.durations import Duration, positive_seconds
from simple_mutex._core.flows import CompareAndSet, Flow, Get, Pause, PutIfAbsent, settle
from simple_mutex._core.keys import check_key, check_prefix, decode_key, encode_key
from simple_mutex._runtime.drivers import run, run_async
from simple_mutex.busy.policy import unreachable
from simple_mutex.caches.adapt import as_cache
from simple_mutex.contract import AnyCache, Entry, Scannable, is_async
from simple_mutex.errors import (
    ConstraintTypeError,
    ConstraintValueError,
    LineFullError,
    MalfunctionError,
    SimpleCacheConditionError,
    bad_input,
)

R = TypeVar("R")
Message: TypeAlias = Any
"""What a parked task needs to be published again: any JSON value (Celery: the task's
name, arguments and routing options; RQ: the job's id)."""

VERSION = 1
MAX_TICKET = 2**53  # JSON numbers stay exact below it in every reader
_EPOCH_RE = re.compile(r"[0-9a-f]{8,64}")
_TICKET_RE = re.compile(r"[1-9][0-9]{0,15}")


class Ticket(NamedTuple):
    """A place in one key's line: the line's ``epoch`` and the number it handed out. The
    integrations carry both in the message (Celery's headers, RQ's job meta)."""

    epoch: str
    number: int


# -- the record -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Parked:
    message: Message
    at: float
    """When it was first parked: ``park_for`` runs from here."""
    promoted: float | None = None
    """When it was last published for its turn (None: not since it was parked)."""


@dataclass(frozen=True)
class Running:
    ticket: int
    since: float
    redelivers: bool
    """Its broker delivers it again if its worker dies (Celery ``acks_late`` with
    ``reject_on_worker_lost``): a lapsed lock then waits for that copy."""
    lapsed: float | None = None
    """When a sweep first found its lock free (a dead holder): the wait for the
    redelivered copy runs from here, for ``gap_for``."""


@dataclass(frozen=True)
class Line:
    """One key's line (the design's table). The decisions never change one in place:
    each returns a new record, so every mapping here is treated as read-only.

    Every ticket in ``[turn, next)`` is in exactly one of ``issued``, ``parked``,
    ``ended`` or ``running`` (a parked copy of the running ticket may sit beside it: a
    redelivery that came while its lock was still held). Tickets below ``turn`` are done,
    but the ``skipped`` ones, which may still arrive (and then park, or run)."""

    key: str
    epoch: str
    next: int = 1
    turn: int = 1
    issued: Mapping[int, float] = field(default_factory=dict)
    """ticket -> when it is due (sent, plus its countdown): the gap clock runs from here."""
    parked: Mapping[int, Parked] = field(default_factory=dict)
    ended: frozenset[int] = frozenset()
    skipped: Mapping[int, float] = field(default_factory=dict)
    """ticket -> when it was skipped: one that never arrives is forgotten after
    ``park_for``."""
    running: Running | None = None

    @property
    def waiting(self) -> int:
        """Tickets handed out and not done: what ``queue_max`` bounds."""
        return self.next - self.turn

    def ticket(self, number: int) -> Ticket:
        return Ticket(self.epoch, number)


def new_line(key: str, epoch: str | None = None) -> Line:
    return Line(key=key, epoch=secrets.token_hex(8) if epoch is None else epoch)


def encode(line: Line) -> str:
    """The record's JSON. Messages must be JSON values: a NaN, or an object json cannot
    write, is refused here, before anything is stored."""
    record: dict[str, Any] = {
        "v": VERSION,
        "key": line.key,
        "epoch": line.epoch,
        "next": line.next,
        "turn": line.turn,
        "issued": {str(t): at for t, at in sorted(line.issued.items())},
        "parked": {
            str(t): {"message": p.message, "at": p.at, "promoted": p.promoted}
            for t, p in sorted(line.parked.items())
        },
        "ended": sorted(line.ended),
        "skipped": {str(t): at for t, at in sorted(line.skipped.items())},
        "running": None
        if line.running is None
        else {
            "ticket": line.running.ticket,
            "since": line.running.since,
            "redelivers": line.running.redelivers,
            "lapsed": line.running.lapsed,
        },
    }
    try:
        return json.dumps(record, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        # ValueError: a NaN or an infinity; TypeError: an object json cannot write.
        error = ConstraintValueError if isinstance(exc, ValueError) else ConstraintTypeError
        message = f"line {line.key!r}: a parked message must be a JSON value ({exc})"
        raise error(message, key=line.key) from None


class _Malformed(Exception):
    pass


def decode(value: str, key: str, cache_name: str = "the") -> Line:
    """The record at ``line.<key>``, checked field by field; anything we never write
    (another program's value, a truncated one, a broken invariant) is a MalfunctionError
    naming the key."""
    try:
        record = json.loads(value)
        return _checked(record, key)
    except (ValueError, RecursionError, _Malformed) as exc:
        raise MalfunctionError(
            f"{cache_name} cache holds a malformed line record for key {key!r}: {exc}; is "
            "another program writing under the line prefix?",
            key=key,
        ) from None


def _checked(record: object, key: str) -> Line:
    if not isinstance(record, dict):
        raise _Malformed("not a JSON object")
    expected = {"v", "key", "epoch", "next", "turn", "issued", "parked", "ended", "skipped",
                "running"}  # fmt: skip
    if set(record) != expected:
        raise _Malformed(f"fields {sorted(record)}, not {sorted(expected)}")
    if record["v"] != VERSION or type(record["v"]) is not int:
        raise _Malformed(f"version {record['v']!r}")
    if record["key"] != key:
        raise _Malformed(f"it names key {record['key']!r}")
    epoch = record["epoch"]
    if not isinstance(epoch, str) or not _EPOCH_RE.fullmatch(epoch):
        raise _Malformed(f"epoch {epoch!r}")
    nxt, turn = _number(record["next"], "next"), _number(record["turn"], "turn")
    if turn > nxt:
        raise _Malformed(f"turn {turn} is past next {nxt}")
    issued = {_ticket(t): _time(at, "issued") for t, at in _object(record["issued"], "issued")}
    skipped = {_ticket(t): _time(at, "skipped") for t, at in _object(record["skipped"], "skipped")}
    parked = {_ticket(t): _parked(p) for t, p in _object(record["parked"], "parked")}
    if not isinstance(record["ended"], list):
        raise _Malformed("ended is not a list")
    ended_list = [_number(t, "ended") for t in record["ended"]]
    ended = frozenset(ended_list)
    running = _running(record["running"])
    open_range = range(turn, nxt)
    if len(ended) != len(ended_list) or not all(turn < t < nxt for t in ended):
        raise _Malformed(f"ended {ended_list} is not a set of tickets after turn {turn}")
    if not all(t in open_range for t in issued):
        raise _Malformed(f"issued {sorted(issued)} outside [{turn}, {nxt})")
    if not all(t < turn for t in skipped):
        raise _Malformed(f"skipped {sorted(skipped)} not below turn {turn}")
    if running is not None and not running.ticket <= turn:
        raise _Malformed(f"running ticket {running.ticket} is after turn {turn}")
    held = {running.ticket} if running is not None else set()
    for t in parked:
        if t not in open_range and t not in skipped and t not in held:
            raise _Malformed(f"parked ticket {t} is neither waiting nor skipped")
    waiting = {t for t in parked if t in open_range} - held
    sets = [set(issued), waiting, set(ended), held & set(open_range)]
    if sum(map(len, sets)) != len(set().union(*sets)):
        raise _Malformed("a ticket is in two of issued, parked, ended, running")
    if set().union(*sets) != set(open_range):
        raise _Malformed(f"tickets of [{turn}, {nxt}) missing from the record")
    return Line(key, epoch, nxt, turn, issued, parked, ended, skipped, running)


def _number(value: object, name: str) -> int:
    if type(value) is not int or not 1 <= value <= MAX_TICKET:
        raise _Malformed(f"{name} {value!r} is not a ticket number")
    return value


def _ticket(text: str) -> int:
    if not _TICKET_RE.fullmatch(text):
        raise _Malformed(f"ticket {text!r}")
    return _number(int(text), "ticket")


def _time(value: object, name: str) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):  # type: ignore[arg-type]
        raise _Malformed(f"{name} time {value!r}")
    return float(value)  # type: ignore[arg-type]


def _object(value: object, name: str) -> list[tuple[str, Any]]:
    if not isinstance(value, dict):
        raise _Malformed(f"{name} is not an object")
    return list(value.items())


def _parked(value: object) -> Parked:
    if not isinstance(value, dict) or set(value) != {"message", "at", "promoted"}:
        raise _Malformed(f"parked entry {value!r:.80}")
    promoted = value["promoted"]
    return Parked(
        value["message"],
        _time(value["at"], "parked"),
        None if promoted is None else _time(promoted, "promoted"),
    )


def _running(value: object) -> Running | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"ticket", "since", "redelivers", "lapsed"}:
        raise _Malformed(f"running {value!r:.80}")
    if type(value["redelivers"]) is not bool:
        raise _Malformed(f"redelivers {value['redelivers']!r}")
    lapsed = value["lapsed"]
    return Running(
        _number(value["ticket"], "running"),
        _time(value["since"], "running"),
        value["redelivers"],
        None if lapsed is None else _time(lapsed, "lapsed"),
    )


# -- what an arrival leads to: a closed set, matched exhaustively --------------------------


@dataclass(frozen=True)
class Duplicate:
    """Drop it (acknowledge, run nothing): its ticket ended, or a copy of it is parked
    or running."""

    ticket: int


@dataclass(frozen=True)
class RunLate:
    """Run it now, out of order, with a ``late`` event: its gap was stepped over
    (``skipped``), or it belongs to an earlier line (``stranger``: the record expired and
    was created again)."""

    ticket: int
    why: Literal["skipped", "stranger"]


@dataclass(frozen=True)
class Run:
    """Its turn, the lock free: take the lock, ``start``, run."""

    ticket: int


@dataclass(frozen=True)
class Park:
    """Not its turn (or the lock is busy): ``park`` its message, then acknowledge it."""

    ticket: int


Arrival: TypeAlias = Duplicate | RunLate | Run | Park


@dataclass(frozen=True)
class Publish:
    """Publish this parked message again: its turn has come."""

    ticket: int
    message: Message


@dataclass(frozen=True)
class Swept:
    """What one sweep of a line decided."""

    publish: tuple[Publish, ...] = ()
    skipped: tuple[int, ...] = ()
    """Gaps stepped over (issued, never arrived, for ``gap_for``)."""
    expired: tuple[int, ...] = ()
    """Parked messages older than ``park_for``, dropped (an ``expired`` event each)."""
    crashed: int | None = None
    """The running ticket whose lock lapsed with no redelivery to wait for: ended."""


# -- the decisions ------------------------------------------------------------------------------


def take(
    line: Line, now: float, *, queue_max: int | None = None, after: float = 0.0
) -> tuple[Line, Ticket]:
    """A send: the next ticket. ``after`` is the task's countdown: it holds the line from
    the send, and its gap clock starts when it is due. A full line raises."""
    if queue_max is not None and line.waiting >= queue_max:
        raise LineFullError(
            f"the line of key {line.key!r} is full: {line.waiting} tasks wait or run "
            f"(queue_max={queue_max}); raise queue_max, or send with on_full='skip'",
            key=line.key,
            limit=queue_max,
        )
    if line.next >= MAX_TICKET:
        raise MalfunctionError(f"the line of key {line.key!r} ran out of tickets", key=line.key)
    ticket = line.next
    issued = {**line.issued, ticket: now + after}
    return replace(line, next=ticket + 1, issued=issued), line.ticket(ticket)


def arrive(line: Line, ticket: Ticket, *, lock_free: bool) -> Arrival:
    """What a worker that got ``ticket``'s message does (the design's step 2)."""
    t = ticket.number
    if ticket.epoch != line.epoch or t >= line.next:
        # No place in this line (its record expired and started again, or a failover
        # lost the write that handed it out): it runs, under the lock, said so.
        return RunLate(t, "stranger")
    running = line.running
    if running is not None and running.ticket == t:
        if not running.redelivers:
            # Another copy of a task that started (a promotion published twice): it ran,
            # or runs, once; its broker promised no more (early ack).
            return Duplicate(t)
        if lock_free:
            return Run(t)  # its holder died, and this is the broker's copy
        # The broker's copy came while the dead holder's lock is still held: it waits,
        # parked, for the lease to lapse (the sweep publishes it then).
        return Park(t) if t not in line.parked else Duplicate(t)
    parked = line.parked.get(t)
    if parked is not None and parked.promoted is None:
        return Duplicate(t)  # redelivered after it was parked (write-then-ack)
    if t in line.skipped:
        return RunLate(t, "skipped") if lock_free and running is None else Park(t)
    if t < line.turn or t in line.ended:
        return Duplicate(t)
    if t == line.turn and lock_free and running is None:
        return Run(t)
    return Park(t)


def park(line: Line, ticket: Ticket, message: Message, now: float) -> Line:
    """Store the message of a ticket ``arrive`` said to park; a message parked before
    keeps its first time (``park_for`` counts from it) and is no longer promoted."""
    t = ticket.number
    if ticket.epoch != line.epoch or t >= line.next:
        # A stranger cannot park in this line: it has no place in it. Run it, late.
        raise ConstraintValueError(f"line {line.key!r}: ticket {ticket} is not of this line")
    before = line.parked.get(t)
    at = now if before is None else before.at
    issued = {k: v for k, v in line.issued.items() if k != t}
    return replace(line, issued=issued, parked={**line.parked, t: Parked(message, at)})


def arrival(
    line: Line, ticket: Ticket, message: Message, now: float, *, lock_free: bool
) -> tuple[Line, Arrival]:
    """``arrive``, and the park it may call for, as one change (write-then-ack)."""
    decided = arrive(line, ticket, lock_free=lock_free)
    if isinstance(decided, Park):
        return park(line, ticket, message, now), decided
    return line, decided


def start(line: Line, ticket: Ticket, now: float, *, redelivers: bool) -> tuple[Line, Arrival]:
    """Mark ``ticket`` running; its caller holds the lock. The decision is taken again
    on the record as it is now: anything but ``Run`` or ``RunLate`` tells the caller to
    release the lock and act on that instead (``Park``: call ``arrival``)."""
    decided = arrive(line, ticket, lock_free=True)
    match decided:
        case Run(t) | RunLate(t, "skipped"):
            issued, parked = _without(line.issued, t), _without(line.parked, t)
            skipped, running = _without(line.skipped, t), Running(t, now, redelivers)
            return replace(
                line, issued=issued, parked=parked, skipped=skipped, running=running
            ), decided
        case RunLate() | Park() | Duplicate():
            return line, decided  # a stranger runs without a mark; the others do not run
        case unknown:
            return unreachable(unknown)


def end(line: Line, ticket: Ticket, now: float) -> tuple[Line, Publish | None]:
    """``ticket`` ended (success, failure, a revoke while it ran, a dead child freed by
    the parent): one write moves the turn past it and every ``ended`` ticket, clears
    ``running``, and marks the new head promoted; the caller then releases the lock and
    publishes what this returns. Ending a ticket that is not running changes nothing
    (the sweep ended it already, or this is a second report)."""
    if ticket.epoch != line.epoch or line.running is None or line.running.ticket != ticket.number:
        return line, None
    # A parked copy of it (the broker's, kept in case its holder died) is done with too.
    t = ticket.number
    return _advance(replace(line, running=None, parked=_without(line.parked, t)), t, now)


def retry(line: Line, ticket: Ticket, now: float, *, after: float = 0.0) -> Line:
    """The task's own ``Task.retry``: not an end. Its ticket keeps the turn (a late one
    goes back to ``skipped``), due again after the retry's countdown."""
    running = line.running
    if ticket.epoch != line.epoch or running is None or running.ticket != ticket.number:
        return line
    t = ticket.number
    # The retry's own message carries the ticket on; a parked copy of it is stale.
    line = replace(line, running=None, parked=_without(line.parked, t))
    if t >= line.turn:
        return replace(line, issued={**line.issued, t: now + after})
    return replace(line, skipped={**line.skipped, t: now + after})


def revoke(line: Line, ticket: Ticket, now: float) -> tuple[Line, Publish | None]:
    """``ticket`` will never run (revoked before it started). After the turn it goes to
    ``ended`` for the turn to step over; the head moves the turn on (and promotes the
    next); a skipped one is forgotten. A running ticket's revoke is its ``end``."""
    if ticket.epoch != line.epoch:
        return line, None
    if line.running is not None and line.running.ticket == ticket.number:
        return end(line, ticket, now)
    forgotten = _forget(line, ticket.number)
    if forgotten.turn != line.turn:
        return _promote(forgotten, now)
    return forgotten, None


def _forget(line: Line, t: int) -> Line:
    """``t`` (not running) will never run: out of every field; the turn steps past it
    when it was the head."""
    if t in line.skipped:
        skipped = {k: v for k, v in line.skipped.items() if k != t}
        return replace(line, parked=_without(line.parked, t), skipped=skipped)
    if not line.turn <= t < line.next or t in line.ended:
        return line
    line = replace(line, issued=_without(line.issued, t), parked=_without(line.parked, t))
    if t == line.turn:
        return _step(line, t)
    return replace(line, ended=line.ended | {t})


def _without(mapping: Mapping[int, R], t: int) -> dict[int, R]:
    return {k: v for k, v in mapping.items() if k != t}


def _advance(line: Line, done: int, now: float) -> tuple[Line, Publish | None]:
    """After ``done`` ended: step the turn past it if it was the head, then promote the
    next to run."""
    return _promote(_step(line, done) if done == line.turn else line, now)


def _step(line: Line, done: int) -> Line:
    """The head ``done`` is over: the turn steps past it and every ended ticket, and
    what was parked below the new turn (copies of done tickets) is dropped."""
    turn, ended = done + 1, set(line.ended)
    while turn in ended:
        ended.discard(turn)
        turn += 1
    parked = {t: p for t, p in line.parked.items() if t >= turn or t in line.skipped}
    return replace(line, turn=turn, ended=frozenset(ended), parked=parked)


def _promote(line: Line, now: float) -> tuple[Line, Publish | None]:
    """Mark the parked ticket to run next promoted, and say what to publish."""
    head = _head(line)
    if head is None:
        return line, None
    entry = line.parked[head]
    promoted = replace(entry, promoted=now)
    return replace(line, parked={**line.parked, head: promoted}), Publish(head, entry.message)


def _head(line: Line) -> int | None:
    """The parked ticket to run next: a late one first (it was sent before the turn),
    else the turn's own; None when the next to run has not arrived."""
    late = [t for t in line.parked if t in line.skipped]
    if late:
        return min(late)
    return line.turn if line.turn in line.parked else None


def sweep(
    line: Line,
    now: float,
    *,
    lock_free: bool,
    promote_grace: float,
    gap_for: float,
    park_for: float,
) -> tuple[Line, Swept]:
    """The design's step 4, for one line: drop what waited past ``park_for``; then, when
    the lock is free, publish a head nobody ran (not promoted within ``promote_grace``),
    end or wait for a dead holder's ticket, and step over gaps empty for ``gap_for``."""
    line, expired = _expire(line, now, park_for)
    publish: list[Publish] = []
    skipped: list[int] = []
    crashed: int | None = None
    running = line.running
    if not lock_free:
        pass  # a live holder: it ends its own ticket and promotes the next
    elif running is not None:
        t = running.ticket
        if t in line.parked:
            # The broker's copy came while the dead holder's lock was held, and parked.
            entry = replace(line.parked[t], promoted=now)
            line = replace(line, running=None, parked={**line.parked, t: entry})
            publish.append(Publish(t, entry.message))
        elif running.redelivers and running.lapsed is None:
            line = replace(line, running=replace(running, lapsed=now))
        elif running.redelivers and running.lapsed is not None and now - running.lapsed < gap_for:
            pass  # the broker's copy is on its way
        else:
            crashed = t
            line, promoted = _advance(replace(line, running=None), t, now)
            publish += [promoted] if promoted is not None else []
    else:
        while True:
            head = _head(line)
            if head is not None:
                entry = line.parked[head]
                if entry.promoted is None or now - entry.promoted >= promote_grace:
                    entry = replace(entry, promoted=now)
                    line = replace(line, parked={**line.parked, head: entry})
                    publish.append(Publish(head, entry.message))
                break
            due = line.issued.get(line.turn)
            if due is None or now - due < gap_for:
                break
            gap = line.turn
            skipped.append(gap)
            line = replace(line, issued=_without(line.issued, gap))
            line = _step(replace(line, skipped={**line.skipped, gap: now}), gap)
    return line, Swept(tuple(publish), tuple(skipped), tuple(expired), crashed)


def _expire(line: Line, now: float, park_for: float) -> tuple[Line, list[int]]:
    """Drop parked messages older than ``park_for`` (their tickets will never run) and
    skipped tickets that never arrived in as long."""
    expired = sorted(t for t, p in line.parked.items() if now - p.at > park_for)
    stale = {t for t, at in line.skipped.items() if now - at > park_for}
    if stale:
        line = replace(line, skipped={k: v for k, v in line.skipped.items() if k not in stale})
    for t in expired:
        if line.running is not None and line.running.ticket == t:
            # A parked copy of the running ticket: the run goes on, the copy goes.
            line = replace(line, parked=_without(line.parked, t))
        else:
            line = _forget(line, t)
    return line, expired


# -- the read-modify-write -------------------------------------------------------------------

UPDATE_WRITES = 32
"""Writes one update may try before it gives up: each lost one means another writer's
landed in between, so a line this contended is named, never spun on forever."""

Change = Callable[[Line, bool], tuple[Line, R]]
"""A pure change: (the record, whether the lock was free when read) -> (the new record,
what the caller learns). Returning the same record writes nothing."""


def update(
    cache_key: str,
    key: str,
    change: Change[R],
    *,
    ttl: float,
    now: Callable[[], float],
    rng: random.Random,
    lock_key: str | None = None,
    cache_name: str = "the",
) -> Flow[R]:
    """Read ``cache_key``'s record (a new line when missing), read the lock at
    ``lock_key`` after it (when given), apply ``change``, and compare-and-set the result
    (put-if-absent when it was missing); a lost race starts over, at most
    ``UPDATE_WRITES`` times. The ttl is restarted on every write."""
    for attempt in range(UPDATE_WRITES):
        entry: Entry | None = yield Get(cache_key)
        line = new_line(key) if entry is None else decode(entry.value, key, cache_name)
        lock_free = True
        if lock_key is not None:
            lock_free = (yield Get(lock_key)) is None
        new, result = change(line, lock_free)
        if new is line:
            return result
        value = encode(new)
        op = (
            PutIfAbsent(cache_key, value, ttl)
            if entry is None
            else CompareAndSet(cache_key, value, ttl, entry.version)
        )
        try:
            yield op
        except SimpleCacheConditionError:
            # Another writer's change landed first: decide again on theirs, after a
            # jittered pause that grows, so the writers of a hot key spread out.
            yield Pause(min(0.05, 0.001 * 2 ** min(attempt, 6)) * (0.5 + rng.random()))
            continue
        except MalfunctionError as fault:
            # The reply may be all that was lost: the record then holds exactly our value.
            if fault.unsent or fault.withheld:
                raise
            found = yield from settle(cache_key, value)
            if found is None:
                raise fault.about(key, [cache_key]) from None
        return result
    raise MalfunctionError(
        f"the line of key {key!r} changed under each of {UPDATE_WRITES} writes in a row; "
        "that many writers on one key at once is more than a line is built for",
        key=key,
    )


# -- the two faces -----------------------------------------------------------------------------

_rng = random.Random()
os.register_at_fork(after_in_child=_rng.seed)  # forked workers must not back off in step

DEFAULT_PARK_FOR = 86_400.0


class Lines:
    """The lines of one cache, under ``prefix`` (``line.``, beside the locks'
    ``mutex.``), keys encoded as the locks' are, so no key escapes its prefix. Every
    step is a pair: ``x`` blocks, ``x_async`` awaits, both running the same flow.

    ``park_for`` (how long a parked message may wait) plus ``lease`` (the locks') is
    each record's ttl, restarted on every write: a line nobody uses expires with its last
    parked message. ``lock_prefix`` is the prefix of the locks the line stands beside."""

    def __init__(
        self,
        cache: Any,
        *,
        lease: Duration,
        park_for: Duration = DEFAULT_PARK_FOR,
        prefix: str = "line.",
        lock_prefix: str = "mutex.",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cache: AnyCache = as_cache(cache)
        self.lease = positive_seconds(lease, "lease")
        self.park_for = positive_seconds(park_for, "park_for")
        self.prefix = check_prefix(prefix)
        self.lock_prefix = check_prefix(lock_prefix)
        if self.prefix == self.lock_prefix:
            raise bad_input(prefix, str, "a line's prefix must differ from its locks'")
        self.clock = clock
        self._aio = is_async(self.cache)

    def cache_key(self, key: str) -> str:
        return self.prefix + encode_key(check_key(key))

    def lock_key(self, key: str) -> str:
        return self.lock_prefix + encode_key(check_key(key))

    def _flow(self, key: str, change: Change[R], *, with_lock: bool = False) -> Flow[R]:
        return update(
            self.cache_key(key),
            key,
            change,
            ttl=self.park_for + self.lease,
            now=self.clock,
            rng=_rng,
            lock_key=self.lock_key(key) if with_lock else None,
            cache_name=getattr(self.cache, "name", type(self.cache).__name__),
        )

    def _run(self, method: str, flow: Flow[R]) -> R:
        if self._aio:
            flow.close()
            raise ConstraintTypeError(
                f"Lines.{method}() cannot run on the asyncio cache "
                f"{type(self.cache).__name__}: use `await {method}_async(...)`"
            )
        return run(self.cache, flow)  # type: ignore[arg-type]

    # Each step: its change (built once), then its two faces.

    def keys(self) -> list[str]:
        """The keys that have a line now, sorted: what a sweep goes through. Needs a
        cache that lists its entries (``scan``: every cache of ``simple_mutex.caches``)."""
        if self._aio:
            raise ConstraintTypeError(
                f"Lines.keys() cannot run on the asyncio cache {type(self.cache).__name__}: "
                "use `await keys_async()`"
            )
        if not isinstance(self.cache, Scannable):
            raise ConstraintTypeError(f"{type(self.cache).__name__} cannot list its lines")
        return self._keys_of(self.cache.scan(self.prefix))

    async def keys_async(self) -> list[str]:
        scan = getattr(self.cache, "scan", None)
        if scan is None:
            raise ConstraintTypeError(f"{type(self.cache).__name__} cannot list its lines")
        if self._aio:
            return self._keys_of(await scan(self.prefix))
        return self._keys_of(await asyncio.to_thread(lambda: list(scan(self.prefix))))

    def _keys_of(self, found: Iterable[tuple[str, Entry]]) -> list[str]:
        """The user's key of each line record: decoded from its cache key, or read from
        the record when the key was too long and hashed (the record names it, and must
        encode back to the cache key it sits at)."""
        keys = []
        for cache_key, entry in found:
            encoded = cache_key[len(self.prefix) :]
            key = decode_key(encoded)
            if key is None:
                try:
                    named = json.loads(entry.value).get("key")
                except (ValueError, RecursionError, AttributeError):
                    named = None
                if not isinstance(named, str) or not named or encode_key(named) != encoded:
                    continue  # nothing a line of ours could have written
                key = named
            keys.append(key)
        return sorted(keys)

    def _read(self, key: str) -> Flow[Line | None]:
        cache_key = self.cache_key(key)
        name = getattr(self.cache, "name", type(self.cache).__name__)
        entry: Entry | None = yield Get(cache_key)
        return None if entry is None else decode(entry.value, key, name)

    def read(self, key: str) -> Line | None:
        """The line of ``key`` as it is now (None: no line)."""
        return self._run("read", self._read(key))

    async def read_async(self, key: str) -> Line | None:
        return await run_async(self.cache, self._read(key))

    def _take(self, key: str, queue_max: int | None, after: float) -> Flow[Ticket]:
        return self._flow(
            key, lambda line, _: take(line, self.clock(), queue_max=queue_max, after=after)
        )

    def take(self, key: str, *, queue_max: int | None = None, after: float = 0.0) -> Ticket:
        """A send's ticket; raises LineFullError when ``queue_max`` are waiting."""
        return self._run("take", self._take(key, queue_max, after))

    async def take_async(
        self, key: str, *, queue_max: int | None = None, after: float = 0.0
    ) -> Ticket:
        return await run_async(self.cache, self._take(key, queue_max, after))

    def _arrive(self, key: str, ticket: Ticket, message: Message) -> Flow[Arrival]:
        return self._flow(
            key,
            lambda line, free: arrival(line, ticket, message, self.clock(), lock_free=free),
            with_lock=True,
        )

    def arrive(self, key: str, ticket: Ticket, message: Message) -> Arrival:
        """What to do with ``ticket``'s message; a ``Park`` is written before this
        returns (acknowledge the message only after)."""
        return self._run("arrive", self._arrive(key, ticket, message))

    async def arrive_async(self, key: str, ticket: Ticket, message: Message) -> Arrival:
        return await run_async(self.cache, self._arrive(key, ticket, message))

    def _start(self, key: str, ticket: Ticket, redelivers: bool) -> Flow[Arrival]:
        return self._flow(
            key, lambda line, _: start(line, ticket, self.clock(), redelivers=redelivers)
        )

    def start(self, key: str, ticket: Ticket, *, redelivers: bool = False) -> Arrival:
        """Mark ``ticket`` running (call it holding the lock); see ``start()``."""
        return self._run("start", self._start(key, ticket, redelivers))

    async def start_async(self, key: str, ticket: Ticket, *, redelivers: bool = False) -> Arrival:
        return await run_async(self.cache, self._start(key, ticket, redelivers))

    def _end(self, key: str, ticket: Ticket) -> Flow[Publish | None]:
        return self._flow(key, lambda line, _: end(line, ticket, self.clock()))

    def end(self, key: str, ticket: Ticket) -> Publish | None:
        """``ticket`` ended: the message to publish once the lock is released, if any."""
        return self._run("end", self._end(key, ticket))

    async def end_async(self, key: str, ticket: Ticket) -> Publish | None:
        return await run_async(self.cache, self._end(key, ticket))

    def _retry(self, key: str, ticket: Ticket, after: float) -> Flow[None]:
        return self._flow(
            key, lambda line, _: (retry(line, ticket, self.clock(), after=after), None)
        )

    def retry(self, key: str, ticket: Ticket, *, after: float = 0.0) -> None:
        """The task retries itself: its ticket keeps the turn."""
        self._run("retry", self._retry(key, ticket, after))

    async def retry_async(self, key: str, ticket: Ticket, *, after: float = 0.0) -> None:
        await run_async(self.cache, self._retry(key, ticket, after))

    def _revoke(self, key: str, ticket: Ticket) -> Flow[Publish | None]:
        return self._flow(key, lambda line, _: revoke(line, ticket, self.clock()))

    def revoke(self, key: str, ticket: Ticket) -> Publish | None:
        """``ticket`` will never run: the message to publish next, if its turn passed on."""
        return self._run("revoke", self._revoke(key, ticket))

    async def revoke_async(self, key: str, ticket: Ticket) -> Publish | None:
        return await run_async(self.cache, self._revoke(key, ticket))

    def _sweep(self, key: str, promote_grace: float, gap_for: float) -> Flow[Swept]:
        def change(line: Line, free: bool) -> tuple[Line, Swept]:
            return sweep(
                line,
                self.clock(),
                lock_free=free,
                promote_grace=promote_grace,
                gap_for=gap_for,
                park_for=self.park_for,
            )

        return self._flow(key, change, with_lock=True)

    def sweep(self, key: str, *, promote_grace: float, gap_for: float) -> Swept:
        """One sweep of ``key``'s line: what to publish, what was skipped or expired."""
        return self._run("sweep", self._sweep(key, promote_grace, gap_for))

    async def sweep_async(self, key: str, *, promote_grace: float, gap_for: float) -> Swept:
        return await run_async(self.cache, self._sweep(key, promote_grace, gap_for))


def ticket_of(epoch: object, number: object) -> Ticket:
    """A ticket as a message carried it (JSON headers): checked, so a forged or
    mangled header is refused, never taken for a place in the line."""
    if not isinstance(epoch, str) or not _EPOCH_RE.fullmatch(epoch):
        raise bad_input(epoch, str, f"a line ticket's epoch must be hex, got {epoch!r:.40}")
    if type(number) is not int or not 1 <= number < MAX_TICKET:
        raise bad_input(
            number, int, f"a line ticket's number must be a positive int, got {number!r:.40}"
        )
    return Ticket(epoch, number)


__all__ = [
    "Arrival",
    "Duplicate",
    "Line",
    "Lines",
    "Park",
    "Parked",
    "Publish",
    "Run",
    "RunLate",
    "Running",
    "Swept",
    "Ticket",
    "arrival",
    "arrive",
    "decode",
    "encode",
    "end",
    "new_line",
    "park",
    "retry",
    "revoke",
    "start",
    "sweep",
    "take",
    "ticket_of",
    "update",
]
