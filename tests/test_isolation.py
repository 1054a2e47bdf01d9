"""Tests that may run at the same time (the pytest-xdist workers of a tier, a second suite
on the same machine) cannot reach each other's data: the proof, read off the sources.

What tests share is the machine's services (Redis at 6379, PostgreSQL at 5432, RabbitMQ at
5672). Each test writes there under names of its own (a uuid in its keys, prefixes,
queues, tables, databases and worker names: see the contributing guide, "The tiers").
What could still reach another test is a command that acts on a whole server, or a fixed
port. So:

* every command that acts on a whole server or on other clients' sessions (FLUSHALL,
  SCRIPT FLUSH, CLIENT KILL, CONFIG SET, SHUTDOWN, pg_terminate_backend, DROP TABLE,
  drop_database...) appears only where it is listed below, with the reason it cannot
  reach another test: the server is the test's own, or the name is;
* every port written in a test is one of the shared services'; any other server a test
  starts listens on ``free_port()``.

A new occurrence fails here until it is listed, with its reason.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

TESTS = Path(__file__).resolve().parent
SHARED_PORTS = {"6379", "5432", "5672"}

SERVER_WIDE = re.compile(
    r"\.(flushall|flushdb|script_flush|function_flush|config_set|config_rewrite|client_kill"
    r"|client_pause|shutdown|failover|replicaof|slaveof|drop_database)\("
    r"|(FLUSHALL|FLUSHDB|SCRIPT FLUSH|CONFIG SET|CLIENT KILL|CLIENT PAUSE|pg_terminate_backend"
    r"|DROP TABLE|DROP SCHEMA|DROP ROLE|DROP OWNED|DROP DATABASE|TRUNCATE|ALTER SYSTEM)"
)
PORT = re.compile(r"(?:\bport\s*=\s*|127\.0\.0\.1:|localhost:)(\d{2,5})\b")

# (file, command) -> (how many times it appears, why it cannot reach another test)
ALLOWED: dict[tuple[str, str], tuple[int, str]] = {
    ("test_faults.py", "flushall"): (1, "on the test's own redis-server (a free port)"),
    ("test_faults.py", "FLUSHALL"): (2, "a parameter's name for the flushall above"),
    ("test_faults.py", "pg_terminate_backend"): (
        2,
        "the sessions of an application_name of the test's own (and a comment)",
    ),
    ("test_faults.py", "replicaof"): (1, "the failover of the test's own replica"),
    ("servers.py", "shutdown"): (1, "RedisServer.shutdown: a server the test started"),
    ("caches/test_redis.py", "shutdown"): (2, "RedisServer.shutdown: the test's own server"),
    ("celery_mutex/test_celery_line.py", "shutdown"): (
        1,
        "RedisServer.shutdown: the test's own append-only lock cache, restarted",
    ),
    ("caches/test_redis.py", "script_flush"): (1, "on the test's own redis-server"),
    ("caches/test_redis.py", "SCRIPT FLUSH"): (2, "the docstrings of that test and another's"),
    ("caches/test_redis_async.py", "client_kill"): (
        1,
        "only the connections whose client name the test made up",
    ),
    ("caches/test_postgres.py", "pg_terminate_backend"): (
        2,
        "the backend pid of a session the test opened",
    ),
    ("caches/test_postgres_async.py", "pg_terminate_backend"): (
        3,
        "the backend pid of a session the test opened (and a docstring)",
    ),
    ("contrib/test_opentelemetry.py", "shutdown"): (2, "the test's own OpenTelemetry providers"),
    ("contrib/test_prometheus.py", "shutdown"): (1, "the test's own metrics HTTP server"),
    ("caches/test_mongo.py", "drop_database"): (1, "the module's database, named for its run"),
    ("caches/test_mongo_async.py", "drop_database"): (1, "the module's database, for its run"),
    ("caches/test_hostile.py", "drop_database"): (1, "hostile_<run>: the module's own"),
    ("caches/test_fences.py", "drop_database"): (2, "<run>_<clock>, <run>_stall: the module's"),
    ("caches/test_fences.py", "DROP TABLE"): (1, "a table named with a uuid by the test"),
    ("caches/test_hostile.py", "DROP TABLE"): (1, "hostile_<run>: the module's own"),
    ("caches/test_postgres.py", "DROP TABLE"): (
        4,
        "tables named with a uuid or the run (and a hostile table name, refused)",
    ),
    ("caches/test_postgres.py", "DROP SCHEMA"): (1, "evil_<run>: the module's own"),
    ("caches/test_postgres.py", "ALTER SYSTEM"): (1, "on the test's own server (own_server)"),
    ("caches/test_postgres.py", "DROP ROLE"): (2, "<run>_dml, <run>_role: the module's roles"),
    ("caches/test_postgres.py", "DROP OWNED"): (2, "by the module's own roles"),
    ("caches/test_fences.py", "DROP ROLE"): (1, "a role named for the run"),
    ("caches/test_fences.py", "DROP OWNED"): (1, "by a role named for the run"),
    ("test_secrets.py", "DROP ROLE"): (1, "sec_<run>: the test's own role"),
    ("test_secrets.py", "DROP OWNED"): (1, "by sec_<run>: the test's own role"),
    ("fenced/test_fenced.py", "DROP SCHEMA"): (1, "s_<uuid>: the test's own schema"),
    ("fenced/test_fenced.py", "DROP TABLE"): (3, "a table named with a uuid (and injected names)"),
    ("fenced_support.py", "DROP TABLE"): (1, "new_table's name: a uuid"),
    ("celery_mutex/test_celery_line.py", "DROP TABLE"): (1, "a lock table named for the run"),
    ("test_secrets.py", "DROP TABLE"): (1, "a table named with a uuid"),
    ("nemesis/store.py", "DROP TABLE"): (1, "the run's own tables, named for its id"),
}


def sources() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if p.name != Path(__file__).name)


def test_every_server_wide_command_is_listed_with_its_reason() -> None:
    found: Counter[tuple[str, str]] = Counter()
    for path in sources():
        for match in SERVER_WIDE.finditer(path.read_text()):
            found[(str(path.relative_to(TESTS)), match[1] or match[2])] += 1
    listed = {place: count for place, (count, _) in ALLOWED.items()}
    assert dict(found) == listed, (
        "a command that acts on a whole server appeared, moved or went: list it in ALLOWED "
        "with the reason it cannot reach another test (its own server, or names of its own)"
    )


# (file, port) -> why a port that is no shared service's is written there
PORTS_QUOTED = {
    ("test_docs.py", "2379"): "the etcd guide's example address, replaced by the test's own",
    ("admin/test_board.py", "41765"): "a Host header's port the page's host rule reads; no "
    "server listens on it",
}


def test_every_port_written_in_a_test_is_a_shared_service() -> None:
    others = [
        f"{path.relative_to(TESTS)}: {match[0]}"
        for path in sources()
        for match in PORT.finditer(path.read_text())
        if match[1] not in SHARED_PORTS
        and (str(path.relative_to(TESTS)), match[1]) not in PORTS_QUOTED
    ]
    assert not others, f"a fixed port: start the server on free_port() instead: {others}"
