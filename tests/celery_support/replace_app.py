"""The app the ``on_busy="replace"`` suite's ``celery worker -P prefork`` subprocesses run.

``writer`` holds ``doc.<doc>`` and runs ``replaced_writer.Writer.loop``: a fenced write
every 20 ms, each outcome logged; a newer call of the same key replaces it. Configured
from ``CM_*`` like ``celery_support.app``.
"""

from __future__ import annotations

import os

import redis
from replaced_writer import STORE_URL, Writer

from celery_support.env_app import app_from_env

# isort: split
from celery_mutex import MutexTask, current_lease
from simple_mutex import SimpleMutexLeaseExpiredError

app = app_from_env("celery_support.replace_app")
PREFIX: str = app.conf.mutex_prefix
LEASE = float(os.environ.get("CM_LEASE", "30"))
_writer = Writer(redis.Redis.from_url(app.conf.mutex_cache), PREFIX)
__all__ = ["STORE_URL", "app", "writer", "writer_retrying"]


@app.task(base=MutexTask, mutex={"key": "doc.{doc}", "on_busy": "replace", "lease": LEASE})
def writer(doc: str, name: str, writes: int, deaf: bool = False) -> str:
    """``writes`` fenced writes under the key (``Writer.loop``)."""
    return _writer.loop(doc, name, writes, current_lease().fence, deaf)


@app.task(
    base=MutexTask,
    mutex={"key": "doc.{doc}", "on_busy": "replace", "lease": LEASE},
    autoretry_for=(SimpleMutexLeaseExpiredError,),
    retry_kwargs={"max_retries": 2, "countdown": 1},
)
def writer_retrying(doc: str, name: str, writes: int) -> str:
    """``writer`` that retries itself when it loses its lease (a replaced call's retry
    must not take the key back from the call that replaced it)."""
    return _writer.loop(doc, name, writes, current_lease().fence)
