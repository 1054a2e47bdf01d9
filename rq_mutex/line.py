"""``on_busy="queue"`` for RQ: a job whose turn has not come is parked in its key's line
(``simple_mutex.busy.line``; ``docs/design/queue.md``) and its work horse ends at once;
the job is enqueued again, at the back of its queue, when its turn comes::

    enqueue   ``Queue.create_job`` (every enqueue path goes through it; wrapped in
              ``rq_mutex.job``) takes the job's ticket into ``job.meta["rq_mutex_line"]``;
              behind a ticket ahead the job is parked there and then (the wrapped
              ``Queue._enqueue_job`` schedules it instead of pushing it). A full line
              raises LineFullError, or (``on_full="skip"``) marks the job to finish at
              once with the skip marker. A job created scheduled (``enqueue_at`` /
              ``enqueue_in``), with dependencies, or on a synchronous queue was not sent
              to run now: it takes its place when it first reaches a worker.
    arrival   its turn and the lock free: take the lock, mark it running, run the body.
              Not its turn, or the lock busy: park. The line holds ``{"id", "queue"}``
              (written before the horse ends: write-then-ack), and the job returns
              ``rq.Retry(interval=park_for + ...)``, so RQ keeps it SCHEDULED in the
              ScheduledJobRegistry, off every queue, its hash and result handle intact.
              A second copy of a ticket that ran or runs finishes with the skip marker
              (reason "duplicate").
    end       one write passes the turn on, the lock is released, then the next parked
              job is enqueued (at the back of its queue) and taken out of the registry
              (publish-then-forget: a crash in between leaves a duplicate, which the line
              drops, never a loss). RQ's own retries (``retry=Retry(...)`` with retries
              left, or a returned ``rq.Retry``) keep the turn instead.
    sweep     a parking arrival sweeps its key; ``rq_mutex.Worker`` sweeps the lines on
              its connection every ``SWEEP_EVERY`` seconds, between jobs and while idle
              (a head nobody ran is published, a dead horse's turn ends once its lock
              lapsed, a ticket that never arrived is stepped over).

RQ's ``RateLimit`` (3.0) was evaluated as the base and not chosen: ``docs/design/queue.md``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime as dt
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from rq import Queue, Retry
from rq.exceptions import NoSuchJobError
from rq.job import Job, JobStatus
from rq.registry import ScheduledJobRegistry
from rq.results import Result
from rq.utils import now as rq_now

from simple_mutex import Lease, LineFullError, MalfunctionError
from simple_mutex.busy import line as ln
from simple_mutex.busy import skip_marker, unreachable
from simple_mutex.busy.line import driver
from simple_mutex.busy.policy import BusyPolicy, QueuePolicy, most_patient
from simple_mutex.busy.port import Published

log = logging.getLogger("rq_mutex")

META = "rq_mutex_line"  # job.meta: its ticket, {"epoch", "number"}
META_PARKS = "rq_mutex_parks"  # job.meta: how often it parked at a worker
META_FULL = "rq_mutex_line_full"  # job.meta: its line was full at the send (on_full="skip")
META_SUPERSEDED = "rq_mutex_superseded_by"  # job.meta: the id of the job that took its place
PATIENCE = 2.0  # how long an end waits for the next job's parking horse to finish
UNLIMITED = 2**31 - 1  # rq.Retry needs a number
_FAILED = {Result.Type.FAILED, Result.Type.STOPPED} | {
    t
    for t in Result.Type
    if t.name == "MAX_RETRIES_EXCEEDED"  # RQ 3.0 and later
}
SAVED_WITHIN = 5.0  # a job parked at its send is saved by its producer well within this


@dataclass(frozen=True)
class Finish:
    """The job ends now without running its body, returning ``value`` (the skip marker,
    or the ``rq.Retry`` that parks it)."""

    value: Any


# -- the send --------------------------------------------------------------------------------


def takes_its_place_at_send(job: Job) -> bool:
    """A job sent to run now (not scheduled for later, no dependencies to wait for)."""
    status = job.get_status(refresh=False)
    return status in (None, JobStatus.QUEUED) and not job._dependency_ids


def at_send(
    job: Job,
    lines: ln.Lines,
    key: str,
    policy: BusyPolicy,
    *,
    origin: str,
    connection: Any,
    name: str,
) -> None:
    """The ticket of a job being created on the queue ``origin``, into its meta (saved
    with the job). Behind a ticket ahead (one running, or the turn not its own) it parks
    at once: the line holds it now, and ``divert`` schedules it instead of pushing it, so
    a burst for one key costs no horse per job. Keep latest and debounce: it takes the
    waiting job's place (that job is released to finish as superseded), and a debounced
    job is scheduled for when it is due (RQ's scheduler, or a sweep, enqueues it)."""
    if not takes_its_place_at_send(job):
        return
    queue, collapse = policy.queue, ln.collapse_for(policy)
    message = message_of(job.id, origin, policy)
    gone: tuple[ln.Superseded, ...] = ()
    # The caller's meta= dict may be passed to other enqueues: this job gets its own.
    job.meta = dict(job.meta or {})
    try:
        if collapse is None:
            # Sent to its queue, it leaves its copy in the line: should it never start (its
            # worker died holding it), a sweep publishes that copy in its place.
            ticket, parked = lines.send(key, lambda _: message, queue_max=queue.max, keep_copy=True)
        else:
            ticket, parked, gone = lines.send_collapsed(
                key, lambda _: message, collapse, queue_max=queue.max
            )
    except LineFullError:
        if queue.on_full != "skip":
            raise
        job.meta[META_FULL] = True
        return
    job.meta[META] = {"epoch": ticket.epoch, "number": ticket.number}
    pending = _sending.get()
    if pending is not None:
        pending.append((lines, key, ticket))  # undone if the batch fails before its push
    release_superseded(connection, key, gone)
    if parked:
        wake = time.time() + park_interval(queue)
        if isinstance(collapse, ln.Debounce):
            wake = driver.due(lines, key, ticket) or time.time() + collapse.period
        # RQ's registry scores by the whole second, rounded down: round up, or RQ's
        # scheduler would bring a debounced job before it is due.
        setattr(job, _PARK_AT_SEND, math.ceil(wake))


def release_superseded(connection: Any, key: str, gone: tuple[ln.Superseded, ...]) -> None:
    """Each job a newer one took the place of is enqueued (at the front), so it arrives,
    finds itself superseded and finishes with the skip marker: its result handle resolves
    through RQ's own machinery. One still being saved by its producer finishes when RQ's
    scheduler runs it instead."""
    for call in gone:
        found = _parked_job(connection, key, call.ticket, call.message, None, 0.0)
        if isinstance(found, Job):
            # Said in its meta: a call parked as it arrived has left the line (its ticket
            # is over), and nothing else there tells it from a job requeued by hand.
            newer = call.by_message.get("id") if isinstance(call.by_message, Mapping) else None
            found.meta[META_SUPERSEDED] = newer if isinstance(newer, str) else ""
            found.save_meta()  # type: ignore[no-untyped-call]
            _enqueue_parked(connection, found, at_front=True)  # it only finishes, at once


def message_of(job_id: str, origin: str, policy: BusyPolicy) -> dict[str, Any]:
    """What the line holds for a parked job: its id and queue, and the sweep's bounds of
    its job function (a worker's sweep has no job code: it reads them here), its lease
    among them (how long a job taken and never begun is waited for: ``_stranded``)."""
    queue = policy.queue
    return {"id": job_id, "queue": origin, "gap_for": queue.gap_for,
            "park_for": queue.park_for, "lease": policy.lease}  # fmt: skip


def policy_in(line: ln.Line | None, default: QueuePolicy) -> QueuePolicy:
    """The sweep's bounds the line's parked jobs and copies carry (``message_of``): the
    most patient of them, as jobs of several functions may share a key; ``default`` when
    the line holds neither (then no bound applies: a gap is judged only behind a parked
    job or with a copy, and only parked jobs age)."""
    carried = []
    messages = [] if line is None else [p.message for p in line.parked.values()]
    for found in [*messages, *([] if line is None else line.copies.values())]:
        if isinstance(found, Mapping):
            gap_for, park_for = found.get("gap_for"), found.get("park_for")
            if isinstance(gap_for, int | float) and isinstance(park_for, int | float):
                carried.append(dataclasses.replace(default, gap_for=gap_for, park_for=park_for))
    return most_patient(carried) or default


# The tickets an enqueue_many took so far, to give back if it fails before it pushes them
# (a later job's bad key, a full line): else they would stand in the line as gaps.
_sending: contextvars.ContextVar[list[tuple[ln.Lines, str, ln.Ticket]] | None] = (
    contextvars.ContextVar("rq_mutex_sending", default=None)
)


@contextlib.contextmanager
def sending_batch() -> Iterator[None]:
    """Around ``Queue.enqueue_many``: on failure, the tickets it took are revoked."""
    token = _sending.set([])
    try:
        yield
    except BaseException:
        for lines, key, ticket in _sending.get() or []:
            try:
                lines.revoke(key, ticket)
            except MalfunctionError as fault:
                log.warning("the line of %r keeps a ticket of a failed enqueue: %s", key, fault)
        raise
    finally:
        _sending.reset(token)


_PARK_AT_SEND = "_rq_mutex_park_at_send"  # on the Job object its producer just created


def divert(queue: Queue, job: Job, pipeline: Any) -> bool:
    """Schedule (park) a job ``at_send`` parked instead of pushing it on ``queue``, in
    the enqueue's own pipeline; True when it was. Only the producer's own Job object
    carries the mark, once: every later push of the job (its promotion) goes through."""
    wake = getattr(job, _PARK_AT_SEND, None)
    if wake is None:
        return False
    delattr(job, _PARK_AT_SEND)
    # Enqueued as far as its caller can tell (rq cron asserts the stamp a push sets).
    job.enqueued_at = rq_now()
    queue.schedule_job(job, dt.datetime.fromtimestamp(wake, dt.timezone.utc), pipeline=pipeline)
    return True


def ticket_from(job: Job) -> ln.Ticket | None:
    """The ticket in a job's meta; a mangled one is refused (the job takes a new place)."""
    found = (job.meta or {}).get(META)
    if not isinstance(found, Mapping):
        return None
    try:
        return ln.ticket_of(found.get("epoch"), found.get("number"))
    except (TypeError, ValueError) as bad:
        log.warning("job %s: its %s meta was refused: %s", job.id, META, bad)
        return None


def _take(job: Job, lines: ln.Lines, key: str) -> ln.Ticket:
    """A place taken as the job arrives, saved in its meta so a park keeps it."""
    ticket = lines.take(key)
    job.meta[META] = {"epoch": ticket.epoch, "number": ticket.number}
    job.save_meta()  # type: ignore[no-untyped-call]
    return ticket


# -- the arrival ---------------------------------------------------------------------------------


def park_interval(queue: QueuePolicy) -> int:
    """RQ's schedule for a parked job: past ``park_for`` and a few sweeps, so a sweep has
    dropped its entry (it then ends as a duplicate) before RQ's scheduler would run it."""
    return math.ceil(queue.park_for + 3 * queue.sweep_every)


@dataclass(frozen=True)
class JobPublisher:
    """The port's publisher for the jobs of one connection: a parked job (kept SCHEDULED
    by RQ) is enqueued again, at the back of its queue."""

    connection: Any
    lines: ln.Lines
    name: str
    log: logging.Logger = log

    def publish(self, key: str, what: ln.Publish, *, by: str) -> Published:
        """Only a job still in the ScheduledJobRegistry is enqueued: one already out was
        published (and is queued or running), so a second promoter adds no copy. An end
        waits up to ``PATIENCE`` for the next job's parking horse to finish. A job gone
        from RQ (deleted, or ended without running: a job timeout as it parked) is
        "gone"; one not saved yet by the producer that parked it at its send is "not
        now" for ``SAVED_WITHIN`` seconds, then gone."""
        patience = PATIENCE if by == "end" else 0.0
        found = _parked_job(
            self.connection, key, what.ticket, what.message, self.lines, patience,
            rescue=by == "sweep",
        )  # fmt: skip
        if isinstance(found, Job):
            _enqueue_parked(self.connection, found)
            log.debug("published job %s, ticket %d of %r, by %s", found.id, what.ticket, key, by)
            return "sent"
        young = what.parked_at is not None and time.time() - what.parked_at < SAVED_WITHIN
        if found is None or (found == _YOUNG and young):
            return "not now"
        return "gone"


@dataclass(frozen=True, kw_only=True)
class JobCall(JobPublisher):
    """The port's call: one run of ``job`` at a worker."""

    job: Job
    policy: BusyPolicy

    @property
    def id(self) -> str:
        return str(self.job.id)

    @property
    def who(self) -> str:
        return f"job {self.job.id}"

    @property
    def bounds(self) -> QueuePolicy:
        return self.policy.queue

    keeps_parked = True  # RQ keeps a parked job SCHEDULED, its hash and handle intact

    def ticket(self) -> ln.Ticket | None:
        return ticket_from(self.job)

    def take(self, lines: ln.Lines, key: str) -> ln.Ticket:
        return _take(self.job, lines, key)

    def message(self, ticket: ln.Ticket) -> dict[str, Any]:
        return message_of(self.job.id, self.job.origin, self.policy)

    def attempt(self) -> int | None:
        return None  # RQ's retry is the same job again: no attempt number to tell copies

    def redelivers(self) -> bool:
        return bool(self.job.retries_left)

    def ran_and_failed(self) -> bool:
        # Requeued by hand (job.requeue() of a failed or stopped job, `rq requeue`), or it
        # never ran at all. A parking is no run (its result is RQ's "retried").
        last = self.job.latest_result()
        return last is None or last.type in _FAILED

    def resolve(self, key: str, gone: tuple[ln.Superseded, ...]) -> None:
        release_superseded(self.connection, key, gone)

    def parked(self, key: str, ticket: ln.Ticket) -> None:
        pass  # RQ has no signals; the line's event says it

    def started(self, key: str, ticket: ln.Ticket) -> None:
        # A copy a publish left in the registry (it crashed between its two steps) must
        # not run again after park_for: one ZREM.
        registry = ScheduledJobRegistry(self.job.origin, connection=self.connection)  # type: ignore[no-untyped-call]
        registry.remove(self.job)


def arrive(
    job: Job,
    key: str,
    lines: ln.Lines,
    policy: BusyPolicy,
    name: str,
    acquire: Callable[[], Lease],
    flag_skipped: Callable[[Job, str], None],
) -> driver.Turn | Finish:
    """The line's answer for this run of ``job``: its ``Turn`` (the lock taken, marked
    running) or how it ``Finish``es now (parked, a duplicate, superseded, the line was
    full)."""
    if (job.meta or {}).get(META_FULL):
        flag_skipped(job, "line full")
        return Finish(skip_marker("rq_mutex", key, reason="line full"))
    if META_SUPERSEDED in (job.meta or {}):
        flag_skipped(job, "superseded")
        newer = job.meta[META_SUPERSEDED] or None
        return Finish(skip_marker("rq_mutex", key, reason="superseded", by=newer))
    call = JobCall(job.connection, lines, name, job=job, policy=policy)
    match driver.arrive(call, lines, key, ln.collapse_for(policy), acquire):
        case driver.Turn() as turn:
            return turn
        case driver.Parking(due=due):
            if due is None:
                return _park(job, park_interval(policy.queue))
            # A debounced job woken early (RQ's whole seconds) sleeps until it is due.
            return _park(job, math.ceil(due - time.time()) + 1)
        case driver.Dropped(reason=reason, by=newer):
            flag_skipped(job, reason)
            extra = {"by": newer} if reason == "superseded" else {}
            return Finish(skip_marker("rq_mutex", key, reason=reason, **extra))
        case _ as unknown:
            return unreachable(unknown)


def _park(job: Job, interval: int) -> Finish:
    """Park the job at this worker: it returns ``rq.Retry``, and RQ keeps it SCHEDULED.
    RQ counts that as one of its retries (``number_of_retries``): the parks are counted
    in the job's meta too (saved with it as RQ schedules it), so that a retry the body
    asks for itself is not refused for retries it never made (``own_retry``)."""
    job.meta[META_PARKS] = int(job.meta.get(META_PARKS, 0)) + 1
    return Finish(Retry(max=UNLIMITED, interval=interval))


def own_retry(job: Job, value: Any) -> Any:
    """The body's own ``rq.Retry``, its ``max`` raised by the job's parks (RQ compares
    ``number_of_retries``, which counts them, with it)."""
    parks = int((job.meta or {}).get(META_PARKS, 0))
    if isinstance(value, Retry) and parks:
        value.max += parks
    return value


# -- the end ---------------------------------------------------------------------------------


def ending(
    job: Job,
    key: str,
    turn: driver.Turn,
    lines: ln.Lines,
    queue: QueuePolicy,
    name: str,
    *,
    returned: object = None,
    failed: BaseException | None = None,
) -> Callable[[], None]:
    """Before the lock is released: the turn moves on, or stays for RQ's own retry.
    Returns what to do once it is released: enqueue the next parked job."""
    ticket, count = turn.ticket, job.number_of_retries or 0
    again: float | None = None
    if isinstance(returned, Retry) and not (count and count >= returned.max):
        # RQ runs it again, unless its retries are used up (then RQ fails it: an end).
        again = Retry.get_interval(count, returned.intervals)
    elif failed is not None and job.retries_left:
        # RQ runs it again (same job id, same ticket): it keeps its turn, due when RQ
        # schedules it (RQ's own index into the intervals: by retries left).
        again = float(job.get_retry_interval())
    return driver.end(
        JobPublisher(job.connection, lines, name), lines, key, ticket, queue,
        again_after=again, who=f"job {job.id}",
    )  # fmt: skip


# -- publishing ------------------------------------------------------------------------------


def _enqueue_parked(connection: Any, job: Job, *, at_front: bool = False) -> None:
    """Publish-then-forget: onto its queue first, then out of the registry (and out of
    the queue's intermediate list, where a worker that died left a job it had popped:
    RQ's maintenance would fail it there later). At the back, as any enqueue: at the
    front, promotions under load kept jumping the first job of other keys, which waited
    past gap_for and were stepped over (run out of order)."""
    queue = Queue(job.origin, connection=connection)
    queue.enqueue_job(job, at_front=at_front)
    ScheduledJobRegistry(job.origin, connection=connection).remove(job)  # type: ignore[no-untyped-call]
    connection.lrem(queue.intermediate_queue_key, 0, job.id)


_GONE, _YOUNG = "gone", "young"


def _parked_job(
    connection: Any,
    key: str,
    ticket: int,
    message: ln.Message,
    lines: ln.Lines | None,
    patience: float,
    *,
    rescue: bool = False,
) -> Job | str | None:
    """The parked job to enqueue; None when it is not ours to enqueue now (queued
    already, or its horse is still parking it), ``_GONE`` when it will never run, and
    ``_YOUNG`` when no such job exists yet (a producer still saving one it parked at its
    send, or one that died before it could: the caller tells them apart by age). With
    ``rescue`` (a sweep's publish, long after the last), a queued or started job that no
    worker will run (``_stranded``) is enqueued again."""
    job_id = message.get("id") if isinstance(message, Mapping) else None
    origin = message.get("queue") if isinstance(message, Mapping) else None
    if not isinstance(job_id, str) or not isinstance(origin, str):
        log.warning("ticket %d of %r holds no job: stepped over", ticket, key)
        return _GONE
    registry = ScheduledJobRegistry(origin, connection=connection)  # type: ignore[no-untyped-call]
    deadline = time.monotonic() + patience
    while True:
        try:
            job = Job.fetch(job_id, connection=connection)
        except NoSuchJobError:
            if time.monotonic() > deadline:
                return _YOUNG
            time.sleep(0.01)
            continue
        if connection.zscore(registry.key, job_id) is not None:
            return job
        status = job.get_status(refresh=False)
        if rescue and lines is not None and _stranded(connection, job, lines, key, ticket, message):
            log.warning("job %s, ticket %d of %r, was taken by a worker that died before it "
                        "began it: enqueued again", job_id, ticket, key)  # fmt: skip
            return job
        if status not in (JobStatus.STARTED, JobStatus.SCHEDULED, JobStatus.QUEUED):
            log.warning("job %s, ticket %d of %r, ended %s without its turn: stepped over",
                        job_id, ticket, key, status)  # fmt: skip
            return _GONE
        if status == JobStatus.QUEUED or time.monotonic() > deadline:
            return None  # queued already, or still parking: a later sweep tries again
        if status == JobStatus.STARTED and lines is not None and driver.running(lines, key, ticket):
            return None  # its horse saw the turn come before it parked, and runs it
        time.sleep(0.01)


UNBEGUN = "rq_mutex:unbegun:"  # + job id and ticket: when a sweep first found it unbegun


def _stranded(
    connection: Any, job: Job, lines: ln.Lines, key: str, ticket: int, message: ln.Message
) -> bool:
    """Whether ``job``, the line's head, was taken off its queue by a worker that died
    before its horse began the body: RQ then keeps it QUEUED in the queue's intermediate
    list, or STARTED with an execution nobody heartbeats any more, until its maintenance
    fails it minutes later, and the line would wait that long for a job that never runs.
    A job still in its queue is slow, not lost; one whose horse began it in the line, or
    whose execution is heartbeated, is running. A STARTED job whose heartbeat lapsed is
    stranded at once (its dead execution's entries go, so that RQ's cleanup never fails
    its next run); a QUEUED one once it has stayed unbegun for its lease, as a holder
    paused past its lease has lost its lock: the first sweep that finds it marks when
    (``UNBEGUN``), a later one judges. A worker
    paused longer than that, then resuming, runs nothing twice: its copy finds the turn
    taken and is a duplicate (which RQ records on the job id, as any duplicate)."""
    queue = Queue(job.origin, connection=connection)
    mark = f"{UNBEGUN}{job.id}:{ticket}"
    status = job.get_status(refresh=True)
    unbegun = (
        connection.lpos(queue.key, job.id) is None
        and not driver.running(lines, key, ticket)
        and (
            status == JobStatus.QUEUED
            or (status == JobStatus.STARTED and _unheartbeated(connection, queue, job))
        )
    )
    if not unbegun:
        connection.delete(mark)
        return False
    if status == JobStatus.STARTED:
        # Its horse's heartbeat lapsed: RQ's own proof of a dead worker, which needs no
        # wait of ours (RQ's maintenance, every 10 minutes, would fail the job).
        registry = queue.started_job_registry.key
        connection.zrem(registry, *_executions(connection, registry, job))
        return True
    found = message.get("lease") if isinstance(message, Mapping) else None
    lease = float(found) if isinstance(found, int | float) and found > 0 else lines.lease
    connection.set(mark, repr(time.time()), nx=True, px=int(2 * lease * 1000) + 60_000)
    first = connection.get(mark)
    if first is None or time.time() - float(first) < lease:
        return False
    connection.delete(mark)
    return True


def _executions(connection: Any, registry: str, job: Job) -> list[Any]:
    return [member for member, _ in connection.zscan_iter(registry, match=f"{job.id}:*")]


def _unheartbeated(connection: Any, queue: Queue, job: Job) -> bool:
    """Whether every execution of the started ``job`` has stopped being heartbeated: its
    entries in the started registry (``<job id>:<execution id>``) are all past their
    score."""
    registry = queue.started_job_registry.key
    scores = [connection.zscore(registry, m) for m in _executions(connection, registry, job)]
    now = time.time()
    return bool(scores) and all(s is not None and s != math.inf and s <= now for s in scores)


# -- sweeping ----------------------------------------------------------------------------------


def sweep_all(connection: Any, lines: ln.Lines, queue: QueuePolicy, name: str) -> int:
    """Sweep every line in ``lines``' cache (a worker's periodic sweep), each by the
    bounds its parked jobs carry; returns how many lines there were."""
    publisher = JobPublisher(connection, lines, name)
    return driver.sweep_lines(
        lines, lambda key: (publisher, policy_in(lines.read(key), queue)), log
    )
