"""A real ``celery worker`` app whose MutexTask body writes through the fence guard:
the Celery guide's recipe (``fenced_update(..., fence=current_lease().fence)``)."""

from __future__ import annotations

import os

import psycopg

from celery_support.env_app import app_from_env

# isort: split
from celery_mutex import MutexTask, current_lease
from simple_mutex.fenced import fenced_update

POSTGRES_URL = os.environ.get("POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
# Celery's default prefetch, as this app always had: the writers contend as they queue.
app = app_from_env("celery_support.fenced_app", worker_prefetch_multiplier=4)


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
