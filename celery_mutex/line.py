"""``on_busy="queue"`` for Celery: a task whose turn has not come is parked in its key's
line (``simple_mutex.busy.line``, ``docs/design/queue.md``) and re-published when it
comes, so tasks of one key run one at a time, in send order, and none holds a slot.

The steps, and where Celery takes them::

    apply_async     take a ticket (the send's place in the line) -> the message's header
    before_start    arrive: Duplicate (drop) | Park (write, then Ignore: the slot is free)
                    | Run (take the lock, mark running, run the body)
    the body ends   end: the turn moves on (one write), then the lock is released, then
                    the next parked message is published (publish-then-forget)
    Task.retry      the ticket keeps its turn; the retry's message carries it
    revoke          a revoked ticket is stepped over (or ended, when it ran)
    a dead child    the worker's parent ends its turn (unless its broker redelivers it)
    every worker    a sweep thread, every ``sweep_every``: publishes a head nobody ran,
                    ends a dead holder's turn, steps over a ticket that never arrived

A parked message is the call as JSON (name, id, arguments, the options that route it):
the same task id runs when it is published again, so its ``AsyncResult`` resolves then.
A call that arrives with no ticket (``send_task``, a beat's send) takes its place when it
arrives. Synchronous calls (``apply()``, ``task_always_eager``, direct calls) have no
line: they wait for the lock, as ``on_busy="wait"`` does.

``on_busy="latest"`` and ``"debounce"`` are the same line holding one waiting
call per key (``simple_mutex.busy.line.collapse``): a newer call takes its place, and the
call it replaced resolves at once, its result the skip marker with ``reason`` superseded
and ``by`` the task id of the call that took its place (``resolve``). A debounced call
waits parked until it is due; a worker's sweep publishes it then.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from simple_mutex import Lease, MalfunctionError
from simple_mutex.busy import skip_marker
from simple_mutex.busy.line import (
    Collapse,
    Lines,
    Publish,
    Superseded,
    Ticket,
    collapse_for,
    driver,
    ticket_of,
)
from simple_mutex.busy.policy import IN_LINE, QueuePolicy, unreachable
from simple_mutex.busy.port import Published
from simple_mutex.errors import ConstraintTypeError, ConstraintValueError, LineFullError

from . import call_state, per_call, signals
from ._celery import (
    DisabledBackend,
    EagerResult,
    Ignore,
    Reject,
    Retry,
    SoftTimeLimitExceeded,
    TimeLimitExceeded,
    states,
    uuid,
)
from .config import Config, config_of
from .slots import BEAT_SLOT

log = logging.getLogger("celery_mutex")

HEADER = "mutex_line"  # {"epoch", "number"}: the call's ticket; a worker makes it an attribute


def _found(request: Any, name: str) -> Any:
    """Header ``name`` of a request: an attribute (a worker's task context), in
    ``headers`` (apply(), a retry's options) or in ``request_dict`` (a worker's Request);
    or of apply_async's options (a dict)."""
    if isinstance(request, Mapping):
        return (request.get("headers") or {}).get(name)
    for found in (
        getattr(request, name, None),
        (getattr(request, "headers", None) or {}).get(name),
        (getattr(request, "request_dict", None) or {}).get(name),
    ):
        if found is not None:
            return found
    return None


def ticket_from(request: Any) -> Ticket | None:
    """The ticket a request carries; a mangled one is refused (the call then takes a
    place as it arrives), never taken for a place in the line."""
    found = _found(request, HEADER)
    if not isinstance(found, Mapping):
        return None
    try:
        return ticket_of(found.get("epoch"), found.get("number"))
    except (TypeError, ValueError) as bad:
        log.warning("a %s header was refused: %s", HEADER, bad)
        return None


def _call_of(options: Mapping[str, Any]) -> dict[str, Any]:
    """The per-call options apply_async put in the headers it sends."""
    found = _found(options, per_call.HEADER)
    return dict(found) if isinstance(found, Mapping) else {}


def _header(ticket: Ticket) -> dict[str, Any]:
    return {"epoch": ticket.epoch, "number": ticket.number}


def _configured_on_busy(task: Any) -> Any:
    """The task's own on_busy, read without building its configuration (a producer that
    sends MutexTasks need not configure a lock cache unless they queue)."""
    for source in (
        task._mutex_spec.options if task._mutex_spec is not None else {},
        {"on_busy": task._get_app().conf.get("mutex_on_busy")},
        task.mutex_defaults(),
    ):
        if source.get("on_busy") is not None:
            return source["on_busy"]
    return None


def queues(task: Any, call: Mapping[str, Any]) -> bool:
    """Whether this call of ``task`` goes through the line (queue, latest, debounce)."""
    own = _configured_on_busy(task)
    wanted = call.get("on_busy", own)
    if wanted not in IN_LINE:
        return False
    if own != wanted:
        raise ConstraintValueError(
            f"{task.name}: apply_async(mutex={{'on_busy': {wanted!r}}}) needs the task's "
            f"own on_busy={wanted!r} (workers sweep the lines of such tasks only, and a "
            f"line keeps one discipline); set it on the task's mutex={{...}}"
        )
    return True


def collapse_of(cfg: Config) -> Collapse:
    """How the task's line collapses: ``Latest``, ``Debounce``, or None (the queue)."""
    return collapse_for(cfg.policy)


def _json_checked(task: Any, args: Any, kwargs: Any) -> None:
    try:
        json.dumps([list(args or ()), dict(kwargs or {})])
    except (TypeError, ValueError) as bad:
        raise ConstraintTypeError(
            f"{task.name}: on_busy='queue' keeps a parked call as JSON, and these "
            f"arguments are not JSON ({bad}); pass JSON values (ids, not objects)"
        ) from None


def _delay(countdown: Any, eta: Any) -> float:
    """Seconds until a send with this countdown or ETA is due (0: now)."""
    if isinstance(countdown, int | float) and not isinstance(countdown, bool):
        return max(0.0, float(countdown))
    if isinstance(eta, dt.datetime):
        now = dt.datetime.now(eta.tzinfo or dt.timezone.utc)
        if eta.tzinfo is None:
            eta = eta.replace(tzinfo=dt.timezone.utc)
        return max(0.0, float((eta - now).total_seconds()))
    return 0.0


def at_send(task: Any, args: Any, kwargs: Any, options: dict[str, Any]) -> Any:
    """Before ``apply_async`` sends: take the call's ticket into its headers. Returns
    None to send, or the result to answer instead (a full line with ``on_full="skip"``).
    Raises LineFullError for a full line with ``on_full="raise"``."""
    headers = options.get("headers") or {}
    call = _call_of(options)
    if HEADER in headers or task._get_app().conf.task_always_eager or not queues(task, call):
        return None  # a re-publish or a retry keeps its ticket; eager calls have no line
    _json_checked(task, args, kwargs)
    _expires_from_now(options)
    cfg = config_of(task)
    key = per_call.key_of(task, args, kwargs, call)
    after = _delay(options.get("countdown"), options.get("eta"))
    left = _until_expiry(options)
    if left is not None:
        # The gap clock of a call that expires runs out at its expiry at the latest: a
        # broker with message TTLs (RabbitMQ) drops it unseen then, and the calls behind
        # it would otherwise wait gap_for for a message that cannot come.
        after = min(after, left - cfg.policy.queue.gap_for)
    collapse = collapse_of(cfg)
    try:
        if _parks_at_send(options):
            # Behind a ticket ahead, the call goes into the line at once, not through
            # the broker: a burst for one key costs no delivery per parked call.
            task_id = options.get("task_id") or uuid()

            def message_for(ticket: Ticket) -> dict[str, Any]:
                return _sent_message(task, task_id, args, kwargs, options, ticket)

            gone: tuple[Superseded, ...] = ()
            if collapse is None:
                # A call sent straight to the broker leaves a copy in the line: should
                # its message be slow or lost, the line sends that copy in its place.
                ticket, parked = cfg.lines.send(
                    key, message_for, queue_max=cfg.policy.queue.max, keep_copy=True
                )
            else:
                ticket, parked, gone = cfg.lines.send_collapsed(
                    key, message_for, collapse, queue_max=cfg.policy.queue.max
                )
            resolve(task, key, gone)
            if parked:
                signals.mutex_parked.send(
                    sender=task, task_id=task_id, key=key, ticket=ticket.number
                )
                config_of(task).lines.event("parked", key, task.name, ticket.number)
                return task.AsyncResult(task_id)
            options["task_id"] = task_id
        else:
            # A countdown, an ETA, a link or a place in a canvas: the call goes through
            # the broker, and the line keeps its copy (when its options travel as JSON)
            # to send in its place should it not come gap_for after it is due.
            copy_for = None
            carried = _carried_by_copy(options) if collapse is None else None
            if carried is not None:
                task_id = options.get("task_id") or uuid()
                options["task_id"] = task_id

                def copy_for(ticket: Ticket) -> dict[str, Any]:
                    return _sent_message(
                        task, task_id, args, kwargs, options, ticket, carried=carried
                    )

            ticket = cfg.lines.take(
                key, queue_max=cfg.policy.queue.max, after=after, copy_for=copy_for
            )
    except LineFullError:
        if cfg.policy.queue.on_full == "raise":
            raise
        log.info("%s: not sent: the line of %r is full", task.name, key)
        marker = skip_marker("celery_mutex", key, holder=None)
        return EagerResult(options.get("task_id") or uuid(), marker, states.SUCCESS)
    options["headers"] = {**headers, HEADER: _header(ticket)}
    return None


# The apply_async options a call parked at its send keeps for its publish; a send with any
# other (a countdown, an ETA, a link, a place in a canvas) goes through the broker and
# parks, if it must, when it arrives.
_KEPT_AT_SEND = frozenset(
    {"queue", "exchange", "routing_key", "priority", "expires", "time_limit",
     "soft_time_limit", "shadow", "ignore_result", "retries"}
)  # fmt: skip


def _expires_from_now(options: dict[str, Any]) -> None:
    """A relative ``expires`` (seconds) as the moment it means, counted from this send: a
    call parked at its send is published when its turn comes, and Celery would count
    the seconds again from that publish (a call given ``expires=2`` ran 3 s after it
    expired)."""
    expires = options.get("expires")
    if isinstance(expires, int | float) and not isinstance(expires, bool):
        at = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=expires)
        options["expires"] = at.isoformat()


def _until_expiry(options: Mapping[str, Any]) -> float | None:
    """Seconds until ``options``' ``expires`` (an ISO moment with its zone: what a send
    or a worker's request carries; negative once past); None without one. A moment
    without a zone is left to the worker, which reads it in its own."""
    expires = options.get("expires")
    if not isinstance(expires, str):
        return None
    try:
        at = dt.datetime.fromisoformat(expires)
    except ValueError:
        return None
    if at.tzinfo is None:
        return None
    return (at - dt.datetime.now(dt.timezone.utc)).total_seconds()


def expired(message: Mapping[str, Any]) -> bool:
    """Whether a parked call's ``expires`` has passed (``_until_expiry``)."""
    left = _until_expiry(message.get("options") or {})
    return left is not None and left <= 0


def _parks_at_send(options: Mapping[str, Any]) -> bool:
    given = {name for name, value in options.items() if value is not None}
    return given <= _KEPT_AT_SEND | {"task_id", "headers"} and _is_json(
        {name: options[name] for name in given - {"task_id"}}
    )


# The apply_async options a copy does not carry: when it is sent (gap_for after the call
# was due) it goes at once; the rest are how a send is made, or given to send_task anew.
_NOT_IN_A_COPY = frozenset(
    {"countdown", "eta", "task_id", "headers", "producer", "connection", "router",
     "result_cls", "publisher", "add_to_parent", "task_type"}
)  # fmt: skip


def _carried_by_copy(options: Mapping[str, Any]) -> dict[str, Any] | None:
    """The options a copy of this send carries (a link, a chain, a chord, a group id,
    routing), or None when one of them does not travel as JSON: such a call keeps no
    copy, and its gap is judged as before copies."""
    carried = {
        name: value
        for name, value in options.items()
        if name not in _NOT_IN_A_COPY and value is not None
    }
    return carried if _is_json(carried) else None


def _sent_message(
    task: Any,
    task_id: str,
    args: Any,
    kwargs: Any,
    options: Mapping[str, Any],
    ticket: Ticket,
    *,
    carried: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The call as the line keeps it: parked at its send (the options ``_KEPT_AT_SEND``),
    or as its copy (the options ``carried``)."""
    if carried is None:
        carried = {n: v for n, v in options.items() if n in _KEPT_AT_SEND and v is not None}
    return {
        "task": task.name,
        "id": task_id,
        "args": list(args or ()),
        "kwargs": dict(kwargs or {}),
        "options": dict(carried),
        "headers": {**(options.get("headers") or {}), HEADER: _header(ticket)},
    }


def sending(task: Any, send: Callable[..., Any]) -> Callable[..., Any]:
    """``send`` (apply_async's), the call's ticket taken first (``at_send``) and given
    back when the send fails."""

    def send_in_line(args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        answer = at_send(task, args, kwargs, options)
        if answer is not None:
            return answer  # a full line, on_full="skip"
        try:
            return send(args, kwargs, **options)
        except BaseException:
            unsent(task, args, kwargs, options)
            raise

    return send_in_line


def unsent(task: Any, args: Any, kwargs: Any, options: Mapping[str, Any]) -> None:
    """The send failed after its ticket was taken: the ticket will never arrive."""
    ticket = ticket_from(options)
    if ticket is None:
        return
    cfg = config_of(task)
    key = per_call.key_of(task, args, kwargs, _call_of(options))
    try:
        publish(task, key, cfg.lines.revoke(key, ticket), by="revoke")
    except MalfunctionError as fault:
        log.warning("%s: ticket %s of %r stays until a sweep: %s", task.name, ticket, key, fault)


# -- the message a parked call keeps -----------------------------------------------------------

# What a call's request says about its place in a canvas and how it runs: sent again with
# the message, so a parked link of a chain or member of a group still completes it.
_CARRIED = (
    "root_id",
    "parent_id",
    "group_id",
    "group_index",
    "chord",
    "chain",
    "link",
    "link_error",
    "expires",
    "soft_time_limit",
    "time_limit",
    "retries",
    "reply_to",
    "shadow",
    "replaced_task_nesting",
)


def message_of(task: Any, args: Any, kwargs: Any, ticket: Ticket) -> dict[str, Any]:
    """The call as JSON: enough for ``send_task`` to publish it again, same task id."""
    request = task.request
    executing = request.as_execution_options()
    options = {
        name: executing[name] for name in _CARRIED if executing.get(name) not in (None, [], {})
    }
    delivery = request.delivery_info or {}
    exchange, routing_key = delivery.get("exchange"), delivery.get("routing_key")
    if exchange == "" and routing_key:
        options["queue"] = routing_key  # sent to the default exchange, by queue name
    elif routing_key:
        options.update(exchange=exchange, routing_key=routing_key)
    if delivery.get("priority") is not None:
        options["priority"] = delivery["priority"]
    headers: dict[str, Any] = {HEADER: _header(ticket)}
    call = per_call.of_request(request)
    if call:
        headers[per_call.HEADER] = call
    slot = getattr(request, BEAT_SLOT, None)  # set by before_start
    if slot is not None:  # a beat's tick buffered in the line is still that tick
        headers[BEAT_SLOT] = slot
    message = {
        "task": task.name,
        "id": request.id,
        "args": list(args or ()),
        "kwargs": dict(kwargs or {}),
        "options": options,
        "headers": headers,
    }
    try:
        json.dumps(message)
    except (TypeError, ValueError):
        # An option that does not travel as JSON: the call is kept without its canvas
        # options rather than lost (its arguments were checked at the send).
        message["options"] = {k: v for k, v in options.items() if _is_json(v)}
    return message


def _is_json(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


@dataclass(frozen=True)
class TaskPublisher:
    """The port's publisher for one task: a parked call goes out again with
    ``send_task``, same task id, same ticket."""

    task: Any
    log: logging.Logger = log

    @property
    def name(self) -> str:
        return str(self.task.name)

    def publish(self, key: str, what: Publish, *, by: str) -> Published:
        message = what.message
        if expired(message):
            self._end_expired(key, message)
            return "gone"  # the line steps over it, as over a revoked call
        self.task._get_app().send_task(
            message["task"],
            args=message["args"],
            kwargs=message["kwargs"],
            task_id=message["id"],
            headers=message["headers"],
            add_to_parent=False,
            **message["options"],
        )
        log.debug("published %s[%s], ticket %d, by %s", message["task"], message["id"],
                  what.ticket, by)  # fmt: skip
        signals.mutex_promoted.send(
            sender=self.task, task_id=message["id"], key=key, ticket=what.ticket, by=by
        )
        return "sent"

    def _end_expired(self, key: str, message: Mapping[str, Any]) -> None:
        """A call whose ``expires`` passed while it was parked ends as Celery ends an
        expired message (REVOKED, reason "expired"), never run: published, a broker
        with message TTLs (RabbitMQ) would drop it unseen, and the line would wait for
        it. (A call stored nowhere, ``ignore_result``, just ends.)"""
        log.info("%s[%s] expired in the line of %r: revoked", message["task"], message["id"], key)
        # Judged by the parked call's own task: the publisher is the call that ended
        # before it, maybe of another task of the same key (one that ignores its result).
        task = self.task._get_app().tasks.get(message["task"], self.task)
        _store_ending(
            task, message["id"], "expiry", lambda b: b.mark_as_revoked(message["id"], "expired")
        )


def end_stepped_over(app: Any, message: object) -> None:
    """An operator stepped over the call ``message`` (``celery mutex step-over``): it
    will never run, so its result is stored REVOKED, as an expired call's is, and its
    ``AsyncResult`` resolves. A message that names no task of ``app`` is left alone."""
    if not isinstance(message, Mapping) or not isinstance(message.get("id"), str):
        return
    task = app.tasks.get(message.get("task"))
    if task is None:
        return
    task_id = message["id"]
    _store_ending(task, task_id, "step-over",
                  lambda b: b.mark_as_revoked(task_id, "stepped over by an operator"))  # fmt: skip


def _storing(task_id: str, result: object) -> Callable[[Any], object]:
    return lambda backend: backend.store_result(task_id, result, states.SUCCESS)


def _store_ending(task: Any, task_id: str, what: str, store: Callable[[Any], object]) -> None:
    """Store how a call left the line without running (``store(backend)``), so its
    ``AsyncResult`` resolves; nothing when nobody can read its result. A store that
    fails is logged: the call is out of the line either way, and its result waits."""
    if task.ignore_result or isinstance(task.backend, DisabledBackend):
        return
    try:
        store(task.backend)
    except Exception as exc:
        if isinstance(exc, SoftTimeLimitExceeded | TimeLimitExceeded):
            raise  # the caller's own time limit (a send from a task body) goes on up
        log.warning("%s[%s]: storing its %s failed: %r", task.name, task_id, what, exc)


def publish(task: Any, key: str, what: Publish | None, *, by: str) -> None:
    """Send a parked call again, for its turn (same task id, same ticket)."""
    driver.publish(TaskPublisher(task), config_of(task).lines, key, what, by=by)


# -- a worker's arrival ------------------------------------------------------------------------


def redelivers(task: Any) -> bool:
    """Whether the broker delivers this task again if its worker dies mid-run."""
    return bool(task.acks_late and task.reject_on_worker_lost)


def resolve(task: Any, key: str, gone: tuple[Superseded, ...]) -> None:
    """Store the result of each call ``gone`` from the line (a newer call took its
    place), so its ``AsyncResult`` resolves at once. After the line's write: a crash in
    between leaves that result pending, never a call run (nothing of it is left to run)."""
    for call in gone:
        task_id = call.message.get("id") if isinstance(call.message, Mapping) else None
        if task_id is None:
            continue  # nobody can read its result
        newer = call.by_message.get("id") if isinstance(call.by_message, Mapping) else None
        marker = skip_marker("celery_mutex", key, holder=None, reason="superseded", by=newer)
        log.info("%s[%s] superseded in the line of %r by %s", task.name, task_id, key, newer)
        _store_ending(task, task_id, "superseded result", _storing(task_id, marker))


@dataclass(frozen=True, kw_only=True)
class TaskCall(TaskPublisher):
    """The port's call: the delivery ``task.request`` is running."""

    cfg: Config

    @property
    def request(self) -> Any:
        return self.task.request

    @property
    def id(self) -> str:
        return str(self.request.id)

    @property
    def who(self) -> str:
        return f"{self.task.name}[{self.request.id}]"

    @property
    def bounds(self) -> QueuePolicy:
        return self.cfg.policy.queue

    keeps_parked = False  # the line keeps a parked call; the broker's message is acked

    def ticket(self) -> Ticket | None:
        return ticket_from(self.request)

    def take(self, lines: Lines, key: str) -> Ticket:
        return lines.take(key)  # a redelivery of it takes its place again as it arrives

    def message(self, ticket: Ticket) -> dict[str, Any]:
        request = self.request
        return message_of(self.task, request.args or (), request.kwargs or {}, ticket)

    def attempt(self) -> int | None:
        return call_state.attempt_of(self.request)

    def redelivers(self) -> bool:
        return redelivers(self.task)

    def ran_and_failed(self) -> bool:
        return False  # a failed call's turn ends with it: a copy of it is a duplicate

    def resolve(self, key: str, gone: tuple[Superseded, ...]) -> None:
        resolve(self.task, key, gone)

    def parked(self, key: str, ticket: Ticket) -> None:
        call_state.of(self.request).parked = True
        signals.mutex_parked.send(
            sender=self.task, task_id=self.request.id, key=key, ticket=ticket.number
        )

    def started(self, key: str, ticket: Ticket) -> None:
        # Parked and then handed its own turn by the parking's sweep, it runs after all:
        # this delivery is the call's end (its enqueue marker is freed with it).
        call_state.of(self.request).parked = False


def arrive(
    task: Any, cfg: Config, key: str, acquire: Callable[[], Lease]
) -> Lease | dict[str, Any]:
    """The line's answer for this delivery (``task.request``'s): the lease to run under
    (its turn came and the lock was free), the marker to return instead of running (a
    newer call took this one's place: keep latest, debounce), or Ignore raised (parked,
    or a duplicate: the slot is free, the message acknowledged; a parked call is
    published again in its turn)."""
    request = task.request
    match driver.arrive(TaskCall(task, cfg=cfg), cfg.lines, key, collapse_of(cfg), acquire):
        case driver.Turn(lease=lease, ticket=ticket, late=late):
            # Out of order, said so to the body too (the nemesis records it; None when in
            # order): the state's late is the RunLate's why.
            state = call_state.of(request)
            state.late, state.ticket = late, (key, ticket)
            return lease
        case driver.Parking() | driver.Dropped(reason="duplicate"):
            call_state.of(request).parked = True  # the call is not over: keep its marker
            raise Ignore()
        case driver.Dropped(by=newer):
            return skip_marker("celery_mutex", key, holder=None, reason="superseded", by=newer)
        case _ as unknown:
            return unreachable(unknown)


def _sweep_key(task: Any, cfg: Config, key: str) -> None:
    driver.sweep_key(TaskPublisher(task), cfg.lines, key, cfg.policy.queue)


# -- the end of a run ------------------------------------------------------------------------


def ending(task: Any, exc: BaseException | None) -> Callable[[], None]:
    """Before the lock is released: the turn moves on (or, for ``Task.retry``, stays).
    Returns what to do once it is released: publish the next parked call."""
    state = call_state.of(task.request)
    found = state.ticket
    if found is None:
        return _nothing
    state.ticket = None
    key, ticket = found
    lines = config_of(task).lines
    again: float | None = None
    retried: int | None = None  # the attempt whose later copies are duplicates
    if isinstance(exc, Retry):
        again = _delay(exc.when, exc.when)
        retried = call_state.attempt_of(task.request)
    elif isinstance(exc, Reject) and exc.requeue and task.acks_late:
        # Its message goes back to the queue: the call comes again, in its turn, as the
        # same attempt (so no attempt is named: that copy must run).
        again = 0.0
    return driver.end(
        TaskPublisher(task), lines, key, ticket, config_of(task).policy.queue,
        again_after=again, who=task.name, attempt=retried,
    )  # fmt: skip


def _nothing() -> None:
    pass


def end_of_dead(
    task: Any, task_id: str, args: Any, kwargs: Any, context: Any, *, killed: bool
) -> None:
    """The worker's parent freed a dead child's lock: the turn moves on, unless the
    child was killed outright and the broker delivers the call again (its copy then runs
    in the same turn). A time limit or a revoke ends the call: its message is done."""
    if not (killed and redelivers(task)):
        _from_the_parent(task, task_id, args, kwargs, context, "end")


def revoked(task: Any, task_id: str, args: Any, kwargs: Any, context: Any) -> None:
    """A call revoked before it ran: its ticket is stepped over."""
    _from_the_parent(task, task_id, args, kwargs, context, "revoke")


def _from_the_parent(
    task: Any, task_id: str, args: Any, kwargs: Any, context: Any, step: str
) -> None:
    """``Lines.end`` or ``Lines.revoke`` for the ticket a worker's request carries, and
    the publish of the next call; from a signal handler, so it logs and never raises."""
    ticket = ticket_from(context)
    if ticket is None:
        return
    try:
        lines = config_of(task).lines
        key = per_call.key_of(task, args, kwargs, per_call.of_request(context))
        what = lines.end(key, ticket) if step == "end" else lines.revoke(key, ticket)
        publish(task, key, what, by="parent" if step == "end" else "revoke")
    except Exception as exc:  # a signal handler: log, never raise into Celery
        log.warning("%s[%s]: its line moves on at the next sweep: %r", task.name, task_id, exc)
