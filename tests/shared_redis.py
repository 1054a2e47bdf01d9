"""The shared Redis the suites run against (REDIS_URL): a client that fails the run,
never skips it, when the server does not answer, and cleans up the run's keys."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


@contextlib.contextmanager
def shared_client(url: str, *patterns: str) -> Iterator[redis.Redis]:
    """A client of the server at ``url``; on exit the keys matching ``patterns`` (the
    run's own prefixes) are deleted and the client closed."""
    probe = redis.Redis.from_url(
        url, socket_timeout=2, socket_connect_timeout=2, retry=Retry(NoBackoff(), 0)
    )
    try:
        probe.ping()
    except redis.RedisError as exc:
        pytest.fail(
            f"no Redis answers at {url} ({exc!r}); start one (redis-server, or "
            "apt-get install -y redis-server) or point REDIS_URL at one"
        )
    finally:
        probe.close()
    conn = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)
    yield conn
    for pattern in patterns:
        for key in conn.scan_iter(match=pattern, count=1000):
            conn.delete(key)
    conn.close()


def ids_named(client: redis.Redis, name: str) -> set[int]:
    """The server's ids of the connections open under the client name ``name`` (the
    client list also shows every other test's and process's connections)."""
    return {int(c["id"]) for c in client.client_list() if c["name"] == name}


def still_listed(client: redis.Redis, name: str, ids: set[int], within: float = 3.0) -> set[int]:
    """Which of ``ids`` the server still lists after ``within`` seconds. A closed socket
    leaves the list when the server reads its end, and that read can come after a CLIENT
    LIST another connection sent meanwhile (CI saw one, on redis-py 4.6): a connection
    that was disconnected is gone within a few event-loop turns, one that was kept stays."""
    deadline = time.monotonic() + within
    while (left := ids & ids_named(client, name)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left
