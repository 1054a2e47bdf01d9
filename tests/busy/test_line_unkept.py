"""A line's parked calls live only in its cache: one on a Redis that keeps no data across a
restart is warned about where it is started (a Celery worker's start, an RQ worker's
first sweep that finds lines), naming the fix. Real ``redis-server`` processes of this
module's own: without persistence, with ``appendonly yes``, and with CONFIG renamed away
(as managed services do: trusted, no warning)."""

from __future__ import annotations

import asyncio
import logging
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio
from servers import RedisServer, free_port, own_redis

# isort: split
from simple_mutex.busy.line import Lines
from simple_mutex.caches import AsyncRedisCache, RedisCache

pytestmark = pytest.mark.backends


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, int]]:
    """Four servers: "none" (no save, appendonly no), "snapshots" (a save schedule,
    appendonly no), "aof" and "no-config"."""
    started: list[RedisServer] = []
    workdir = tmp_path_factory.mktemp("unkept")
    ports = {}
    try:
        for name, extra in {
            "none": (),
            "snapshots": ("--save", "3600 1"),
            "aof": ("--appendonly", "yes"),
            "no-config": ("--rename-command", "CONFIG", ""),
        }.items():
            ports[name] = free_port()
            own_redis(started, Path(workdir / name), ports[name], *extra)
        yield ports
    finally:
        for server in started:
            server.stop()


def _cache(port: int) -> RedisCache:
    return RedisCache(redis.Redis(port=port))


KEPT = {"none": "none", "snapshots": "snapshots", "aof": "append-only file", "no-config": None}


def test_the_cache_says_what_it_keeps_across_a_restart(servers: dict[str, int]) -> None:
    for name, kept in KEPT.items():
        assert _cache(servers[name]).persistence() == kept, name
        aio = AsyncRedisCache(redis.asyncio.Redis(port=servers[name]))
        assert asyncio.run(aio.persistence()) == kept, name
    none = Lines(_cache(servers["none"]), lease=10).unkept()
    assert none is not None
    assert "keeps no data across a restart" in none
    assert "appendonly yes" in none
    snapshots = Lines(_cache(servers["snapshots"]), lease=10).unkept()
    assert snapshots is not None
    assert "a crash loses the calls parked in them since" in snapshots
    assert Lines(_cache(servers["aof"]), lease=10).unkept() is None
    assert Lines(_cache(servers["no-config"]), lease=10).unkept() is None


def test_a_celery_worker_start_warns_of_a_line_in_a_redis_that_keeps_nothing(
    servers: dict[str, int], caplog: pytest.LogCaptureFixture
) -> None:
    from celery import Celery

    from celery_mutex import MutexTask
    from celery_mutex.startup import _check_at_start

    for name, warned in (("none", True), ("aof", False)):
        app = Celery(f"unkept-{name}", set_as_current=False, broker="memory://")
        app.conf.mutex_cache = f"redis://127.0.0.1:{servers[name]}/0"

        @app.task(shared=False, base=MutexTask, mutex={"key": "o.{n}", "on_busy": "queue"})
        def in_line(n: int) -> int:
            return n

        @app.task(shared=False, base=MutexTask, mutex={"key": "s.{n}", "on_busy": "skip"})
        def skipping(n: int) -> int:
            return n

        app.finalize()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="celery_mutex"):
            _check_at_start(sender=types.SimpleNamespace(app=app))
        said = [r.getMessage() for r in caplog.records if "keeps no data" in r.getMessage()]
        assert len(said) == (1 if warned else 0), (name, said)


def test_an_rq_worker_warns_once_at_its_first_sweep_that_finds_lines(
    servers: dict[str, int], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rq_mutex import Queue, Worker
    from rq_mutex.horses import LINE_KEEPER_ENV
    from rq_mutex.worker import LINE_CACHES

    monkeypatch.delenv(LINE_KEEPER_ENV, raising=False)  # the worker sets it: undone after
    # Its own Redis persists; the lines of a job's cache= of its own (named by URL) do not.
    own = redis.Redis(port=servers["aof"])
    elsewhere = redis.Redis(port=servers["none"])
    monkeypatch.setenv(LINE_CACHES, f"redis://127.0.0.1:{servers['none']}/0")
    worker = Worker([Queue("unkept", connection=own)], connection=own)
    with caplog.at_level(logging.WARNING, logger="rq_mutex"):
        worker.sweep_lines()  # no line yet: nothing said
        assert not [r for r in caplog.records if "keeps no data" in r.getMessage()]
        Lines(RedisCache(own), lease=10).take("order.7")
        Lines(RedisCache(elsewhere), lease=10).take("order.8")
        for _ in range(5):  # the URL is read again at every sweep: still said once
            worker.sweep_lines()
    said = [r.getMessage() for r in caplog.records if "keeps no data" in r.getMessage()]
    assert len(said) == 1, said
