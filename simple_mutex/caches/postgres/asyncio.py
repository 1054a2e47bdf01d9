"""AsyncPostgresCache: PostgresCache on psycopg's asyncio connections.

The same table, statements, fences, garbage collection, retry of a statement sent on a
session the server had ended, and fault mapping as ``PostgresCache``: all of it lives in
``statements.py``; this module only awaits. ``Mutex(psycopg.AsyncConnection)`` and
``Mutex(psycopg_pool.AsyncConnectionPool)`` wrap the connection in this cache.

* One autocommit connection per process and event loop, opened from a conninfo or URL
  (or the connection you pass, or a pool's). Coroutines of a loop take turns on it, one
  statement at a time, as the threads of a PostgresCache do; a coroutine cancelled
  mid-statement leaves the connection unusable (a reply may be unread), so the next
  statement opens another. Threads that each run their own loops (sync workers calling
  ``asyncio.run``) share one cache safely: each loop has its own sessions and locks, and
  a closed loop's are dropped. A connection or pool you pass belongs to one loop: a
  second loop using it while the first is still open is refused (``ConstraintError``).
* ``wait`` parks the coroutine on the loop: one coroutine at a time LISTENs on a
  connection of its own for its keys' channels (``pg_notify`` on release), the others
  sleep out their timeout and retry, as the engine's poll does. No thread either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, TypeVar

from simple_mutex._runtime.steps import drive_async
from simple_mutex.caches._base import driver_imports
from simple_mutex.contract import Entry
from simple_mutex.errors import ConstraintError, MalfunctionError

from .statements import (
    LOST_RACE,
    NO_STANDBY_WAIT,
    CommitWatch,
    PostgresCore,
    Statement,
    Unreplicated,
)
from .sync import PostgresCache

with driver_imports("postgres"):
    import psycopg
    from psycopg.pq import TransactionStatus

T = TypeVar("T")


class AsyncPostgresCache(PostgresCore):
    """An AsyncConditionalCache in one PostgreSQL table.

    ``conninfo`` is a libpq conninfo string or ``postgresql://`` URL, an autocommit
    ``psycopg.AsyncConnection``, or a ``psycopg_pool.AsyncConnectionPool`` (open it before
    use). ``table`` and ``gc_after`` as for ``PostgresCache``; both may share a table."""

    _connection_type = psycopg.AsyncConnection
    _pool_type = "AsyncConnectionPool"

    # A deploy step, run once as the table's owner: the same blocking call on both faces.
    create_schema = staticmethod(PostgresCache.create_schema)

    def _own_state(self) -> None:
        # Sessions and asyncio locks belong to one loop: each loop has its own.
        self._loops: dict[asyncio.AbstractEventLoop, _Sessions] = {}
        self._given_loop: asyncio.AbstractEventLoop | None = None

    async def close(self) -> None:
        """Close the connections this cache opened on the running loop, and drop those of
        loops that have closed (a given connection or pool stays open)."""
        sessions = self._loops.pop(asyncio.get_running_loop(), None)
        self._drop_closed_loops()
        if sessions is None:
            return
        for conn in (sessions.conn, sessions.listener):
            if conn is not None and conn is not self._given:
                await conn.close()

    # -- connections -------------------------------------------------------------------

    def _after_fork(self) -> None:
        self._forget_sessions()
        self._loops = {}  # the parent's loops, sessions and locks did not come along
        self._given_loop = None

    def _here(self) -> _Sessions:
        """The running loop's sessions and locks, made on its first statement: a session
        opened on another loop would wait on that loop (forever, once it has ended)."""
        loop = asyncio.get_running_loop()
        sessions = self._loops.get(loop)
        if sessions is None:
            sessions = self._loops[loop] = self._first_use(loop)
        return sessions

    def _first_use(self, loop: asyncio.AbstractEventLoop) -> _Sessions:
        self._drop_closed_loops()
        if self._conn is not None or self._pool is not None:
            owner = self._given_loop
            if owner is not None and owner is not loop and not owner.is_closed():
                what = "connection pool" if self._pool is not None else "connection"
                raise ConstraintError(
                    f"AsyncPostgresCache was given one psycopg async {what}, which another "
                    "event loop still open uses: it serves one loop at a time. Threads "
                    "that each run an event loop (asyncio.run in sync workers) need a "
                    "conninfo or URL (the cache opens sessions per loop), or a cache each"
                )
            self._given_loop = loop
        return _Sessions(self._conn)

    def _drop_closed_loops(self) -> None:
        for loop, sessions in list(self._loops.items()):
            if loop.is_closed() and self._loops.pop(loop, None) is not None:
                for conn in (sessions.conn, sessions.listener):
                    if conn is not self._given:
                        _discard(conn)

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        conn = await psycopg.AsyncConnection.connect(self._conninfo, autocommit=True)
        setup = self._session_setup()
        if setup is not None:
            await conn.execute(setup)
        return conn

    async def _create_table(self, conn: psycopg.AsyncConnection[Any]) -> None:
        for statement, name, lookup in self._setup_steps():
            if await (await conn.execute(lookup, (name,))).fetchone() != (None,):
                continue
            try:
                fresh = conn.info.transaction_status == TransactionStatus.IDLE
                with contextlib.suppress(*LOST_RACE), self._watched(conn):
                    async with conn.transaction():
                        if fresh:  # a transaction of its own (not a pooled one's savepoint)
                            await conn.execute(NO_STANDBY_WAIT)
                        await conn.execute(self._sql[statement])
            except psycopg.errors.InsufficientPrivilege as exc:
                self._denied(statement, exc)
        self._ready = True

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A session to run on, as ``PostgresCache._connection``: a psycopg error passes
        through (``EndedSession`` around it when the session had been ended)."""
        sessions = self._here()
        if self._pool is not None:
            async with self._pool.connection() as conn:
                if not self._ready:
                    await self._create_table(conn)
                with self._pooled(conn):
                    yield conn
            return
        async with sessions.turn:
            reused = False
            try:
                reused = sessions.conn is not None and not sessions.conn.closed
                if sessions.conn is None or not reused:
                    sessions.conn = await self._connect()
                if not self._ready:
                    await self._create_table(sessions.conn)
                yield sessions.conn
            except psycopg.Error as exc:
                ended = reused and sessions.conn is not None and sessions.conn.broken
                self._drop(sessions, exc)
                self._pass_on(exc, ended=ended)
            except BaseException:
                self._note_unsettled(sessions.conn)
                self._drop(sessions, None)  # cancelled mid-statement: a reply may be unread
                raise

    async def _run(self, statement: Statement[T]) -> T:
        return await drive_async(self._running(statement), self._perform, self._failed)

    async def _perform(self, statement: Statement[Any]) -> Any:
        async with self._connection() as conn:
            with self._watched(conn) as watch:
                cursor = await conn.execute(statement.sql, statement.params)
                reply: Any
                if statement.rows == "count":
                    reply = cursor.rowcount
                else:
                    rows = cursor.fetchall() if statement.rows == "all" else cursor.fetchone()
                    reply = await rows
        if watch.unreplicated:
            raise Unreplicated(reply)
        return reply

    @contextlib.contextmanager
    def _watched(self, conn: psycopg.AsyncConnection[Any]) -> Iterator[CommitWatch]:
        """As ``PostgresCache._watched``: a timer on the loop cancels the statement still
        in flight ``commit_bound`` seconds on; its notices are read (``CommitWatch``)."""
        loop = asyncio.get_running_loop()
        watch = CommitWatch(time.monotonic() + self.commit_bound)
        conn.add_notice_handler(watch.notice)
        timer = loop.call_later(self.commit_bound, _fire, watch, conn)
        try:
            yield watch
        finally:
            timer.cancel()
            conn.remove_notice_handler(watch.notice)

    def _drop(self, sessions: _Sessions, error: psycopg.Error | None) -> None:
        conn = sessions.conn
        if conn is None or self._keeps(conn, error):
            return
        sessions.conn = None
        if conn is self._given:
            self._conn = None  # broken: every loop opens sessions of its own from now on
        else:
            _discard(conn)

    # -- the contract ------------------------------------------------------------------

    async def get(self, key: str) -> Entry | None:
        return await self._run(self._get(key))

    async def scan(self, prefix: str) -> list[tuple[str, Entry]]:
        """As ``PostgresCache.scan``, awaited: the whole listing at once."""
        return await self._run(self._scan(prefix))

    async def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:
        entry = await self._run(self._put(key, value, ttl))
        if self._collect_due():
            with contextlib.suppress(MalfunctionError):
                await self.collect()
        return entry

    async def compare_and_set(self, key: str, value: str, *, ttl: float, version: str) -> Entry:
        return await self._run(self._cas(key, value, ttl, version))

    async def compare_and_delete(self, key: str, *, version: str) -> None:
        await self._run(self._delete(key, version))

    async def collect(self) -> int:
        """As ``PostgresCache.collect``: up to 256 rows of keys freed or expired more than
        ``gc_after`` ago; how many it deleted."""
        if self.gc_after is None:
            return 0
        try:
            return await self._run(self._collect())
        except MalfunctionError as exc:
            return self._collect_failed(exc)

    async def wait(self, keys: Sequence[str], timeout: float) -> None:
        if timeout < 0.001 or not keys:
            await asyncio.sleep(max(timeout, 0.0))
            return
        sessions = self._here()
        deadline = asyncio.get_running_loop().time() + timeout
        if sessions.listening.locked():
            # Another coroutine of ours listens: sleep, and let the engine poll after.
            await asyncio.sleep(timeout)
            return
        channels, listen, check = self._listen(keys)
        async with sessions.listening:
            try:
                await self._listen_once(sessions, channels, listen, check, deadline)
            except psycopg.Error as exc:
                listener, sessions.listener = sessions.listener, None
                _discard(listener)
                raise (self._failed(check, exc) or exc) from exc
            except BaseException:
                listener, sessions.listener = sessions.listener, None
                _discard(listener)  # cancelled mid-read: its state is unknown
                raise

    async def _listen_once(
        self,
        sessions: _Sessions,
        channels: set[str],
        listen: str,
        check: Statement[bool],
        deadline: float,
    ) -> None:
        if sessions.listener is None or sessions.listener.closed:
            sessions.listener = await self._connect()
        conn = sessions.listener
        await conn.execute(listen)
        live = await (await conn.execute(check.sql, check.params)).fetchone()
        if not check.finish(live):
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining > 0:
                # Closed on leaving: the generator holds the connection's lock until then.
                async with contextlib.aclosing(conn.notifies(timeout=remaining)) as notes:
                    async for note in notes:
                        if note.channel in channels:
                            break
        # Listen only while waiting: an idle listening session that reads nothing would
        # hold back the server's notification queue for every database user.
        await conn.execute("UNLISTEN *")


class _Sessions:
    """One event loop's sessions: the statement session and the coroutines' turns on
    it, the listening session and the right to listen."""

    def __init__(self, conn: psycopg.AsyncConnection[Any] | None) -> None:
        self.conn = conn
        self.turn = asyncio.Lock()
        self.listener: psycopg.AsyncConnection[Any] | None = None
        self.listening = asyncio.Lock()


_CANCELLING: set[asyncio.Task[None]] = set()  # the loop keeps only weak references


def _fire(watch: CommitWatch, conn: psycopg.AsyncConnection[Any]) -> None:
    """Cancel the statement in flight on ``conn`` (a task: sending a cancel connects)."""
    watch.fired = True
    task = asyncio.get_running_loop().create_task(_cancel(conn))
    _CANCELLING.add(task)
    task.add_done_callback(_CANCELLING.discard)


async def _cancel(conn: psycopg.AsyncConnection[Any]) -> None:
    with contextlib.suppress(psycopg.Error, OSError):
        await conn.cancel_safe(timeout=5)


def _discard(conn: psycopg.AsyncConnection[Any] | None) -> None:
    """Close a connection without awaiting (after a cancellation, or on another loop)."""
    if conn is not None:
        with contextlib.suppress(psycopg.Error, OSError):  # never a signal's exception
            conn.pgconn.finish()
