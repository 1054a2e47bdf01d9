"""The line's per-call driver: what every task queue does with ``Lines`` for one call,
written once. A task queue implements the port (``simple_mutex.busy.port``: how it
publishes a parked call, keeps a ticket with a call, resolves a superseded call) and maps
the outcomes below onto its own ways to end a delivery; the loop, the sweeps and the
hand-off live here.

* ``arrive``: one delivery of a call, decided until it is settled: its ``Turn`` (the
  lock taken, the line marked running), ``Parking`` (the line holds it: end the delivery,
  it is published again in its turn) or ``Dropped`` (a duplicate, or a newer call took
  its place: it never runs).
* ``end``: a run is over: the turn moves on (or stays, for the queue's own retry), the
  lock is released, then the next parked call is published.
* ``publish``: send a parked call for its turn; one the queue says will never run is
  stepped over and the next one published instead.
* ``sweep_key``, ``sweep_lines``: publish a head nobody ran, end a dead holder's turn,
  step over a ticket that never arrived.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from simple_mutex._runtime.interrupt import not_theirs
from simple_mutex.busy.policy import QueuePolicy, unreachable
from simple_mutex.busy.port import Call, Publisher
from simple_mutex.errors import MalfunctionError, SimpleMutexAcquireTimeoutError
from simple_mutex.lease import Lease

from .collapse import Collapse, Superseded
from .decisions import Duplicate, Park, Publish, Run, RunLate, Swept
from .record import Parked, Ticket
from .store import Lines

# Decisions one arrival may take before the line is called too contended: each is a lock
# taken and lost to a re-decision, or a record changed under it, in a row.
ARRIVALS = 8


@dataclass(frozen=True)
class Turn:
    """The call's turn came: run the body under ``lease``, then ``end`` ``ticket``.
    ``late``: why it runs out of order (RunLate's), None in order."""

    lease: Lease
    ticket: Ticket
    late: str | None = None


@dataclass(frozen=True)
class Parking:
    """The line holds the call: end this delivery without running it. ``due``: when a
    debounced call woken before its time is due (None: park for the queue's usual
    while)."""

    ticket: Ticket
    due: float | None = None


@dataclass(frozen=True)
class Dropped:
    """The call never runs: a ``duplicate`` of a ticket that ran, runs or is parked, or
    ``superseded`` by a newer call (``by``: that call's id)."""

    reason: Literal["duplicate", "superseded"]
    by: str | None = None


Arrived = Turn | Parking | Dropped


def arrive(
    call: Call,
    lines: Lines,
    key: str,
    collapse: Collapse,
    acquire: Callable[[], Lease],
) -> Arrived:
    """Decide one delivery of ``call`` on ``key``'s line until it settles."""
    log, name = call.log, call.name
    ticket = call.ticket() or call.take(lines, key)
    for _ in range(ARRIVALS):
        message = call.message(ticket)
        decided = lines.arrive(key, ticket, message, collapse=collapse, attempt=call.attempt())
        match decided:
            case Superseded():
                return _superseded(call, key, decided)
            case Duplicate() if call.keeps_parked and _parked_here(lines, key, ticket, call.id):
                # Not a copy: this very call, parked, woken by its queue (a debounced
                # call's due time, or park_for). A sweep may hand it the turn now; else it
                # parks again, and its turn is handed to it as to any other.
                if sweep_key(call, lines, key, call.bounds, own=call.id):
                    continue
                due = _entry(lines, key, ticket)
                when = None if due is None else due.due
                return Parking(ticket, when if when is not None and when > time.time() else None)
            case Duplicate() if _over(lines, key, ticket) and call.ran_and_failed():
                # Its turn is over and it did not succeed: not a copy but a run again
                # (a failed job requeued by hand): it takes a new place.
                log.info("%s runs again: it takes a new place in the line of %r", call.who, key)
                ticket = call.take(lines, key)
            case Duplicate():
                log.info("%s: ticket %d of %r is a duplicate", call.who, ticket.number, key)
                return Dropped("duplicate")
            case Park(superseded=gone):
                call.resolve(key, gone)
                call.parked(key, ticket)
                lines.event("parked", key, name, ticket.number)
                log.info("%s parked in the line of %r (ticket %d)", call.who, key, ticket.number)
                # Any parking sweeps its key: a head a dead holder left moves on now. The
                # sweep may hand the turn to this very call: it then runs instead.
                if sweep_key(call, lines, key, call.bounds, own=call.id):
                    continue
                if call.keeps_parked and _promoted(lines, key, ticket):
                    # Its holder ended since and handed it the turn while this delivery
                    # still runs (the holder's publish waits for it to park): it runs here.
                    continue
                return Parking(ticket)
            case RunLate(why="stranger"):
                # Its line's record is gone (expired, or lost in a failover): it takes a
                # place in the line as it is now.
                ticket = call.take(lines, key)
            case Run() | RunLate():
                try:
                    lease = acquire()
                except SimpleMutexAcquireTimeoutError:
                    continue  # taken meanwhile: decide again (it parks)
                started = lines.start(
                    key,
                    ticket,
                    redelivers=call.redelivers(),
                    collapse=collapse,
                    message=message,
                    attempt=call.attempt(),
                )
                if isinstance(started, Superseded):
                    lease.release()
                    return _superseded(call, key, started)
                if isinstance(started, Run | RunLate):
                    late = started.why if isinstance(started, RunLate) else None
                    if late is not None:
                        log.warning(
                            "%s runs out of order: ticket %d of %r was %s",
                            call.who, ticket.number, key, late,
                        )  # fmt: skip
                    call.started(key, ticket)
                    return Turn(lease, ticket, late)
                lease.release()  # the record changed since: decide again on it
            case _ as unknown:
                unreachable(unknown)
    raise MalfunctionError(
        f"{call.who}: the line of {key!r} changed under each of {ARRIVALS} arrivals in a row",
        key=key,
    )


def _superseded(call: Call, key: str, by: Superseded) -> Dropped:
    newer = by.by_message.get("id") if isinstance(by.by_message, Mapping) else None
    call.log.info("%s: a newer call of %r (%s) took its place", call.who, key, newer)
    return Dropped("superseded", newer if isinstance(newer, str) else None)


def _entry(lines: Lines, key: str, ticket: Ticket) -> Parked | None:
    """``ticket``'s parked entry in the line as it is now (None: not parked there)."""
    line = lines.read(key)
    return None if line is None or line.epoch != ticket.epoch else line.parked.get(ticket.number)


def due(lines: Lines, key: str, ticket: Ticket) -> float | None:
    """When ``ticket``'s debounced entry is due (None: not parked, or not debounced)."""
    parked = _entry(lines, key, ticket)
    return None if parked is None else parked.due


def _parked_here(lines: Lines, key: str, ticket: Ticket, call_id: str) -> bool:
    """Whether the line holds ``call_id`` itself parked at ``ticket``, not yet promoted."""
    parked = _entry(lines, key, ticket)
    return (
        parked is not None
        and parked.promoted is None
        and isinstance(parked.message, Mapping)
        and parked.message.get("id") == call_id
    )


def _promoted(lines: Lines, key: str, ticket: Ticket) -> bool:
    """Whether ``ticket`` is parked and was handed the turn."""
    parked = _entry(lines, key, ticket)
    return parked is not None and parked.promoted is not None


def _over(lines: Lines, key: str, ticket: Ticket) -> bool:
    """Whether ``ticket``'s turn is over: passed or ended, neither running nor parked."""
    line = lines.read(key)
    if line is None or line.epoch != ticket.epoch:
        return False
    t = ticket.number
    if line.running is not None and line.running.ticket == t:
        return False  # a copy of a run still going
    return (t < line.turn or t in line.ended) and t not in line.parked


def running(lines: Lines, key: str, number: int) -> bool:
    """Whether ticket ``number`` of ``key``'s line is the one running."""
    line = lines.read(key)
    return line is not None and line.running is not None and line.running.ticket == number


# -- the end of a run --------------------------------------------------------------------------


def end(
    publisher: Publisher,
    lines: Lines,
    key: str,
    ticket: Ticket,
    bounds: QueuePolicy,
    *,
    again_after: float | None,
    who: str,
    attempt: int | None = None,
) -> Callable[[], None]:
    """Before the lock is released: the turn moves on (``again_after`` None) or stays
    for the queue's own retry of ``attempt``, due in that many seconds. Returns what to
    do once it is released: publish the next parked call (or sweep the key)."""
    return pass_on(
        lines, key, ticket, again_after=again_after, attempt=attempt, who=who,
        log=publisher.log,
        publish=lambda promoted: publish(publisher, lines, key, promoted, by="end"),
        sweep=lambda: sweep_key(publisher, lines, key, bounds),
    )  # fmt: skip


def pass_on(
    lines: Lines,
    key: str,
    ticket: Ticket,
    *,
    again_after: float | None,
    attempt: int | None = None,
    publish: Callable[[Publish], object],
    sweep: Callable[[], object],
    who: str,
    log: logging.Logger,
) -> Callable[[], None]:
    """The end of a run in the line, for an integration: before the lock is released,
    the turn moves on (``again_after`` None) or stays (the task queue's own retry, due in
    that many seconds). Returns what to do once the lock is released: ``publish`` the
    next parked call, or, with none to publish, ``sweep`` the key (the next call may have
    arrived between this write and the release, found the lock still held and parked).
    ``who`` names the run in the log; nothing here raises into the run's own outcome."""
    try:
        promoted = lines.over(key, ticket, again_after=again_after, attempt=attempt)
    except MalfunctionError as fault:
        # The lock is still released; a sweep finds the turn's holder gone and moves on.
        log.warning("%s: the line of %r moves on at the next sweep: %s", who, key, fault)
        return _nothing
    if again_after is not None:
        return _nothing

    def then() -> None:
        try:
            sweep() if promoted is None else publish(promoted)
        except Exception as exc:
            if not_theirs(exc):
                raise  # a job timeout or time limit that landed here is the run's own
            # The run's outcome stands: the head stays promoted, and a sweep publishes it
            # again once promote_grace has passed.
            log.warning("%s: passing the line of %r on failed: %r", who, key, exc)

    return then


def _nothing() -> None:
    pass


# -- publishing --------------------------------------------------------------------------------


def publish(publisher: Publisher, lines: Lines, key: str, what: Publish | None, *, by: str) -> bool:
    """Send the parked call ``what`` for its turn; True when it was sent. One its queue
    says will never run (deleted, or ended without its turn) is stepped over and the next
    one published instead, so no dead entry holds the line; one the queue cannot send now
    is left to a later sweep."""
    for _ in range(ARRIVALS):
        if what is None:
            return False
        match publisher.publish(key, what, by=by):
            case "sent":
                waited = None if what.parked_at is None else max(0.0, time.time() - what.parked_at)
                lines.event("promoted", key, publisher.name, what.ticket, waited=waited, by=by)
                return True
            case "not now":
                return False
            case "gone":
                line = lines.read(key)
                if line is None:
                    return False
                what = lines.revoke(key, Ticket(line.epoch, what.ticket))
            case _ as unknown:
                unreachable(unknown)
    return False


# -- sweeping ----------------------------------------------------------------------------------


def sweep_key(
    publisher: Publisher,
    lines: Lines,
    key: str,
    bounds: QueuePolicy,
    *,
    own: str | None = None,
) -> bool:
    """One sweep of ``key``'s line, publishing what it says to; True when it handed the
    turn to the call ``own`` (the caller's, still being delivered: it runs now instead)."""
    try:
        swept = lines.sweep(key, promote_grace=bounds.promote_grace, gap_for=bounds.gap_for)
    except MalfunctionError as fault:
        publisher.log.warning("sweeping the line of %r failed: %s", key, fault)
        return False
    mine = False
    for what in swept.publish:
        if own is not None and isinstance(what.message, Mapping) and what.message.get("id") == own:
            mine = True
            continue
        publish(publisher, lines, key, what, by="sweep")
    report(swept, key, publisher.log)
    return mine


def sweep_lines(
    lines: Lines, each: Callable[[str], tuple[Publisher, QueuePolicy]], log: logging.Logger
) -> int:
    """Sweep every line in ``lines``' cache once (a worker's periodic sweep), each key by
    the publisher and bounds ``each(key)`` gives: its own calls', so that one task's
    ``gap_for`` never decides for another task's line in the same cache. Returns how many
    lines were swept. Never raises: a sweep goes on with the next line, and the next sweep
    tries again."""
    try:
        keys = lines.keys()
    except MalfunctionError as fault:
        log.warning("sweep: listing the lines under %r failed: %s", lines.prefix, fault)
        return 0
    for key in keys:
        try:
            publisher, bounds = each(key)
            sweep_key(publisher, lines, key, bounds)
        except Exception as exc:  # a sweep must go on with the next line
            log.warning("sweep: the line of %r: %r", key, exc)
    return len(keys)


def report(swept: Swept, key: str, log: logging.Logger) -> None:
    """Log what a sweep of ``key``'s line did besides publishing (the operator's view of
    a dead holder, a lost message, a call that waited too long)."""
    if swept.crashed is not None:
        log.warning("sweep: ticket %d of %r ended: its holder died", swept.crashed, key)
    for again in swept.resent:
        log.warning("sweep: ticket %d of %r did not come; the line sent its own copy, in "
                    "its place", again, key)  # fmt: skip
    for gap in swept.skipped:
        log.warning("sweep: ticket %d of %r never arrived; stepped over", gap, key)
    for gone in swept.expired:
        log.warning("sweep: ticket %d of %r waited past park_for; dropped", gone, key)
