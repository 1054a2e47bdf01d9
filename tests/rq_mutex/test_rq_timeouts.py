"""RQ's own ``job_timeout`` landing while ``mutex_job`` waits for its key (issue 20.7).

RQ raises ``JobTimeoutException`` from its SIGALRM handler in the work horse. Before, the
engine took it for a backend fault, kept waiting, and ran the body once the key was free:
a job with ``job_timeout=1`` finished SUCCESSFUL after 9 s. Now it fails at its timeout
and its body never runs. A real forking ``Worker`` (burst) and the Redis at
127.0.0.1:6379 db 12; a missing server fails the test."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from rq.job import JobStatus
from rq_support import timeouts
from rq_support.workers import Worker  # RQ's, but a shutdown never waits a minute
from workers import ReleaseLater

from rq_mutex import Queue
from simple_mutex import Mutex
from simple_mutex.caches import RedisCache

pytestmark = pytest.mark.integrations


def test_a_job_timeout_while_waiting_fails_the_job_and_skips_its_body():
    conn = redis.Redis.from_url(timeouts.REDIS_URL, socket_connect_timeout=2)
    run = uuid.uuid4().hex[:10]
    queue = Queue(f"rqto-{run}", connection=conn)
    holder = Mutex(RedisCache(conn), lease=30).acquire(f"timeout.{run}")
    releaser = ReleaseLater(8, holder.release)  # long after the job's 1 s timeout
    job = queue.enqueue(timeouts.waits_for_its_key, run, job_timeout=1)
    started = time.monotonic()
    Worker([queue], connection=conn).work(burst=True)
    took = time.monotonic() - started
    releaser.join(10)
    job.refresh()
    assert job.get_status() == JobStatus.FAILED
    result = job.latest_result()
    assert result is not None
    assert "JobTimeoutException" in (result.exc_string or "")
    assert conn.llen(f"rqt:{run}:ran") == 0, "the body ran after the job timed out"
    assert took < 6, f"the job waited {took:.1f} s, past its 1 s timeout"


def test_a_job_timeout_at_the_blocks_door_leaves_no_record(monkeypatch):
    """The job's alarm landing in ``Lease.__enter__`` (its first line, where no
    ``__exit__`` follows): the job fails with it and its key is free at once, not held
    for its lease (a reviewer saw 7 of 2500 synchronous jobs leave their key held)."""
    from rq.timeouts import JobTimeoutException

    from simple_mutex import Lease

    original, fired = Lease._sync, []

    def ring_once(self, method):  # type: ignore[no-untyped-def]
        if not fired:
            fired.append(method)
            raise JobTimeoutException("Task exceeded maximum timeout value")
        return original(self, method)

    monkeypatch.setattr(Lease, "_sync", ring_once)
    conn = redis.Redis.from_url(timeouts.REDIS_URL, socket_connect_timeout=2)
    run = uuid.uuid4().hex[:10]
    queue = Queue(f"rqto-{run}", connection=conn, is_async=False)
    job = queue.enqueue(timeouts.waits_for_its_key, run)
    assert fired == ["__enter__"]
    assert job.get_status() == JobStatus.FAILED
    assert not Mutex(RedisCache(conn)).locked(f"timeout.{run}"), "the key stayed held"
