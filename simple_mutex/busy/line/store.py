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
import functools
import inspect
import itertools
import json
import os
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Concatenate, ParamSpec, TypeVar

from simple_mutex import events
from simple_mutex._core.durations import Duration, positive_seconds
from simple_mutex._core.flows import CompareAndSet, Flow, Get, Pause, PutIfAbsent, settle
from simple_mutex._core.keys import check_key, check_prefix, decode_key, encode_key
from simple_mutex._runtime.drivers import run, run_async
from simple_mutex.caches.adapt import as_cache, index_prefix
from simple_mutex.contract import AnyCache, Entry, Scannable, is_async
from simple_mutex.errors import (
    ConstraintTypeError,
    MalfunctionError,
    SimpleCacheConditionError,
    bad_input,
)

from . import decisions
from .collapse import Collapse, Superseded
from .decisions import Arrival, Publish, SteppedOver, Swept
from .record import Line, Message, Ticket, decode, encode, new_line

R = TypeVar("R")


# -- the read-modify-write -------------------------------------------------------------------

UPDATE_WRITES = 32
UPDATE_FOR = 10.0
"""An update gives up once it has lost ``UPDATE_WRITES`` races and tried for
``UPDATE_FOR`` seconds, both: each lost race means another writer's change landed, so
the line moves on, and under a burst of producers on one key a send waits its turn
rather than fail (4 producers of 500 sends each on one key once lost 5 sends to a
count alone); a line contended past both is named, never spun on forever."""

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
    (put-if-absent when it was missing); a lost race starts over, until ``UPDATE_WRITES``
    and ``UPDATE_FOR`` are both spent. The ttl is restarted on every write."""
    give_up_at = now() + UPDATE_FOR
    for attempt in itertools.count():
        if attempt >= UPDATE_WRITES and now() >= give_up_at:
            break
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
        f"the line of key {key!r} changed under each of {attempt} writes in a row for "
        f"{UPDATE_FOR:g} s; that many writers on one key at once is more than a line is "
        "built for",
        key=key,
    )


# -- the two faces -----------------------------------------------------------------------------

_rng = random.Random()

P = ParamSpec("P")


def faces(
    name: str, build: Callable[Concatenate[Lines, P], Flow[R]]
) -> tuple[Callable[Concatenate[Lines, P], R], Callable[Concatenate[Lines, P], Awaitable[R]]]:
    """The blocking and the asyncio method of one step of ``Lines``, from the one method
    that builds its flow: both faces run the same flow, so neither can drift from the
    other (the shape of tenacity's one state machine and two loops)."""

    def blocking(self: Lines, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._run(name, build(self, *args, **kwargs))

    async def awaiting(self: Lines, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await run_async(self.cache, build(self, *args, **kwargs))

    # help() and the docs show the step's parameters and what it returns (not its flow).
    shown = inspect.signature(build)
    returns = str(shown.return_annotation).removeprefix("Flow[").removesuffix("]")
    named: tuple[tuple[Any, str], ...] = ((blocking, name), (awaiting, f"{name}_async"))
    for face, face_name in named:
        functools.update_wrapper(face, build)
        del face.__wrapped__
        face.__signature__ = shown.replace(return_annotation=returns)
        face.__name__, face.__qualname__ = face_name, f"Lines.{face_name}"
    awaiting.__doc__ = f"``{name}`` for asyncio."
    return blocking, awaiting


os.register_at_fork(after_in_child=_rng.seed)  # forked workers must not back off in step

DEFAULT_PARK_FOR = 86_400.0


def line_prefix(lock_prefix: str = "mutex.") -> str:
    """Where the lines beside the locks under ``lock_prefix`` stand: ``line.`` before it
    (``line.mutex.<key>``), for every task queue, so one reader (``simple-mutex list``,
    ``celery mutex``, the timeline) finds them all."""
    return "line." + check_prefix(lock_prefix)


class Lines:
    """The lines of one cache beside the locks under ``lock_prefix``, under ``prefix``
    (``line_prefix(lock_prefix)`` unless given), keys encoded as the locks' are, so no
    key escapes its prefix. Every step is a pair: ``x`` blocks, ``x_async`` awaits, both
    running the same flow.

    ``park_for`` (how long a parked message may wait) plus ``lease`` (the locks') is
    each record's ttl, restarted on every write: a line nobody uses expires with its last
    parked message."""

    def __init__(
        self,
        cache: Any,
        *,
        lease: Duration,
        park_for: Duration = DEFAULT_PARK_FOR,
        prefix: str | None = None,
        lock_prefix: str = "mutex.",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cache: AnyCache = as_cache(cache)
        self.lease = positive_seconds(lease, "lease")
        self.park_for = positive_seconds(park_for, "park_for")
        self.lock_prefix = check_prefix(lock_prefix)
        self.prefix = line_prefix(lock_prefix) if prefix is None else check_prefix(prefix)
        if self.prefix == self.lock_prefix:
            raise bad_input(prefix, str, "a line's prefix must differ from its locks'")
        index_prefix(self.cache, self.prefix)  # so a sweep and `list` find the lines cheaply
        self.clock = clock
        self._aio = is_async(self.cache)

    def unkept(self) -> str | None:
        """Why the calls parked in these lines would not outlive a restart of their cache
        (acknowledged to their broker once parked, they live only here), or None: a Redis
        that keeps no data (no ``save`` schedule, ``appendonly no``) loses them all when
        it restarts, one with snapshots only those parked since the last. A cache that
        cannot tell (CONFIG denied, or no such probe) is trusted; one out of reach is for
        the first write to report."""
        probe = getattr(self.cache, "persistence", None)
        if probe is None or self._aio:  # an asyncio cache's probe is for its own loop
            return None
        try:
            kept = probe()
        except MalfunctionError:
            return None
        name = getattr(self.cache, "name", "lock")
        if kept == "none":
            lost = (
                f"the {name} cache of these lines keeps no data across a restart (no save "
                "schedule, appendonly no): calls parked in them are lost if it restarts"
            )
        elif kept == "snapshots":
            lost = (
                f"the {name} cache of these lines keeps its data only as of its last "
                "snapshot (appendonly no): a crash loses the calls parked in them since"
            )
        else:
            return None
        return (
            f"{lost} (on_busy='queue', 'latest', 'debounce'). Turn on appendonly yes, or "
            "keep the locks and lines in PostgreSQL"
        )

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

    # Each step: the flow its change makes, and its two faces (``faces``).

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
        """The line of ``key`` as it is now (None: no line)."""
        cache_key = self.cache_key(key)
        name = getattr(self.cache, "name", type(self.cache).__name__)
        entry: Entry | None = yield Get(cache_key)
        return None if entry is None else decode(entry.value, key, name)

    read, read_async = faces("read", _read)

    def _take(
        self,
        key: str,
        *,
        queue_max: int | None = None,
        after: float = 0.0,
        copy_for: Callable[[Ticket], Message] | None = None,
    ) -> Flow[Ticket]:
        """A send's ticket; raises LineFullError when ``queue_max`` are waiting. With
        ``copy_for``, the line keeps the call's copy (``decisions.take``)."""
        return self._flow(
            key,
            lambda line, _: decisions.take(
                line, self.clock(), queue_max=queue_max, after=after, copy_for=copy_for
            ),
        )

    take, take_async = faces("take", _take)

    def _send(
        self,
        key: str,
        message_for: Callable[[Ticket], Message],
        *,
        queue_max: int | None = None,
        keep_copy: bool = False,
    ) -> Flow[tuple[Ticket, bool]]:
        """A send's ticket, its message parked at once when a ticket is ahead of it
        (True: parked, publish nothing; False: publish it now, and with ``keep_copy`` the
        line keeps a copy to send again if it never comes). See ``decisions.send``."""
        return self._flow(
            key,
            lambda line, _: decisions.send(
                line, self.clock(), message_for, queue_max=queue_max, keep_copy=keep_copy
            ),
        )

    send, send_async = faces("send", _send)

    def _send_collapsed(
        self,
        key: str,
        message_for: Callable[[Ticket], Message],
        collapse: Collapse,
        *,
        queue_max: int | None = None,
    ) -> Flow[tuple[Ticket, bool, tuple[Superseded, ...]]]:
        """A send of keep latest or debounce: it takes the waiting call's place, or
        parks (or, for ``Latest`` with nobody ahead, is to be published: False); the
        calls it superseded come back. See ``send_collapsed()``."""
        return self._flow(
            key,
            lambda line, _: decisions.send_collapsed(
                line, self.clock(), message_for, collapse, queue_max=queue_max
            ),
        )

    send_collapsed, send_collapsed_async = faces("send_collapsed", _send_collapsed)

    def _arrive(
        self,
        key: str,
        ticket: Ticket,
        message: Message,
        *,
        collapse: Collapse = None,
        attempt: int | None = None,
    ) -> Flow[Arrival]:
        """What to do with ``ticket``'s message; a ``Park`` is written before this
        returns (acknowledge the message only after)."""
        return self._flow(
            key,
            lambda line, free: decisions.arrival(
                line,
                ticket,
                message,
                self.clock(),
                lock_free=free,
                collapse=collapse,
                attempt=attempt,
            ),
            with_lock=True,
        )

    arrive, arrive_async = faces("arrive", _arrive)

    def _start(
        self,
        key: str,
        ticket: Ticket,
        *,
        redelivers: bool = False,
        collapse: Collapse = None,
        message: Message = None,
        attempt: int | None = None,
    ) -> Flow[Arrival]:
        """Mark ``ticket`` running (call it holding the lock); see ``start()``."""
        return self._flow(
            key,
            lambda line, _: decisions.start(
                line,
                ticket,
                self.clock(),
                redelivers=redelivers,
                collapse=collapse,
                message=message,
                attempt=attempt,
            ),
        )

    start, start_async = faces("start", _start)

    def _end(self, key: str, ticket: Ticket) -> Flow[Publish | None]:
        """``ticket`` ended: the message to publish once the lock is released, if any."""
        return self._flow(key, lambda line, _: decisions.end(line, ticket, self.clock()))

    end, end_async = faces("end", _end)

    def _over(
        self, key: str, ticket: Ticket, *, again_after: float | None, attempt: int | None = None
    ) -> Flow[Publish | None]:
        """A run of ``ticket`` is over. ``again_after`` set: it will run again (its task
        queue's own retry, due in that many seconds) and keeps its turn (``retry``, of
        ``attempt``); None: it ended (``end``: the message to publish once the lock is
        released, if any)."""
        if again_after is None:
            return (yield from self._end(key, ticket))
        yield from self._retry(key, ticket, after=again_after, attempt=attempt)
        return None

    over, over_async = faces("over", _over)

    def _retry(
        self, key: str, ticket: Ticket, *, after: float = 0.0, attempt: int | None = None
    ) -> Flow[None]:
        """The task retries itself: its ticket keeps the turn (see ``decisions.retry``)."""
        return self._flow(
            key,
            lambda line, _: (
                decisions.retry(line, ticket, self.clock(), after=after, attempt=attempt),
                None,
            ),
        )

    retry, retry_async = faces("retry", _retry)

    def _revoke(self, key: str, ticket: Ticket) -> Flow[Publish | None]:
        """``ticket`` will never run: the message to publish next, if its turn passed on."""
        return self._flow(key, lambda line, _: decisions.revoke(line, ticket, self.clock()))

    revoke, revoke_async = faces("revoke", _revoke)

    def _step_over(
        self, key: str, ticket: int, *, accepts: Callable[[Message], bool] | None = None
    ) -> Flow[SteppedOver]:
        """An operator steps over ``ticket`` of ``key``'s line (``decisions.step_over``):
        it never runs; the next head waits for a worker's sweep to publish it.
        ``accepts``: whether the call found there is the one the operator was shown."""
        return self._flow(key, lambda line, _: decisions.step_over(line, ticket, accepts))

    step_over, step_over_async = faces("step_over", _step_over)

    def _sweep(self, key: str, *, promote_grace: float, gap_for: float) -> Flow[Swept]:
        """One sweep of ``key``'s line: what to publish, what was skipped or expired."""

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

    sweep, sweep_async = faces("sweep", _sweep)
