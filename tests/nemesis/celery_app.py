"""The Celery app the nemesis's real ``celery worker -P prefork`` processes run.

Configured from the environment: ``NEM_BROKER`` (RabbitMQ: an unacked message of a killed
worker is redelivered at once), ``NEM_BACKEND`` (Redis), ``NEM_CACHE``, ``NEM_PREFIX``,
``NEM_QUEUE``, ``NEM_HISTORY`` (the history directory), ``NEM_STORE`` (the fenced store).

``work`` takes ``k.<key>`` (renewed 2 s lease, ``on_busy="wait"``), then writes its fence
to the store ``steps`` times, and writes ``cleanup`` more in a ``finally:`` (the clean-up
a revoke or a hard time limit lets run: it must still be inside the lock). ``work_late``
is the same with ``acks_late``. Every run records ``run`` start / end and the lock hold
(``acquire`` from ``task_prerun``, before the lock is taken; ``granted`` once held).
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import signals
from celery_support.env_app import app_from_env

import nemesis  # noqa: F401  (sys.path)
from celery_mutex import MutexTask, current_lease
from nemesis.body import Steps
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
LOCK = {"key": "k.{key}", "on_busy": "wait", "timeout": 20, "lease": 2, "renew": True}
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


def _op(task: Any) -> str:
    return f"{task.request.id}:{os.getpid()}:{task.request.retries or 0}"


@signals.task_prerun.connect
def _prerun(sender: Any = None, task: Any = None, args: Any = (), kwargs: Any = None,
            **_: Any) -> None:  # fmt: skip
    rec, _ = _recorder()
    key = (kwargs or {}).get("key")
    if key is None:
        return
    rec("run", task=task.request.id, phase="prerun", pid=os.getpid())
    rec("acquire", id=_op(task), key=f"k.{key}", timeout=LOCK["timeout"], lease=2, renew=True,
        task=task.request.id)  # fmt: skip


def _body(task: Any, key: str, steps: int, cleanup: int, pause: float) -> str:
    rec, writer = _recorder()
    op, lease = _op(task), current_lease()
    assert lease is not None
    rec("granted", id=op, key=f"k.{key}", fence=lease.fence, slot=lease.slot,
        deadline=lease._deadline, task=task.request.id)  # fmt: skip
    rec("run", task=task.request.id, phase="start", pid=os.getpid())
    _redis().set(f"{PREFIX}pid.{task.request.id}", os.getpid(), ex=600)
    n = 0
    try:
        for n in range(steps):
            writer.step(op, f"k.{key}", lease, n)
            time.sleep(pause)
    except BaseException as exc:
        rec("lost" if "LeaseExpired" in type(exc).__name__ else "failed", id=op,
            key=f"k.{key}", error=repr(exc)[:200])  # fmt: skip
        raise
    finally:
        for m in range(cleanup):
            writer.step(op, f"k.{key}", lease, n + 1 + m, cleanup=True)
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


@app.task(base=MutexTask, bind=True, mutex=LOCK)
def work(self: Any, key: str, steps: int = 6, cleanup: int = 20, pause: float = 0.05) -> str:
    return _body(self, key, steps, cleanup, pause)


@app.task(base=MutexTask, bind=True, mutex=LOCK, acks_late=True)
def work_late(self: Any, key: str, steps: int = 6, cleanup: int = 20, pause: float = 0.05) -> str:
    return _body(self, key, steps, cleanup, pause)
