"""Job functions the nemesis's real ``rq worker`` processes run (enqueued by name).

Configured from the environment of the worker (its work horses inherit it):
``NEM_HISTORY``, ``NEM_STORE``, ``NEM_PREFIX``. ``work`` takes ``k.<key>`` (renewed 2 s
lease, ``on_busy="wait"``) and writes its fence to the store ``steps`` times; ``unique``
takes a key of its own (``u.<key>``, ``on_busy="skip"``): nobody else ever holds it, so a
skip can only be its own dead attempt turning its retry away (issue 21, item 3).
Each run records ``run`` prerun (before the lock) / start / end and its hold.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

from rq import get_current_job

import nemesis  # noqa: F401  (sys.path)
from nemesis.body import Steps
from nemesis.history import Recorder
from rq_mutex import current_lease, mutex_job

PREFIX = os.environ.get("NEM_PREFIX", "nemrq.")
_state: dict[str, Any] = {}


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
            return fn(key, **kwargs)

        return run

    return decorate


def _body(template: str, key: str, steps: int = 6, pause: float = 0.05) -> str:
    rec, writer = _recorder()
    job, lease = get_current_job(), current_lease()
    assert job is not None
    assert lease is not None
    op, name = _state["op"], template.format(key=key)
    rec("granted", id=op, key=name, fence=lease.fence, slot=lease.slot,
        deadline=lease._deadline, task=job.id)  # fmt: skip
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
