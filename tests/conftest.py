"""Shared fixtures for the core suites: fresh caches and unique keys.

Nothing here is autouse, so backend suites written by others are not affected.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tiers
from alarms import Alarm
from servers import (  # the servers a session starts once: fixtures for every suite
    RedisServer,
    etcd_cluster,  # noqa: F401
    mongo_url,  # noqa: F401
    moto,  # noqa: F401
    seaweed,  # noqa: F401
)

from simple_mutex import DiskCache, InMemoryCache

# A shell without job control starts background commands with SIGINT ignored, and an
# ignored signal stays ignored across exec: every process the tests start would be deaf to
# Ctrl-C (the CLI's watch tests send it). A handled signal is reset at exec instead.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def memory_cache() -> InMemoryCache:
    """A fresh per-process cache."""
    return InMemoryCache()


@pytest.fixture(params=["memory", "disk"])
def any_cache(request: pytest.FixtureRequest, tmp_path: Path) -> InMemoryCache | DiskCache:
    """Each local cache in turn, for API tests that must hold on every tier."""
    return InMemoryCache() if request.param == "memory" else DiskCache(tmp_path / "locks")


@pytest.fixture
def alarm() -> Iterator[None]:
    """SIGALRM raises ``Alarm`` (a job timeout) for the test; at teardown a timer the test
    left set is cleared and the previous handler is back."""

    def ring(signum: int, frame: object) -> None:
        raise Alarm("the job's time is up")

    previous = signal.signal(signal.SIGALRM, ring)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def key() -> str:
    """A lock key no other test uses."""
    return f"test.{uuid.uuid4().hex[:12]}"


@pytest.fixture
def children() -> Iterator[list[Any]]:
    """Processes a test starts; any still alive at teardown are killed."""
    started: list[Any] = []
    yield started
    for proc in started:
        if proc.is_alive():
            proc.kill()
        proc.join(5)


@pytest.fixture
def redis_servers() -> Iterator[list[RedisServer]]:
    """Redis servers a test starts (tests/servers.py: own_redis); every one is stopped at
    teardown, whatever happened."""
    started: list[RedisServer] = []
    yield started
    for server in started:
        if server.proc is not None and server.proc.poll() is None:
            os.kill(server.pid, signal.SIGCONT)  # a frozen one ignores SIGTERM
        server.stop()


# -- tiers (tests/tiers.py): every test has one; the fast tier is guarded -----------------
def pytest_addoption(parser: pytest.Parser) -> None:
    tiers.addoption(parser)


def pytest_configure(config: pytest.Config) -> None:
    tiers.configure(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tiers.modify_items(config, items)


pytest_runtest_setup = pytest_runtest_call = pytest_runtest_teardown = tiers.guarded
