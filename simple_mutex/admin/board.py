"""What the live page (``simple-mutex serve``) shows, apart from how it is served: a
snapshot of every held key and every line with a call in it or its lock held, as JSON,
and the events between two snapshots (grants, hand-overs, takeovers, frees, lapses,
calls parked and started). Pure but for ``read``, which is two scans of the cache: its
cost is that of ``simple-mutex list``, whatever the number of viewers (the server reads
once per refresh and every viewer gets that copy).

Nothing here carries an owner's token: ``LiveLock`` never does, and a line's messages
are shown only as the call they name (a task's name and id, a job's id), never their
arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from simple_mutex.admin import (
    LiveLock,
    call_of,
    calls_in,
    lines_by_key,
    live_locks,
    named_tickets,
    waited_on,
    waiting_in,
)
from simple_mutex.admin.commands import as_json, lapsed_into, now, who
from simple_mutex.busy.line import Line

# Past these, a line's call is flagged as stuck with what a worker's sweep does about
# it: the defaults of ``promote_grace`` and ``gap_for`` (a task may set others; the page
# cannot know which, so it says "by default").
PROMOTE_GRACE = 30.0
GAP_FOR = 120.0
CALLS_SHOWN = 200  # per line, in order: a longer line says how many more wait
SWEEP_LATE = 30.0  # a sweep comes every few seconds: this long past the grace, none came
# How near its end a lease counts as run out, as ``watch`` judges takeovers.
SLACK = timedelta(seconds=0.25)


@dataclass(frozen=True)
class Snapshot:
    """The held permits and the lines worth showing, read at ``at``."""

    at: datetime
    locks: tuple[LiveLock, ...]
    lines: Mapping[str, Line]
    waiting: Mapping[str, bool | None]  # per held key: is a waiter blocked on it?


def read(cache: object, prefix: str) -> Snapshot:
    """One snapshot: the locks, then the lines (a line with no call on its way, parked
    or running and its lock free is idle, and left out as ``list`` leaves it)."""
    locks = tuple(live_locks(cache, prefix))
    at = now()  # after the scan: a grant it read was made by then
    held = {lock.key for lock in locks}
    lines = {
        key: line
        for key, line in lines_by_key(cache, prefix).items()
        if line.waiting or key in held or line.running is not None
    }
    waiting: dict[str, bool | None] = {}
    for lock in locks:
        if not waiting.get(lock.key):  # one slot that says yes is enough
            waiting[lock.key] = waited_on(cache, lock)
    return Snapshot(at, locks, lines, waiting)


# -- the page's JSON ---------------------------------------------------------------------------


def state(snap: Snapshot, events: list[dict[str, Any]], *, actions: bool) -> dict[str, Any]:
    """The JSON the page draws: ``locks``, ``lines``, ``events`` (newest last) and whether
    the release button is on."""
    moment = snap.at
    held = {lock.key for lock in snap.locks}
    return {
        "at": moment.isoformat(),
        "actions": actions,
        "locks": [
            {
                **as_json(lock),
                "held_for": (moment - lock.acquired_at).total_seconds(),
                "lease_left": (lock.expires_at - moment).total_seconds(),
                "waiters": snap.waiting.get(lock.key),
                "in_line": lock.key in snap.lines,
            }
            for lock in snap.locks
        ],
        "lines": [
            line_state(key, line, key in held, moment.timestamp())
            for key, line in sorted(snap.lines.items())
        ],
        "events": events,
    }


def line_state(key: str, line: Line, held: bool, now_s: float) -> dict[str, Any]:
    """One line, its calls in ticket order (each ``running``, ``parked`` or ``sent``:
    handed a ticket, not arrived yet), and what is stuck in it, said as the reason."""
    calls = calls_in(line, CALLS_SHOWN)
    stuck: list[str] = []
    running = line.running.ticket if line.running is not None else None
    if line.running is not None and not held:
        then = (
            "its broker delivers it again, and the line waits for that copy"
            if line.running.redelivers
            else "a worker's sweep ends its turn"
        )
        stuck.append(f"ticket {running}'s holder is gone (its lock is free): {then}")
    head = next((c for c in calls if c["state"] != "running"), None)
    if head is not None and running is None and not held:
        waited = now_s - (head.get("promoted") or head["since"])
        if head["state"] == "parked" and head.get("promoted") and waited > PROMOTE_GRACE:
            stuck.append(f"ticket {head['ticket']} was sent for its turn {waited:.0f} s ago "
                         "and has not started (a backlog, or a lost message: a sweep sends "
                         "it again)")  # fmt: skip
        elif (
            head["state"] == "parked"
            and waited > PROMOTE_GRACE + SWEEP_LATE
            and (head.get("due") or 0) <= now_s  # a debounced call waits until it is due
        ):
            stuck.append(f"ticket {head['ticket']} has waited {waited:.0f} s with the key "
                         "free and nobody sent it: no worker sweeps these lines (an "
                         "rq_mutex.Worker, or a Celery worker with the task, on this "
                         "cache)")  # fmt: skip
        elif head["state"] == "sent" and len(calls) > 1 and waited > GAP_FOR:
            stuck.append(f"ticket {head['ticket']} was sent {waited:.0f} s ago and never "
                         "arrived; the calls behind it wait for it (gap_for)")  # fmt: skip
    return {
        "key": key,
        "held": held,
        "more": max(0, len(named_tickets(line)) - CALLS_SHOWN),
        "turn": line.turn,
        "waiting": waiting_in(line),
        "calls": calls,
        "stuck": stuck,
    }


# -- what changed between two snapshots ----------------------------------------------------------


def changes(before: Snapshot | None, after: Snapshot) -> list[dict[str, Any]]:
    """The events between two snapshots, oldest first: ``granted`` (a key taken that was
    free), ``handed over`` (a new holder while the old one still had time: freed and
    taken), ``takeover`` (a new holder once the old lease had run out: a crashed,
    paused or stuck holder), ``freed`` / ``lapsed`` (no holder now), ``parked`` and
    ``started`` (a line's calls). The first snapshot has none."""
    if before is None:
        return []
    at = after.at.isoformat()
    found: list[dict[str, Any]] = []

    def event(kind: str, key: str, text: str) -> None:
        found.append({"at": at, "kind": kind, "key": key, "text": text})

    old = {(lock.key, lock.slot): lock for lock in before.locks}
    new = {(lock.key, lock.slot): lock for lock in after.locks}
    for place, lock in new.items():
        was = old.get(place)
        if was is None:
            event("granted", lock.key, f"{who(lock)} took it (fence {lock.fence})")
        elif was.fence != lock.fence:
            kind = "takeover" if lapsed_into(was, lock, after.at, SLACK) else "handed over"
            event(kind, lock.key, f"{who(was)} -> {who(lock)} (fence {lock.fence})")
    for place, was in old.items():
        if place not in new:
            ran_out = after.at + SLACK >= was.expires_at
            what = "let its lease run out" if ran_out else "was freed with time left"
            event("lapsed" if ran_out else "freed", was.key, f"{who(was)} {what}")
    for key, line in after.lines.items():
        prior = before.lines.get(key)
        for number, entry in sorted(line.parked.items()):
            if prior is None or number not in prior.parked:
                event("parked", key, f"ticket {number}: {call_of(entry.message)}")
        started = line.running.ticket if line.running is not None else None
        if started is not None and (prior is None or prior.running is None
                                    or prior.running.ticket != started):  # fmt: skip
            event("started", key, f"ticket {started}")
    return found
