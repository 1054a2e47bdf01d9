"""DiskCache: one machine. SQLite from the standard library (WAL), and a futex gate.

Layout, in the directory you pass: ``simple-mutex.sqlite3`` holds one row per key locked
lately (``key, value, version, fence, expires_at, waiting``); ``simple-mutex.gate`` holds
the wake-up counters (``gate.py``: 4 KiB, fixed). Nothing else is created, ever.

* Each operation is one SQL statement, atomic across processes, rolled back if its writer
  dies mid-write. A grant's fence is max(the row's fence + 1, the clock in µs), the clock
  read inside the statement, under SQLite's write lock.
* A freed key keeps its row (value NULL) for ``gc_after`` seconds (60 by default); one
  grant in 64 looks at the next 1024 rows (a cursor in the store, shared by every process)
  and deletes those freed or expired as long ago. The clock floor keeps fences growing
  after that, even in a new directory (a tmpfs after a reboot).
* A grant over a row that expired with its value still there (its holder never freed
  it) says it took over (``Entry.took_over``); over a freed row, or a new one, it does
  not. Its version carries the mark (``common.TOOK_OVER``), so no column is added.
* Expiry is judged by this machine's wall clock, shared by every process on it.
* ``wait`` marks the held keys' rows and blocks on the gate until a release of a marked
  key, the earliest expiry of the keys (a crashed holder's lock is taken over as its
  lease ends), or the timeout. An unmarked release makes no system call.
* A crash loses nothing; a power cut can lose the last commits, never the file's
  integrity. Not for network file systems (SQLite's locking is unreliable there).

Rationale and figures: docs/design/disk.md.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from simple_mutex.caches._base import (
    DEFAULT_GC_AFTER,
    TOOK_OVER,
    CacheBase,
    fault,
    gc_after_seconds,
    gc_due,
    malformed,
    new_version,
    prefix_end,
    took_over_version,
)
from simple_mutex.contract import Entry
from simple_mutex.errors import ConstraintValueError, MalfunctionError, SimpleCacheConditionError

from .gate import open_gate

FILENAME = "simple-mutex.sqlite3"
GATE_FILENAME = "simple-mutex.gate"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    key TEXT PRIMARY KEY,
    value TEXT,              -- NULL once freed; the row stays gc_after for its fence
    version TEXT NOT NULL,
    fence INTEGER NOT NULL,
    expires_at REAL NOT NULL, -- the lease's end, or the moment it was freed
    waiting REAL             -- a waiter may block on the key until then: wake it
) WITHOUT ROWID
"""
# Where the collection goes on: the key it last reached, shared by every process (an
# index on expires_at would find the rows directly, but updating it made every lock
# cycle a third slower; walking the keys a slice at a time costs nothing on the cycle).
_SWEEP_SCHEMA = """
CREATE TABLE IF NOT EXISTS sweep (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    after TEXT NOT NULL      -- the last key the collection looked at
)
"""
_SWEEP_ROWS = 1024  # rows one pass looks at: 16 per grant on average


def numbered(params: Sequence[object]) -> dict[str, object]:
    """The statements' parameters by number (``?1`` is ``params[0]``): a statement reads
    one more than once. sqlite3 counts ``?NNN`` as named, so they are given as a mapping
    (a sequence for them is deprecated in Python 3.12 and refused from 3.14)."""
    return {str(number): value for number, value in enumerate(params, start=1)}


# Insert, or take over a freed or expired row; the fence is max(fence + 1, the clock in
# µs: clock_fence, in SQL), and the waiters marked for the last holder must mark again.
# Over a row its holder never freed (value not NULL: it lapsed) the version gets the
# TOOK_OVER mark: RETURNING shows only the new row, and the version says what the old was.
# The clock is read by a function SQLite calls inside the statement, after it took the
# write lock: a floor read before waiting for the lock (or the guard) would be stale by
# the time it lands, and a row granted and collected meanwhile would carry a larger fence
# (lifecycle rule 16). Registered as not deterministic (its value changes from call to
# call): SQLite calls it on every execution, never once for a prepared statement.
_CLOCK_FUNCTION = "simple_mutex_clock"

_PUT = f"""
INSERT INTO entries (key, value, version, fence, expires_at)
VALUES (?1, ?2, ?3, CAST({_CLOCK_FUNCTION}() * 1000000 AS INTEGER), ?4)
ON CONFLICT (key) DO UPDATE
    SET value = excluded.value,
        version = excluded.version || iif(entries.value IS NULL, '', '{TOOK_OVER}'),
        fence = max(entries.fence + 1, excluded.fence), expires_at = excluded.expires_at,
        waiting = NULL
    WHERE entries.value IS NULL OR entries.expires_at <= ?5
RETURNING fence, version
"""
_GET = """
SELECT value, version, fence, expires_at FROM entries
WHERE key = ?1 AND value IS NOT NULL AND expires_at > ?2
"""
# Live rows under a prefix: a range on the primary key (BINARY collation: the byte order
# of UTF-8, which is code point order), so the index finds them and no pattern is parsed.
_SCAN = """
SELECT key, value, version, fence, expires_at FROM entries
WHERE key >= ?1 AND (?2 IS NULL OR key < ?2) AND value IS NOT NULL AND expires_at > ?3
"""
_WAITED_ON = "SELECT waiting FROM entries WHERE key = ?1 AND waiting > ?2"
_CAS = """
UPDATE entries SET value = ?2, version = ?3, expires_at = ?4
WHERE key = ?1 AND version = ?5 AND value IS NOT NULL AND expires_at > ?6
RETURNING fence
"""
# Free the row, stamped with the moment: it is collected gc_after from now.
_DELETE = """
UPDATE entries SET value = NULL, expires_at = ?3
WHERE key = ?1 AND version = ?2 AND value IS NOT NULL AND expires_at > ?3
RETURNING waiting
"""
# The next slice of keys after ?1 (up to ?3 when given): its last key, its size, and how
# many of its rows were freed or expired before ?4 (live rows expire after now).
_SLICE = """
SELECT max(key), count(*), coalesce(sum(expires_at < ?4), 0) FROM (
    SELECT key, expires_at FROM entries WHERE key > ?1 AND (?3 IS NULL OR key <= ?3)
    ORDER BY key LIMIT ?2
)
"""
_COLLECT = "DELETE FROM entries WHERE key > ?1 AND key <= ?2 AND expires_at < ?3"
# Mark the keys that are held as waited for; each one's expiry.
_MARK = """
UPDATE entries SET waiting = ?1
WHERE key IN ({keys}) AND value IS NOT NULL AND expires_at > ?{now}
RETURNING expires_at
"""


class DiskCache(CacheBase):
    name = "disk"
    driver_errors: tuple[type[Exception], ...] = (sqlite3.Error,)

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        gc_after: float | None = DEFAULT_GC_AFTER,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``gc_after``: seconds a freed or expired key's row is kept (None: forever)."""
        self.gc_after = gc_after_seconds("DiskCache", gc_after)
        if not str(path):
            raise ConstraintValueError("DiskCache needs a directory path, got an empty one")
        directory = Path(path)
        if directory.exists() and not directory.is_dir():
            raise ConstraintValueError(
                f"DiskCache path {str(directory)!r} is a file; pass a directory (it holds "
                f"{FILENAME})"
            )
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConstraintValueError(
                f"DiskCache could not create directory {str(directory)!r}: {exc}; pass a "
                "writable directory"
            ) from None
        super().__init__()
        self.path = directory / FILENAME
        self._place = f" at {str(self.path)!r}"
        self._clock = clock
        self._conn: sqlite3.Connection | None = None
        self._gate = open_gate(directory / GATE_FILENAME)

    def _before_fork(self) -> None:
        # SQLite must not see a connection carried across fork(), even one the child never
        # uses: its per-process lock bookkeeping would be copied in a state the child does
        # not own (children then hung opening their own). Close it; it reopens on next use.
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __del__(self) -> None:
        # Close the connection with the cache. From Python 3.11 a sqlite3.Connection is in
        # a reference cycle (with its statement cache): dropped, it stays open until the
        # cyclic collector runs, out of reach of _before_fork (this cache has left the
        # fork registry). Carried open across a fork, SQLite's bookkeeping in each child
        # says the process holds the file's shared locks already, so the children take
        # none of their own (fcntl locks are not inherited); when the collector then
        # closes it in the parent, that close finds no other reader, checkpoints, and
        # deletes the -wal and -shm under the children: their later commits go to an
        # unlinked log (lost updates), and a process opening afterwards starts a new one
        # (two stores: one key granted twice).
        conn = self.__dict__.get("_conn")  # None as well when __init__ failed early
        if conn is not None:
            self._conn = None
            with contextlib.suppress(sqlite3.Error):  # closed already, at interpreter exit
                conn.close()

    def _connect(self) -> sqlite3.Connection:
        # Autocommit: every statement is its own transaction. 10 s bounds a wait for the
        # write lock; another process holds it for microseconds, so only a wedged disk hits it.
        conn = sqlite3.connect(
            self.path, timeout=10.0, isolation_level=None, check_same_thread=False
        )
        try:
            # The clock itself (time.time, a C function: the cheapest call back).
            conn.create_function(_CLOCK_FUNCTION, 0, self._clock, deterministic=False)
            _set_up(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def _run(
        self, operation: str, key: str, sql: str, params: tuple[object, ...], rows: bool = False
    ) -> Any:
        """Run one statement and read its reply (the first row, or every row with
        ``rows``), faults named for the user.

        The reply is read under the guard too: SQLite calls the clock function back while
        it holds the connection's mutex, which then waits for the GIL; a thread reading
        another statement's row from the same connection at that moment holds the GIL
        and waits for that mutex (a deadlock, seen as a hung acquire)."""
        # A plain lock, not a contextmanager: this is the hot path of every operation.
        with self._guard:
            try:
                if self._conn is None:
                    self._conn = self._connect()
                cursor = self._conn.execute(sql, numbered(params))
                return cursor.fetchall() if rows else cursor.fetchone()
            except sqlite3.Error as exc:
                raise fault(self.name, operation, key, exc, self._place) from exc

    def _entry(self, operation: str, key: str, row: tuple[Any, ...]) -> Entry:
        types = tuple(type(field) for field in row)
        if types == (str, str, int, float):
            return Entry(*row)
        names = ", ".join(t.__name__ for t in types)
        raise malformed(self.name, operation, key, f"a row of {names}")

    def get(self, key: str) -> Entry | None:
        row = self._run("get", key, _GET, (key, self._clock()))
        return None if row is None else self._entry("get", key, row)

    def scan(self, prefix: str) -> Iterator[tuple[str, Entry]]:
        bounds = (prefix, prefix_end(prefix), self._clock())
        found = self._run("scan", prefix, _SCAN, bounds, rows=True)
        return iter([(row[0], self._entry("scan", row[0], row[1:])) for row in found])

    def waited_on(self, key: str) -> bool:
        """Is a waiter blocked on ``key``? Its ``wait`` marked the row until its timeout."""
        return self._run("waited_on", key, _WAITED_ON, (key, self._clock())) is not None

    def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:
        now = self._clock()
        version = new_version()
        params = (key, value, version, now + ttl, now)
        won = self._run("put_if_absent", key, _PUT, params)
        if won is not None:
            if self.gc_after is not None and gc_due():
                # The grant stands whatever the collection meets (a full disk): the next
                # operation reports a lasting fault itself.
                with contextlib.suppress(MalfunctionError):
                    self.collect()
            return Entry(value, won[1], won[0], now + ttl, won[1] == took_over_version(version))
        row = self._run("put_if_absent", key, _GET, (key, now))
        current = None if row is None else self._entry("put_if_absent", key, row)
        if current is not None and current.value == value:
            return current  # our own earlier write, whose reply was lost
        raise SimpleCacheConditionError(f"disk: {key!r} is held")

    def compare_and_set(self, key: str, value: str, *, ttl: float, version: str) -> Entry:
        now = self._clock()
        new = new_version()
        params = (key, value, new, now + ttl, version, now)
        row = self._run("compare_and_set", key, _CAS, params)
        if row is None:
            raise SimpleCacheConditionError(f"disk: {key!r} is not at version {version}")
        return Entry(value, new, row[0], now + ttl)

    def compare_and_delete(self, key: str, *, version: str) -> bool | None:
        now = self._clock()
        freed = self._run("compare_and_delete", key, _DELETE, (key, version, now))
        if freed is None:
            raise SimpleCacheConditionError(f"disk: {key!r} is not at version {version}")
        if self._gate is None:
            return None
        # Only a key marked by a waiter costs a wake-up (a system call).
        return freed[0] is not None and freed[0] > now and self._gate.wake(self._gate.bucket(key))

    def collect(self) -> int:
        """One collection pass (run by one grant in 64): look at the next 1024 rows in key
        order, from where the last pass of any process stopped (round to the first key
        after the last), and delete those freed or expired more than ``gc_after`` ago; how
        many it deleted. Their keys' next fences come from the clock."""
        if self.gc_after is None:
            return 0
        before = self._clock() - self.gc_after
        with self._guard:
            try:
                if self._conn is None:
                    self._conn = self._connect()
                return _sweep(self._conn, before)
            except sqlite3.Error as exc:
                raise fault(self.name, "collect", "", exc, self._place) from exc

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        if not keys or timeout <= 0:
            return
        bucket = self._gate.bucket(keys[0]) if self._gate is not None else 0
        counter = self._gate.counter(bucket) if self._gate is not None else 0
        # Marked after reading the counter: a release from now on sees the mark and moves
        # the counter (gate.py); one before it left the key free, which the mark finds.
        distinct = tuple(dict.fromkeys(keys))
        now = self._clock()
        numbers = range(2, len(distinct) + 2)
        sql = _MARK.format(keys=",".join(f"?{n}" for n in numbers), now=len(distinct) + 2)
        params = (now + timeout + 1.0, *distinct, now)
        held = self._run("wait", keys[0], sql, params, rows=True)
        if len(held) < len(distinct):
            return  # a key is free already
        lapse = min((row[0] for row in held if type(row[0]) is float), default=now + timeout)
        pause = min(timeout, lapse - now)
        if self._gate is None:
            time.sleep(max(pause, 0.0))
        elif pause > 0:
            self._gate.block(bucket, counter, pause)


def _sweep(conn: sqlite3.Connection, before: float) -> int:
    """One pass. A look first, without the write lock: most passes find nothing to delete
    and the cursor where it was, and a write transaction costs a commit. Otherwise the
    same look again in one transaction, then the deletes and the cursor's move."""
    _, found, cursor, after = _slices(conn, before)
    if not found and cursor == after:
        return 0
    conn.execute("BEGIN IMMEDIATE")
    try:
        slices, _, cursor, after = _slices(conn, before)
        deleted = sum(
            conn.execute(_COLLECT, numbered((*bounds, before))).rowcount for bounds in slices
        )
        if cursor != after:
            conn.execute("INSERT OR REPLACE INTO sweep (id, after) VALUES (0, ?)", (cursor,))
        conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):  # a broken connection rolled back already
            conn.execute("ROLLBACK")
        raise
    return deleted


def _slices(conn: sqlite3.Connection, before: float) -> tuple[list[tuple[str, str]], int, str, str]:
    """The pass's slices, from the shared cursor to the last key, then from the first key
    on if that was short: their bounds, how many old rows they hold, the cursor after
    (the last slice's end; the start once every row was looked at), and before."""
    row = conn.execute("SELECT after FROM sweep WHERE id = 0").fetchone()
    after = row[0] if row is not None else ""
    slices, found, budget = [], 0, _SWEEP_ROWS
    for start, end in ((after, None), ("", after or None)):
        last, seen, old = conn.execute(_SLICE, numbered((start, budget, end, before))).fetchone()
        if seen:
            slices.append((start, last))
            found, budget = found + old, budget - seen
        if budget == 0:
            return slices, found, last, after
        if not after:
            break  # the first slice began at the first key: every row was looked at
    return slices, found, "", after


def _set_up(conn: sqlite3.Connection) -> None:
    deadline = time.monotonic() + 10.0
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            break
        except sqlite3.OperationalError as exc:
            # Processes opening a new store at once race to switch it to WAL, and SQLite
            # answers "locked" at once instead of waiting: wait here.
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.005)
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute(_SCHEMA)
    conn.execute(_SWEEP_SCHEMA)
    if "waiting" not in {row[1] for row in conn.execute("PRAGMA table_info(entries)")}:
        # A store made before waiters marked rows; another process may add it first.
        with contextlib.suppress(sqlite3.OperationalError):
            conn.execute("ALTER TABLE entries ADD COLUMN waiting REAL")


def from_url(url: str) -> DiskCache:
    """``file:///absolute/directory`` (or ``file://localhost/...``)."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ConstraintValueError(
            f"file URL {url!r} names host {parts.netloc!r}; a DiskCache is local, "
            "write file:///absolute/path"
        )
    if not parts.path.startswith("/"):
        raise ConstraintValueError(
            f"file URL {url!r} needs an absolute path; write file:///absolute/path"
        )
    return DiskCache(unquote(parts.path))
