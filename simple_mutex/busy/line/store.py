"""The line in a cache (``docs/design/queue.md``): the read-modify-write that applies a
decision, and ``Lines``, its blocking and asyncio faces.

``update`` is an engine flow (``simple_mutex._core.flows``): read the record (and, for
the decisions that need it, the lock *after* it), apply a pure change, compare-and-set it
(put-if-absent when missing); a lost race re-reads and applies the change again.
``Lines`` runs it blocking or on asyncio, one method pair per step, from the same flow;
it encodes keys as the locks do and restarts each record's ttl on every write.

Why reading the lock after the record is enough: a task marks itself running (``start``)
only after it took the lock, and that mark is a write to the record. A change decided on
"the lock is free" lands only if the record did not change since it was read, so no task
started in between; one that took the lock after the read finds the new record when it
writes ``start``, which decides again (and may tell it to park).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from simple_mutex import events
from simple_mutex._core.durations import Duration, positive_seconds
from simple_mutex._core.flows import CompareAndSet, Flow, Get, Pause, PutIfAbsent, settle
from simple_mutex._core.keys import check_key, check_prefix, decode_key, encode_key
from simple_mutex._runtime.drivers import run, run_async
from simple_mutex._runtime.interrupt import not_theirs
from simple_mutex.caches.adapt import as_cache
from simple_mutex.contract import AnyCache, Entry, Scannable, is_async
from simple_mutex.errors import (
    ConstraintTypeError,
    MalfunctionError,
    SimpleCacheConditionError,
    bad_input,
)

from . import decisions
from .collapse import Collapse, Superseded
from .decisions import Arrival, Publish, Swept
from .record import Line, Message, Ticket, decode, encode, new_line

R = TypeVar("R")


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


def pass_on(
    lines: Lines,
    key: str,
    ticket: Ticket,
    *,
    again_after: float | None,
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
        promoted = lines.over(key, ticket, again_after=again_after)
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


def report(swept: Swept, key: str, log: logging.Logger) -> None:
    """Log what a sweep of ``key``'s line did besides publishing (the operator's view of
    a dead holder, a lost message, a call that waited too long)."""
    if swept.crashed is not None:
        log.warning("sweep: ticket %d of %r ended: its holder died", swept.crashed, key)
    for gap in swept.skipped:
        log.warning("sweep: ticket %d of %r never arrived; stepped over", gap, key)
    for gone in swept.expired:
        log.warning("sweep: ticket %d of %r waited past park_for; dropped", gone, key)


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

    def event(
        self,
        kind: str,
        key: str,
        name: str,
        ticket: int,
        *,
        waited: float | None = None,
        by: str | None = None,
    ) -> None:
        """A ``parked`` or ``promoted`` lock event (``simple_mutex.events``) of the task or
        job ``name``: the journal, the timeline and the metrics see a call wait in its
        key's line. Built only when someone listens."""
        if events.wanted(kind):
            cache = getattr(self.cache, "name", type(self.cache).__name__)
            events.emit(events.LockEvent(
                kind, key, name, str(cache), events.now(), waited=waited, reason=by,
                ticket=ticket,
            ))  # fmt: skip

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
            key,
            lambda line, _: decisions.take(line, self.clock(), queue_max=queue_max, after=after),
        )

    def take(self, key: str, *, queue_max: int | None = None, after: float = 0.0) -> Ticket:
        """A send's ticket; raises LineFullError when ``queue_max`` are waiting."""
        return self._run("take", self._take(key, queue_max, after))

    async def take_async(
        self, key: str, *, queue_max: int | None = None, after: float = 0.0
    ) -> Ticket:
        return await run_async(self.cache, self._take(key, queue_max, after))

    def _send(
        self, key: str, message_for: Callable[[Ticket], Message], queue_max: int | None
    ) -> Flow[tuple[Ticket, bool]]:
        return self._flow(
            key,
            lambda line, _: decisions.send(line, self.clock(), message_for, queue_max=queue_max),
        )

    def send(
        self, key: str, message_for: Callable[[Ticket], Message], *, queue_max: int | None = None
    ) -> tuple[Ticket, bool]:
        """A send's ticket, its message parked at once when a ticket is ahead of it
        (True: parked, publish nothing; False: publish it now). See ``send()``."""
        return self._run("send", self._send(key, message_for, queue_max))

    async def send_async(
        self, key: str, message_for: Callable[[Ticket], Message], *, queue_max: int | None = None
    ) -> tuple[Ticket, bool]:
        return await run_async(self.cache, self._send(key, message_for, queue_max))

    def _send_collapsed(
        self,
        key: str,
        message_for: Callable[[Ticket], Message],
        collapse: Collapse,
        queue_max: int | None,
    ) -> Flow[tuple[Ticket, bool, tuple[Superseded, ...]]]:
        return self._flow(
            key,
            lambda line, _: decisions.send_collapsed(
                line, self.clock(), message_for, collapse, queue_max=queue_max
            ),
        )

    def send_collapsed(
        self,
        key: str,
        message_for: Callable[[Ticket], Message],
        collapse: Collapse,
        *,
        queue_max: int | None = None,
    ) -> tuple[Ticket, bool, tuple[Superseded, ...]]:
        """A send of keep latest or debounce: it takes the waiting call's place, or
        parks (or, for ``Latest`` with nobody ahead, is to be published: False); the
        calls it superseded come back. See ``send_collapsed()``."""
        return self._run(
            "send_collapsed", self._send_collapsed(key, message_for, collapse, queue_max)
        )

    async def send_collapsed_async(
        self,
        key: str,
        message_for: Callable[[Ticket], Message],
        collapse: Collapse,
        *,
        queue_max: int | None = None,
    ) -> tuple[Ticket, bool, tuple[Superseded, ...]]:
        return await run_async(
            self.cache, self._send_collapsed(key, message_for, collapse, queue_max)
        )

    def _arrive(
        self, key: str, ticket: Ticket, message: Message, collapse: Collapse
    ) -> Flow[Arrival]:
        return self._flow(
            key,
            lambda line, free: decisions.arrival(
                line, ticket, message, self.clock(), lock_free=free, collapse=collapse
            ),
            with_lock=True,
        )

    def arrive(
        self, key: str, ticket: Ticket, message: Message, *, collapse: Collapse = None
    ) -> Arrival:
        """What to do with ``ticket``'s message; a ``Park`` is written before this
        returns (acknowledge the message only after)."""
        return self._run("arrive", self._arrive(key, ticket, message, collapse))

    async def arrive_async(
        self, key: str, ticket: Ticket, message: Message, *, collapse: Collapse = None
    ) -> Arrival:
        return await run_async(self.cache, self._arrive(key, ticket, message, collapse))

    def _start(
        self, key: str, ticket: Ticket, redelivers: bool, collapse: Collapse, message: Message
    ) -> Flow[Arrival]:
        return self._flow(
            key,
            lambda line, _: decisions.start(
                line,
                ticket,
                self.clock(),
                redelivers=redelivers,
                collapse=collapse,
                message=message,
            ),
        )

    def start(
        self,
        key: str,
        ticket: Ticket,
        *,
        redelivers: bool = False,
        collapse: Collapse = None,
        message: Message = None,
    ) -> Arrival:
        """Mark ``ticket`` running (call it holding the lock); see ``start()``."""
        return self._run("start", self._start(key, ticket, redelivers, collapse, message))

    async def start_async(
        self,
        key: str,
        ticket: Ticket,
        *,
        redelivers: bool = False,
        collapse: Collapse = None,
        message: Message = None,
    ) -> Arrival:
        return await run_async(self.cache, self._start(key, ticket, redelivers, collapse, message))

    def _end(self, key: str, ticket: Ticket) -> Flow[Publish | None]:
        return self._flow(key, lambda line, _: decisions.end(line, ticket, self.clock()))

    def end(self, key: str, ticket: Ticket) -> Publish | None:
        """``ticket`` ended: the message to publish once the lock is released, if any."""
        return self._run("end", self._end(key, ticket))

    async def end_async(self, key: str, ticket: Ticket) -> Publish | None:
        return await run_async(self.cache, self._end(key, ticket))

    def over(self, key: str, ticket: Ticket, *, again_after: float | None) -> Publish | None:
        """A run of ``ticket`` is over. ``again_after`` set: it will run again (its task
        queue's own retry, due in that many seconds) and keeps its turn (``retry``); None:
        it ended (``end``: the message to publish once the lock is released, if any)."""
        if again_after is None:
            return self.end(key, ticket)
        self.retry(key, ticket, after=again_after)
        return None

    async def over_async(
        self, key: str, ticket: Ticket, *, again_after: float | None
    ) -> Publish | None:
        if again_after is None:
            return await self.end_async(key, ticket)
        await self.retry_async(key, ticket, after=again_after)
        return None

    def _retry(self, key: str, ticket: Ticket, after: float) -> Flow[None]:
        return self._flow(
            key, lambda line, _: (decisions.retry(line, ticket, self.clock(), after=after), None)
        )

    def retry(self, key: str, ticket: Ticket, *, after: float = 0.0) -> None:
        """The task retries itself: its ticket keeps the turn."""
        self._run("retry", self._retry(key, ticket, after))

    async def retry_async(self, key: str, ticket: Ticket, *, after: float = 0.0) -> None:
        await run_async(self.cache, self._retry(key, ticket, after))

    def _revoke(self, key: str, ticket: Ticket) -> Flow[Publish | None]:
        return self._flow(key, lambda line, _: decisions.revoke(line, ticket, self.clock()))

    def revoke(self, key: str, ticket: Ticket) -> Publish | None:
        """``ticket`` will never run: the message to publish next, if its turn passed on."""
        return self._run("revoke", self._revoke(key, ticket))

    async def revoke_async(self, key: str, ticket: Ticket) -> Publish | None:
        return await run_async(self.cache, self._revoke(key, ticket))

    def _sweep(self, key: str, promote_grace: float, gap_for: float) -> Flow[Swept]:
        def change(line: Line, free: bool) -> tuple[Line, Swept]:
            return decisions.sweep(
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
