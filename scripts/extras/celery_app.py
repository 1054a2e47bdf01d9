"""The Celery app a real ``celery worker`` imports during scripts/check_extras.sh.

Broker and lock cache come from CHECK_BROKER and CHECK_CACHE, so one module serves the
RabbitMQ check (``celery`` alone) and the Redis one (``celery,redis``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from celery import Celery

from celery_mutex import MutexTask, current_lease

app = Celery("check_extras", set_as_current=False)
app.conf.update(
    broker_url=os.environ["CHECK_BROKER"],
    mutex_cache=os.environ["CHECK_CACHE"],
    mutex_prefix=f"check-extras-{os.environ['CHECK_RUN']}.",
    task_default_queue=f"check-extras-{os.environ['CHECK_RUN']}",
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
)


@app.task(base=MutexTask, mutex={"key": "order.{order_id}", "on_busy": "retry"})
def charge(order_id: int, out: str) -> None:
    """Write what the worker saw while it held the lock: the check reads it back."""
    lease = current_lease()
    assert lease is not None, "MutexTask ran the body without a lease"
    Path(out).write_text(json.dumps({"key": lease.key, "fence": lease.fence, "pid": os.getpid()}))
