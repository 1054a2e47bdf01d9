"""The line's decisions (``docs/design/queue.md``), without I/O: each step of the design
is a pure function of (record, inputs, now) that returns the new record and what the
caller must do.

``take`` (a send), ``send`` (one that parks at once behind a ticket ahead), ``arrive``
(a worker got the message: ``Duplicate``, ``RunLate``, ``Run`` or ``Park``, the closed
set ``Arrival``), ``park`` (and ``arrival``, both as one change), ``start``, ``end``,
``retry``, ``revoke`` and ``sweep`` (its outcome a ``Swept``: the messages to
``Publish``, and what it skipped, expired or ended). They never read a clock or a cache:
tests drive them exhaustively.

Keep latest and debounce (``collapse``: ``Latest``, ``Debounce``) are the same steps
given ``collapse=``, plus ``send_collapsed`` (a send that takes the waiting call's place):
a key's line then holds one waiting call, and every call that loses its place is a
``Superseded`` (an arrival's outcome, or listed in a ``Park`` and a send's answer).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal, TypeAlias, TypeVar

from simple_mutex.busy.policy import unreachable
from simple_mutex.errors import ConstraintValueError, LineFullError, MalfunctionError

from .collapse import Collapse, Debounce, Superseded, identity
from .record import MAX_TICKET, Line, Message, Parked, Running, Ticket

R = TypeVar("R")


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
    superseded: tuple[Superseded, ...] = ()
    """With ``collapse``: the waiting calls this one took the place of (their results
    are the caller's to resolve)."""


Arrival: TypeAlias = Duplicate | RunLate | Run | Park | Superseded
"""``Superseded`` only with ``collapse``: a newer call waits, so this one will not run."""


@dataclass(frozen=True)
class Publish:
    """Publish this parked message again: its turn has come."""

    ticket: int
    message: Message
    parked_at: float | None = field(default=None, compare=False)
    """When it was first parked (``Parked.at``): what its ``promoted`` event's wait is
    measured from. Not part of equality: the same publish, whenever it parked."""


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
    resent: tuple[int, ...] = ()
    """Heads sent again from the line's own copy (``Line.copies``) in their own place:
    their message never came, or their holder died and the broker's copy did not come."""


# -- the decisions ------------------------------------------------------------------------------


def take(
    line: Line,
    now: float,
    *,
    queue_max: int | None = None,
    after: float = 0.0,
    copy_for: Callable[[Ticket], Message] | None = None,
) -> tuple[Line, Ticket]:
    """A send: the next ticket. ``after`` is the task's countdown: it holds the line from
    the send, and its gap clock starts when it is due. ``copy_for``: the call's message,
    kept as its copy (``Line.copies``) for a sweep to send in its place should the
    broker's not come ``gap_for`` after it was due. A full line raises."""
    if queue_max is not None and line.waiting >= queue_max:
        raise LineFullError(
            f"the line of key {line.key!r} is full: {line.waiting} tasks wait or run "
            f"(queue_max={queue_max}); raise queue_max, or send with on_full='skip'",
            key=line.key,
            limit=queue_max,
        )
    if line.next >= MAX_TICKET:
        raise MalfunctionError(f"the line of key {line.key!r} ran out of tickets", key=line.key)
    t = line.next
    issued = {**line.issued, t: now + after}
    line = replace(line, next=t + 1, issued=issued)
    ticket = line.ticket(t)
    if copy_for is not None:
        line = replace(line, copies={**line.copies, t: copy_for(ticket)})
    return line, ticket


def send(
    line: Line,
    now: float,
    message_for: Callable[[Ticket], Message],
    *,
    queue_max: int | None = None,
    keep_copy: bool = False,
) -> tuple[Line, tuple[Ticket, bool]]:
    """A send with no countdown that parks at once when a ticket is ahead of it (one
    running, or the turn not yet its own): its message goes into the line, not to the
    broker, so a burst for one key costs no delivery per call, and is published when its
    turn comes. Returns the ticket and whether it was parked (False: publish it now).
    ``message_for`` builds the message, which carries its ticket. ``keep_copy``: a call
    sent to the broker leaves its copy in the line (``Line.copies``), which a sweep sends
    again if the broker's never comes."""
    line, ticket = take(line, now, queue_max=queue_max)
    t = ticket.number
    if t == line.turn and line.running is None:
        if keep_copy:
            line = replace(line, copies={**line.copies, t: message_for(ticket)})
        return line, (ticket, False)  # nobody ahead: to the broker, and it runs
    parked = {**line.parked, t: Parked(message_for(ticket), now)}
    return replace(line, issued=_without(line.issued, t), parked=parked), (ticket, True)


def arrive(
    line: Line,
    ticket: Ticket,
    *,
    lock_free: bool,
    collapse: Collapse = None,
    message: Message = None,
    attempt: int | None = None,
) -> Arrival:
    """What a worker that got ``ticket``'s message does (the design's step 2). With
    ``collapse``, ``message`` (the arriving one) tells a copy of a call whose place a
    newer call took (same ticket, another identity: ``Superseded``), and under
    ``Debounce`` a call never parked waits, parked, for its quiet time. ``attempt``
    (Celery's ``retries``): a delivery of an attempt before the ticket's retry is a
    duplicate (None: the queue cannot tell)."""
    t = ticket.number
    if ticket.epoch != line.epoch or t >= line.next:
        # No place in this line (its record expired and started again, or a failover
        # lost the write that handed it out): it runs, under the lock, said so.
        return RunLate(t, "stranger")
    if attempt is not None and attempt < line.retried.get(t, 0):
        return Duplicate(t)  # a copy sent before the retry: that attempt is over
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
    replaced = parked is not None and identity(message) != identity(parked.message)
    if collapse is not None and message is not None and parked is not None and replaced:
        # The broker's copy of a call parked at its arrival, whose place a newer call took
        # (a crash between the park's write and its ack): it must not run.
        return Superseded(t, message, t, parked.message)
    if parked is not None and parked.promoted is None:
        return Duplicate(t)  # redelivered after it was parked (write-then-ack)
    if t in line.skipped:
        return RunLate(t, "skipped") if lock_free and running is None else Park(t)
    if t < line.turn or t in line.ended:
        return Duplicate(t)
    if isinstance(collapse, Debounce) and parked is None:
        return Park(t)  # it came through the broker, never parked: its quiet time first
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
    line: Line,
    ticket: Ticket,
    message: Message,
    now: float,
    *,
    lock_free: bool,
    collapse: Collapse = None,
    attempt: int | None = None,
) -> tuple[Line, Arrival]:
    """``arrive``, and the park it may call for, as one change (write-then-ack). With
    ``collapse`` the park takes the place of the waiting calls (listed in the ``Park``),
    or, when a newer call waits, this one is ``Superseded`` and leaves the line."""
    decided = arrive(
        line, ticket, lock_free=lock_free, collapse=collapse, message=message, attempt=attempt
    )
    if isinstance(decided, Park):
        copy = line.running is not None and line.running.ticket == ticket.number
        if collapse is None or copy:
            # The broker's copy of the running call (its worker died; acks_late) is that
            # call, not a newer one: it waits for the dead lease as in the queue, and no
            # waiting call takes its turn.
            return park(line, ticket, message, now), decided
        return _park_collapsed(line, ticket, message, now, collapse)
    return line, decided


def _waiting(line: Line, but: int | None, now: float | None = None) -> dict[int, Parked]:
    """The parked calls that wait: not promoted (nobody published them for their turn)
    and not a copy of the running ticket. With ``now``, only those a newer call may take
    the place of: not a debounced call already due (its burst ended; a late scheduler
    or sweep has not published it yet, and a new burst must not take its run away)."""
    held = line.running.ticket if line.running is not None else None
    return {
        u: p
        for u, p in line.parked.items()
        if p.promoted is None
        and u not in (held, but)
        and (now is None or p.due is None or p.due > now)
    }


def _park_collapsed(
    line: Line, ticket: Ticket, message: Message, now: float, collapse: Collapse
) -> tuple[Line, Park | Superseded]:
    """Park ``ticket`` in the place of every waiting call; or, when a newer call waits
    already (it was sent after this one), this one leaves the line superseded."""
    if ticket.epoch != line.epoch or ticket.number >= line.next:
        raise ConstraintValueError(f"line {line.key!r}: ticket {ticket} is not of this line")
    t = ticket.number
    # A newer call waiting, due or not, was sent after this one: this one is superseded.
    every = _waiting(line, t)
    newer = [u for u in every if u > t]
    if newer:
        by = max(newer)
        return _forget(line, t), Superseded(t, message, by, every[by].message)
    waiting = _waiting(line, t, now)
    line, first = _replaced(line, waiting, now, collapse)
    line = replace(
        line,
        issued=_without(line.issued, t),
        parked={**line.parked, t: _entry(message, first, now, collapse)},
    )
    return line, Park(
        t, tuple(Superseded(u, p.message, t, message) for u, p in sorted(waiting.items()))
    )


def _replaced(
    line: Line, waiting: Mapping[int, Parked], now: float, collapse: Collapse
) -> tuple[Line, float]:
    """``waiting`` leave the line; returns it and when the burst they belong to began
    (a debounce's ``max_delay`` counts from its first call; else now)."""
    for u in waiting:
        line = _forget(line, u)
    if isinstance(collapse, Debounce):
        return line, min((p.at for p in waiting.values()), default=now)
    return line, now


def _entry(message: Message, first: float, now: float, collapse: Collapse) -> Parked:
    due = collapse.due(first, now) if isinstance(collapse, Debounce) else None
    return Parked(message, first, due=due)


def send_collapsed(
    line: Line,
    now: float,
    message_for: Callable[[Ticket], Message],
    collapse: Collapse,
    *,
    queue_max: int | None = None,
) -> tuple[Line, tuple[Ticket, bool, tuple[Superseded, ...]]]:
    """A send under ``collapse``: when a call waits, this one takes its place, and its
    ticket when no ticket handed out after it is still on its way through the broker
    (the waiting message is replaced in place: a burst costs one entry, not a ticket
    each; ticket order stays send order, which is how an arrival tells the newer call).
    Else it takes a ticket and parks behind a ticket ahead (``Latest``; with nobody ahead
    it is published now) or always (``Debounce``: due ``period`` from now). Returns the
    ticket, whether it was parked, and the calls it superseded."""
    waiting = {} if collapse is None else _waiting(line, None, now)
    if not waiting and not isinstance(collapse, Debounce):
        line, (ticket, was_parked) = send(line, now, message_for, queue_max=queue_max)
        return line, (ticket, was_parked, ())
    newest = max(waiting, default=0)
    if waiting and not any(i > newest for i in line.issued):
        ticket = line.ticket(newest)
        kept = {newest: waiting[newest]}
        line, first = _replaced(line, _without(waiting, newest), now, collapse)
    else:
        kept = {}
        line, first = _replaced(line, waiting, now, collapse)
        line, ticket = take(line, now, queue_max=queue_max)
    t = ticket.number
    if isinstance(collapse, Debounce):
        first = min([first, *(p.at for p in kept.values())])
    message = message_for(ticket)
    parked = {**line.parked, t: _entry(message, first, now, collapse)}
    gone = tuple(Superseded(w, p.message, t, message) for w, p in sorted(waiting.items()))
    return replace(line, issued=_without(line.issued, t), parked=parked), (ticket, True, gone)


def start(
    line: Line,
    ticket: Ticket,
    now: float,
    *,
    redelivers: bool,
    collapse: Collapse = None,
    message: Message = None,
    attempt: int | None = None,
) -> tuple[Line, Arrival]:
    """Mark ``ticket`` running; its caller holds the lock. The decision is taken again
    on the record as it is now: anything but ``Run`` or ``RunLate`` tells the caller to
    release the lock and act on that instead (``Park``: call ``arrival``)."""
    decided = arrive(
        line, ticket, lock_free=True, collapse=collapse, message=message, attempt=attempt
    )
    match decided:
        case Run(t) | RunLate(t, "skipped"):
            issued, parked = _without(line.issued, t), _without(line.parked, t)
            skipped, running = _without(line.skipped, t), Running(t, now, redelivers)
            copies = line.copies
            entry = line.parked.get(t)
            if redelivers and collapse is None and entry is not None and t not in copies:
                # Started from the line (a parked call published, or the line's own copy
                # sent again): its message is the copy a sweep sends should this holder
                # die too and the broker's redelivery not come.
                copies = {**copies, t: entry.message}
            return replace(
                line, issued=issued, parked=parked, skipped=skipped, running=running,
                copies=copies,
            ), decided  # fmt: skip
        case RunLate() | Park() | Duplicate() | Superseded():
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


def retry(
    line: Line, ticket: Ticket, now: float, *, after: float = 0.0, attempt: int | None = None
) -> Line:
    """The task's own ``Task.retry``: not an end. Its ticket keeps the turn (a late one
    goes back to ``skipped``), due again after the retry's countdown. ``attempt``: the
    attempt that retries (Celery's ``retries``); a later delivery of it or of any attempt
    before is a duplicate."""
    running = line.running
    if ticket.epoch != line.epoch or running is None or running.ticket != ticket.number:
        return line
    t = ticket.number
    # The retry's own message carries the ticket on; a parked copy of it, and the line's
    # own copy of the first message, are stale (dropped by hand: the ticket goes back to
    # issued, where a copy would live). One write, so that no step between leaves the
    # ticket nowhere, which would drop what the record keeps of it (``retried``).
    retried = line.retried if attempt is None else {**line.retried, t: attempt + 1}
    due = now + after
    in_turn = t >= line.turn
    return replace(
        line,
        running=None,
        parked=_without(line.parked, t),
        copies=_without(line.copies, t),
        retried=retried,
        issued={**line.issued, t: due} if in_turn else line.issued,
        skipped=line.skipped if in_turn else {**line.skipped, t: due},
    )


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


@dataclass(frozen=True)
class SteppedOver:
    """What an operator's step-over found at ticket ``ticket``: ``was`` is "parked"
    (``message`` is its call), "sent" (handed out, never arrived), "skipped" (stepped
    over by the line already, and forgotten now) when it was done; "running", "not
    waiting" or "changed" (another call than the operator was shown) when nothing was
    done."""

    ticket: int
    was: str
    message: Message = None

    @property
    def done(self) -> bool:
        return self.was in ("parked", "sent", "skipped")


def step_over(
    line: Line, t: int, accepts: Callable[[Message], bool] | None = None
) -> tuple[Line, SteppedOver]:
    """An operator steps over ticket ``t`` (a head whose message was lost, a call that
    must not run): it never runs, and if it arrives later it is dropped as a duplicate.
    Unlike ``revoke`` nothing is promoted: an operator's tool has no broker to publish
    with, so the next head, never sent for its turn, is published by the next sweep of a
    worker (or started by the running call's end). A running ticket is refused: it ends
    itself, or, its holder gone, a sweep ends it."""
    if line.running is not None and line.running.ticket == t:
        return line, SteppedOver(t, "running")
    parked = line.parked.get(t)
    message = line.copies.get(t) if parked is None else parked.message
    if accepts is not None and not accepts(message):
        # The operator was shown another call at this ticket (a keep-latest line's newer
        # call has taken its place since): stepping over this one was never asked for.
        return line, SteppedOver(t, "changed", message)
    if t in line.skipped:
        return _forget(line, t), SteppedOver(t, "skipped", message)
    if not line.turn <= t < line.next or t in line.ended:
        return line, SteppedOver(t, "not waiting")
    return _forget(line, t), SteppedOver(t, "parked" if parked else "sent", message)


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
    # Kept: a late ticket still to come, and the broker's copy of the running one (it may
    # run late, behind the turn, and its worker die).
    running = line.running.ticket if line.running is not None else None
    parked = {
        t: p for t, p in line.parked.items() if t >= turn or t in line.skipped or t == running
    }
    return replace(line, turn=turn, ended=frozenset(ended), parked=parked)


def _promote(line: Line, now: float) -> tuple[Line, Publish | None]:
    """Mark the parked ticket to run next promoted, and say what to publish."""
    head = _head(line)
    if head is None:
        return line, None
    entry = line.parked[head]
    if entry.due is not None and entry.due > now:
        return line, None  # a debounced call: the sweep publishes it when it is due
    promoted = replace(entry, promoted=now, resent=0)
    return replace(line, parked={**line.parked, head: promoted}), Publish(
        head, entry.message, entry.at
    )


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
    end or wait for a dead holder's ticket, and step over gaps empty for ``gap_for`` that a
    parked ticket waits behind."""
    line, expired = _expire(line, now, park_for)
    publish: list[Publish] = []
    resent: list[int] = []
    skipped: list[int] = []
    crashed: int | None = None
    running = line.running
    if not lock_free:
        pass  # a live holder: it ends its own ticket and promotes the next
    elif running is not None:
        t = running.ticket
        if t in line.parked:
            # The broker's copy came while the dead holder's lock was held, and parked.
            entry = replace(line.parked[t], promoted=now, resent=0)
            line = replace(line, running=None, parked={**line.parked, t: entry})
            if t < line.turn:  # it ran late (its gap stepped over): so does its copy
                line = replace(line, skipped={**line.skipped, t: now})
            publish.append(Publish(t, entry.message, entry.at))
        elif running.redelivers and running.lapsed is None:
            line = replace(line, running=replace(running, lapsed=now))
        elif running.redelivers and running.lapsed is not None and now - running.lapsed < gap_for:
            pass  # the broker's copy is on its way
        elif running.redelivers and t == line.turn and t in line.copies:
            # The broker's copy did not come (a Redis broker redelivers only after its
            # visibility_timeout, an hour by default): the line's own copy runs the call
            # again in its own turn, and the broker's, when it comes, is a duplicate.
            line, sent = _resend(line, t, now)
            publish.append(sent)
            resent.append(t)
        else:
            crashed = t
            line, promoted = _advance(replace(line, running=None), t, now)
            publish += [promoted] if promoted is not None else []
    else:
        while True:
            head = _head(line)
            if head is not None:
                again = _published_again(line.parked[head], now, promote_grace)
                if again is not None:
                    line = replace(line, parked={**line.parked, head: again})
                    publish.append(Publish(head, again.message, again.at))
                break
            gap = line.turn
            due = line.issued.get(gap)
            if due is not None and gap in line.copies:
                # Slow or lost, its place stays its own: gap_for after it was due, the
                # line's copy goes out, and whichever copy comes first runs (the other is
                # a duplicate). Nobody need wait behind: a lost call is not left lost.
                if now - due >= gap_for:
                    line, sent = _resend(line, gap, now)
                    publish.append(sent)
                    resent.append(gap)
                break
            behind = [p.at for t, p in line.parked.items() if t > gap]
            if due is None or not behind:
                # Nobody waits behind the gap: stepping over it would gain nothing and
                # could put a message still in a slow broker queue out of order.
                break
            if now - max(due, min(behind)) < gap_for:
                break  # gap_for runs from when it was due and someone waited behind it
            skipped.append(gap)
            # One write: the gap moves from issued to skipped, keeping what the record
            # holds of it (a retry's attempt).
            gapped = replace(
                line, issued=_without(line.issued, gap), skipped={**line.skipped, gap: now}
            )
            line = _step(gapped, gap)
    return line, Swept(tuple(publish), tuple(skipped), tuple(expired), crashed, tuple(resent))


RESEND_AT_MOST = 600.0
"""The longest a sweep waits between two publishes of a head that has not started."""
RESENT_COUNTED = 32
"""Resends past this are not counted: the wait reached ``RESEND_AT_MOST`` long before."""


def resend_after(promote_grace: float, resent: int) -> float:
    """How long after its last publish a head that has not started is published again,
    having been so ``resent`` times already: ``promote_grace``, then twice that, and so
    on, up to ``RESEND_AT_MOST`` (or ``promote_grace``, if longer)."""
    return min(promote_grace * 2.0 ** min(resent, 32), max(promote_grace, RESEND_AT_MOST))


def _published_again(entry: Parked, now: float, promote_grace: float) -> Parked | None:
    """The head ``entry`` as a sweep publishes it now, or None when it is not to be: a
    head nobody sent for its turn goes at once (a debounced one once it is due); one sent
    and not started (lost in a crash between a release and its publish, or slow behind a
    backlog) goes again after ``resend_after``, less often each time, so a long backlog
    does not fill with copies of it."""
    if entry.due is not None and entry.due > now:
        return None  # a debounced call waits for its quiet time
    if entry.promoted is None:
        return replace(entry, promoted=now)
    if now - entry.promoted >= resend_after(promote_grace, entry.resent):
        return replace(entry, promoted=now, resent=min(entry.resent + 1, RESENT_COUNTED))
    return None


def _resend(line: Line, t: int, now: float) -> tuple[Line, Publish]:
    """Ticket ``t`` (the head, on its way, or running and its holder dead) becomes a
    parked call made of the line's copy, promoted now: sent again in its own place."""
    entry = Parked(line.copies[t], now, promoted=now)
    running = None if line.running is not None and line.running.ticket == t else line.running
    line = replace(
        line,
        issued=_without(line.issued, t),
        parked={**line.parked, t: entry},
        running=running,
        copies=_without(line.copies, t),
    )
    return line, Publish(t, entry.message, entry.at)


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
