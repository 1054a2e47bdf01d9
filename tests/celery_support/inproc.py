"""An app with every task the in-process Celery suite runs (thread pool worker)."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from celery import Celery
from celery.exceptions import Ignore

# isort: split
from celery_mutex import MutexTask, current_lease

REDIS_URL = "redis://127.0.0.1:6379/11"
RUN_ID = uuid.uuid4().hex[:10]
PREFIX = f"cmt{RUN_ID}."
QUEUE = f"cmt-{RUN_ID}"

app = Celery("celery_support.inproc", set_as_current=False)
app.conf.update(
    broker_url=REDIS_URL,
    result_backend=REDIS_URL,
    task_default_queue=QUEUE,
    mutex_cache=REDIS_URL,
    mutex_prefix=PREFIX,
    broker_connection_retry_on_startup=True,
)

RUNS: list[tuple[str, Any]] = []  # (task, argument) of bodies that ran (thread pool: shared)
_gauge = threading.Lock()
CONCURRENCY = {"now": 0, "max": 0}

FAST = {"countdown": 0.05, "backoff": 1.5, "cap": 0.2}


@app.task(base=MutexTask, mutex={"key": "order.{order_id}", "on_busy": "skip"})
def skip_task(order_id: int, amount: int = 0) -> str:
    RUNS.append(("skip_task", order_id))
    return "ran"


@app.task(base=MutexTask, mutex={"key": "order.{order_id}", "on_busy": "raise"})
def raise_task(order_id: int) -> str:
    RUNS.append(("raise_task", order_id))
    return "ran"


@app.task(
    base=MutexTask,
    bind=True,
    max_retries=0,
    mutex={"key": "order.{order_id}", "on_busy": "retry", "retry": FAST},
)
def retry_task(self: Any, order_id: int) -> dict[str, Any]:
    RUNS.append(("retry_task", order_id))
    busy = getattr(self.request, "mutex_busy_retries", 0)
    return {"retries": self.request.retries, "busy_retries": busy}


@app.task(base=MutexTask, mutex={"key": "order.{order_id}", "on_busy": "wait", "timeout": 5})
def wait_task(order_id: int) -> str:
    return "ran"


@app.task(base=MutexTask, mutex={"key": "order.{order_id}", "on_busy": "wait", "timeout": 0.3})
def wait_short(order_id: int) -> str:
    return "ran"


@app.task(
    base=MutexTask,
    mutex={"key": "order.{order_id}", "on_busy": "raise", "lease": 0.4, "renew": False},
)
def lose_lease(order_id: int) -> str:
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:  # pure Python: the interrupt lands at once
        pass
    RUNS.append(("lose_lease", order_id))
    return "finished"


@app.task(base=MutexTask, mutex={"key": "order.{order_id}", "lease": 0.6, "renew": True})
def long_renewed(order_id: int) -> str:
    time.sleep(1.5)  # > the lease: renewal keeps it
    return "ran"


@app.task(base=MutexTask, mutex={"key": "order.{order_id}", "on_busy": "raise"})
def lease_info(order_id: int) -> dict[str, Any]:
    lease = current_lease()
    assert lease is not None
    return {"key": lease.key, "fence": lease.fence, "expires": lease.expires_at.isoformat()}


@app.task(base=MutexTask, bind=True, mutex={"key": "order.{order_id}", "on_busy": "raise"})
def self_retry(self: Any, order_id: int) -> int:
    RUNS.append(("self_retry", self.request.retries))
    if self.request.retries == 0:
        retry = self.retry(countdown=0, throw=False)
        time.sleep(0.3)  # the retry (same task id) arrives meanwhile and waits for us
        RUNS.append(("self_retry unwound", time.monotonic()))
        raise retry
    RUNS.append(("self_retry entered", time.monotonic()))
    return int(self.request.retries)


@app.task(base=MutexTask, mutex={"key": "order.{order_id}", "on_busy": "raise"})
def fail_task(order_id: int) -> None:
    raise KeyError("boom")


@app.task(base=MutexTask, mutex={"key": "order.{order_id}", "on_busy": "raise"})
def ignore_task(order_id: int) -> None:
    raise Ignore()


@app.task(base=MutexTask, mutex={"key": "pool", "permits": 3, "on_busy": "wait", "timeout": 10})
def sem_task(n: int) -> int:
    with _gauge:
        CONCURRENCY["now"] += 1
        CONCURRENCY["max"] = max(CONCURRENCY["max"], CONCURRENCY["now"])
    time.sleep(0.15)
    with _gauge:
        CONCURRENCY["now"] -= 1
    return n


@app.task(
    base=MutexTask, mutex={"key": "order.{order_id}", "on_busy": "raise", "enqueue": "return"}
)
def queued_once(order_id: int) -> str:
    time.sleep(0.5)
    return "ran"


@app.task(base=MutexTask, mutex={"key": "order.{order_id}", "enqueue": "raise"})
def queued_raise(order_id: int) -> str:
    time.sleep(0.5)
    return "ran"


@app.task(
    base=MutexTask,
    mutex={"key": "order.{order_id}", "on_busy": "retry", "enqueue": "return", "retry": FAST},
)
def queued_retry(order_id: int) -> str:
    RUNS.append(("queued_retry", order_id))
    return "ran"


@app.task(base=MutexTask, mutex={"key": "replace.{order_id}", "on_busy": "replace", "lease": 30})
def replace_task(order_id: int, name: str, seconds: float) -> str:
    """Runs ``seconds`` unless a newer call of its order replaces it."""
    RUNS.append(("replace_task", (order_id, name, current_lease().fence)))
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.01)
    RUNS.append(("replace_done", (order_id, name)))
    return name
