"""The in-process worker the Celery suites run their app's tasks on."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from celery.contrib.testing.worker import start_worker


@contextmanager
def threaded_worker(app: Any, redis_url: str) -> Iterator[None]:
    """A worker thread pool (8 threads) in this process for ``app``; the Redis it uses
    must answer (a missing server fails the test, it never skips it)."""
    redis.Redis.from_url(redis_url, socket_connect_timeout=2).ping()
    with start_worker(
        app, pool="threads", concurrency=8, perform_ping_check=False, shutdown_timeout=10
    ):
        yield
