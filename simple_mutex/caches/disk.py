"""DiskCache: one machine. SQLite from the standard library, in WAL mode.

Why SQLite and not lock files: each operation is one SQL statement, and SQLite's commit is
atomic across processes (its own file locks) and survives a writer killed mid-write (the
journal rolls it back); a lock file plus a record file would need both proved by hand.
In WAL mode with ``synchronous=NORMAL`` a commit does not wait for ``fsync``: a process
crash loses nothing, and a power cut can lose the last commits but never corrupts the file
(a lost lock record after a power cut is harmless: every holder died with the machine).

Expiry is judged by this machine's wall clock, shared by every process on it. A freed
key keeps its row (value NULL) so its fence keeps growing across releases and expiries.
Not for network file systems: SQLite's locking is unreliable on NFS.
"""

from __future__ import annotations

import asyncio
import os
import random
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from simple_mutex import forksafe
from simple_mutex.contract import Entry
from simple_mutex.errors import ConstraintError, MalfunctionError, SimpleCacheConditionError

FILENAME = "simple-mutex.sqlite3"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    key TEXT PRIMARY KEY,
    value TEXT,              -- NULL once freed; the row stays for its fence
    version TEXT NOT NULL,
    fence INTEGER NOT NULL,
    expires_at REAL NOT NULL
) WITHOUT ROWID
"""

# Insert, or take over a freed or expired row; the fence counts every grant.
_PUT = """
INSERT INTO entries (key, value, version, fence, expires_at) VALUES (?1, ?2, ?3, 1, ?4)
ON CONFLICT (key) DO UPDATE
    SET value = excluded.value, version = excluded.version,
        fence = entries.fence + 1, expires_at = excluded.expires_at
    WHERE entries.value IS NULL OR entries.expires_at <= ?5
RETURNING fence
"""
_GET = """
SELECT value, version, fence, expires_at FROM entries
WHERE key = ?1 AND value IS NOT NULL AND expires_at > ?2
"""
_CAS = """
UPDATE entries SET value = ?2, version = ?3, expires_at = ?4
WHERE key = ?1 AND version = ?5 AND value IS NOT NULL AND expires_at > ?6
RETURNING fence
"""
_DELETE = """
UPDATE entries SET value = NULL
WHERE key = ?1 AND version = ?2 AND value IS NOT NULL AND expires_at > ?3
"""


class DiskCache:
    name = "disk"

    def __init__(
        self, path: str | os.PathLike[str], *, clock: Callable[[], float] = time.time
    ) -> None:
        if not str(path):
            raise ConstraintError("DiskCache needs a directory path, got an empty one")
        directory = Path(path)
        if directory.exists() and not directory.is_dir():
            raise ConstraintError(
                f"DiskCache path {str(directory)!r} is a file; pass a directory (it holds "
                f"{FILENAME})"
            )
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConstraintError(
                f"DiskCache could not create directory {str(directory)!r}: {exc}; pass a "
                "writable directory"
            ) from None
        self.path = directory / FILENAME
        self._clock = clock
        self._guard = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        forksafe.register(self)
        self._one("open", "SELECT 1", ())

    def _before_fork(self) -> None:
        # SQLite must not see a connection carried across fork(), even one the child never
        # uses: its per-process lock bookkeeping would be copied in a state the child does
        # not own (children then hung opening their own). Close it; it reopens on next use.
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _after_fork(self) -> None:
        pass

    def _connect(self) -> sqlite3.Connection:
        # Autocommit: every statement is its own transaction. 10 s bounds a wait for the
        # write lock; another process holds it for microseconds, so only a wedged disk hits it.
        conn = sqlite3.connect(
            self.path, timeout=10.0, isolation_level=None, check_same_thread=False
        )
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute(_SCHEMA)
        return conn

    def _run(self, operation: str, sql: str, params: tuple[object, ...]) -> sqlite3.Cursor:
        """Run one statement (caller holds ``_guard``), faults named for the user."""
        try:
            if self._conn is None:
                self._conn = self._connect()
            return self._conn.execute(sql, params)
        except sqlite3.Error as exc:
            raise MalfunctionError(
                f"disk cache at {str(self.path)!r} failed during {operation}: {exc}"
            ) from exc

    def _one(self, operation: str, sql: str, params: tuple[object, ...]) -> Any:
        # A plain lock, not a contextmanager: this is the hot path of every operation.
        with self._guard:
            return self._run(operation, sql, params).fetchone()

    def get(self, key: str) -> Entry | None:
        row = self._one("get", _GET, (key, self._clock()))
        return None if row is None else Entry(row[0], row[1], row[2], row[3])

    def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:
        now = self._clock()
        version = _new_version()
        row = self._one("put_if_absent", _PUT, (key, value, version, now + ttl, now))
        if row is not None:
            return Entry(value, version, row[0], now + ttl)
        current = self._one("put_if_absent", _GET, (key, now))
        if current is not None and current[0] == value:
            return Entry(current[0], current[1], current[2], current[3])
        raise SimpleCacheConditionError(f"disk: {key!r} is held")

    def compare_and_set(self, key: str, value: str, *, ttl: float, version: str) -> Entry:
        now = self._clock()
        new_version = _new_version()
        row = self._one("compare_and_set", _CAS, (key, value, new_version, now + ttl, version, now))
        if row is None:
            raise SimpleCacheConditionError(f"disk: {key!r} is not at version {version}")
        return Entry(value, new_version, row[0], now + ttl)

    def compare_and_delete(self, key: str, *, version: str) -> None:
        with self._guard:
            changed = self._run("compare_and_delete", _DELETE, (key, version, self._clock()))
            count = changed.rowcount
        if count != 1:
            raise SimpleCacheConditionError(f"disk: {key!r} is not at version {version}")

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        # SQLite has no change notification across processes: the engine's jittered poll
        # is the whole strategy here.
        time.sleep(timeout)

    async def wait_async(self, keys: Sequence[str], timeout: float) -> None:
        # Never a thread per waiter: an async poll is just a sleep on the loop.
        await asyncio.sleep(timeout)


def _new_version() -> str:
    return f"{random.getrandbits(64):016x}"
