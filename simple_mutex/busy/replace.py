"""``on_busy="replace"``: the newest call takes the key from the running holder and has
it stopped. The round and the holder's side are the same for Celery and RQ; how a call
is named in its record's label and how its worker is told differ, and each integration
supplies them (``celery_mutex.replace``, ``rq_mutex.replace``).

One round, in the new call (a worker's call; a synchronous one waits instead)::

    new call                       lock record                 old holder
    try once: busy                 {old token, fence f}
    read the holder's label
    evict the old call's record    {ours, "evicted by"}
      (Mutex.evict): moved to one  (gone)
      of ours on the version read,
      then deleted
    ask its worker to stop it  ->  the worker signals the process running it
                                   (STOP_SIGNAL), or, when the body runs in the worker's
                                   own process, calls check_now()
    put-if-absent: ours            {new token, fence > f}
    runs the body                                              STOP_SIGNAL: a thread
                                                               renews this process's
                                                               leases now; the renewal
                                                               finds the record gone:
                                                               the loss interrupt stops
                                                               the body (LeaseExpired)

The lease passes on whatever becomes of the stop: the record is taken by compare-and-set
steps on the lock itself, never by asking the holder. A holder that cannot be reached
finds its lease lost at its next renewal, a third of a lease later at most, and meanwhile
writes with the older fence, which a fenced store refuses once the new holder has written
(``simple_mutex.fenced``). Replace is the one place that frees a record while its holder
may still act (lifecycle rule 12 waits for the holder to be gone): the user asked for it.

``ROUNDS`` bounds the rounds against other replacing calls: each round frees the holder
it read, and the call that then writes first holds the key; the others replace it in
their next round. Past the bound the call fails with SimpleMutexAcquireTimeoutError.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from simple_mutex import (
    Holder,
    Lease,
    Mutex,
    SimpleMutexAcquireTimeoutError,
    SimpleMutexError,
)
from simple_mutex._core.records import EVICTED_BY

STOP_SIGNAL = signal.SIGUSR2
"""What a worker sends the process that runs a replaced call. SIGUSR1 is billiard's soft
time limit and SIGTERM ends a process; SIGUSR2 only makes its leases renew now."""
ROUNDS = 5


@dataclass(frozen=True)
class Takeover:
    """What an integration supplies for one replacing call of ``key``."""

    key: str
    call: str  # the replacing call, for the log
    take_once: Callable[[], Lease]  # one try (timeout 0), as the call would acquire
    holder: Callable[[], Holder | None]  # a current holder (None: free, or unreadable)
    victim_of: Callable[[Holder], str | None]
    """The call to stop, from its holder record; None when it is not one the integration
    can stop (another kind of record, or an earlier attempt of this very call). It raises
    ``NewerCall`` when the holder is a call sent after this one: the newest wins, so this
    one gives way."""
    free: Callable[[str], bool]  # evict that call's record(s) (``Mutex.evict``)
    stop: Callable[[str], None]  # ask that call's worker to stop it (no reply awaited)
    log: logging.Logger


class NewerCall(Exception):
    """A call sent after this one holds the key, or took it from an earlier attempt of
    this one (this is a retry, or a scheduled run of an older call arriving late): this
    call is the one superseded, and must not run. ``label``: that newer call's."""

    def __init__(self, label: str | None) -> None:
        super().__init__(f"superseded by {label}, a newer call of the key")
        self.label = label


def take(over: Takeover) -> Lease:
    """The key's lease for this call, taken from its holder if need be. Raises
    ``NewerCall`` (from ``victim_of``), or SimpleMutexAcquireTimeoutError after
    ``ROUNDS`` rounds: naming the holder when it was one replace cannot stop."""
    busy: SimpleMutexAcquireTimeoutError | None = None
    unstoppable: Holder | None = None  # the last round's holder, when it could not be stopped
    for _ in range(ROUNDS):
        try:
            return over.take_once()
        except SimpleMutexAcquireTimeoutError as exc:
            busy = exc
        holder = unstoppable = over.holder()
        if holder is None:
            continue  # freed meanwhile
        if (holder.label or "").startswith(EVICTED_BY):
            unstoppable = None  # another replacing call is freeing it: not a holder
            continue
        victim = over.victim_of(holder)
        if victim is None:
            continue  # nothing here can stop it: take_once waits its turn (or fails)
        unstoppable = None
        if over.free(victim):
            over.log.warning(
                "%s: took %r from %s (fence %d), which is being stopped",
                over.call,
                over.key,
                holder.label,
                holder.fence,
            )
        over.stop(victim)
    assert busy is not None
    if unstoppable is not None:
        raise SimpleMutexAcquireTimeoutError(
            f"{over.key!r} is held by {unstoppable.label!r}, which on_busy='replace' cannot "
            "stop: not a call it can name (a lock taken outside a task or job, or by the "
            "other integration), or an earlier attempt of this very call",
            key=over.key,
        ) from busy
    raise SimpleMutexAcquireTimeoutError(
        f"{over.key!r}: on_busy='replace' met a new holder in each of {ROUNDS} rounds "
        "(other replacing calls of this key); the newest of them holds it",
        key=over.key,
    ) from busy


MARK_TTL = 24 * 3600.0  # far beyond any retry or requeue of a replaced call


class Marks:
    """The calls a newer one replaced, in the lock cache under ``prefix``: one record per
    replaced call, never released (it lapses after ``MARK_TTL``), its label the call that
    replaced it. A later attempt of a replaced call (its retry) reads it and gives way
    (``NewerCall``) instead of taking the key back with its older data."""

    def __init__(self, cache: object, prefix: str) -> None:
        self.space = Mutex(cache, lease=MARK_TTL, prefix=prefix, name="replaced")

    def mark(self, call: str, by: str) -> None:
        """Record that ``by`` replaced ``call``; best effort: the key passed on anyway."""
        try:
            self.space.acquire(call, timeout=0, label=by)  # held until it lapses
        except SimpleMutexError as exc:  # marked already, or the cache failed
            logging.getLogger("simple_mutex").debug("replace: marking %s: %r", call, exc)

    def check(self, call: str) -> None:
        """Raise ``NewerCall`` if a newer call replaced ``call``."""
        try:
            held = self.space.holder(call)
        except SimpleMutexError:  # unreadable: this attempt goes on as a new one
            return
        if held is not None:
            raise NewerCall(held.label or "a newer call")


def call_in_brackets(label: str | None) -> str | None:
    """The call id in a label ``"<name>[<id>]"`` (a Celery task's), else None."""
    if not label or not label.endswith("]") or "[" not in label:
        return None
    return label[label.rindex("[") + 1 : -1] or None


# -- the holder's side: renew at once when told -------------------------------------------


class _Watch:
    """The leases this process's calls hold, and the thread that renews them at once when
    a stop arrives (a signal handler may not take locks: it only writes to a pipe)."""

    def __init__(self) -> None:
        self.leases: weakref.WeakSet[Lease] = weakref.WeakSet()
        self.lock = threading.Lock()
        self.pipe: tuple[int, int] | None = None

    def start(self) -> None:
        with self.lock:
            if self.pipe is not None:
                return
            self.pipe = os.pipe()
        threading.Thread(target=self._loop, args=(self.pipe[0],), daemon=True,
                         name="simple_mutex-replace").start()  # fmt: skip

    def _loop(self, fd: int) -> None:
        while True:
            try:
                os.read(fd, 64)
            except OSError:
                return  # closed: a forked child's copy
            with self.lock:
                held = list(self.leases)
            for lease in held:
                if lease.lost:
                    continue
                try:
                    lease.renew()  # a record gone: marks the loss, interrupts the body
                except SimpleMutexError as exc:
                    logging.getLogger("simple_mutex").debug(
                        "replace: renewing %r on a stop: %r", lease.key, exc
                    )

    def nudge(self) -> None:
        if self.pipe is not None:
            with contextlib.suppress(OSError):
                os.write(self.pipe[1], b"!")


_watch = _Watch()


def watch(lease: Lease) -> None:
    """Renew ``lease`` at once when this process is told to stop a replaced holder."""
    _watch.start()
    with _watch.lock:
        _watch.leases.add(lease)


def check_now() -> None:
    """Renew every lease watched here now (a stop arrived)."""
    _watch.nudge()


def ignore_stop_signal() -> None:
    """Make this process (a worker's main process) ignore STOP_SIGNAL: a child it forks
    inherits that until it answers the signal itself, so a stop sent in between (the
    worker names the child before the child is ready) cannot end it."""
    signal.signal(STOP_SIGNAL, signal.SIG_IGN)


def _on_stop_signal(signum: int, frame: object) -> None:
    _watch.nudge()  # one write to a pipe: safe wherever the main thread was


def answer_stop_signal() -> None:
    """Make this process answer STOP_SIGNAL (its default action would end it). Call it in
    the worker's child, in its main thread, before it runs a call."""
    signal.signal(STOP_SIGNAL, _on_stop_signal)


def _forget_after_fork() -> None:
    global _watch
    inherited, _watch = _watch, _Watch()  # the parent's thread does not exist here
    for fd in inherited.pipe or ():
        with contextlib.suppress(OSError):
            os.close(fd)


os.register_at_fork(after_in_child=_forget_after_fork)
