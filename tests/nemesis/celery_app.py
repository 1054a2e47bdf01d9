"""The Celery app the nemesis's real ``celery worker -P prefork`` processes run.

Configured from the environment: ``NEM_BROKER`` (RabbitMQ: an unacked message of a killed
worker is redelivered at once), ``NEM_BACKEND`` (Redis), ``NEM_CACHE``, ``NEM_PREFIX``,
``NEM_QUEUE``, ``NEM_HISTORY`` (the history directory), ``NEM_STORE`` (the fenced store).

``work`` takes ``k.<key>`` (renewed 2 s lease, ``on_busy="wait"``), then writes its fence
to the store ``steps`` times, and writes ``cleanup`` more in a ``finally:`` (the clean-up
a revoke or a hard time limit lets run: it must still be inside the lock). ``work_late``
is the same with ``acks_late``. ``work_queued`` (and ``work_queued_late``, with
``acks_late``) is the same body on ``q.<key>`` with ``on_busy="queue"``: its calls run one
at a time in send order, a call whose turn has not come is parked (its ``task_prerun``
``acquire`` then ends in a ``parked`` event: it raised ``Ignore``) and published again in
its turn. ``work_latest`` (and ``work_latest_late``) is the same body on ``l.<key>``
with ``on_busy="latest"``, ``work_debounced`` (and ``_late``) on ``d.<key>`` with
``on_busy="debounce"``: a call whose place a newer one took never runs (its arrival, if
it has one, ends in a ``superseded`` event). ``work_replacing`` is the same body on
``r.<key>`` with ``on_busy="replace"``: the newest call takes the key from the running
one and stops it (its body ends with the lost lease). Every run records ``run`` start /
end and the lock hold (``acquire`` from
``task_prerun``, before the lock is taken; ``granted`` once held, with ``late``: the
line's reason when the run is out of send order, else None).
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import signals
from celery_support.env_app import app_from_env

import nemesis  # noqa: F401  (sys.path)
from celery_mutex import MutexTask, call_state, current_lease
from nemesis.body import Steps
from nemesis.celery_locks import DEBOUNCE, LATEST, LOCK, QUEUED, REPLACING
from nemesis.history import Recorder

app = app_from_env(
    "nemesis.celery_app",
    "NEM",
    broker="amqp://guest:guest@127.0.0.1:5672//",
    backend="redis://127.0.0.1:6379/14",
    queue="nemesis",
    cache="redis://127.0.0.1:6379/14",
    prefix="nemcel.",
    task_reject_on_worker_lost=True,  # acks_late: a killed worker's task is redelivered
)
PREFIX: str = app.conf.mutex_prefix
QUEUED_TASKS = {f"{__name__}.work_queued", f"{__name__}.work_queued_late"}
LATEST_TASKS = {f"{__name__}.work_latest", f"{__name__}.work_latest_late"}
DEBOUNCED_TASKS = {f"{__name__}.work_debounced", f"{__name__}.work_debounced_late"}
IN_LINE = QUEUED_TASKS | LATEST_TASKS | DEBOUNCED_TASKS
REPLACING_TASK = f"{__name__}.work_replacing"
ARRIVAL = 10  # a queued arrival's bound (no wait: the line's writes, then park or run)
_rec: Recorder | None = None
_steps: Steps | None = None


def _recorder() -> tuple[Recorder, Steps]:
    global _rec, _steps
    if _rec is None or _rec.pid != os.getpid():  # one history per pool process
        _rec = Recorder(os.environ["NEM_HISTORY"], "celery-child")
        _rec("start", forked=True)
        _steps = Steps(_rec, os.environ["NEM_STORE"])
    assert _steps is not None
    return _rec, _steps


_ops: dict[str, str] = {}  # task id -> the op of its current arrival in this process
_arrivals = 0


def _op(task: Any) -> str:
    """The op of this arrival: a queued call arrives once per publish (same task id), and a
    duplicate copy may arrive after its run in the same process, so each has its own."""
    found = _ops.get(task.request.id)
    return found or f"{task.request.id}:{os.getpid()}:{task.request.retries or 0}"


def _lock(task: Any, key: str) -> str:
    for kind, names in (("q", QUEUED_TASKS), ("l", LATEST_TASKS), ("d", DEBOUNCED_TASKS)):
        if task.name in names:
            return f"{kind}.{key}"
    return f"r.{key}" if task.name == REPLACING_TASK else f"k.{key}"


@signals.task_prerun.connect
def _prerun(sender: Any = None, task: Any = None, args: Any = (), kwargs: Any = None,
            **_: Any) -> None:  # fmt: skip
    rec, _ = _recorder()
    key = (kwargs or {}).get("key")
    if key is None:
        return
    global _arrivals
    _arrivals += 1
    queued = task.name in IN_LINE
    op = f"{task.request.id}:{os.getpid()}:{task.request.retries or 0}:{_arrivals}"
    _ops[task.request.id] = op
    rec("run", task=task.request.id, phase="prerun", pid=os.getpid())
    bounded = queued or task.name == REPLACING_TASK  # no wait: a try, then the takeover
    rec("acquire", id=op, key=_lock(task, key), timeout=ARRIVAL if bounded else LOCK["timeout"],
        lease=2, renew=True, task=task.request.id)  # fmt: skip


@signals.task_postrun.connect
def _postrun(sender: Any = None, task: Any = None, kwargs: Any = None, state: Any = None,
             retval: Any = None, **_: Any) -> None:  # fmt: skip
    """A queued arrival parked (or dropped as a duplicate): it raised Ignore, no grant. A
    keep-latest arrival superseded by a newer call: it returned the marker, no grant."""
    key = (kwargs or {}).get("key")
    if key is None:
        return
    if isinstance(retval, dict) and retval.get("reason") == "superseded":
        rec, _ = _recorder()
        rec("superseded", id=_op(task), key=_lock(task, key), task=task.request.id,
            by=retval.get("by"))  # fmt: skip
        rec("run", task=task.request.id, phase="superseded", pid=os.getpid())
        return
    if state != "IGNORED" or not call_state.of(task.request).parked:
        return
    rec, _ = _recorder()
    rec("parked", id=_op(task), key=_lock(task, key), task=task.request.id)
    rec("run", task=task.request.id, phase="parked", pid=os.getpid())


def _body(task: Any, key: str, steps: int, cleanup: int, pause: float) -> str:
    rec, writer = _recorder()
    op, lease = _op(task), current_lease()
    assert lease is not None
    lock = _lock(task, key)
    rec("granted", id=op, key=lock, fence=lease.fence, slot=lease.slot,
        deadline=lease._deadline, task=task.request.id,
        late=call_state.of(task.request).late)  # fmt: skip
    rec("run", task=task.request.id, phase="start", pid=os.getpid())
    _redis().set(f"{PREFIX}pid.{task.request.id}", os.getpid(), ex=600)
    n = 0
    try:
        for n in range(steps):
            writer.step(op, lock, lease, n)
            time.sleep(pause)
    except BaseException as exc:
        rec("lost" if "LeaseExpired" in type(exc).__name__ else "failed", id=op,
            key=lock, error=repr(exc)[:200])  # fmt: skip
        raise
    finally:
        for m in range(cleanup):
            writer.step(op, lock, lease, n + 1 + m, cleanup=True)
            time.sleep(0.01)
    rec("run", task=task.request.id, phase="end", pid=os.getpid())
    rec("done", id=op)
    return "ran"


_client: redis.Redis | None = None


def _redis() -> redis.Redis:
    global _client
    if _client is None:
        _client = redis.Redis.from_url(app.conf.result_backend)
    return _client


def _work(name: str, mutex: dict[str, Any], **options: Any) -> Any:
    """The task ``name`` of this module: ``_body`` under ``mutex`` (``options``: Celery's,
    e.g. ``acks_late``)."""

    def run(self: Any, key: str, steps: int = 6, cleanup: int = 20, pause: float = 0.05) -> str:
        return _body(self, key, steps, cleanup, pause)

    task = app.task(base=MutexTask, bind=True, mutex=mutex, name=f"{__name__}.{name}", **options)
    return task(run)


work = _work("work", LOCK)
work_late = _work("work_late", LOCK, acks_late=True)
work_queued = _work("work_queued", QUEUED)
work_queued_late = _work("work_queued_late", QUEUED, acks_late=True)
work_latest = _work("work_latest", LATEST)
work_latest_late = _work("work_latest_late", LATEST, acks_late=True)
work_debounced = _work("work_debounced", DEBOUNCE)
work_debounced_late = _work("work_debounced_late", DEBOUNCE, acks_late=True)
work_replacing = _work("work_replacing", REPLACING)
