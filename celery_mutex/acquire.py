"""``before_start``: take the task's lock, or apply ``on_busy`` (``simple_mutex.busy``
decides; this module knows how Celery re-queues and where a request keeps its state)."""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, NoReturn

from simple_mutex import Lease, SimpleMutexAcquireTimeoutError
from simple_mutex.busy import RunAgain, Skip, skip_marker, unreachable

from . import call_state, line, per_call, replace, signals
from ._celery import Retry
from ._owned import owner_of
from .config import Config, config_of
from .slots import BEAT_SLOT

log = logging.getLogger("celery_mutex")

BUSY_HEADER = "mutex_busy_retries"  # busy re-publishes so far; Task.retry's count stays


def before_start(
    task: Any,
    task_id: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    direct: bool = False,
) -> None:
    """Leaves in the call's state (``call_state.of(task.request)``) either ``lease``
    (held, loss interrupt armed for this thread) or ``skipped`` (the marker to return
    instead of running).
    ``direct``: a direct call (``task(...)``), synchronous and never a beat's tick."""
    request = task.request
    synchronous = direct or bool(request.is_eager)
    call = per_call.of_request(request)
    cfg = per_call.applied(config_of(task), call)
    # A worker makes every header a request attribute; apply() and task_always_eager keep
    # them in request.headers. The body reads the tick it belongs to in one place
    # either way (None: not sent by a guarded beat).
    headers = request.headers or {}
    slot = None if direct else getattr(request, BEAT_SLOT, None) or headers.get(BEAT_SLOT)
    request.mutex_beat_slot = slot
    if slot is not None:
        from .beat import drop_duplicate_tick

        space = cfg.locks.space
        in_line = cfg.policy.in_line and line.ticket_from(request) is not None
        dropped = drop_duplicate_tick(
            task, space.cache, space.prefix, task_id, line_decides=in_line
        )
        if dropped is not None:  # this tick already started: run nothing
            reason = f"{dropped.get('reason', 'duplicate')} tick"  # duplicate | redelivered
            _skip(task, dropped, reason=reason, holder=dropped.get("holder"))
            return
    key = per_call.key_of(task, args, kwargs, call)
    started = time.monotonic()
    take = functools.partial(
        cfg.locks.acquire,
        key,
        owner=owner_of(task_id),
        attempt=request.retries or 0,
        timeout=cfg.policy.wait_for(synchronous=synchronous),
        renew=cfg.policy.renew,
        label=f"{task.name}[{task_id}]",
    )
    try:
        if cfg.policy.in_line and not synchronous:
            found = line.arrive(task, cfg, key, take)
            if isinstance(found, dict):  # superseded: a newer call took its place
                _skip(task, found, reason="superseded", holder=None)
                return
            lease = found
        elif cfg.policy.on_busy == "replace" and not synchronous:
            lease = replace.take(task, cfg, key, owner_of(task_id), take)
        else:
            lease = take()
    except replace.NewerCall as newer:  # a retry of a replaced call: the newest one won
        log.info("skipped %s[%s]: %s", task.name, task_id, newer)
        marker = skip_marker("celery_mutex", key, holder=newer.label, reason="superseded")
        _skip(task, marker, reason="superseded", holder=newer.label)
        return
    except SimpleMutexAcquireTimeoutError as busy:
        _busy(task, cfg, key, busy, args, kwargs, synchronous)
        return
    state = call_state.of(request)
    state.lease, state.started = lease, time.monotonic()
    log.debug("acquired %r for %s[%s] (fence %d)", key, task.name, task_id, lease.fence)
    lease.on_lost(functools.partial(_lost, task, task_id, lease))
    if not synchronous:  # a newer on_busy="replace" call may take the key and stop us
        replace.watch(lease)
    waited = state.started - started
    signals.mutex_acquired.send(
        sender=task, task_id=task_id, key=key, fence=lease.fence, waited=waited
    )
    lease.__enter__()  # last: from here a loss interrupts this thread


def _busy(
    task: Any,
    cfg: Config,
    key: str,
    busy: SimpleMutexAcquireTimeoutError,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    synchronous: bool,
) -> None:
    request = task.request
    holder = cfg.locks.holder_label(key)
    policy = cfg.policy.on_busy
    signals.mutex_busy.send(sender=task, task_id=request.id, key=key, policy=policy, holder=holder)
    count = int(getattr(request, BUSY_HEADER, None) or 0)
    try:
        decision = cfg.policy.after_busy(busy, synchronous=synchronous, busy_retries=count)
    except SimpleMutexAcquireTimeoutError:
        log.info("%s[%s] failed: %r is busy (held by %s)", task.name, request.id, key, holder)
        raise
    match decision:
        case Skip():
            log.info("skipped %s[%s]: %r is held by %s", task.name, request.id, key, holder)
            marker = skip_marker("celery_mutex", key, holder=holder)
            _skip(task, marker, reason="busy", holder=holder)
        case RunAgain(delay=delay):
            _run_again(task, key, holder, busy, args, kwargs, count, delay)
        case _ as unknown:
            unreachable(unknown)


def _run_again(
    task: Any,
    key: str,
    holder: str | None,
    busy: SimpleMutexAcquireTimeoutError,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    count: int,
    delay: float,
) -> NoReturn:
    request = task.request
    # Our own re-publish, not Task.retry: ``retries`` stays as it was, so waiting for a
    # busy key never uses up the task's max_retries (nor counts as a new attempt).
    call = per_call.of_request(request)  # a worker keeps it as an attribute, not a header
    headers = {**(request.headers or {}), per_call.HEADER: call, BUSY_HEADER: count + 1}
    sig = task.signature_from_request(
        request, args, kwargs, countdown=delay, retries=request.retries or 0, headers=headers
    )
    sig.apply_async()
    log.info(
        "%s[%s]: %r is busy (held by %s); retry %d in %.2f s",
        task.name,
        request.id,
        key,
        holder,
        count + 1,
        delay,
    )
    raise Retry(exc=busy, when=delay, sig=sig)


SKIPPED_EVENT = "task-mutex-skipped"


def _skip(task: Any, marker: dict[str, Any], *, reason: str, holder: str | None) -> None:
    """Return ``marker`` instead of running, and say so where monitors look: the run
    itself ends SUCCESS, so Flower and event consumers get a ``task-mutex-skipped`` task
    event (fields ``key``, ``reason`` "busy" | "duplicate tick" | "redelivered tick" |
    "superseded" (keep latest, debounce: an arrival a newer call replaced), ``holder``)."""
    request = task.request
    call_state.of(request).skipped = marker
    if request.is_eager or not request.hostname or not getattr(task, "send_events", True):
        return  # no worker: no event stream to send to
    try:
        task.send_event(
            SKIPPED_EVENT, key=marker.get("key"), reason=reason, holder=holder, retry=False
        )
    except Exception as exc:  # a monitoring message must never fail the run
        log.warning("%s[%s]: could not send %s: %r", task.name, request.id, SKIPPED_EVENT, exc)


def _lost(task: Any, task_id: str, lease: Lease) -> None:
    log.error(
        "%s[%s]: lease on %r (fence %d) lost while the task ran; interrupting it",
        task.name,
        task_id,
        lease.key,
        lease.fence,
    )
    signals.mutex_lost.send(sender=task, task_id=task_id, key=lease.key, fence=lease.fence)
