"""The app the observability suite runs under a real ``celery worker -P prefork -E``, with
prometheus-client in multiprocess mode, set up as docs/guides/observability.md says:

* ``PROMETHEUS_MULTIPROC_DIR`` is set before the worker starts (by the test);
* ``instrument()`` runs at import, in the worker's main process, before the pool forks:
  every child inherits the subscriber and writes its own files;
* the main process serves every child's metrics on ``CM_METRICS_PORT``
  (``MultiProcessCollector``); a child that exits is marked dead, so the held gauge
  (``livesum``) forgets it.

Configured like ``celery_support.app`` from the ``CM_*`` variables.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import signals
from prometheus_client import CollectorRegistry, multiprocess, start_http_server
from workers import spin

from celery_support.env_app import app_from_env

# isort: split
from celery_mutex import MutexTask
from simple_mutex.contrib import prometheus

app = app_from_env("celery_support.metrics_app")

prometheus.instrument()


@signals.worker_init.connect
def serve_metrics(**_: Any) -> None:
    """One endpoint in the worker's main process for the metrics of all its children."""
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    start_http_server(int(os.environ["CM_METRICS_PORT"]), addr="127.0.0.1", registry=registry)


@signals.worker_process_shutdown.connect
def forget_child(pid: int, **_: Any) -> None:
    multiprocess.mark_process_dead(pid)


@app.task(base=MutexTask, mutex={"key": "hold", "on_busy": "skip"})
def hold(n: int) -> int:
    """Holds the one key 0.3 s; a run that finds it held is skipped."""
    time.sleep(0.3)
    return n


@app.task(
    base=MutexTask, mutex={"key": "lapse.{n}", "on_busy": "raise", "lease": 1, "renew": False}
)
def lapse(n: int) -> None:
    """Outlives its fixed 1 s lease: the lease is lost and the run fails."""
    spin(5)
