"""One event stream for every lock: who got it, who found it busy, who let go, who lost it.

::

    from simple_mutex import events

    unsubscribe = events.subscribe(lambda event: print(event.kind, event.key, event.waited))

Every ``Mutex``, ``Semaphore``, ``Lease`` and ``with_simple_mutex`` emits, sync and async, and
the Celery and RQ integrations through them. A callback runs in the thread that emitted
(the acquiring or releasing thread; the keeper's for ``lost`` and background ``renewed``);
one that raises is logged and never breaks the lock. With no subscriber nothing is built.

Logs: a lost lease is a WARNING and a timed-out acquire an INFO record of the
``simple_mutex`` logger, whatever else listens; ``subscribe(log_event)`` makes every event
a record (DEBUG for the rest). Each record's ``extra`` carries the event's fields
(``mutex_kind``, ``mutex_key``, ...), for JSON formatters and structlog; never a token.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from ._core.records import Holder
from ._runtime.interrupt import not_theirs

log = logging.getLogger("simple_mutex")

KINDS = ("acquired", "busy", "timed_out", "released", "renewed", "lost", "parked", "promoted")
_LEVELS = {"lost": logging.WARNING, "timed_out": logging.INFO}


@dataclass(frozen=True, slots=True)
class LockEvent:
    """Something that happened to a lock. Seconds are floats; ``at`` is aware UTC."""

    kind: str
    """acquired, busy (a try-once attempt found it held), timed_out, released, renewed, lost;
    for ``on_busy="queue"``: parked (a call went into its key's line to wait its turn) and
    promoted (its turn came: it was published again)"""
    key: str
    """The user's key, verbatim."""
    name: str
    """A low-cardinality label: a ``with_simple_mutex`` template, a task or job name, or the
    ``name=`` of a Mutex / Semaphore ("mutex" / "semaphore" by default)."""
    cache: str
    """The cache's name ("redis", "postgres", ...)."""
    at: datetime
    fence: int | None = None
    slot: int | None = None
    holder: Holder | None = None
    """Who holds it (acquired, renewed, released, lost: this holder; busy, timed_out: the
    holder in the way when known). Never the token."""
    waited: float | None = None
    """acquired, busy, timed_out: how long the acquire took; promoted: how long the call
    waited parked."""
    held: float | None = None
    """released, lost: how long the lease was held."""
    took_over: bool = False
    """acquired: the slot's last holder never freed it (it crashed, stalled or overran
    its lease, and its record lapsed), as far as the cache still remembers that holder
    (``Entry.took_over``); False after a release, on a first grant, or once forgotten."""
    reason: str | None = None
    """lost: why; promoted: who published it (end, sweep, revoke, parent)."""
    ticket: int | None = None
    """parked, promoted: the call's place in its key's line (pairs the two)."""


Subscriber = Callable[[LockEvent], None]

subscribers: tuple[Subscriber, ...] = ()
"""Read on the hot path: empty means nothing is built."""
_lock = threading.Lock()


def subscribe(callback: Subscriber) -> Callable[[], None]:
    """Call ``callback(event)`` for every lock event in this process; returns the function
    that stops it."""
    global subscribers
    with _lock:
        subscribers = (*subscribers, callback)

    def unsubscribe() -> None:
        global subscribers
        with _lock:
            subscribers = tuple(s for s in subscribers if s is not callback)

    return unsubscribe


def wanted(kind: str) -> bool:
    """Will an event of this kind reach anyone? Subscribers take every kind; the logger
    takes lost and timed_out by itself (the hot kinds only through ``log_event``)."""
    return bool(subscribers) or (kind in _LEVELS and log.isEnabledFor(_LEVELS[kind]))


def log_event(event: LockEvent) -> None:
    """A record of the ``simple_mutex`` logger for ``event``, its fields in ``extra``."""
    level = _LEVELS.get(event.kind, logging.DEBUG)
    if log.isEnabledFor(level):
        fields = {f"mutex_{name}": value for name, value in asdict(event).items()}
        log.log(level, "%s %r (%s, fence %s)", event.kind, event.key, event.name,
                event.fence, extra=fields)  # fmt: skip


def emit(event: LockEvent) -> None:
    """Hand the event to every subscriber (a failing one is logged); a lost lease and a
    timed-out acquire are logged even when nobody subscribed."""
    if event.kind in _LEVELS and log_event not in subscribers:
        log_event(event)
    for callback in subscribers:
        try:
            callback(event)
        except Exception as exc:
            # A signal handler's exception (RQ's job timeout, Celery's soft time limit)
            # that landed while a subscriber ran is the caller's, not the subscriber's
            # failure: swallowed, it let the job run on past its timeout.
            if not_theirs(exc):
                raise
            log.exception("simple_mutex.events subscriber %r failed", callback)


def now() -> datetime:
    return datetime.now(timezone.utc)
