"""Fenced stores: the downstream resource a lock protects. Each enforces the fence rule
itself, in one atomic step: a write is accepted only if its fence is >= the last accepted
fence of its key (the README's ``UPDATE ... WHERE fence <= :f``), and every accepted write
is appended to the store's own log, in the store's order. The checker re-verifies the rule
from the history and from that log, independently of the verdicts the store returned.

A store is always on a server the nemesis never breaks (the shared Redis or PostgreSQL, or
a SQLite file), so that a fault dealt to the lock's server cannot hide in the store.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from typing import Any, Protocol

Write = tuple[int, str, int, str]  # store order, key, fence, writer


class FencedStore(Protocol):
    def write(self, key: str, fence: int, writer: str) -> tuple[bool, int]:
        """Write if ``fence`` >= the key's last accepted fence; (accepted, last fence)."""

    def log(self) -> list[Write]:
        """The accepted writes, in the order the store accepted them."""

    def close(self) -> None: ...


def open_store(url: str) -> FencedStore:
    """``sqlite:///path``, ``redis://host:port/db?prefix=...``, ``postgresql://...?table=``."""
    if url.startswith("sqlite://"):
        return SqliteStore(url.removeprefix("sqlite://"))
    base, _, query = url.partition("?")
    name = query.partition("=")[2]
    if url.startswith("redis://"):
        return RedisStore(base, name)
    if url.startswith("postgresql://"):
        return PostgresStore(base, name)
    raise ValueError(f"no fenced store for {url!r}")


class SqliteStore:
    """One SQLite file shared by every process of a run (disk and memory tiers)."""

    def __init__(self, path: str) -> None:
        self._db = sqlite3.connect(path, timeout=60, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(
            "CREATE TABLE IF NOT EXISTS last (key TEXT PRIMARY KEY, fence INTEGER);"
            "CREATE TABLE IF NOT EXISTS accepted (seq INTEGER PRIMARY KEY AUTOINCREMENT,"
            " key TEXT, fence INTEGER, writer TEXT);"
        )

    def write(self, key: str, fence: int, writer: str) -> tuple[bool, int]:
        db = self._db
        for attempt in range(100):
            try:
                db.execute("BEGIN IMMEDIATE")
                break
            except sqlite3.OperationalError:  # locked past the timeout: a frozen writer
                time.sleep(0.05 * attempt)
        try:
            row = db.execute("SELECT fence FROM last WHERE key = ?", (key,)).fetchone()
            if row is not None and fence < row[0]:
                db.execute("COMMIT")
                return False, int(row[0])
            db.execute("INSERT OR REPLACE INTO last VALUES (?, ?)", (key, fence))
            db.execute("INSERT INTO accepted (key, fence, writer) VALUES (?, ?, ?)",
                       (key, fence, writer))  # fmt: skip
            db.execute("COMMIT")
            return True, fence
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def log(self) -> list[Write]:
        rows = self._db.execute("SELECT seq, key, fence, writer FROM accepted ORDER BY seq")
        return [(int(s), str(k), int(f), str(w)) for s, k, f, w in rows]

    def close(self) -> None:
        self._db.close()


# KEYS[1] the key's last fence, KEYS[2] the log; ARGV[1] fence, ARGV[2] writer.
# Returns {1, fence} when accepted, {0, last} when refused. Fences are below 2**53.
_REDIS_WRITE = """
local last = tonumber(redis.call('GET', KEYS[1]))
local fence = tonumber(ARGV[1])
if last ~= nil and fence < last then return {0, last} end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('RPUSH', KEYS[2], KEYS[1] .. ' ' .. ARGV[1] .. ' ' .. ARGV[2])
return {1, fence}
"""


class RedisStore:
    """A Lua compare-and-set on the shared Redis, under a run's own prefix."""

    def __init__(self, url: str, prefix: str) -> None:
        import redis

        self._conn = redis.Redis.from_url(url, socket_timeout=30)
        self._prefix = prefix
        self._script = self._conn.register_script(_REDIS_WRITE)

    def write(self, key: str, fence: int, writer: str) -> tuple[bool, int]:
        keys = [f"{self._prefix}last:{key}", f"{self._prefix}log"]
        ok, last = self._script(keys=keys, args=[fence, writer])
        return bool(ok), int(last)

    def log(self) -> list[Write]:
        rows = self._conn.lrange(f"{self._prefix}log", 0, -1)
        writes = []
        for seq, row in enumerate(rows):
            name, fence, writer = row.decode().split(" ")
            writes.append((seq, name.removeprefix(f"{self._prefix}last:"), int(fence), writer))
        return writes

    def drop(self) -> None:
        names = list(self._conn.scan_iter(match=f"{self._prefix}*", count=1000))
        for start in range(0, len(names), 500):
            self._conn.delete(*names[start : start + 500])

    def close(self) -> None:
        self._conn.close()


class PostgresStore:
    """A row per key and a log table on the shared PostgreSQL; one transaction per write
    (the key's row locked FOR UPDATE)."""

    def __init__(self, url: str, table: str) -> None:
        import psycopg

        self._conn: Any = psycopg.connect(url, autocommit=True, connect_timeout=10)
        self._last, self._log = f"{table}_last", f"{table}_log"
        for statement in (
            f"CREATE TABLE IF NOT EXISTS {self._last} (key TEXT PRIMARY KEY, fence BIGINT)",
            f"CREATE TABLE IF NOT EXISTS {self._log} (seq BIGSERIAL PRIMARY KEY, key TEXT,"
            " fence BIGINT, writer TEXT)",
        ):
            # Two sessions creating it at once: PostgreSQL's IF NOT EXISTS is not atomic
            # (pg_type's unique index). The winner's table is the one we need.
            with contextlib.suppress(psycopg.errors.UniqueViolation):
                self._conn.execute(statement)

    def write(self, key: str, fence: int, writer: str) -> tuple[bool, int]:
        with self._conn.transaction():
            self._conn.execute(
                f"INSERT INTO {self._last} VALUES (%s, NULL) ON CONFLICT DO NOTHING", (key,)
            )
            (last,) = self._conn.execute(
                f"SELECT fence FROM {self._last} WHERE key = %s FOR UPDATE", (key,)
            ).fetchone()
            if last is not None and fence < last:
                return False, int(last)
            self._conn.execute(f"UPDATE {self._last} SET fence = %s WHERE key = %s", (fence, key))
            self._conn.execute(
                f"INSERT INTO {self._log} (key, fence, writer) VALUES (%s, %s, %s)",
                (key, fence, writer),
            )
            return True, fence

    def log(self) -> list[Write]:
        rows = self._conn.execute(f"SELECT seq, key, fence, writer FROM {self._log} ORDER BY seq")
        return [(int(s), str(k), int(f), str(w)) for s, k, f, w in rows]

    def drop(self) -> None:
        self._conn.execute(f"DROP TABLE IF EXISTS {self._last}, {self._log}")

    def close(self) -> None:
        self._conn.close()
