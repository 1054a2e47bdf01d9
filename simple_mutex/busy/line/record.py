"""The line's record (``docs/design/queue.md``): one JSON value per key at
``line.<key>``, and the ticket that names a place in it.

``Line`` is the record (frozen: each decision returns a new one), with its ``Parked``
messages and the ``Running`` ticket; ``Ticket`` is a place in it, carried by a message
and checked on the way in (``ticket_of``). ``encode``/``decode`` are its JSON, never
pickle: ``decode`` checks it field by field, invariants included, and anything we never
write is a ``MalfunctionError`` naming the key.

Tickets carry the line's ``epoch`` (random, set when the record is created): a record
that expired and was created again starts over at ticket 1, and a message of the old one
must not be taken for a duplicate of the new one's ticket (it runs, late, said so).
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeAlias

from simple_mutex.errors import (
    ConstraintTypeError,
    ConstraintValueError,
    MalfunctionError,
    bad_input,
)

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


# -- the record -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Parked:
    message: Message
    at: float
    """When it was first parked: ``park_for`` runs from here."""
    promoted: float | None = None
    """When it was last published for its turn (None: not since it was parked)."""
    due: float | None = None
    """``on_busy="debounce"``: not published before this time (None: when its turn comes).
    Its ``at`` is then the first call of the burst, which ``max_delay`` counts from."""
    resent: int = 0
    """How many times a sweep published it again since it was promoted, for not having
    started: each waits twice as long as the one before (``decisions.resend_after``), so
    a head slow behind a backlog is not delivered again every few seconds."""


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
    copies: Mapping[int, Message] = field(default_factory=dict)
    """ticket -> the line's own copy of a call it sent straight to the broker (a send that
    keeps one: Celery's), kept while it is on its way (issued) and, when its broker
    redelivers, while it runs. A sweep sends it again in its own place when its message
    never came (``gap_for``) or its holder died and the broker's copy did not come: no
    call is stepped over, or lost, because time passed. Only the live ones are written
    (``live_copies``)."""

    retried: Mapping[int, int] = field(default_factory=dict)
    """ticket -> the attempt its task queue's retry carries (Celery's ``retries``): a
    delivery of an earlier attempt (a copy the line or a sweep sent before the retry) is
    a duplicate, never a second run of that attempt. Kept while the ticket waits (sent,
    parked, or skipped and still to come) or runs."""

    def __post_init__(self) -> None:
        # A copy lives exactly as long as its ticket is on its way or running with a
        # broker that redelivers, a retry's attempt as long as its ticket waits or runs:
        # every decision that moves a ticket on drops them here.
        if self.copies:
            object.__setattr__(self, "copies", live_copies(self))
        if self.retried:
            running = {self.running.ticket} if self.running is not None else set()
            waits = (self.issued, self.parked, self.skipped, running)
            live = {t: n for t, n in self.retried.items() if any(t in w for w in waits)}
            object.__setattr__(self, "retried", live)

    @property
    def waiting(self) -> int:
        """Tickets handed out and not done: what ``queue_max`` bounds."""
        return self.next - self.turn

    def ticket(self, number: int) -> Ticket:
        return Ticket(self.epoch, number)


def live_copies(line: Line) -> dict[int, Message]:
    """The copies still of use: of a ticket on its way, or running with a broker that
    redelivers (its holder may die, and that copy may never come)."""
    running = line.running
    kept = {running.ticket} if running is not None and running.redelivers else set()
    return {t: m for t, m in line.copies.items() if t in line.issued or t in kept}


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
            | ({} if p.due is None else {"due": p.due})
            | ({"resent": p.resent} if p.resent else {})
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
    if line.copies:  # absent when empty: a line without copies reads as it always did
        record["copies"] = {str(t): m for t, m in sorted(line.copies.items())}
    if line.retried:  # as copies
        record["retried"] = {str(t): n for t, n in sorted(line.retried.items())}
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
    if set(record) - {"copies", "retried"} != expected:
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
    copies = {_ticket(t): m for t, m in _object(record.get("copies", {}), "copies")}
    retried = {_ticket(t): _attempt(n) for t, n in _object(record.get("retried", {}), "retried")}
    line = Line(key, epoch, nxt, turn, issued, parked, ended, skipped, running, copies, retried)
    if "copies" in record and (not copies or line.copies != copies):
        raise _Malformed(f"copies {sorted(copies)} of tickets neither sent nor running")
    if "retried" in record and (not retried or line.retried != retried):
        raise _Malformed(f"retried {sorted(retried)} of tickets neither waiting nor running")
    return line


def _attempt(value: object) -> int:
    if type(value) is not int or not 1 <= value <= 1_000_000:
        raise _Malformed(f"attempt {value!r:.20}")
    return value


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
    # "due" only for a debounced call, "resent" only once a sweep sent it again: a queue's
    # records stay as they were before either.
    optional = {"due", "resent"}
    if not isinstance(value, dict) or set(value) - optional != {"message", "at", "promoted"}:
        raise _Malformed(f"parked entry {value!r:.80}")
    promoted, resent = value["promoted"], value.get("resent", 0)
    if type(resent) is not int or not 0 <= resent <= 32 or (resent and promoted is None):
        raise _Malformed(f"resent {resent!r:.20}")
    return Parked(
        value["message"],
        _time(value["at"], "parked"),
        None if promoted is None else _time(promoted, "promoted"),
        _time(value["due"], "due") if "due" in value else None,
        resent,
    )


def _running(value: object) -> Running | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"ticket", "since", "redelivers", "lapsed"}:
        raise _Malformed(f"running {value!r:.80}")
    if type(value["redelivers"]) is not bool:
        raise _Malformed(f"redelivers {value['redelivers']!r}")
    lapsed = value["lapsed"]
    if lapsed is not None and not value["redelivers"]:
        raise _Malformed("lapsed, with no redelivery to wait for")
    return Running(
        _number(value["ticket"], "running"),
        _time(value["since"], "running"),
        value["redelivers"],
        None if lapsed is None else _time(lapsed, "lapsed"),
    )
