"""The app of the migration suite (tests/celery_mutex/test_compat.py): each peer behaviour
the Celery guide's migration table maps, as a task on the drop-in class (``once``: celery-once's
``QueueOnce``, ``singleton``: celery-singleton's ``Singleton``) and as the ``MutexTask``
the table maps it to (``mutex``). ``TASKS[behaviour][variant]`` is the task.

The drop-ins are configured only through the peers' own settings (``ONCE``,
``singleton_backend_url``), as a migrating app would be; ``mutex_prefix`` keeps this
run's keys apart from other runs on the shared Redis.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from celery import Celery
from celery.exceptions import Ignore

# isort: split
from celery_mutex import MutexTask
from celery_mutex.compat import QueueOnce, Singleton

REDIS_URL = "redis://127.0.0.1:6379/11"
RUN_ID = uuid.uuid4().hex[:10]
PREFIX = f"cmc{RUN_ID}."

app = Celery("celery_support.compat_app", set_as_current=False)
app.conf.update(
    broker_url=REDIS_URL,
    result_backend=REDIS_URL,
    task_default_queue=f"cmc-{RUN_ID}",
    broker_connection_retry_on_startup=True,
    mutex_prefix=PREFIX,
    # the peers' settings: the drop-ins' only lock cache
    ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": REDIS_URL}},
    singleton_backend_url=REDIS_URL,
)

RUNS: list[dict[str, Any]] = []  # bodies that ran (a thread pool: one list)
STARTED: list[tuple[str, object]] = []  # (run, n) of bodies that started


def _ran(run: str, n: object, start: float, **more: Any) -> None:
    RUNS.append({"run": run, "n": n, "start": start, "end": time.monotonic(), **more})


def hold(run: str, n: int, seconds: float = 0.4) -> int:
    """Holds its key ``seconds``, then records when it ran."""
    start = time.monotonic()
    STARTED.append((run, n))
    time.sleep(seconds)
    _ran(run, n, start)
    return n


def on_c(run: str, a: int, c: int) -> int:
    """Keyed on ``c`` alone by the tasks built from it."""
    start = time.monotonic()
    time.sleep(0.4)
    _ran(run, (a, c), start)
    return a


def retry_once(self: Any, run: str, n: int) -> int:
    """Retries itself once, 0.6 s later: the key stays taken meanwhile."""
    _ran(run, n, time.monotonic(), retries=self.request.retries)
    if self.request.retries == 0:
        raise self.retry(countdown=0.6)
    return int(self.request.retries)


def end_as(run: str, how: str) -> str:
    """Ends the way ``how`` says: "return", "fail" or "ignore"."""
    _ran(run, how, time.monotonic())
    if how == "fail":
        raise KeyError(how)
    if how == "ignore":
        raise Ignore()
    return how


MUTEX = {"cache": REDIS_URL, "on_busy": "skip"}  # the table's MutexTask counterparts


def _tasks(body: Any, **variants: tuple[type[Any], dict[str, Any]]) -> dict[str, Any]:
    """One task per variant: (base class, task options)."""
    made = {}
    for variant, (base, options) in variants.items():
        name = f"{body.__name__}.{variant}.{len(TASKS)}"
        made[variant] = app.task(name=name, base=base, shared=False, **options)(body)
    return made


TASKS: dict[str, dict[str, Any]] = {}
TASKS["raises"] = _tasks(
    hold,
    once=(QueueOnce, {}),
    singleton=(Singleton, {"raise_on_duplicate": True}),
    mutex=(MutexTask, {"mutex": {**MUTEX, "enqueue": "raise"}}),
)
TASKS["returns"] = _tasks(
    hold,
    singleton=(Singleton, {}),
    mutex=(MutexTask, {"mutex": {**MUTEX, "enqueue": "return"}}),
)
TASKS["graceful"] = _tasks(
    hold,
    once=(QueueOnce, {"once": {"graceful": True}}),
    mutex=(MutexTask, {"mutex": {**MUTEX, "enqueue": "return"}}),
)
TASKS["by_name"] = _tasks(
    hold,
    once=(QueueOnce, {"once": {"keys": []}}),
    singleton=(Singleton, {"unique_on": []}),
    mutex=(MutexTask, {"mutex": {**MUTEX, "key": [], "enqueue": "raise"}}),
)
TASKS["on_c"] = _tasks(
    on_c,
    once=(QueueOnce, {"once": {"keys": ["c"]}}),
    singleton=(Singleton, {"unique_on": "c"}),
    mutex=(MutexTask, {"mutex": {**MUTEX, "key": ["c"], "enqueue": "raise"}}),
)
TASKS["expiry"] = _tasks(
    hold,
    once=(QueueOnce, {"once": {"timeout": 0.5}}),
    singleton=(Singleton, {"lock_expiry": 0.5}),
    mutex=(MutexTask, {"mutex": {**MUTEX, "enqueue": "raise", "enqueue_ttl": 0.5}}),
)
TASKS["unlock"] = _tasks(
    hold,
    once=(QueueOnce, {"once": {"unlock_before_run": True}}),
    mutex=(
        MutexTask,
        {"mutex": {**MUTEX, "enqueue": "raise", "enqueue_until": "start", "on_busy": "retry"}},
    ),
)
TASKS["retry"] = _tasks(
    retry_once,
    once=(QueueOnce, {"bind": True, "max_retries": 1}),
    singleton=(Singleton, {"bind": True, "max_retries": 1}),
    mutex=(MutexTask, {"bind": True, "max_retries": 1, "mutex": {**MUTEX, "enqueue": "raise"}}),
)
TASKS["endings"] = _tasks(
    end_as,
    once=(QueueOnce, {}),
    singleton=(Singleton, {}),
    mutex=(MutexTask, {"mutex": {**MUTEX, "enqueue": "raise"}}),
)
