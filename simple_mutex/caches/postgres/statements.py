"""What PostgresCache and AsyncPostgresCache share: the table, every statement, its
parameters and the meaning of its rows, conninfo defaults and the one mapping of
psycopg's errors (``PostgresCore._failed``). No I/O here: each operation is a flow
(``_running``) that yields its ``Statement``; the shared drivers of
``simple_mutex._runtime.steps`` run it, ``sync.py`` executing each statement on psycopg's
blocking connections, ``asyncio.py`` awaiting it on its asyncio ones. Rationale:
docs/design/postgres.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, NoReturn, TypeVar

from simple_mutex._core.flows import Pause
from simple_mutex._runtime.steps import StepFlow
from simple_mutex.caches._base import (
    DEFAULT_GC_AFTER,
    TOOK_OVER,
    CacheBase,
    driver_imports,
    fault,
    gc_after_seconds,
    gc_due,
    malformed,
    new_version,
    took_over_version,
)
from simple_mutex.contract import Entry
from simple_mutex.errors import (
    ConstraintTypeError,
    ConstraintValueError,
    MalfunctionError,
    SimpleCacheConditionError,
    bad_input,
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
# A commit's wait for a synchronous standby runs after the statement, where
# statement_timeout no longer counts (the server disables it before committing): a
# standby that is gone, or a promoted one still configured synchronous with none
# streaming, holds every write for ever. The face cancels the statement itself this long
# after its statement_timeout (the server's own timeout answers a slow statement first);
# a cancelled wait is answered as a success with a WARNING, the write committed here but
# on no standby.
_CANCEL_GRACE_S = 0.5
# A setting in ``options`` (``-c statement_timeout=5s``; the server takes the last one
# given, and reads "5\ s", an escaped space, as 5 s).
_TIMEOUT_SETTING = re.compile(
    r"statement_timeout\s*=\s*'?(\d+(?:\.\d+)?)(?:\\?\s)*(us|ms|s|min|h|d)?", re.IGNORECASE
)
_UNITS_S = {"us": 1e-6, "ms": 0.001, "s": 1.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
# Creating the table does not wait for a synchronous standby (for its own transaction
# only): a gone standby would hold it a bound per statement, before the call's own. Any
# grant made in it waits, and replicates the table's creation with it.
NO_STANDBY_WAIT = "SELECT pg_catalog.set_config('synchronous_commit', 'local', true)"
SYNC_REP_CANCELLED = "01000"  # the WARNING's SQLSTATE (its text may be translated)
# The server session of a statement an interrupt left in flight: ended, then waited for.
# Only our own role's sessions, and only while that statement still runs.
_END_BACKEND = (
    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
    " WHERE pid = %(pid)s AND usename = current_user AND state = 'active'"
)
_BACKEND_ACTIVE = "SELECT 1 FROM pg_stat_activity WHERE pid = %(pid)s AND state = 'active'"
_UNSETTLED_WAIT_S = 2.0
_UNSETTLED_POLL_S = 0.01


def _found_row(row: Any) -> bool:
    return row is not None


_COLLECT_ROWS = 256  # rows one collection pass deletes at most: 4 per grant on average
# Errors of a table of another shape under our name: undefined column or function
# (operator), datatype mismatch, no unique key for ON CONFLICT.
_OTHER_SHAPE = ("42703", "42883", "42804", "42P10")


def _denied(sqlstate: str | None) -> bool:
    """A refusal that does not pass by itself, which a waiter raises at once: a login
    refused (class 28) or a missing privilege. Anything else (a session ended, the server
    starting or shutting down, a standby not yet promoted) it rides out."""
    return sqlstate is not None and (sqlstate.startswith("28") or sqlstate == "42501")


# Every name a statement uses is qualified: the table with its schema, functions and
# types with pg_catalog. So a schema placed earlier on the role's search_path (one another
# role may create objects in) cannot put its own table or clock_timestamp() in their
# place. Operators (=, >, ||) are pg_catalog's too, which PostgreSQL searches first
# unless a search_path names pg_catalog after another schema: don't.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS {t} (
    key pg_catalog.text PRIMARY KEY,
    value pg_catalog.text,
    version pg_catalog.text NOT NULL,
    fence pg_catalog.int8 NOT NULL,
    expires_at pg_catalog.timestamptz NOT NULL
)
"""
# Finds the rows to collect without a scan; created with the table, or added to a table
# of an earlier version by a role that owns it (others collect by a bounded scan).
_INDEX = "CREATE INDEX IF NOT EXISTS {i} ON {t} (expires_at)"
_EPOCH = "extract(epoch FROM expires_at)::pg_catalog.float8"
_EXPIRY = "pg_catalog.clock_timestamp() + pg_catalog.make_interval(secs => %(ttl)s)"
_LIVE = "value IS NOT NULL AND expires_at > pg_catalog.clock_timestamp()"
_CLOCK_FENCE = "(extract(epoch FROM pg_catalog.clock_timestamp()) * 1000000)::pg_catalog.int8"

# Insert, or take over a freed or expired row (max(fence + 1, the clock in µs)). When the
# row is live the INSERT returns nothing and the second SELECT reads it (from the
# statement's snapshot), so the caller can tell our own earlier write (same value: a lost
# reply) from another holder in the same round trip. Over a row its holder never freed
# (value not NULL: it lapsed) the version gets the TOOK_OVER mark: RETURNING shows only
# the new row (before PostgreSQL 18), and the version says what the old one was.
_PUT = f"""
WITH put AS (
    INSERT INTO {{t}} AS e (key, value, version, fence, expires_at)
    VALUES (%(key)s, %(value)s, %(version)s, {_CLOCK_FENCE}, {_EXPIRY})
    ON CONFLICT (key) DO UPDATE
        SET value = excluded.value,
            version = excluded.version || CASE WHEN e.value IS NULL THEN '' ELSE '{TOOK_OVER}' END,
            fence = GREATEST(e.fence + 1, {_CLOCK_FENCE}), expires_at = excluded.expires_at
        WHERE e.value IS NULL OR e.expires_at <= pg_catalog.clock_timestamp()
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
# woken waiter finds the key free. A row already freed at this very version (nothing
# granted since: a grant writes a new version) is our own release sent again after its
# reply was lost: it counts as freed, not as a lost lease.
_FREE = f"""
freed AS (
    UPDATE {{t}} SET value = NULL, expires_at = pg_catalog.clock_timestamp()
    WHERE key = %(key)s AND version = %(version)s AND ({_LIVE} OR value IS NULL)
    RETURNING key
)
"""
_DELETE = f"WITH {_FREE} SELECT pg_catalog.pg_notify(%(channel)s, '') FROM freed"
# The same release, undoing a grant no synchronous standby acknowledged, committed without
# waiting for one (synchronous_commit local, for this transaction only): a standby that
# never had the grant needs no news of its withdrawal, and the call is bounded.
_WITHDRAW = f"""
WITH here AS (SELECT pg_catalog.set_config('synchronous_commit', 'local', true)), {_FREE}
SELECT pg_catalog.pg_notify(%(channel)s, '') FROM freed, here
"""
# Rows freed or expired more than gc_after ago (a live row expires after now), the oldest
# first; rows another session has locked are left for a later pass, never waited for.
_COLLECT = """
DELETE FROM {t} WHERE key IN (
    SELECT key FROM {t}
    WHERE expires_at < pg_catalog.clock_timestamp() - pg_catalog.make_interval(secs => %(after)s)
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
_LIVE_COUNT = f"SELECT pg_catalog.count(*) FROM {{t}} WHERE key = ANY(%(keys)s) AND {_LIVE}"


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Statement(Generic[T]):
    """One operation as both faces run it: the SQL and its parameters, what the face
    reads back (``rows``: "one", the first row or None; "all", every row; "count", the
    rows it changed), and what that reply means (``finish``)."""

    operation: str
    key: str
    sql: str
    params: dict[str, Any]
    finish: Callable[[Any], T]
    rows: str = "one"


Flow = StepFlow[Statement[Any], T]


class PostgresCore(CacheBase):
    """Everything PostgresCache and AsyncPostgresCache share: options, SQL, parameters,
    row parsing and fault mapping. Subclasses only do the I/O."""

    name = "postgres"
    driver_errors: tuple[type[Exception], ...] = (psycopg.Error,)
    _connection_type: ClassVar[Any] = type(None)
    """psycopg's Connection or AsyncConnection: the kind of session a subclass accepts."""
    _pool_type: ClassVar[str] = ""
    """psycopg_pool's ConnectionPool or AsyncConnectionPool, by name."""

    def __init__(
        self,
        conninfo: Any,
        *,
        table: str = "simple_mutex_locks",
        schema: str = "public",
        gc_after: float | None = DEFAULT_GC_AFTER,
    ) -> None:
        owner = type(self).__name__
        self.gc_after = gc_after_seconds(owner, gc_after)
        self.table = check_identifier(owner, "table", table)
        self.schema = check_identifier(owner, "schema", schema)
        self._pool: Any = None
        self._conn: Any = None
        self._unsettled: int | None = None  # see _note_unsettled
        self._given: Any = conninfo  # never closed here
        if isinstance(conninfo, str):
            self._conninfo = _with_defaults(conninfo)
        elif isinstance(conninfo, self._connection_type):
            if not conninfo.autocommit:
                raise ConstraintValueError(
                    f"{owner} needs an autocommit connection (connect(..., "
                    "autocommit=True)): a lock written inside your transaction would stay "
                    "invisible until you commit; or pass a conninfo string or a pool"
                )
            self._conn = conninfo
            self._conninfo = _with_defaults(
                make_conninfo(conninfo.info.dsn, password=conninfo.info.password or None)
            )
        elif _is_pool(conninfo, self._pool_type):
            self._pool = conninfo
            known = {d.keyword.decode() for d in psycopg.pq.Conninfo.get_defaults()}
            options = {k: v for k, v in (conninfo.kwargs or {}).items() if k in known}
            self._conninfo = _with_defaults(make_conninfo(conninfo.conninfo, **options))
        else:
            raise ConstraintTypeError(
                f"{owner} needs a conninfo string or URL, a psycopg "
                f"{self._connection_type.__name__} or a psycopg_pool {self._pool_type}, got "
                f"{type(conninfo).__name__}"
            )
        quoted = qualified(schema, table)
        self._index = _index_name(table)
        index = sql.Identifier(self._index).as_string(None)
        self._sql = {
            name: text.format(t=quoted, i=index)
            for name, text in (
                ("schema", _SCHEMA), ("index", _INDEX), ("put", _PUT), ("get", _GET),
                ("cas", _CAS), ("delete", _DELETE), ("withdraw", _WITHDRAW),
                ("live", _LIVE_COUNT),
                ("collect", _COLLECT), ("scan", _SCAN),
            )
        }  # fmt: skip
        self._ready = False  # the table is known to exist
        self.commit_bound = commit_bound(self._conninfo)
        super().__init__()
        self._own_state()

    def _own_state(self) -> None:
        """Set up what only the blocking or the asyncio subclass keeps (its listener)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(table={self.table!r}, schema={self.schema!r})"

    # -- sessions ----------------------------------------------------------------------

    def _forget_sessions(self) -> None:
        """In a forked child: the parent's sockets are not ours. Drop them unclosed
        (psycopg never sends a Terminate from a process that did not open the connection)
        and open our own. A pool's workers and connections stay in the parent: borrowing
        from it here would wait forever, so the child uses one connection of its own,
        opened from the pool's parameters."""
        self._conn = None
        self._pool = None

    def _session_setup(self) -> str | None:
        """The statement a session this cache opens runs first, if any: a statement
        timeout, unless the conninfo sets its own."""
        if "statement_timeout" in session_options(self._conninfo):
            return None
        return f"SET statement_timeout = {_STATEMENT_TIMEOUT_MS}"

    def _setup_steps(self) -> Iterator[tuple[str, str, str]]:
        """The table, then its index: (statement, name, how to look for it). Look before
        creating: a role without CREATE gets "permission denied" from CREATE TABLE IF NOT
        EXISTS even when the table is there. Drivers run each creation in a transaction
        (a savepoint on a pooled connection's), suppress ``LOST_RACE`` (sessions creating
        at the same instant collide in the catalog: the loser uses the winner's) and pass
        InsufficientPrivilege to ``_denied``."""
        for name, statement in ((self.table, "schema"), (self._index, "index")):
            yield statement, qualified(self.schema, name), "SELECT pg_catalog.to_regclass(%s)"

    def _denied(self, statement: str, exc: BaseException) -> None:
        if statement == "schema":
            raise exc
        # Only the table's owner may index it: collection then scans the table, which the
        # collection itself keeps small.
        log.warning(
            "%s: no index on %s.expires_at and this role may not create it; garbage "
            "collection scans the table. Run once, as its owner: %s",
            type(self).__name__, self.table, self._sql["index"],
        )  # fmt: skip

    def _keeps(self, conn: Any, error: BaseException | None) -> bool:
        """May a connection that raised ``error`` be used again? Only after an error the
        server answered (a statement timeout); never after an interrupt mid-statement,
        which may leave a reply unread."""
        return (
            isinstance(error, psycopg.errors.DatabaseError)
            and error.sqlstate is not None
            and not error.sqlstate.startswith("08")  # connection exceptions
            and not conn.broken
        )

    # -- the statements ----------------------------------------------------------------

    def _running(self, statement: Statement[T]) -> Flow[T]:
        """One statement, its reply read by ``statement.finish``. A reused session the
        server ended (a restart, a fail-over, ``pg_terminate_backend``, an idle-session
        timeout) fails the next statement sent on it, which never ran: that one is sent
        once more, on a fresh session. A statement an interrupt left in flight is
        finished first (``_finishing``)."""
        backend, self._unsettled = self._unsettled, None
        if backend is not None:
            yield from self._finishing(backend)
        try:
            reply = yield statement
        except SessionEnded:
            reply = yield statement
        except UnreplicatedCommit as unreplicated:
            return (yield from self._unreplicated(statement, unreplicated.reply))
        return statement.finish(reply)

    def _unreplicated(self, statement: Statement[T], reply: Any) -> Flow[T]:
        """A write committed here whose wait for a synchronous standby was cancelled at the
        call's bound: no standby has it, so a failover now would lose it. As on Redis with
        ``replicas=N``: a grant is withdrawn (without waiting for a standby) and reported
        as a fault, a renewal does not count; a release counts (the key is free here; if
        a failover brings the record back, it lapses with its lease, held by no one)."""
        result = statement.finish(reply)
        key = statement.key
        if statement.operation == "put_if_absent":
            assert isinstance(result, Entry)
            params = {"key": key, "version": result.version, "channel": self._channel(key)}
            try:
                withdraw = Statement("put_if_absent", key, self._sql["withdraw"], params,
                                     _found_row)  # fmt: skip
                undone = yield withdraw
            except MalfunctionError:
                undone = False
            raise self._unreplicated_write(key, "grant", bool(undone))
        if statement.operation == "compare_and_set":
            raise self._unreplicated_write(key, "renewal", None)
        return result

    def _unreplicated_write(self, key: str, what: str, undone: bool | None) -> MalfunctionError:
        fate = {True: ", so it was withdrawn", False: ", so it does not count (it lapses "
                "with its lease)", None: "; it does not count"}[undone]  # fmt: skip
        return MalfunctionError(
            f"postgres cache: no synchronous standby acknowledged the {what} of {key!r} "
            f"within {self.commit_bound:g} s (its commit stopped waiting for one: it is on "
            f"this server only){fate}; is a standby streaming (pg_stat_replication), or is "
            "synchronous_standby_names naming one that is gone?",
            key=key,
            unsent=bool(undone),
            withheld=undone is not None,  # a grant: never read back as one
        )

    def _note_unsettled(self, conn: Any) -> None:
        """Called as a session is dropped after an interrupt (a job timeout's exception,
        a cancellation). If a statement was still in flight on it, the server goes on
        with it after we hang up: a put may land after the caller, seeing nothing yet,
        has freed what it wrote (found by the alarm test under load). Its backend is
        noted, so the next statement first waits for it to end (``_finishing``)."""
        if conn is None:
            return
        with contextlib.suppress(psycopg.Error):
            if conn.info.transaction_status == psycopg.pq.TransactionStatus.ACTIVE:
                self._unsettled = conn.info.backend_pid

    def _finishing(self, backend: int) -> Flow[None]:
        """End the server session that ran an interrupted statement (a put's insert
        still waiting on a lock is rolled back; one that committed stays, for the
        caller's clean-up to read and free), and wait, at most ``_UNSETTLED_WAIT_S``, for
        it to be gone. Best effort: a fault here is left to the next statement."""
        params = {"pid": backend}
        try:
            yield Statement("settle", "", _END_BACKEND, params, _found_row)
            for _ in range(int(_UNSETTLED_WAIT_S / _UNSETTLED_POLL_S)):
                if not (yield Statement("settle", "", _BACKEND_ACTIVE, params, _found_row)):
                    return
                yield Pause(_UNSETTLED_POLL_S)
        except MalfunctionError:
            return

    @staticmethod
    def _pass_on(exc: psycopg.Error, *, ended: bool) -> NoReturn:
        """Let a psycopg error out of a face's session code: as ``EndedSession`` around it
        when the session it came from had been ended by the server (the statement never
        ran; only the session code can tell), else as is. Both faces' sessions end here."""
        if ended:
            raise EndedSession() from exc
        raise exc

    @contextlib.contextmanager
    def _pooled(self, conn: Any) -> Iterator[None]:
        """Around the use of a session a pool handed out: a psycopg error leaves through
        ``_pass_on``, as ended if the session broke (it was an idle one the server had
        ended). Read before the pool takes the session back, which closes a broken one
        (and one an interrupt left mid-statement, which is noted first)."""
        try:
            yield
        except psycopg.Error as exc:
            self._pass_on(exc, ended=conn.broken)
        except BaseException:
            self._note_unsettled(conn)
            raise

    def _failed(self, statement: Statement[Any], exc: Exception) -> Exception | None:
        """The one place a driver error becomes what users see: a psycopg error (or a
        face's ``EndedSession`` around one) is the MalfunctionError of the statement's
        operation on its key (``SessionEnded`` when the session had been ended: the flow
        sends the statement again); a table of another shape is a malformed entry; None
        for anything else (a signal handler's exception, a bug): it propagates as is."""
        if isinstance(exc, Unreplicated):
            return UnreplicatedCommit(exc.reply)
        ended = isinstance(exc, EndedSession)
        cause = exc.__cause__ if ended else exc
        if not isinstance(cause, psycopg.Error):
            return None
        operation, key = statement.operation, statement.key
        error: MalfunctionError
        if cause.sqlstate in _OTHER_SHAPE:
            detail = f"table {self.table!r} is not a lock table: {str(cause).strip()}"
            error = malformed(self.name, operation, key, detail)
        else:
            error = fault(self.name, operation, key, cause, lasting=_denied(cause.sqlstate))
            if ended:
                error = SessionEnded(error.message, key)
        error.__cause__ = cause
        return error

    def _get(self, key: str) -> Statement[Entry | None]:
        return Statement("get", key, self._sql["get"], {"key": key}, _entry_or_none)

    def _put(self, key: str, value: str, ttl: float) -> Statement[Entry]:
        version = new_version()
        took_over = took_over_version(version)  # what the statement makes of it (_PUT)

        def finish(row: Any) -> Entry:
            if row is not None and row[1] in (version, took_over):  # just written by us
                return Entry(row[0], row[1], row[2], row[3], row[1] == took_over)
            if row is not None and row[0] == value:  # our own earlier write (a lost reply)
                return Entry(row[0], row[1], row[2], row[3])
            raise SimpleCacheConditionError(f"postgres: {key!r} is held", key=key)

        params = {"key": key, "value": value, "version": version, "ttl": ttl}
        return Statement("put_if_absent", key, self._sql["put"], params, finish)

    def _cas(self, key: str, value: str, ttl: float, version: str) -> Statement[Entry]:
        new = new_version()

        def finish(row: Any) -> Entry:
            if row is None:
                raise SimpleCacheConditionError(
                    f"postgres: {key!r} is not at version {version}", key=key
                )
            return Entry(value, new, row[0], row[1])

        params = {"key": key, "value": value, "new": new, "version": version, "ttl": ttl}
        return Statement("compare_and_set", key, self._sql["cas"], params, finish)

    def _delete(self, key: str, version: str) -> Statement[None]:
        def finish(row: Any) -> None:
            if row is None:
                raise SimpleCacheConditionError(
                    f"postgres: {key!r} is not at version {version}", key=key
                )

        params = {"key": key, "version": version, "channel": self._channel(key)}
        return Statement("compare_and_delete", key, self._sql["delete"], params, finish)

    def _collect_due(self) -> bool:
        """Does this grant also collect? The grant stands whatever the collection meets
        (drivers suppress its MalfunctionError); the next operation reports a lasting
        fault itself."""
        return self.gc_after is not None and gc_due()

    def _collect(self) -> Statement[int]:
        params = {"after": self.gc_after, "limit": _COLLECT_ROWS}
        return Statement("collect", "", self._sql["collect"], params, int, rows="count")

    def _scan(self, prefix: str) -> Statement[list[tuple[str, Entry]]]:
        params = {"pattern": like_prefix(prefix)}
        return Statement("scan", prefix, self._sql["scan"], params, scanned, rows="all")

    def _collect_failed(self, exc: MalfunctionError) -> int:
        """A collection's fault: a role without DELETE collects nothing from now on (a
        warning says so, once); any other fault is raised."""
        if not isinstance(exc.__cause__, psycopg.errors.InsufficientPrivilege):
            raise exc
        log.warning(
            "%s: this role may not DELETE from %s, so freed keys' rows are never "
            "collected: GRANT DELETE ON %s TO the lock role",
            type(self).__name__, self.table, self.table,
        )  # fmt: skip
        self.gc_after = None
        return 0

    def _listen(self, keys: Sequence[str]) -> tuple[set[str], str, Statement[bool]]:
        """The channels to wait on, the LISTEN statement, and the check run after it (is
        one of ``keys`` free already?): LISTEN commits before the check reads, so a
        release is either seen as a free key by the check or delivered to us: none falls
        between the two."""
        channels = {self._channel(key) for key in keys}
        distinct = list(set(keys))

        def any_free(live: Any) -> bool:
            return live is None or live[0] < len(distinct)

        check = Statement("wait", keys[0], self._sql["live"], {"keys": distinct}, any_free)
        return channels, "".join(f'LISTEN "{c}";' for c in channels), check

    def _channel(self, key: str) -> str:
        # Channel names are identifiers of at most 63 bytes: a digest of table and key.
        digest = hashlib.blake2b(f"{self.table}\0{key}".encode(), digest_size=16)
        return "sm_" + digest.hexdigest()


def like_prefix(prefix: str) -> str:
    """A LIKE pattern (escape character ``\\``) for the strings that start with ``prefix``."""
    escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped + "%"


def scanned(rows: Any) -> list[tuple[str, Entry]]:
    """The (key, entry) pairs of the scan statement's rows."""
    return [(row[0], Entry(row[1], row[2], row[3], row[4])) for row in rows]


def _entry_or_none(row: Any) -> Entry | None:
    return None if row is None else Entry(row[0], row[1], row[2], row[3])


LOST_RACE = (
    psycopg.errors.UniqueViolation, psycopg.errors.DuplicateObject, psycopg.errors.DuplicateTable
)  # fmt: skip
"""Errors of a table or index created by another session at the same instant."""


class SessionEnded(MalfunctionError):
    """A reused session the server had ended: the statement sent on it never ran."""


class Unreplicated(Exception):
    """What a face raises when a statement succeeded but its commit's wait for a
    synchronous standby was cancelled (``CommitWatch.unreplicated``): ``reply`` is what it
    read back; ``PostgresCore._failed`` maps it (to ``UnreplicatedCommit``)."""

    def __init__(self, reply: Any) -> None:
        super().__init__("the commit is on this server only")
        self.reply = reply


class UnreplicatedCommit(MalfunctionError):
    """A write committed on the primary only; the flow decides what it means there."""

    def __init__(self, reply: Any) -> None:
        super().__init__("postgres: the commit is on this server only")
        self.reply = reply


class CommitWatch:
    """One statement's watch, armed by a face: cancelled (``fire``, by the face's timer)
    once past ``PostgresCore.commit_bound``, and told the statement's notices. A
    cancelled wait for synchronous replication comes back as a success with a WARNING
    (SQLSTATE 01000), the write committed here only; whoever cancelled it (our timer,
    an operator), it does not count as replicated."""

    __slots__ = ("deadline", "fired", "unreplicated")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.fired = False
        self.unreplicated = False

    def notice(self, diagnostic: Any) -> None:
        if diagnostic.sqlstate == SYNC_REP_CANCELLED:
            self.unreplicated = True


def session_options(conninfo: str) -> str:
    """The server settings a session of ``conninfo`` starts with: its ``options``, else
    libpq's PGOPTIONS."""
    return str(conninfo_to_dict(conninfo).get("options") or os.environ.get("PGOPTIONS", ""))


def commit_bound(conninfo: str) -> float:
    """Seconds after which a face cancels a statement still in flight: the session's
    ``statement_timeout`` (the conninfo's ``options``, else ours; 0, "none", counts as
    ours) and a grace for the server's own timeout to answer first."""
    found = _TIMEOUT_SETTING.findall(session_options(conninfo))
    seconds = 0.0
    if found:
        number, unit = found[-1]  # the server's reading: the last one given counts
        seconds = float(number) * _UNITS_S[(unit or "ms").lower()]
    return (seconds or _STATEMENT_TIMEOUT_MS / 1000) + _CANCEL_GRACE_S


class EndedSession(Exception):
    """What a face's session code raises, ``from`` the psycopg error, when that error
    came from a reused session the server had ended: only the session code knows it
    was reused; ``PostgresCore._failed`` maps it (to ``SessionEnded``)."""


def check_identifier(owner: str, what: str, name: object) -> str:
    if not isinstance(name, str) or not _IDENTIFIER.fullmatch(name):
        raise bad_input(
            name, str,
            f"{owner} {what} must be a plain identifier (letters, digits, _; at most 63), "
            f"got {name!r}",
        )  # fmt: skip
    return name


def qualified(schema: str, name: str) -> str:
    """``"schema"."name"``: never resolved through the session's search_path."""
    return f"{sql.Identifier(schema).as_string(None)}.{sql.Identifier(name).as_string(None)}"


def schema_statements(table: str, schema: str = "public", grant_to: str | None = None) -> list[str]:
    """The statements the table's owner runs once (``create_schema``, or by hand), the
    GRANT of exactly the four privileges a lock role needs included when ``grant_to``
    names that role. LISTEN and NOTIFY need no privilege."""
    owner = "PostgresCache.create_schema"
    schema = check_identifier(owner, "schema", schema)
    t = qualified(schema, check_identifier(owner, "table", table))
    i = sql.Identifier(_index_name(table)).as_string(None)
    statements = [_SCHEMA.format(t=t).strip(), _INDEX.format(t=t, i=i)]
    if grant_to is not None:
        role = sql.Identifier(check_identifier(owner, "grant_to", grant_to)).as_string(None)
        statements += [
            f"GRANT USAGE ON SCHEMA {sql.Identifier(schema).as_string(None)} TO {role}",
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON {t} TO {role}",
        ]
    return statements


def _index_name(table: str) -> str:
    """``<table>_gc``; for a table name too long for that, its head and a digest."""
    if len(table) <= 60:
        return f"{table}_gc"
    return f"{table[:46]}_gc_{hashlib.blake2b(table.encode(), digest_size=6).hexdigest()}"


def _is_pool(obj: object, kind: str) -> bool:
    try:
        import psycopg_pool
    except ImportError:
        return False
    return isinstance(obj, getattr(psycopg_pool, kind))


def _with_defaults(conninfo: str) -> str:
    try:
        given = conninfo_to_dict(conninfo)
    except psycopg.Error:
        # Only the kind of problem is echoed: a conninfo may hold a password.
        raise ConstraintValueError(
            "bad PostgreSQL conninfo or URL (expected postgresql://user@host/db or "
            "'host=... dbname=...')"
        ) from None
    extra = {name: value for name, value in _CONNECT_DEFAULTS.items() if name not in given}
    return make_conninfo(conninfo, **extra)
