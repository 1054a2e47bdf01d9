"""PostgresCache: every machine that reaches one PostgreSQL (psycopg 3).

One table holds every lock, created on first use; where the lock role may not create
tables, run this once (``simple_mutex_locks`` is the default ``table``)::

    CREATE TABLE simple_mutex_locks (
        key text PRIMARY KEY,
        value text,                     -- NULL once freed: the row stays gc_after
        version text NOT NULL,          -- random per write: the compare-and-set condition
        fence bigint NOT NULL,          -- max(fence + 1, the server's clock in µs)
        expires_at timestamptz NOT NULL -- the lease's end, or when it was freed
    );
    CREATE INDEX simple_mutex_locks_gc ON simple_mutex_locks (expires_at);
    GRANT SELECT, INSERT, UPDATE, DELETE ON simple_mutex_locks TO lock_role;

* Each operation is one statement, atomic on the server, whose ``clock_timestamp()``
  decides expiry and floors fences: a grant's fence is max(the row's fence + 1, the
  server's clock in µs), so a lost row never restarts it. A semaphore slot is a row of
  its own. Fences and locks are as durable as the server's commits (keep
  ``synchronous_commit`` on).
* A freed or expired row stays ``gc_after`` seconds (60 by default); then one grant in 64
  deletes a batch of such rows (``DELETE`` needs the grant above; without it nothing is
  collected and a warning says so once).
* A release notifies the key's channel (``pg_notify``); a waiter listens on a connection
  of its own only while it waits. Expiries notify nobody: the poll finds them.
* One autocommit connection per process (from a conninfo or URL, or the connection you
  pass; or a pool's), with timeouts so no call hangs on a dead server; replaced when
  broken and after fork. Every psycopg error is a ``MalfunctionError`` naming postgres,
  the operation and the key.

Rationale: docs/design/postgres.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from simple_mutex.contract import Entry
from simple_mutex.errors import ConstraintError, MalfunctionError, SimpleCacheConditionError

from .common import (
    DEFAULT_GC_AFTER,
    CacheBase,
    driver_imports,
    fault,
    gc_after_seconds,
    gc_due,
    malformed,
    new_version,
)

with driver_imports("postgres"):
    import psycopg
    from psycopg import sql
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

log = logging.getLogger("simple_mutex")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
# Set only where the conninfo says nothing: a dead server or a cut network must end a
# call in seconds (keepalives and tcp_user_timeout), not after the kernel's ~15 minutes.
_CONNECT_DEFAULTS = {
    "connect_timeout": "5",
    "keepalives": "1",
    "keepalives_idle": "5",
    "keepalives_interval": "2",
    "keepalives_count": "3",
    "tcp_user_timeout": "10000",
}
_STATEMENT_TIMEOUT_MS = 10_000  # a single-row statement takes microseconds
_COLLECT_ROWS = 256  # rows one collection pass deletes at most: 4 per grant on average
# Errors of a table of another shape under our name: undefined column or function
# (operator), datatype mismatch, no unique key for ON CONFLICT.
_OTHER_SHAPE = ("42703", "42883", "42804", "42P10")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS {t} (
    key text PRIMARY KEY,
    value text,
    version text NOT NULL,
    fence bigint NOT NULL,
    expires_at timestamptz NOT NULL
)
"""
# Finds the rows to collect without a scan; created with the table, or added to a table
# of an earlier version by a role that owns it (others collect by a bounded scan).
_INDEX = "CREATE INDEX IF NOT EXISTS {i} ON {t} (expires_at)"
_EPOCH = "extract(epoch FROM expires_at)::float8"
_EXPIRY = "clock_timestamp() + make_interval(secs => %(ttl)s)"
_LIVE = "value IS NOT NULL AND expires_at > clock_timestamp()"
_CLOCK_FENCE = "(extract(epoch FROM clock_timestamp()) * 1000000)::bigint"

# Insert, or take over a freed or expired row (max(fence + 1, the clock in µs)). When the
# row is live the INSERT returns nothing and the second SELECT reads it (from the
# statement's snapshot), so the caller can tell our own earlier write (same value: a lost
# reply) from another holder in the same round trip.
_PUT = f"""
WITH put AS (
    INSERT INTO {{t}} AS e (key, value, version, fence, expires_at)
    VALUES (%(key)s, %(value)s, %(version)s, {_CLOCK_FENCE}, {_EXPIRY})
    ON CONFLICT (key) DO UPDATE
        SET value = excluded.value, version = excluded.version,
            fence = GREATEST(e.fence + 1, {_CLOCK_FENCE}), expires_at = excluded.expires_at
        WHERE e.value IS NULL OR e.expires_at <= clock_timestamp()
    RETURNING value, version, fence, {_EPOCH}
)
SELECT * FROM put
UNION ALL
SELECT value, version, fence, {_EPOCH} FROM {{t}}
WHERE key = %(key)s AND {_LIVE} AND NOT EXISTS (SELECT FROM put)
"""
_GET = f"SELECT value, version, fence, {_EPOCH} FROM {{t}} WHERE key = %(key)s AND {_LIVE}"
_CAS = f"""
UPDATE {{t}} SET value = %(value)s, version = %(new)s, expires_at = {_EXPIRY}
WHERE key = %(key)s AND version = %(version)s AND {_LIVE}
RETURNING fence, {_EPOCH}
"""
# Free the row (the fence stays in it, stamped with the moment: collected gc_after from
# now) and wake listeners: the notification is sent when the statement commits, so a
# woken waiter finds the key free.
_DELETE = f"""
WITH freed AS (
    UPDATE {{t}} SET value = NULL, expires_at = clock_timestamp()
    WHERE key = %(key)s AND version = %(version)s AND {_LIVE}
    RETURNING key
)
SELECT pg_notify(%(channel)s, '') FROM freed
"""
# Rows freed or expired more than gc_after ago (a live row expires after now), the oldest
# first; rows another session has locked are left for a later pass, never waited for.
_COLLECT = """
DELETE FROM {t} WHERE key IN (
    SELECT key FROM {t}
    WHERE expires_at < clock_timestamp() - make_interval(secs => %(after)s)
    ORDER BY expires_at LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
"""
# Live rows under a prefix. LIKE with its wildcards escaped matches exactly that prefix;
# the primary key's index serves it when the key column's collation is "C" (elsewhere the
# table is read through, which garbage collection keeps to the keys of the last minutes).
_SCAN = f"""
SELECT key, value, version, fence, {_EPOCH} FROM {{t}}
WHERE key LIKE %(pattern)s ESCAPE '\\' AND {_LIVE}
"""
_LIVE_COUNT = f"SELECT count(*) FROM {{t}} WHERE key = ANY(%(keys)s) AND {_LIVE}"


class PostgresCache(CacheBase):
    """A ConditionalCache in one PostgreSQL table.

    ``conninfo`` is a libpq conninfo string or ``postgresql://`` URL, an autocommit
    ``psycopg.Connection``, or a ``psycopg_pool.ConnectionPool``. ``gc_after``: seconds a
    freed or expired key's row is kept (None: forever)."""

    name = "postgres"

    def __init__(
        self,
        conninfo: Any,
        *,
        table: str = "simple_mutex_locks",
        gc_after: float | None = DEFAULT_GC_AFTER,
    ) -> None:
        self.gc_after = gc_after_seconds("PostgresCache", gc_after)
        if not isinstance(table, str) or not _IDENTIFIER.fullmatch(table):
            raise ConstraintError(
                f"PostgresCache table must be a plain identifier (letters, digits, _; at "
                f"most 63), got {table!r}; create it in a schema on the role's search_path"
            )
        self.table = table
        self._pool: Any = None
        self._conn: psycopg.Connection[Any] | None = None
        self._given: object = conninfo  # never closed here
        if isinstance(conninfo, str):
            self._conninfo = _with_defaults(conninfo)
        elif isinstance(conninfo, psycopg.Connection):
            if not conninfo.autocommit:
                raise ConstraintError(
                    "PostgresCache needs an autocommit connection (psycopg.connect(..., "
                    "autocommit=True)): a lock written inside your transaction would stay "
                    "invisible until you commit; or pass a conninfo string or a pool"
                )
            self._conn = conninfo
            self._conninfo = _with_defaults(
                make_conninfo(conninfo.info.dsn, password=conninfo.info.password or None)
            )
        elif _is_pool(conninfo):
            self._pool = conninfo
            known = {d.keyword.decode() for d in psycopg.pq.Conninfo.get_defaults()}
            options = {k: v for k, v in (conninfo.kwargs or {}).items() if k in known}
            self._conninfo = _with_defaults(make_conninfo(conninfo.conninfo, **options))
        else:
            raise ConstraintError(
                f"PostgresCache needs a conninfo string or URL, a psycopg Connection or a "
                f"psycopg_pool ConnectionPool, got {type(conninfo).__name__}"
            )
        quoted = sql.Identifier(table).as_string(None)
        self._index = _index_name(table)
        index = sql.Identifier(self._index).as_string(None)
        self._sql = {
            name: text.format(t=quoted, i=index)
            for name, text in (
                ("schema", _SCHEMA), ("index", _INDEX), ("put", _PUT), ("get", _GET),
                ("cas", _CAS), ("delete", _DELETE), ("live", _LIVE_COUNT),
                ("collect", _COLLECT), ("scan", _SCAN),
            )
        }  # fmt: skip
        self._ready = False  # the table is known to exist
        self._listen_guard = threading.Lock()
        self._listener: psycopg.Connection[Any] | None = None
        super().__init__()

    def __repr__(self) -> str:
        return f"PostgresCache(table={self.table!r})"

    def close(self) -> None:
        """Close the connections this cache opened (a given connection or pool stays open)."""
        with self._guard, self._listen_guard:
            for conn in (self._conn, self._listener):
                if conn is not None and conn is not self._given:
                    conn.close()
            self._conn = self._listener = None

    # -- connections -------------------------------------------------------------------

    def _after_fork(self) -> None:
        # The parent's sockets are not ours: drop them unclosed (psycopg never sends a
        # Terminate from a process that did not open the connection) and open our own.
        self._conn = None
        self._listener = None
        self._listen_guard = threading.Lock()  # a waiting thread did not come along
        # A pool's worker threads and connections stay in the parent: borrowing from it
        # here would wait forever. The child uses one connection of its own, opened from
        # the pool's parameters.
        self._pool = None

    def _connect(self) -> psycopg.Connection[Any]:
        conn = psycopg.connect(self._conninfo, autocommit=True)
        if "statement_timeout" not in str(conninfo_to_dict(self._conninfo).get("options", "")):
            conn.execute(f"SET statement_timeout = {_STATEMENT_TIMEOUT_MS}")
        return conn

    def _create_table(self, conn: psycopg.Connection[Any]) -> None:
        # Look before creating: a role without CREATE gets "permission denied" from
        # CREATE TABLE IF NOT EXISTS even when the table is there.
        # Sessions creating either at the same instant collide in the catalog (a unique
        # violation on pg_type, or "type ... already exists"): the loser uses the winner's.
        # A savepoint keeps a pooled connection's transaction usable.
        errors = psycopg.errors
        lost_race = (errors.UniqueViolation, errors.DuplicateObject, errors.DuplicateTable)
        for name, statement in ((self.table, "schema"), (self._index, "index")):
            quoted = sql.Identifier(name).as_string(None)
            if conn.execute("SELECT to_regclass(%s)", (quoted,)).fetchone() != (None,):
                continue
            try:
                with contextlib.suppress(*lost_race), conn.transaction():
                    conn.execute(self._sql[statement])
            except errors.InsufficientPrivilege:
                if statement == "schema":
                    raise
                # Only the table's owner may index it: collection then scans the table,
                # which the collection itself keeps small.
                log.warning(
                    "PostgresCache: no index on %s.expires_at and this role may not create "
                    "it; garbage collection scans the table. Run once, as its owner: %s",
                    self.table, self._sql["index"],
                )  # fmt: skip
        self._ready = True

    @contextmanager
    def _connection(self, operation: str, key: str) -> Iterator[psycopg.Connection[Any]]:
        if self._pool is not None:
            broken = False
            try:
                with self._pool.connection() as conn:
                    if not self._ready:
                        self._create_table(conn)
                    try:
                        yield conn
                    finally:
                        broken = conn.broken
            except psycopg.Error as exc:
                # A broken pooled session was an idle one the server ended.
                raise self._fault(operation, key, exc, broken) from exc
            return
        with self._guard:
            reused = False
            try:
                reused = self._conn is not None and not self._conn.closed
                if self._conn is None or not reused:
                    self._conn = self._connect()
                if not self._ready:
                    self._create_table(self._conn)
                yield self._conn
            except psycopg.Error as exc:
                ended = reused and self._conn is not None and self._conn.broken
                self._drop(exc)
                raise self._fault(operation, key, exc, ended) from exc
            except BaseException:
                # An interrupt mid-statement may leave a reply unread: never reuse it.
                self._drop(None)
                raise

    def _one(self, operation: str, key: str, sql: str, params: dict[str, Any]) -> Any:
        """One statement's first row. A reused session the server ended (a restart, a
        fail-over, ``pg_terminate_backend``, an idle-session timeout) fails the next
        statement sent on it, which never ran: that one is sent once more, on a fresh
        session."""
        try:
            with self._connection(operation, key) as conn:
                return conn.execute(sql, params).fetchone()
        except _SessionEnded:
            pass
        with self._connection(operation, key) as conn:
            return conn.execute(sql, params).fetchone()

    def _drop(self, error: psycopg.Error | None) -> None:
        """Forget the connection after a fault, so the next call opens a fresh one; an
        error the server answered (a statement timeout) leaves it usable."""
        conn = self._conn
        if conn is None:
            return
        if (
            isinstance(error, psycopg.errors.DatabaseError)
            and error.sqlstate is not None
            and not error.sqlstate.startswith("08")  # connection exceptions
            and not conn.broken
        ):
            return
        self._conn = None
        with contextlib.suppress(Exception):  # it is broken already
            conn.close()

    # -- the contract ------------------------------------------------------------------

    def get(self, key: str) -> Entry | None:
        row = self._one("get", key, self._sql["get"], {"key": key})
        return None if row is None else Entry(row[0], row[1], row[2], row[3])

    def scan(self, prefix: str) -> Iterator[tuple[str, Entry]]:
        pattern = like_prefix(prefix)
        with self._connection("scan", prefix) as conn:
            rows = conn.execute(self._sql["scan"], {"pattern": pattern}).fetchall()
        return iter([(row[0], Entry(row[1], row[2], row[3], row[4])) for row in rows])

    def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:
        params = {"key": key, "value": value, "version": new_version(), "ttl": ttl}
        row = self._one("put_if_absent", key, self._sql["put"], params)
        # Ours when just written (our version) or our own earlier write (same value).
        if row is None or (row[1] != params["version"] and row[0] != value):
            raise SimpleCacheConditionError(f"postgres: {key!r} is held", key=key)
        if self.gc_after is not None and gc_due():
            # The grant stands whatever the collection meets; the next operation reports
            # a lasting fault itself.
            with contextlib.suppress(MalfunctionError):
                self.collect()
        return Entry(row[0], row[1], row[2], row[3])

    def compare_and_set(self, key: str, value: str, *, ttl: float, version: str) -> Entry:
        new = new_version()
        params = {"key": key, "value": value, "new": new, "version": version, "ttl": ttl}
        row = self._one("compare_and_set", key, self._sql["cas"], params)
        if row is None:
            raise SimpleCacheConditionError(
                f"postgres: {key!r} is not at version {version}", key=key
            )
        return Entry(value, new, row[0], row[1])

    def compare_and_delete(self, key: str, *, version: str) -> None:
        params = {"key": key, "version": version, "channel": self._channel(key)}
        freed = self._one("compare_and_delete", key, self._sql["delete"], params)
        if freed is None:
            raise SimpleCacheConditionError(
                f"postgres: {key!r} is not at version {version}", key=key
            )

    def collect(self) -> int:
        """Delete up to 256 rows of keys freed or expired more than ``gc_after`` ago (run
        by one grant in 64); how many it deleted. Their next fences come from the clock.
        A role without DELETE on the table collects nothing: a warning says so, once."""
        if self.gc_after is None:
            return 0
        params = {"after": self.gc_after, "limit": _COLLECT_ROWS}
        try:
            with self._connection("collect", "") as conn:
                return conn.execute(self._sql["collect"], params).rowcount
        except MalfunctionError as exc:
            if not isinstance(exc.__cause__, psycopg.errors.InsufficientPrivilege):
                raise
        log.warning(
            "PostgresCache: this role may not DELETE from %s, so freed keys' rows are "
            "never collected: GRANT DELETE ON %s TO the lock role",
            self.table, self.table,
        )  # fmt: skip
        self.gc_after = None
        return 0

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        deadline = time.monotonic() + max(timeout, 0.0)
        if timeout < 0.001 or not keys:
            time.sleep(max(timeout, 0.0))
            return
        if not self._listen_guard.acquire(timeout=timeout):
            return  # another thread of ours listens; we waited out our timeout for it
        try:
            self._listen_once(keys, deadline)
        except psycopg.Error as exc:
            listener, self._listener = self._listener, None
            if listener is not None:
                listener.close()
            raise self._fault("wait", keys[0], exc) from exc
        finally:
            self._listen_guard.release()

    def _listen_once(self, keys: Sequence[str], deadline: float) -> None:
        if self._listener is None or self._listener.closed:
            self._listener = self._connect()
        conn = self._listener
        channels = {self._channel(key) for key in keys}
        # LISTEN commits before the check reads, so a release is either seen as a free
        # key by the check or delivered to us: none falls between the two.
        conn.execute("".join(f'LISTEN "{channel}";' for channel in channels))
        try:
            live = conn.execute(self._sql["live"], {"keys": list(set(keys))}).fetchone()
            if live is None or live[0] < len(set(keys)):
                return  # a key is free already
            remaining = deadline - time.monotonic()
            if remaining > 0:
                for note in conn.notifies(timeout=remaining):
                    if note.channel in channels:
                        return
        finally:
            if not conn.broken:
                # Listen only while waiting: an idle listening session that reads nothing
                # would hold back the server's notification queue for every database user.
                conn.execute("UNLISTEN *")

    def _channel(self, key: str) -> str:
        # Channel names are identifiers of at most 63 bytes: a digest of table and key.
        digest = hashlib.blake2b(f"{self.table}\0{key}".encode(), digest_size=16)
        return "sm_" + digest.hexdigest()

    def _fault(
        self, operation: str, key: str, exc: psycopg.Error, ended: bool = False
    ) -> MalfunctionError:
        if getattr(exc, "sqlstate", None) in _OTHER_SHAPE:
            detail = f"table {self.table!r} is not a lock table: {str(exc).strip()}"
            return malformed(self.name, operation, key, detail)
        error = fault(self.name, operation, key, exc)
        return _SessionEnded(error.message, key) if ended else error


class _SessionEnded(MalfunctionError):
    """A reused session the server had ended: the statement sent on it never ran."""


def like_prefix(prefix: str) -> str:
    """A LIKE pattern (escape character ``\\``) for the strings that start with ``prefix``."""
    escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped + "%"


def _index_name(table: str) -> str:
    """``<table>_gc``; for a table name too long for that, its head and a digest."""
    if len(table) <= 60:
        return f"{table}_gc"
    return f"{table[:46]}_gc_{hashlib.blake2b(table.encode(), digest_size=6).hexdigest()}"


def _is_pool(obj: object) -> bool:
    try:
        from psycopg_pool import ConnectionPool
    except ImportError:
        return False
    return isinstance(obj, ConnectionPool)


def _with_defaults(conninfo: str) -> str:
    try:
        given = conninfo_to_dict(conninfo)
    except psycopg.Error:
        # Only the kind of problem is echoed: a conninfo may hold a password.
        raise ConstraintError(
            "bad PostgreSQL conninfo or URL (expected postgresql://user@host/db or "
            "'host=... dbname=...')"
        ) from None
    extra = {name: value for name, value in _CONNECT_DEFAULTS.items() if name not in given}
    return make_conninfo(conninfo, **extra)


def from_url(url: str) -> PostgresCache:
    """A PostgresCache from ``postgresql://`` or ``postgres://`` URL; libpq's own query
    options pass through, and ``?table=name`` picks the table."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("postgresql", "postgres"):
        raise ConstraintError(
            f"unknown PostgreSQL URL scheme {parts.scheme!r}; use postgresql:// or postgres://"
        )
    query = parse_qsl(parts.query, keep_blank_values=True)
    tables = [value for name, value in query if name == "table"]
    rest = urlencode([(name, value) for name, value in query if name != "table"])
    plain = urlunsplit(parts._replace(query=rest))
    return PostgresCache(plain, table=tables[-1]) if tables else PostgresCache(plain)
