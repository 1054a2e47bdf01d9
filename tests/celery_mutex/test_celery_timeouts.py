"""Celery's ``soft_time_limit`` landing while ``before_start`` waits for the key (issue
20.7), under a real ``celery worker -P prefork`` (Redis broker, results and locks).

``SoftTimeLimitExceeded`` is raised by the pool's signal handler in the child. Before, the
engine took it for a backend fault and kept waiting; the body ran after 4 s although the
worker logged "Soft time limit (1s) exceeded". Now the task fails with it, at once, and
its body never runs. A missing Redis fails the test."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest
from celery_support.processes import REDIS_URL, Processes
from workers import ReleaseLater

# isort: split
from simple_mutex import Mutex, cache_from_url

pytestmark = pytest.mark.integrations


def test_a_soft_time_limit_while_waiting_fails_the_task_and_skips_its_body():
    with tempfile.TemporaryDirectory() as tmp:
        procs = Processes("celery_support.timeouts_app", Path(tmp))
        try:
            procs.start_worker("w", concurrency=1)
            locks = Mutex(cache_from_url(REDIS_URL), prefix=procs.prefix, lease=60)
            holder = locks.acquire("soft.1")
            releaser = ReleaseLater(10, holder.release)  # long after the 1 s soft limit
            result = procs.app.send_task(
                "celery_support.timeouts_app.waits_under_a_soft_limit", args=(1,)
            )
            started = time.monotonic()
            with pytest.raises(Exception, match=r"SoftTimeLimitExceeded|[Ss]oft time limit"):
                result.get(timeout=30, propagate=True)
            took = time.monotonic() - started
            releaser.join(15)
            time.sleep(1)  # had the wait gone on, the body would run once the key is free
            assert procs.record.llen(f"{procs.prefix}ran.1") == 0, "the body ran anyway"
            assert took < 8, f"the task waited {took:.1f} s past its 1 s soft limit"
            assert result.state == "FAILURE"
        finally:
            procs.stop()
