"""pytest plugin (entry point ``simple_mutex``): fixtures for testing code that locks.

Inert unless a test uses its fixtures (or imports celery_mutex / rq_mutex, whose
per-process state it resets between tests, so each test sees the settings it set):

* ``mutex_cache``: a fresh ``InMemoryCache`` per test; with ``--mutex-cache-url URL``, a
  cache on that URL under a prefix of the test's own (run the same suite on your Redis).
* ``faulty_cache``: a ``simple_mutex.testing.FaultyCache`` over a fresh in-memory cache.
* ``mutex_events``: the ``LockEvent`` list of everything that happened during the test.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from . import events
from .caches import InMemoryCache, cache_from_url
from .contract import AnyCache
from .testing import FaultyCache, isolated


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--mutex-cache-url",
        default=None,
        help="run the mutex_cache fixture on this cache URL (redis://..., postgresql://...) "
        "instead of in memory; each test gets a prefix of its own",
    )


@pytest.fixture
def mutex_cache(request: pytest.FixtureRequest) -> AnyCache:
    """A cache no other test shares: in memory, or on --mutex-cache-url under a prefix."""
    url = request.config.getoption("--mutex-cache-url")
    if url is None:
        return InMemoryCache()
    return isolated(cache_from_url(url), f"t{uuid.uuid4().hex[:12]}.")


@pytest.fixture
def faulty_cache() -> Any:
    """A FaultyCache over a fresh InMemoryCache: ``fail``, ``delay``, ``lose_reply``,
    ``expire``."""
    return FaultyCache(InMemoryCache())


@pytest.fixture
def mutex_events() -> Iterator[list[events.LockEvent]]:
    """Every lock event of the test, in order."""
    seen: list[events.LockEvent] = []
    unsubscribe = events.subscribe(seen.append)
    yield seen
    unsubscribe()


@pytest.fixture(autouse=True)
def _mutex_fresh_settings() -> Iterator[None]:
    """Celery tasks and RQ jobs build their settings and caches once per process: forget
    them after each test that may have changed them (only where those packages are used)."""
    yield
    if "celery_mutex" in sys.modules or "rq_mutex" in sys.modules:
        from .busy import reset

        reset()
