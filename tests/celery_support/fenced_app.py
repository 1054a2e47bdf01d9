"""A real ``celery worker`` app whose MutexTask body writes through the fence guard:
the Celery guide's recipe (``fenced_update(..., fence=current_lease().fence)``)."""

from __future__ import annotations

import os

import psycopg
from celery import Celery

# isort: split
from celery_mutex import MutexTask, current_lease
from simple_mutex.fenced import fenced_update

POSTGRES_URL = os.environ.get("POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
app = Celery("celery_support.fenced_app", set_as_current=False)
app.conf.update(
    broker_url=os.environ.get("CM_BROKER", "redis://127.0.0.1:6379/11"),
    result_backend=os.environ.get("CM_BACKEND", "redis://127.0.0.1:6379/11"),
    task_default_queue=os.environ.get("CM_QUEUE", "cmtest"),
    mutex_cache=os.environ.get("CM_CACHE", "redis://127.0.0.1:6379/11"),
    mutex_prefix=os.environ.get("CM_PREFIX", "cmtest."),
    broker_connection_retry_on_startup=True,
)


@app.task(base=MutexTask, mutex={"key": "account.{account_id}", "on_busy": "wait"})
def set_balance(table: str, account_id: int, balance: int) -> int:
    """Writes the balance under the lease's fence; returns the fence it wrote with."""
    fence = current_lease().fence
    with psycopg.connect(POSTGRES_URL, autocommit=True) as db:
        written = fenced_update(
            db, table, {"id": account_id}, {"writer": str(balance)}, fence=fence
        )
    assert written == 1
    return fence
