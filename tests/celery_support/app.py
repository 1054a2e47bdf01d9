"""The app real ``celery worker -P prefork`` subprocesses run in the Celery suites.

Configured from the environment so each test run gets its own queue, lock prefix and
record keys: ``CM_BROKER``, ``CM_BACKEND``, ``CM_CACHE``, ``CM_PREFIX``, ``CM_QUEUE``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import redis
from celery.signals import task_postrun

from celery_support.env_app import app_from_env

# isort: split
from celery_mutex import MutexTask

app = app_from_env("celery_support.app")
PREFIX: str = app.conf.mutex_prefix
_record = redis.Redis.from_url(app.conf.mutex_cache)

FAST_RETRY = {"countdown": 0.05, "backoff": 1.3, "cap": 0.3}


@app.task(base=MutexTask, mutex={"key": "k.{key_no}", "on_busy": "retry", "retry": FAST_RETRY})
def contend(key_no: int, n: int) -> int:
    """Holds k.<key_no> for ~50 ms and records the interval it ran in."""
    start = time.time()
    time.sleep(0.05)
    end = time.time()
    row = {"key": key_no, "n": n, "start": start, "end": end, "pid": os.getpid()}
    _record.rpush(PREFIX + "runs", json.dumps(row))
    return n


@app.task(base=MutexTask, mutex={"key": "kill.{order_id}", "on_busy": "raise"})
def sleeper(order_id: int) -> None:
    """Publishes its pid, then sleeps until killed."""
    _record.set(f"{PREFIX}pid.{order_id}", os.getpid(), ex=120)
    time.sleep(60)


@app.task(base=MutexTask, mutex={"key": "slow.{order_id}", "on_busy": "raise"}, time_limit=1.5)
def overrun(order_id: int) -> None:
    """Runs past its hard time limit: the pool kills the child."""
    _record.set(f"{PREFIX}pid.slow.{order_id}", os.getpid(), ex=120)
    time.sleep(60)


# The overlap suites: a holder of "steps.<run>" that keeps acting after the signal that
# ends it, and a waiter for the same key. Each step is a time.monotonic() reading
# (system-wide on Linux, so comparable across the worker's processes), appended to
# "<prefix>steps.<run>"; the waiter records when it started waiting and when it entered.
STEPS_LEASE = {"lease": 120}  # far longer than any wait the suites allow: a lapse shows


def _step(run: str, what: str = "steps") -> None:
    key = f"{PREFIX}{what}.{run}"
    _record.pipeline().rpush(key, time.monotonic()).expire(key, 300).execute()


def _steps_deaf_to_sigterm(run: str, seconds: float) -> None:
    """A step every 2 ms for ``seconds``, SIGTERM or not; when SIGTERM came goes to
    "<prefix>term.<run>" (written by the loop: the handler could cut a command)."""
    termed: list[float] = []
    billiards = signal.signal(signal.SIGTERM, lambda *_: termed.append(time.monotonic()))
    _record.set(f"{PREFIX}pid.{run}", os.getpid(), ex=300)
    told = False
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            _step(run)
            if termed and not told:
                told = bool(_record.set(f"{PREFIX}term.{run}", termed[0], ex=300))
            time.sleep(0.002)
    finally:
        signal.signal(signal.SIGTERM, billiards)  # the child's next task gets it back


@app.task(
    base=MutexTask, mutex={"key": "steps.{run}", "on_busy": "raise", **STEPS_LEASE}, time_limit=5
)
def stubborn(run: str) -> None:
    """Runs past its hard time limit (5 s: the waiter waits by then), shrugs off
    billiard's SIGTERM and keeps writing steps until the SIGKILL that follows it."""
    _steps_deaf_to_sigterm(run, 60)


@app.task(base=MutexTask, mutex={"key": "steps.{run}", "on_busy": "raise", **STEPS_LEASE})
def deaf(run: str) -> None:
    """Writes steps for 3 s, whatever SIGTERM says, then returns."""
    _steps_deaf_to_sigterm(run, 3)


def _sleep_then_tidy(run: str, pause: float) -> None:
    _record.set(f"{PREFIX}pid.{run}", os.getpid(), ex=300)
    try:
        time.sleep(120)
    finally:
        for _ in range(50):
            _step(run)
            time.sleep(pause)


@app.task(base=MutexTask, mutex={"key": "steps.{run}", "on_busy": "raise", **STEPS_LEASE})
def tidy(run: str) -> None:
    """Sleeps until revoked; its ``finally:`` clean-up writes 50 steps, 5 ms apart."""
    _sleep_then_tidy(run, 0.005)


@app.task(
    base=MutexTask, mutex={"key": "steps.{run}", "on_busy": "raise", "lease": 5, "renew": False}
)
def tidy_past_lease(run: str) -> None:
    """Like ``tidy``, but its clean-up (50 steps, 120 ms apart) outlasts its fixed 5 s
    lease: the loss interrupt lands in the ``finally:`` that SIGTERM's SystemExit runs."""
    _sleep_then_tidy(run, 0.12)


@app.task(
    base=MutexTask, bind=True,
    mutex={"key": "steps.{run}", "on_busy": "raise", "lease": 30, "renew": True},
)  # fmt: skip
def retries_with_clean_up(self: Any, run: str) -> list[float | int]:
    """Attempt 0 calls ``self.retry(countdown=0)``, whose message goes out before its
    ``finally:`` clean-up (50 steps, 5 ms apart) runs under the lock; attempt 1 records
    when it entered and returns [its entry, its fence, attempt 0's fence]."""
    from celery_mutex import current_lease

    lease = current_lease()
    assert lease is not None
    if self.request.retries == 0:
        _record.set(f"{PREFIX}fence.{run}", lease.fence, ex=300)
        try:
            raise self.retry(countdown=0)
        finally:
            for _ in range(50):
                _step(run)
                time.sleep(0.005)
    return [time.monotonic(), lease.fence, int(_record.get(f"{PREFIX}fence.{run}") or 0)]


@task_postrun.connect
def _linger_after_the_retry(sender: Any = None, state: str | None = None, **_: Any) -> None:
    """``retried_then_killed``'s attempt 0: its child lingers after the body (its lock
    released, its retry sent), its pid in "<prefix>pid.<run>", until it is killed."""
    if getattr(sender, "name", "").endswith(".retried_then_killed") and state == "RETRY":
        _record.set(f"{PREFIX}pid.{sender.request.args[0]}", os.getpid(), ex=300)
        time.sleep(60)


@app.task(
    base=MutexTask, bind=True,
    mutex={"key": "steps.{run}", "on_busy": "raise", **STEPS_LEASE},
)  # fmt: skip
def retried_then_killed(self: Any, run: str) -> int:
    """Attempt 0 retries at once (its child then lingers: ``_linger_after_the_retry``);
    attempt 1 takes the key, records "<prefix>entered.<run>", and holds it, writing a
    step every 50 ms, until "<prefix>go.<run>" is set (60 s at most)."""
    from celery_mutex import current_lease

    if self.request.retries == 0:
        raise self.retry(countdown=0)
    lease = current_lease()
    assert lease is not None
    _record.set(f"{PREFIX}entered.{run}", time.monotonic(), ex=300)
    deadline = time.monotonic() + 60
    while not _record.get(f"{PREFIX}go.{run}") and time.monotonic() < deadline:
        _step(run)
        time.sleep(0.05)
    return lease.fence


@app.task(
    base=MutexTask, bind=True, time_limit=3,
    mutex={"key": "steps.{run}", "on_busy": "raise", "lease": 20, "renew": True},
)  # fmt: skip
def retried_past_its_time_limit(self: Any, run: str) -> float:
    """Attempt 0 sends its retry (``throw=False``) and keeps the key past its 3 s hard
    time limit, which kills its child; attempt 1 (the other child) waits for its earlier
    attempt, then records when it entered ("<prefix>entered.<run>"; attempt 0's start:
    "<prefix>started.<run>")."""
    if self.request.retries == 0:
        _record.set(f"{PREFIX}started.{run}", time.monotonic(), ex=300)
        self.retry(countdown=0, throw=False)
        time.sleep(60)
    entered = time.monotonic()
    _record.set(f"{PREFIX}entered.{run}", entered, ex=300)
    return entered


class _SaysWhenItWaits(MutexTask):
    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        _record.set(f"{PREFIX}waiting.{args[0]}", time.monotonic(), ex=300)
        super().before_start(task_id, args, kwargs)


@app.task(
    base=_SaysWhenItWaits,
    mutex={"key": "steps.{run}", "on_busy": "wait", "timeout": 200, **STEPS_LEASE},
)
def waiter(run: str) -> float:
    """Waits for "steps.<run>" and records when it got it."""
    entered = time.monotonic()
    _record.set(f"{PREFIX}entered.{run}", entered, ex=300)
    return entered


@app.task(base=MutexTask, acks_late=True, mutex={"key": "rej.{order_id}", "enqueue": "return"})
def rejects(order_id: int, requeue: bool) -> str:
    """Rejects its message (``Reject``). With ``requeue`` it runs again, and that second
    run waits (at most 20 s) for the test to set ``<prefix>go.<order_id>``."""
    from celery.exceptions import Reject

    if not requeue:
        raise Reject("never", requeue=False)
    if _record.incr(f"{PREFIX}runs.{order_id}") == 1:
        raise Reject("not now", requeue=True)
    deadline = time.monotonic() + 20
    while not _record.exists(f"{PREFIX}go.{order_id}") and time.monotonic() < deadline:
        time.sleep(0.05)
    return "ran"


@app.task(base=MutexTask, mutex={"key": "dd.{order_id}", "on_busy": "skip", "enqueue": "return"})
def dedup_skip(order_id: int) -> str:
    """A de-duplicated call (the celery-singleton idiom) that holds its key 0.3 s."""
    time.sleep(0.3)
    return "ran"


@app.task(base=MutexTask, mutex={"key": "dd.{order_id}", "enqueue": "raise"})
def dedup_raise(order_id: int) -> str:
    """A call refused while an equal one is queued (the celery-once idiom)."""
    time.sleep(0.5)
    return "ran"


@app.task
def tail(previous: object, tag: str) -> dict[str, object]:
    """A plain task for the end of a chain, a chord's callback or a link: what it got."""
    _record.rpush(PREFIX + "tails", tag)
    return {"tag": tag, "got": previous}
