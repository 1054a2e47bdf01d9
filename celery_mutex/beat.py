"""A beat guard: run several ``celery beat`` processes, and each periodic tick goes out once.

::

    app.conf.beat_scheduler = "celery_mutex.beat:MutexScheduler"
    app.conf.mutex_cache = "redis://127.0.0.1:6379/0"      # or app.conf.mutex_beat_cache

Every beat stays active. Before sending an entry, a beat computes the entry's **slot**, the
same in every beat process whatever its start time, and claims ``"<entry name>@<slot>"``
in the shared cache with one put-if-absent (``Mutex.try_acquire``, never released: it
lapses after ``max(3 periods, 10 s)``). Only the winner sends, stamping the slot into the
``mutex_beat_slot`` header, so a ``MutexTask`` on the worker drops a second copy of a tick.

Slots (``celery_mutex.slots`` has the rules): ``crontab``, its most recent due minute in
its own time zone, DST changes included (written in UTC); an interval, the period
containing now counted from the Unix epoch (``MutexScheduler`` also fires intervals on
those boundaries, so no beat drifts over a slot edge); ``solar``, the observer's solar day
of the most recent event; custom schedules, the due time they report. A beat's clock
decides its slots, so skew between hosts below the claim's lifetime only delays the
beats that are behind. ``MutexSchedulerMixin`` guards other
schedulers (``class S(MutexSchedulerMixin, DatabaseScheduler)``); there intervals fire
when *they* say, so only crontab ticks are exact.

A slot goes out at most once; exactly once unless the winner dies between its claim and
its publish. An unreachable cache sends nothing (``SchedulingError``: fails closed).
Settings: ``mutex_beat_cache`` (default ``mutex_cache``), ``mutex_prefix`` (claims live
under ``beat.<prefix>``), ``mutex_beat_run_ttl`` (worker side: ``drop_duplicate_tick``).
The Celery guide's "Several beats, each tick once" says more.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from typing import Any

from simple_mutex import (
    ConstraintValueError,
    Mutex,
    SimpleMutexAcquireTimeoutError,
    SimpleMutexError,
)
from simple_mutex.busy import positive_seconds, shared_cache, skip_marker

from ._celery import Signal
from ._owned import OwnedLocks, owner_of
from .config import beside

# isort: split
from celery.beat import (  # type: ignore[import-untyped]
    PersistentScheduler,
    SchedulingError,
    event_t,
)
from celery.schedules import schedule as interval_schedule  # type: ignore[import-untyped]

from .slots import BEAT_SLOT, cron_slot, tick_slot

log = logging.getLogger("celery_mutex")

mutex_beat_skipped = Signal(name="mutex_beat_skipped")
"""Sent when a tick is not sent (``sender`` the scheduler, ``reason="claimed"``) or not
run (``sender`` the task, ``reason`` "duplicate" or "redelivered"); also ``entry``: the
entry name (beat side) or ``"<entry>@<slot>"`` (worker side). Count it for metrics."""

HEADER = BEAT_SLOT
"""The message header the winning beat stamps: ``"<entry name>@<slot>"``. A ``MutexTask``
body reads it as ``self.request.mutex_beat_slot`` (``bind=True``; None when the call did
not come from a guarded beat)."""

RUN_TTL = 7200.0  # worker-side record of a started tick (mutex_beat_run_ttl)
_WAKE_LATE = 0.015  # wake just past a boundary (Celery's tick wakes 10 ms early)


def _is_interval(schedule: Any) -> bool:
    return isinstance(schedule, interval_schedule)


# -- the scheduler guard ------------------------------------------------------------------


class MutexSchedulerMixin:
    """Adds the per-tick guard to a ``celery.beat.Scheduler`` subclass (put it first)."""

    app: Any

    def _mutex_beat_cache(self) -> tuple[Any, str]:
        """The claim cache (one per process: a forked beat builds its own) and prefix."""
        conf = self.app.conf
        cache = conf.get("mutex_beat_cache") or conf.get("mutex_cache")
        if cache is None:
            raise ConstraintValueError(
                "celery_mutex.beat: no cache for beat claims; set app.conf.mutex_cache or "
                "app.conf.mutex_beat_cache (e.g. 'redis://host:6379/0'), shared by every beat"
            )
        return shared_cache(cache), beside("beat.", conf.get("mutex_prefix") or "mutex.")

    def setup_schedule(self) -> None:
        self._mutex_beat_cache()  # no cache configured: fail as beat starts, not at each tick
        super().setup_schedule()  # type: ignore[misc]

    def mutex_claim(self, entry: Any, now: float | None = None) -> str | None:
        """Claim ``entry``'s current slot: ``"<entry>@<slot>"`` if this beat won, else None."""
        cache, prefix = self._mutex_beat_cache()
        when = time.time() if now is None else now
        slot, lease = tick_slot(entry.schedule, when, getattr(entry, "last_run_at", None))
        tick = f"{entry.name}@{slot}"
        claim = Mutex(cache, lease=lease, prefix=prefix, label="beat", name="beat")
        return tick if claim.try_acquire(tick) is not None else None

    # The schedule store (a shelve, django-celery-beat's table, redbeat's hash) says when
    # an entry last ran, and operators alert on it. So only the beat that sends a tick
    # records it, and only once it is sent: Celery moves an entry on (``reserve``) before
    # sending it, and a beat that lost the claim, or died between its claim and its
    # publish, would otherwise have saved a run nobody sent. ``reserve`` claims and moves
    # this beat's own copy on (so it does not send again at once), recording nothing;
    # ``apply_async`` records the run (the scheduler's own ``reserve``) after the send.

    def reserve(self, entry: Any) -> Any:
        claims = self.__dict__.setdefault("_mutex_claims", {})
        moved = _moved_on(entry)
        try:
            claims[entry.name] = (self.mutex_claim(entry), moved)
        except SimpleMutexError as exc:  # a cache fault: apply_async fails closed
            claims[entry.name] = (exc, moved)
        return moved

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **kw: Any) -> Any:
        if advance:  # as Celery does: move on first (here: claim), never send twice
            self.reserve(entry)
        claims = self.__dict__.setdefault("_mutex_claims", {})
        tick: str | Exception | None
        moved = None
        try:
            if entry.name in claims:
                tick, moved = claims.pop(entry.name)
            else:
                tick = self.mutex_claim(entry)
        except SimpleMutexError as exc:
            tick = exc
        if isinstance(tick, Exception):  # a cache fault: fail closed, nothing sent
            raise SchedulingError(f"Couldn't claim scheduled task {entry.name}: {tick!r}") from tick
        if tick is None:
            log.info("beat: %s already sent by another beat for this slot", entry.name)
            mutex_beat_skipped.send(sender=self, entry=entry.name, reason="claimed")
            return None
        options = dict(entry.options or {})
        options["headers"] = {**(options.get("headers") or {}), HEADER: tick}
        stamped = _copy(entry)  # the stamp is per send
        stamped.options = options
        log.info("beat: %s claimed %s", entry.name, tick)
        sent = super().apply_async(stamped, producer, advance=False, **kw)  # type: ignore[misc]
        _counted_from_the_store(entry)
        recorded = super().reserve(entry)  # type: ignore[misc]  # sent: the store says it ran
        if moved is not None:  # the copy this beat's heap holds counts that run too
            moved.total_run_count = getattr(recorded, "total_run_count", moved.total_run_count)
        return sent


def _counted_from_the_store(entry: Any) -> None:
    """django-celery-beat counts runs on its in-memory model and saves that count: with
    several beats sharing the table, each beat's copy counts only its own sends, and its
    save would overwrite the others'. Read the stored count first (one row), so the
    record adds this run to all of them. (redbeat reads its entries from Redis each
    tick; a shelve is each beat's own.)"""
    model = getattr(entry, "model", None)
    refresh = getattr(model, "refresh_from_db", None)
    if not callable(refresh):
        return
    from django.db import DatabaseError  # type: ignore[import-untyped, unused-ignore]

    try:
        refresh(fields=["total_run_count"])
    except DatabaseError as exc:  # the send is done; a stale count is the lesser harm
        log.warning("beat: %s: could not read its run count: %r", entry.name, exc)


def _copy(entry: Any) -> Any:
    """A shallow copy that runs no constructor (django-celery-beat's takes a model)."""
    copied = entry.__class__.__new__(entry.__class__)
    copied.__dict__.update(entry.__dict__)
    return copied


def _moved_on(entry: Any) -> Any:
    """A copy of ``entry`` for this beat's own heap, its ``last_run_at`` now (so it is
    not due again at once), nothing written anywhere (django-celery-beat's ``next``
    changes its model, redbeat's writes to Redis). Its run count moves only when a run
    is recorded: the store's next record counts from the heap's copy."""
    moved = _copy(entry)
    now = getattr(entry, "default_now", None) or entry._default_now
    moved.last_run_at = now()
    return moved


class MutexScheduler(MutexSchedulerMixin, PersistentScheduler):  # type: ignore[misc]
    """Celery's default ``PersistentScheduler`` with the per-tick guard, firing interval
    entries on epoch-aligned boundaries so every beat sends in the same slot."""

    def is_due(self, entry: Any) -> tuple[bool, float]:
        schedule = entry.schedule
        period = schedule.run_every.total_seconds() if _is_interval(schedule) else 0.0
        if period <= 0:
            result: tuple[bool, float] = super().is_due(entry)
            return result
        now = time.time()
        last = schedule.maybe_make_aware(entry.last_run_at).timestamp()
        due_at = (math.floor(last / period) + 1) * period
        if now < due_at:
            return False, due_at - now + _WAKE_LATE
        return True, (math.floor(now / period) + 1) * period - now + _WAKE_LATE

    def populate_heap(self, event_t: Any = event_t, heapify: Any = heapq.heapify) -> None:
        # Celery's, but through self.is_due, so the first send is on a boundary too.
        self._heap = []
        for entry in self.schedule.values():
            try:
                is_due, delay = self.is_due(entry)
            except Exception:
                is_due, delay = self._is_due_failed(entry)
            self._heap.append(event_t(self._when(entry, 0 if is_due else delay) or 0, 5, entry))
        heapify(self._heap)


# -- the worker side ----------------------------------------------------------------------


def drop_duplicate_tick(
    task: Any, cache: Any, prefix: str, task_id: str, *, line_decides: bool = False
) -> dict[str, Any] | None:
    """Called by ``MutexTask.before_start`` for a message stamped by a guarded beat.

    Records ``"<entry>@<slot>"`` as started, owned by the task id, for
    ``app.conf.mutex_beat_run_ttl`` seconds (default 7200; never released). A second
    message of the same tick (another task id: a duplicate publish) or the same message
    delivered again (same task id and attempt: a redelivery after a visibility timeout or
    a worker crash with ``acks_late``) is dropped: the skip marker is returned, with
    ``reason``. A retry of the tick itself (``Task.retry``, a busy retry) carries a higher
    attempt and goes on. A tick whose worker died is thus not re-run while the record
    lives; set ``mutex_beat_run_ttl`` below your broker's redelivery delay to re-run it.

    ``line_decides``: the message carries its place in the key's line (an ``on_busy``
    that parks, ``celery_mutex.line``). The same task id then goes on: it is either the
    tick that parked here and is sent again in its turn, or a redelivery, which the line
    judges by its ticket as it does any call's. Only a copy with another task id is
    dropped here.
    """
    request = task.request
    tick = str(getattr(request, HEADER))
    ttl = positive_seconds(
        task._get_app().conf.get("mutex_beat_run_ttl") or RUN_TTL, "mutex_beat_run_ttl"
    )
    attempt = int(request.retries or 0) + int(getattr(request, "mutex_busy_retries", None) or 0)
    runs = OwnedLocks(Mutex(cache, lease=ttl, prefix=beside("ticks.", prefix), name="beat run"))
    try:
        runs.acquire(
            tick,
            owner=owner_of(task_id),
            attempt=attempt,
            timeout=0,
            renew=False,
            label=f"{task.name}[{task_id}]",
            retry_takes_over=True,  # the record says "started"; it guards no work
        )
    except SimpleMutexAcquireTimeoutError:
        holder = runs.holder_label(tick)
        same = holder is not None and holder.endswith(f"[{task_id}]")
        if same and line_decides:
            return None
        reason = "redelivered" if same else "duplicate"
        log.warning(
            "dropped %s[%s]: beat tick %s already started by %s (%s)",
            task.name,
            task_id,
            tick,
            holder,
            reason,
        )
        mutex_beat_skipped.send(sender=task, entry=tick, reason=reason)
        return skip_marker("celery_mutex", tick, holder=holder, reason=reason)
    return None


__all__ = [
    "HEADER",
    "MutexScheduler",
    "MutexSchedulerMixin",
    "cron_slot",
    "drop_duplicate_tick",
    "mutex_beat_skipped",
    "tick_slot",
]
