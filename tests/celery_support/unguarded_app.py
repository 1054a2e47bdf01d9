"""Apps a worker checks as it starts, by ``CM_CASE``:

* ``forgot the base``: a task given ``mutex={...}`` without ``base=MutexTask`` (it would
  take no lock) beside a guarded one: the worker refuses.
* ``no cache``: no lock cache for any ``MutexTask`` (every call would fail): it refuses.
* ``one without a cache``: one ``MutexTask`` with a cache, one without: it starts and
  logs the second.
"""

from __future__ import annotations

import os

from celery_support.env_app import app_from_env

# isort: split
from celery_mutex import MutexTask

CASE = os.environ.get("CM_CASE", "forgot the base")
app = app_from_env("celery_support.unguarded_app")
if CASE == "no cache":
    app.conf.mutex_cache = None

if CASE == "forgot the base":

    @app.task(mutex={"key": "o.{order_id}", "on_busy": "skip"})
    def unguarded(order_id: int) -> None:
        """``base=MutexTask`` forgotten."""


@app.task(base=MutexTask, mutex={"key": "o.{order_id}", "on_busy": "skip"})
def guarded(order_id: int) -> None:
    """Fine, given a lock cache."""


if CASE == "one without a cache":

    @app.task(base=MutexTask, mutex={"key": "o.{order_id}", "cache": None})
    def uncached(order_id: int) -> None:
        """Every call fails: its own options take the app's cache away."""
