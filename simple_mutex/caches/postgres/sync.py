"""PostgresCache: every machine that reaches one PostgreSQL (psycopg 3).

One table holds every lock, created on first use; where the lock role may not create
tables, its owner runs ``PostgresCache.create_schema(url, grant_to="lock_role")`` once, or
these statements (``public.simple_mutex_locks`` is the default ``schema`` and ``table``)::

    CREATE TABLE IF NOT EXISTS "public"."simple_mutex_locks" (
        key pg_catalog.text PRIMARY KEY,
        value pg_catalog.text,                  -- NULL once freed: the row stays gc_after
        version pg_catalog.text NOT NULL,       -- random per write: the compare-and-set condition
        fence pg_catalog.int8 NOT NULL,         -- max(fence + 1, the server's clock in µs)
        expires_at pg_catalog.timestamptz NOT NULL -- the lease's end, or when it was freed
    );
    CREATE INDEX IF NOT EXISTS "simple_mutex_locks_gc"
        ON "public"."simple_mutex_locks" (expires_at);
    GRANT USAGE ON SCHEMA "public" TO "lock_role";
    GRANT SELECT, INSERT, UPDATE, DELETE ON "public"."simple_mutex_locks" TO "lock_role";

The lock role needs nothing else (no CREATE, no other table; LISTEN and NOTIFY need no
privilege). Every statement names the table with its schema and pg_catalog's functions
and types with theirs, so a hostile ``search_path`` changes nothing.

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

The statements and what they mean are shared with ``AsyncPostgresCache`` (psycopg's
asyncio connections) in ``statements.py``. Rationale: docs/design/postgres.md.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from simple_mutex._runtime.steps import drive
from simple_mutex.caches._base import driver_imports, fault
from simple_mutex.contract import Entry
from simple_mutex.errors import ConstraintValueError, MalfunctionError

from .statements import (
    LOST_RACE,
    NO_STANDBY_WAIT,
    CommitWatch,
    PostgresCore,
    Statement,
    Unreplicated,
    _with_defaults,
    schema_statements,
)

with driver_imports("postgres"):
    import psycopg
    from psycopg.pq import TransactionStatus

T = TypeVar("T")


class PostgresCache(PostgresCore):
    """A ConditionalCache in one PostgreSQL table (``schema.table``, ``public`` by default).

    ``PostgresCache.create_schema(conninfo, table=..., schema=..., grant_to=role)``: the
    owner's one-time setup for a lock role without CREATE (the module docstring).

    ``conninfo`` is a libpq conninfo string or ``postgresql://`` URL, an autocommit
    ``psycopg.Connection``, or a ``psycopg_pool.ConnectionPool``. ``gc_after``: seconds a
    freed or expired key's row is kept (None: forever)."""

    _connection_type = psycopg.Connection
    _pool_type = "ConnectionPool"

    def _own_state(self) -> None:
        self._listen_guard = threading.Lock()
        self._listener: psycopg.Connection[Any] | None = None

    def close(self) -> None:
        """Close the connections this cache opened (a given connection or pool stays open)."""
        with self._guard, self._listen_guard:
            for conn in (self._conn, self._listener):
                if conn is not None and conn is not self._given:
                    conn.close()
            self._conn = self._listener = None

    # -- connections -------------------------------------------------------------------

    def _after_fork(self) -> None:
        self._forget_sessions()
        self._listener = None
        self._listen_guard = threading.Lock()  # a waiting thread did not come along

    def _connect(self) -> psycopg.Connection[Any]:
        conn = psycopg.connect(self._conninfo, autocommit=True)
        setup = self._session_setup()
        if setup is not None:
            conn.execute(setup)
        return conn

    @staticmethod
    def create_schema(
        conninfo: str,
        *,
        table: str = "simple_mutex_locks",
        schema: str = "public",
        grant_to: str | None = None,
    ) -> list[str]:
        """Create the lock table and its index as their owner (the role of ``conninfo``),
        and grant a lock role (``grant_to``) exactly what it needs; the statements run,
        for the record. Safe to run again."""
        statements = schema_statements(table, schema, grant_to)
        try:
            with psycopg.connect(_with_defaults(conninfo), autocommit=True) as conn:
                for statement in statements:
                    conn.execute(statement)
        except psycopg.Error as exc:
            raise fault("postgres", "create_schema", table, exc) from exc
        return statements

    def _create_table(self, conn: psycopg.Connection[Any]) -> None:
        for statement, name, lookup in self._setup_steps():
            if conn.execute(lookup, (name,)).fetchone() != (None,):
                continue
            try:
                # Bounded too: a table on this server only is still a table to use.
                fresh = conn.info.transaction_status == TransactionStatus.IDLE
                with contextlib.suppress(*LOST_RACE), self._watched(conn), conn.transaction():
                    if fresh:  # a transaction of its own (not a pooled one's savepoint)
                        conn.execute(NO_STANDBY_WAIT)
                    conn.execute(self._sql[statement])
            except psycopg.errors.InsufficientPrivilege as exc:
                self._denied(statement, exc)
        self._ready = True

    def _session_guard(self) -> contextlib.AbstractContextManager[Any]:
        """What a caller holds around ``_connection``: the guard of our one session, or
        nothing for a pool (it hands each thread a session of its own). Callers take it
        in a plain ``with`` of their own, never inside the generator: a signal handler's
        exception (a job timeout) landing as the generator's ``__enter__`` returns would
        leave a guard taken there held for good, and every later call would hang."""
        return contextlib.nullcontext() if self._pool is not None else self._guard

    @contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A session to run on; the caller holds ``_session_guard()``. A psycopg error
        passes through (``EndedSession`` around it when the session was a reused one the
        server had ended), after the session is dropped if it may not be used again."""
        if self._pool is not None:
            with self._pool.connection() as conn:
                if not self._ready:
                    self._create_table(conn)
                with self._pooled(conn):
                    yield conn
            return
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
            self._pass_on(exc, ended=ended)
        except BaseException:
            self._note_unsettled(self._conn)
            self._drop(None)
            raise

    def _run(self, statement: Statement[T]) -> T:
        return drive(self._running(statement), self._perform, self._failed)

    def _perform(self, statement: Statement[Any]) -> Any:
        with self._session_guard(), self._connection() as conn, self._watched(conn) as watch:
            cursor = conn.execute(statement.sql, statement.params)
            reply: Any
            if statement.rows == "count":
                reply = cursor.rowcount
            else:
                reply = cursor.fetchall() if statement.rows == "all" else cursor.fetchone()
        if watch.unreplicated:
            raise Unreplicated(reply)
        return reply

    @contextmanager
    def _watched(self, conn: psycopg.Connection[Any]) -> Iterator[CommitWatch]:
        """Around one statement on ``conn``: cancelled by the watchdog thread if still in
        flight ``commit_bound`` seconds on (a commit waiting for a synchronous standby
        that is gone), its notices read (``CommitWatch``)."""
        watch = CommitWatch(time.monotonic() + self.commit_bound)
        try:
            # Armed inside the try: a signal handler's exception (a job timeout) landing
            # between the two must not leave the watch armed, to cancel whatever this
            # connection runs next once the bound is past.
            conn.add_notice_handler(watch.notice)
            _WATCHDOG.arm(watch, conn)
            yield watch
        finally:
            _WATCHDOG.disarm(watch)
            with contextlib.suppress(ValueError):  # never added
                conn.remove_notice_handler(watch.notice)

    def _drop(self, error: psycopg.Error | None) -> None:
        """Forget the connection after a fault, so the next call opens a fresh one."""
        conn = self._conn
        if conn is None or self._keeps(conn, error):
            return
        self._conn = None
        # Broken already; only the driver's own errors are dropped: a signal handler's
        # exception (a job timeout) landing here must still reach the caller.
        with contextlib.suppress(psycopg.Error, OSError):
            conn.close()

    # -- the contract ------------------------------------------------------------------

    def get(self, key: str) -> Entry | None:
        return self._run(self._get(key))

    def scan(self, prefix: str) -> Iterator[tuple[str, Entry]]:
        found = self._run(self._scan(prefix))
        return iter(found)

    def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:
        entry = self._run(self._put(key, value, ttl))
        if self._collect_due():
            with contextlib.suppress(MalfunctionError):
                self.collect()
        return entry

    def compare_and_set(self, key: str, value: str, *, ttl: float, version: str) -> Entry:
        return self._run(self._cas(key, value, ttl, version))

    def compare_and_delete(self, key: str, *, version: str) -> None:
        self._run(self._delete(key, version))

    def collect(self) -> int:
        """Delete up to 256 rows of keys freed or expired more than ``gc_after`` ago (run
        by one grant in 64); how many it deleted. Their next fences come from the clock.
        A role without DELETE on the table collects nothing: a warning says so, once."""
        if self.gc_after is None:
            return 0
        try:
            return self._run(self._collect())
        except MalfunctionError as exc:
            return self._collect_failed(exc)

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        deadline = time.monotonic() + max(timeout, 0.0)
        if timeout < 0.001 or not keys:
            time.sleep(max(timeout, 0.0))
            return
        if not self._listen_guard.acquire(timeout=timeout):
            return  # another thread of ours listens; we waited out our timeout for it
        channels, listen, check = self._listen(keys)
        try:
            self._listen_once(channels, listen, check, deadline)
        except psycopg.Error as exc:
            listener, self._listener = self._listener, None
            if listener is not None:
                listener.close()
            raise (self._failed(check, exc) or exc) from exc
        finally:
            self._listen_guard.release()

    def _listen_once(
        self, channels: set[str], listen: str, check: Statement[bool], deadline: float
    ) -> None:
        if self._listener is None or self._listener.closed:
            self._listener = self._connect()
        conn = self._listener
        conn.execute(listen)
        try:
            if check.finish(conn.execute(check.sql, check.params).fetchone()):
                return
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


class _Watchdog:
    """The process's one thread that cancels statements past their bound (``arm``): a
    timer per statement would cost a thread each. It sleeps while nothing is armed, and
    starts on the first statement (a forked child's too: the parent's did not come along)."""

    POLL_S = 0.1  # how late past its bound a statement may be cancelled

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._armed: dict[CommitWatch, psycopg.Connection[Any]] = {}
        self._wake = threading.Event()
        self._starting = threading.Lock()
        self._started = False

    def arm(self, watch: CommitWatch, conn: psycopg.Connection[Any]) -> None:
        self._armed[watch] = conn
        if not self._started:
            with self._starting:
                if not self._started:
                    threading.Thread(target=self._run, name="simple-mutex-pg-watchdog",
                                     daemon=True).start()  # fmt: skip
                    self._started = True
        if not self._wake.is_set():
            self._wake.set()

    def disarm(self, watch: CommitWatch) -> None:
        self._armed.pop(watch, None)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            while self._armed:  # cleared first: an arm after this loop sets it again
                now = time.monotonic()
                for watch, conn in self._armed.copy().items():  # one C call: atomic
                    if not watch.fired and now >= watch.deadline:
                        watch.fired = True
                        # Its own thread: sending a cancel opens a connection, and the
                        # server may be unreachable; the others are watched meanwhile.
                        threading.Thread(target=_cancel, args=(conn,), daemon=True).start()
                time.sleep(self.POLL_S)


def _cancel(conn: psycopg.Connection[Any]) -> None:
    with contextlib.suppress(psycopg.Error, OSError):
        conn.cancel_safe(timeout=5)


_WATCHDOG = _Watchdog()
# A forked child has no watchdog thread, and a lock the parent's threads held stays held.
os.register_at_fork(after_in_child=_WATCHDOG.reset)


def from_url(url: str) -> PostgresCache:
    """A PostgresCache from ``postgresql://`` or ``postgres://`` URL; libpq's own query
    options pass through; ``?table=name`` and ``?schema=name`` pick the table."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("postgresql", "postgres"):
        raise ConstraintValueError(
            f"unknown PostgreSQL URL scheme {parts.scheme!r}; use postgresql:// or postgres://"
        )
    query = parse_qsl(parts.query, keep_blank_values=True)
    ours = {name: value for name, value in query if name in ("table", "schema")}
    # quote, not urlencode's quote_plus: libpq reads "+" as a plus, never as a space, so
    # "options=-c search_path=..." came out as "-c+search_path" (a server error).
    rest = urlencode([(n, v) for n, v in query if n not in ours], quote_via=quote)
    plain = urlunsplit(parts._replace(query=rest))
    table, schema = ours.get("table", "simple_mutex_locks"), ours.get("schema", "public")
    return PostgresCache(plain, table=table, schema=schema)
