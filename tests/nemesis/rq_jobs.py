"""Job functions the nemesis's real ``rq worker`` processes run (enqueued by name).

Configured from the environment of the worker (its work horses inherit it):
``NEM_HISTORY``, ``NEM_STORE``, ``NEM_PREFIX``. ``work`` takes ``k.<key>`` (renewed 2 s
lease, ``on_busy="wait"``) and writes its fence to the store ``steps`` times; ``unique``
takes a key of its own (``u.<key>``, ``on_busy="skip"``): nobody else ever holds it, so a
skip can only be its own dead attempt turning its retry away (issue 21, item 3).
``queued`` is the same body on ``q.<key>`` with ``on_busy="queue"`` (``QUEUED``): its jobs
run one at a time in enqueue order, each taking its ticket in the nemesis's own
``Queue.create_job`` (it imports this module, so ``rq_mutex.job`` knows the function). An
arrival whose turn has not come returns ``rq.Retry`` (parked: its horse ends, RQ keeps the
job SCHEDULED), and a copy of a ticket that ran finishes with the skip marker (reason
"duplicate"): either way its ``acquire`` ends in a ``parked`` event (``reason``), with no
grant. Each run records ``run`` prerun (before the lock) / start / end (/ parked) and its
hold; ``replacing`` is the same body on ``r.<key>`` with ``on_busy="replace"``: the
newest job takes the key from the running one and has it stopped (its body ends with the
lost lease, the ``lost`` event). A queued grant records ``late``, the line's reason when
it runs out of order (RQ tells only its log: ``_Late`` reads it there).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from rq import Retry, get_current_job

import nemesis  # noqa: F401  (sys.path)
from nemesis.body import Steps
from nemesis.history import Recorder
from rq_mutex import current_lease, is_skipped, mutex_job
from rq_mutex.job import META_SKIP_REASON as SKIP_REASON

PREFIX = os.environ.get("NEM_PREFIX", "nemrq.")
_state: dict[str, Any] = {}
ARRIVAL = 10  # a queued arrival's bound (no wait: the line's writes, then park or run)
QUEUED: dict[str, Any] = {"key": "q.{key}", "on_busy": "queue", "lease": 2, "renew": True,
                          "queue": {"sweep_every": 0.5, "gap_for": 3}}  # fmt: skip
REPLACING: dict[str, Any] = {"key": "r.{key}", "on_busy": "replace", "lease": 2, "renew": True}
# The line driver's warning, on rq_mutex's logger; its first argument is "job <id>".
OUT_OF_ORDER = "%s runs out of order: ticket %d of %r was %s"


class _Late(logging.Handler):
    """The line's reason a job runs out of order, from ``rq_mutex``'s warning (job id ->
    why): the only place RQ's queue says it (Celery's is ``call_state.of(request).late``)."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg == OUT_OF_ORDER and isinstance(record.args, tuple):
            job = str(record.args[0]).removeprefix("job ")
            _state.setdefault("late", {})[job] = record.args[3]


logging.getLogger("rq_mutex").addHandler(_Late(logging.WARNING))


def _recorder() -> tuple[Recorder, Steps]:
    rec = _state.get("rec")
    if rec is None or rec.pid != os.getpid():  # one history per work horse
        rec = _state["rec"] = Recorder(os.environ["NEM_HISTORY"], "rq-horse")
        rec("start", forked=True)
        _state["steps"] = Steps(rec, os.environ["NEM_STORE"])
    return rec, _state["steps"]


def recorded(template: str, timeout: float | None) -> Callable[[Callable[..., Any]], Any]:
    """Outside the lock: record that the run began, and its acquire."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(key: str, **kwargs: Any) -> Any:
            rec, _ = _recorder()
            job = get_current_job()
            assert job is not None
            _state["op"] = f"{job.id}:{os.getpid()}:{time.monotonic():.3f}"
            rec("run", task=job.id, phase="prerun", pid=os.getpid())
            rec("acquire", id=_state["op"], key=template.format(key=key), timeout=timeout,
                lease=2, renew=True, task=job.id)  # fmt: skip
            value = fn(key, **kwargs)
            if isinstance(value, Retry) or (is_skipped(value) and template == QUEUED["key"]):
                # Parked (its horse ends; its turn publishes it again) or a duplicate copy
                # dropped: the arrival's acquire ended without a grant.
                reason = "parked" if isinstance(value, Retry) else job.meta.get(SKIP_REASON)
                rec("parked", id=_state["op"], key=template.format(key=key), task=job.id,
                    reason=reason)  # fmt: skip
                rec("run", task=job.id, phase="parked", pid=os.getpid())
            return value

        return run

    return decorate


def _body(template: str, key: str, steps: int = 6, pause: float = 0.05) -> str:
    rec, writer = _recorder()
    job, lease = get_current_job(), current_lease()
    assert job is not None
    assert lease is not None
    op, name = _state["op"], template.format(key=key)
    rec("granted", id=op, key=name, fence=lease.fence, slot=lease.slot,
        deadline=lease._deadline, task=job.id, late=_state.get("late", {}).get(job.id))  # fmt: skip
    rec("run", task=job.id, phase="start", pid=os.getpid())
    job.connection.set(f"{PREFIX}pid.{job.id}", os.getpid(), ex=600)
    try:
        for n in range(steps):
            writer.step(op, name, lease, n)
            time.sleep(pause)
    except BaseException as exc:
        rec("lost" if "LeaseExpired" in type(exc).__name__ else "failed", id=op, key=name,
            error=repr(exc)[:200])  # fmt: skip
        raise
    rec("run", task=job.id, phase="end", pid=os.getpid())
    rec("done", id=op)
    return "ran"


@recorded("k.{key}", 20)
@mutex_job(key="k.{key}", on_busy="wait", timeout=20, lease=2, renew=True)
def work(key: str, steps: int = 6, pause: float = 0.05) -> str:
    return _body("k.{key}", key, steps, pause)


@recorded("u.{key}", 0)  # a long lease: a retry right after a kill meets the dead one's
@mutex_job(key="u.{key}", on_busy="skip", lease=10, renew=True)
def unique(key: str, steps: int = 6, pause: float = 0.05) -> str:
    return _body("u.{key}", key, steps, pause)


@recorded(QUEUED["key"], ARRIVAL)
@mutex_job(**QUEUED)
def queued(key: str, steps: int = 6, pause: float = 0.05) -> str:
    return _body(QUEUED["key"], key, steps, pause)


@recorded(REPLACING["key"], 0)
@mutex_job(**REPLACING)
def replacing(key: str, steps: int = 6, pause: float = 0.05) -> str:
    return _body(REPLACING["key"], key, steps, pause)
