"""What the operator commands do, given a cache: ``list``, ``show``, ``release``,
``step-over``, ``watch``.

``simple-mutex`` (``simple_mutex.admin.cli``) and ``celery mutex`` (``celery_mutex.command``)
differ only in how they find the cache (a URL, or the app's ``mutex_cache``); both call
these. Each returns the exit status: 0 done, 1 nothing to do or refused (a free key, a
changed holder, an answer other than yes). Faults (a bad URL, a server down, a missing
driver) are the callers' to turn into status 2 (``one_line``). Tokens are never shown:
``inspect.LiveLock`` does not carry them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any, TextIO

from simple_mutex.admin import (
    LiveLock,
    call_at,
    call_of,
    calls_in,
    line_of,
    live_locks,
    locks_of,
    named_tickets,
    parked_by_key,
    release,
    step_over,
    waited_on,
    waiting_in,
)
from simple_mutex.busy.line import Line, Message
from simple_mutex.contract import ConditionalCache
from simple_mutex.errors import ConstraintTypeError, MalfunctionError

Ask = Callable[[str], str]

_JSON_FIELDS = ("key", "host", "pid", "label", "acquired_at", "expires_at", "fence", "slot")
_CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear screen
LINE_SHOWN = 50  # calls of a line ``show`` prints; a longer line says how many more


def one_line(problem: BaseException | str) -> str:
    """An error as one line: drivers' messages may span several (psycopg's do)."""
    text = " ".join(str(problem).split()) or type(problem).__name__
    return f"simple-mutex: {text}"


def as_json(lock: LiveLock) -> dict[str, Any]:
    """The ``--json`` form of one held permit: exactly ``_JSON_FIELDS``."""
    held = lock.holder
    return {
        "key": lock.key,
        "host": held.host,
        "pid": held.pid,
        "label": held.label,
        "acquired_at": held.acquired_at.isoformat(),
        "expires_at": held.expires_at.isoformat(),
        "fence": held.fence,
        "slot": lock.slot,
    }


def lines_json(locks: Sequence[LiveLock], parked: dict[str, int]) -> list[dict[str, Any]]:
    """The ``--json`` array: each held permit (with ``parked`` where its key has a
    line), then each key whose line waits with nothing held (its lock fields null)."""
    found = []
    for lock in locks:
        entry = as_json(lock)
        if lock.key in parked:
            entry["parked"] = parked[lock.key]
        found.append(entry)
    held = {lock.key for lock in locks}
    for key in sorted(parked.keys() - held):
        found.append({**dict.fromkeys(_JSON_FIELDS), "key": key, "parked": parked[key]})
    return sorted(found, key=lambda entry: (entry["key"], entry["slot"] or 0))


def waiting_lines(cache: object, prefix: str, locks: Sequence[LiveLock]) -> dict[str, int]:
    """``parked_by_key``, less the idle lines: a key's line is shown when a call waits in
    it or its lock is held. (A line record outlives its last call by a day; after a busy
    day, hundreds of keys have one with nothing in it, which is nothing to look at.)"""
    held = {lock.key for lock in locks}
    return {key: n for key, n in parked_by_key(cache, prefix).items() if n or key in held}


def list_locks(cache: object, prefix: str, out: TextIO, *, json_output: bool = False) -> int:
    """Every live lock under ``prefix``, and the parked count of each key that has a line
    (``on_busy="queue"``) with a call in it or its lock held: a table, or a JSON array."""
    locks = live_locks(cache, prefix)
    parked = waiting_lines(cache, prefix, locks)
    if json_output:
        out.write(json.dumps(lines_json(locks, parked), indent=2) + "\n")
    elif locks or parked:
        out.write(table(locks, now(), parked=parked) + "\n")
    else:
        out.write(f"no live locks under prefix {prefix!r}\n")
    return 0


def show_lock(cache: object, key: str, prefix: str, out: TextIO) -> int:
    """One key in full, every permit of a semaphore, then its line's calls in order
    (the tickets ``step-over`` takes); 1 when it is free."""
    locks = locks_of(cache, key, prefix)
    line = line_of(cache, key, prefix)
    in_line = "" if line is None else f"parked:      {waiting_in(line)} in its line\n"
    calls = "" if line is None else line_calls(line, now())
    if not locks:
        out.write(f"{key!r} is free (nothing held under prefix {prefix!r})\n{in_line}{calls}")
        return 1
    out.write(in_line)
    moment = now()
    for lock in locks:
        held = lock.holder
        out.write(
            f"key:         {lock.key}\n"
            f"slot:        {lock.slot}\n"
            f"host:        {held.host}\n"
            f"pid:         {held.pid}\n"
            f"label:       {'' if held.label is None else held.label}\n"
            f"fence:       {held.fence}\n"
            f"acquired at: {stamp(held.acquired_at)} ({span(moment - held.acquired_at)} ago)\n"
            f"expires at:  {stamp(held.expires_at)} (in {span(held.expires_at - moment)})\n"
            "\n"
        )
    out.write(calls)
    return 0


def line_calls(line: Line, moment: datetime) -> str:
    """A line's calls in ticket order, one row each: ticket, state (running, parked, or
    sent and not arrived), the call (a task's name and id, a job's id) and since when."""
    rows = [["TICKET", "STATE", "CALL", "SINCE"]]
    for call in calls_in(line, LINE_SHOWN):
        since = datetime.fromtimestamp(call["since"], timezone.utc)
        state = "sent, not arrived" if call["state"] == "sent" else call["state"]
        rows.append([str(call["ticket"]), state, call["call"] or "?", span(moment - since)])
    if len(rows) == 1:
        return "line:        no call in it\n"
    more = len(named_tickets(line)) - LINE_SHOWN
    tail = f"\n... and {more} more" if more > 0 else ""
    return f"line (turn {line.turn}):\n{columns(rows)}{tail}\n"


def step_over_call(
    cache: object,
    key: str,
    ticket: int,
    prefix: str,
    out: TextIO,
    *,
    yes: bool = False,
    ask: Ask = input,
    by: str = "simple-mutex step-over",
    ended: Callable[[Message], None] | None = None,
) -> int:
    """Step over ticket ``ticket`` of ``key``'s line, after asking unless ``yes``: that
    call never runs, and the calls behind it go on at a worker's next sweep. 1 when
    there is no such line or waiting ticket, it runs, it is another call than the one
    asked about, or the answer is not yes. ``ended``: told the stepped-over call's
    message, if the line had it (``celery mutex`` stores its result REVOKED)."""
    line = line_of(cache, key, prefix)
    if line is None:
        out.write(f"{key!r} has no line under prefix {prefix!r}: nothing to step over\n")
        return 1
    shown = call_at(line, ticket)
    call = None if shown is None else shown["call"]
    what = f"ticket {ticket} ({call or 'sent, not arrived'})"
    question = f"step over {what} of the line of {key!r}? It will never run."
    if not yes and not confirmed(ask, question):
        out.write("not stepped over\n")
        return 1
    done = step_over(cache, key, ticket, prefix, by=by, call=call)
    if done.was == "changed":
        out.write(f"refused: ticket {ticket} of {key!r} is another call now "
                  f"({call_of(done.message)}); nothing stepped over\n")  # fmt: skip
        return 1
    if done.was == "running":
        out.write(f"refused: ticket {ticket} of {key!r} is running; it ends itself, or "
                  "free its lock with `release` if its holder is stuck\n")  # fmt: skip
        return 1
    if not done.done:
        out.write(f"refused: ticket {ticket} is not waiting in the line of {key!r} (it "
                  f"ran, ended or was never handed out; the turn is {line.turn})\n")  # fmt: skip
        return 1
    if ended is not None:
        ended(done.message)  # the task queue's own record of the call's ending
    out.write(f"stepped over ticket {ticket} ({call_of(done.message)}) of the line of "
              f"{key!r}: it will not run; a worker's next sweep sends the next call\n")  # fmt: skip
    return 0


def release_lock(
    cache: ConditionalCache,
    key: str,
    prefix: str,
    out: TextIO,
    *,
    slot: int | None = None,
    yes: bool = False,
    ask: Ask = input,
    by: str = "simple-mutex release",
) -> int:
    """Free the holder of ``key`` read now (for a semaphore with several, the one of
    ``slot``), after asking unless ``yes``; 1 when there is none, the answer is not yes,
    or the holder changed in between (then nothing is freed)."""
    locks = locks_of(cache, key, prefix)
    if slot is not None:
        locks = [lock for lock in locks if lock.slot == slot]
    if not locks:
        where = "" if slot is None else f" in slot {slot}"
        out.write(f"{key!r} is not held{where} under prefix {prefix!r}: nothing to free\n")
        return 1
    if len(locks) > 1:
        out.write(f"{key!r} has {len(locks)} holders; pass --slot to choose one:\n")
        out.write(table(locks, now()) + "\n")
        return 1
    lock = locks[0]
    described = describe(lock)
    if not yes and not confirmed(ask, f"free {described}?"):
        out.write("not freed\n")
        return 1
    if not release(cache, lock, by=by):
        out.write(
            f"refused: {key!r} slot {lock.slot} was freed or changed hands since it was "
            f"read ({described}); nothing freed\n"
        )
        return 1
    out.write(f"freed {described}\n")
    return 0


def load_functions(cache: object, out: TextIO) -> int:
    """Load the Redis functions library a cache with ``functions=True`` calls
    (``FUNCTION LOAD REPLACE``: the same text again changes nothing), through the
    client of ``cache``, a Redis cache on an administrator's URL."""
    if getattr(cache, "name", None) != "redis":
        raise ConstraintTypeError(
            f"redis-functions loads Redis functions; {type(cache).__name__} is no Redis cache "
            "(give a redis://, rediss:// or unix:// URL)"
        )
    # Here, not at the top: the other commands run where redis-py is not installed.
    from redis.exceptions import RedisError

    from simple_mutex.caches.redis.protocol import FUNCTION_NAMES, RedisLayout, functions_library

    if not isinstance(cache, RedisLayout):
        raise ConstraintTypeError(
            f"redis-functions loads Redis functions; {type(cache).__name__} is no Redis cache "
            "(give a redis://, rediss:// or unix:// URL)"
        )
    try:
        name = cache.client.function_load(functions_library(), replace=True)
    except RedisError as exc:
        raise MalfunctionError(
            f"redis: FUNCTION LOAD failed ({type(exc).__name__}: {exc}); it needs Redis >= "
            "7.0 and a user with +function|load (an administrator's URL)"
        ) from None
    name = name.decode() if isinstance(name, bytes) else name
    out.write(f"loaded Redis functions library {name}: {', '.join(FUNCTION_NAMES.values())}\n")
    return 0


def confirmed(ask: Ask, question: str) -> bool:
    """Whether the operator answers yes to ``question`` (no answer at all: no)."""
    try:
        answer = ask(f"{question} [y/N] ")
    except EOFError:
        return False
    return answer.strip().lower() in ("y", "yes")


def watch_locks(
    cache: object,
    prefix: str,
    out: TextIO,
    *,
    interval: float = 1.0,
    refreshes: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Redraw the table every ``interval`` seconds until Ctrl-C (status 0) or
    ``refreshes`` frames: holders, how long each has held, whether a waiter is blocked on
    the key (where the cache can tell), and takeovers (``lapsed_into``). A server that
    fails after the first refresh is reported in a line and watched on; one that fails
    the first is raised."""
    seen: dict[tuple[str, int], LiveLock] = {}
    # How near its end a lease counts as run out: an expiry is read through a reply that
    # can lag on a loaded server. Short, because a hand-off seen within it of the old
    # lease's end reads as a takeover.
    slack = timedelta(seconds=0.25)
    takeovers: dict[str, int] = {}
    news: list[str] = []
    clear = out.isatty()
    frame = 0
    try:
        while refreshes is None or frame < refreshes:
            frame += 1
            try:
                locks = live_locks(cache, prefix)
                seen_at = now()  # after the scan: a grant it read was made by then
                parked = waiting_lines(cache, prefix, locks)
            except MalfunctionError as exc:
                if frame == 1:
                    raise  # a wrong URL or a server that is down: the caller's status 2
                # A blip of a server that answered before: say so, keep watching.
                out.write(f"{stamp(now())} refresh failed: {one_line(exc)}\n")
                out.flush()
                sleep(interval)
                continue
            current = {(lock.key, lock.slot): lock for lock in locks}
            for place, lock in current.items():
                before = seen.get(place)
                if before is not None and lapsed_into(before, lock, seen_at, slack):
                    takeovers[lock.key] = takeovers.get(lock.key, 0) + 1
                    news.append(f"{stamp(now())} takeover of {lock.key!r} slot {lock.slot}: "
                                f"{who(before)} -> {who(lock)} (fence {lock.fence})")  # fmt: skip
            # A permit no longer held whose lease had run out lapsed (a holder cannot free
            # what it no longer holds): remember it, a waiter may take it at a later
            # refresh. One freed while it still had time is forgotten.
            lapsed = {
                place: lock
                for place, lock in seen.items()
                if place not in current and seen_at + slack >= lock.expires_at
            }
            seen = {**lapsed, **current}
            waiting = waiters(cache, locks)
            moment = now()
            in_lines = f"{sum(parked.values())} parked, " if parked else ""
            head = (
                f"simple-mutex watch: prefix {prefix!r}, {len(locks)} held, {in_lines}"
                f"refreshed {stamp(moment)} every {interval:g} s (Ctrl-C ends)"
            )
            body = (
                table(locks, moment, takeovers, waiting, parked=parked)
                if locks or parked
                else "(no live locks)"
            )
            recent = "\n".join(news[-5:])
            out.write((_CLEAR if clear else "") + f"{head}\n{body}\n{recent}\n".rstrip() + "\n\n")
            out.flush()
            if refreshes is None or frame < refreshes:
                sleep(interval)
    except KeyboardInterrupt:
        out.write("\n")
    out.flush()
    return 0


def lapsed_into(
    before: LiveLock, after: LiveLock, seen_at: datetime, slack: timedelta = timedelta(0)
) -> bool:
    """Is ``after``, the same permit read at ``seen_at``, a takeover of ``before`` (the
    permit's holder as last read, at an earlier refresh): a new grant (a new fence) that
    came once ``before``'s lease had run out (to within ``slack``), which is what a
    crashed, paused or stuck holder looks like when a waiter takes the key? A new grant
    seen while ``before`` still had time is a hand-off (freed, by its holder or an
    operator, and taken at once: consecutive calls of a line do it all day), not one.
    A refresh sees a grant up to one interval after it was made, so a hand-off in the
    last refresh interval of the old lease (as last read: a renewal since can have moved
    it) still reads as a takeover."""
    return before.fence != after.fence and seen_at + slack >= before.expires_at


# -- formatting ------------------------------------------------------------------------


def now() -> datetime:
    return datetime.now(timezone.utc)


def stamp(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def span(delta: Any) -> str:
    """A duration for people: ``42s``, ``3m 05s``, ``2h 10m``; ``0s`` when past."""
    seconds = max(0, int(delta.total_seconds()))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"


def who(lock: LiveLock) -> str:
    held = lock.holder
    label = f" ({held.label})" if held.label else ""
    return f"{held.host} pid {held.pid}{label}"


def describe(lock: LiveLock) -> str:
    return f"{lock.key!r} slot {lock.slot} held by {who(lock)}, fence {lock.fence}"


def clip(text: str, width: int = 60) -> str:
    """A table cell of at most ``width`` characters (``show`` and ``--json`` print it whole)."""
    return text if len(text) <= width else text[: width - 3] + "..."


def waiters(cache: object, locks: Sequence[LiveLock]) -> dict[str, bool | None]:
    """Per key: is a waiter blocked on it (None: the cache cannot tell)?"""
    found: dict[str, bool | None] = {}
    for lock in locks:
        if not found.get(lock.key):  # one slot that says yes is enough
            found[lock.key] = waited_on(cache, lock)
    return found


def table(
    locks: Sequence[LiveLock],
    moment: datetime,
    takeovers: dict[str, int] | None = None,
    waiting: dict[str, bool | None] | None = None,
    *,
    parked: dict[str, int] | None = None,
) -> str:
    """One row per held permit; with ``parked`` (per key with a line) a PARKED column,
    ``-`` for a key with no line, and a row of its own (no holder) for a key whose line
    waits with nothing held. No line anywhere: no column, the table as it always was."""
    heads = ["KEY", "SLOT", "HOLDER", "ACQUIRED", "HELD FOR", "EXPIRES IN", "FENCE"]
    if takeovers is not None:
        heads.append("TAKEOVERS")
    if waiting is not None:
        heads.append("WAITERS")
    if parked:
        heads.append("PARKED")
    keyed: list[tuple[str, int, list[str]]] = []
    for lock in locks:
        held = lock.holder
        row = [
            clip(lock.key), str(lock.slot), who(lock), stamp(held.acquired_at),
            span(moment - held.acquired_at), span(held.expires_at - moment), str(held.fence),
        ]  # fmt: skip
        if takeovers is not None:
            row.append(str(takeovers.get(lock.key, 0)))
        if waiting is not None:
            told = waiting.get(lock.key)
            row.append("?" if told is None else "yes" if told else "no")
        if parked:
            row.append(str(parked[lock.key]) if lock.key in parked else "-")
        keyed.append((lock.key, lock.slot, row))
    if parked:
        held_keys = {lock.key for lock in locks}
        for key in parked.keys() - held_keys:
            row = [clip(key), "-", "(none)", "-", "-", "-", "-"]
            row += ["-"] * (len(heads) - len(row) - 1) + [str(parked[key])]
            keyed.append((key, 0, row))
    return columns([heads] + [row for _, _, row in sorted(keyed, key=lambda k: (k[0], k[1]))])


def columns(rows: list[list[str]]) -> str:
    """Rows of cells as aligned text columns, two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)
    return "\n".join(line.rstrip() for line in lines)
