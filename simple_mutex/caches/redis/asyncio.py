"""AsyncRedisCache: RedisCache for ``redis.asyncio``, awaited on the event loop.

The same keys, scripts, fences, signal list and eviction check as ``RedisCache``: both
build their requests and read their replies in ``protocol.py``; this module does
only the awaited I/O.

* A plain ``redis.asyncio.Redis`` (Sentinel masters included) is used through a few
  connections the cache opens itself with the client's settings, outside its pool and
  with no retry policy (``_OwnConnections``): a command costs one round trip, not a pool
  check-out plus a round trip, a dead server costs no backoff sleeps, and ten thousand
  coroutines at once share at most ``_MAX_OWN`` sockets instead of opening one each.
* Waiting parks a future on the loop, never a thread. One task per signal list (so one
  per lock key waited on, however many coroutines wait on it) blocks in ``BLPOP`` on a
  connection of its own and wakes one local waiter per token, exactly as one blocked
  ``BLPOP`` per waiter would: one release wakes one waiter in the whole fleet.
* A ``RedisCluster``, a single-connection client or a client whose ``execute_command``
  was wrapped (tracing) keeps its own command path, and each waiter blocks in a
  ``BLPOP`` of its own.
* Connections belong to one event loop and one process: used from another loop, or in a
  forked child, the cache leaves the old ones alone and opens new ones; a closed loop's
  are dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import time
import types
import weakref
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any

from simple_mutex.caches._base import driver_imports
from simple_mutex.contract import Entry
from simple_mutex.errors import ConstraintTypeError, MalfunctionError, SimpleCacheConditionError

from .protocol import (
    CAS,
    CONFIG_GET,
    DELETE,
    PERSISTENCE_GETS,
    PUT,
    WAITER_MARK_MS,
    Persistence,
    RedisLayout,
    Request,
    blpop_command,
    load_command,
    mark_command,
    own_connection,
    persistence_of,
    refused,
    token_back_commands,
)

with driver_imports("redis"):
    import redis.asyncio
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError, NoScriptError, RedisError, ResponseError

_MAX_OWN = 16  # connections per cache and loop for the short commands
_MAX_LISTENERS = 256  # signal lists one cache listens to at once; past that, waiters poll

Execute = Callable[..., Coroutine[Any, Any, Any]]


class AsyncRedisCache(RedisLayout):
    """An AsyncConditionalCache over a ``redis.asyncio`` client (``redis.asyncio.Redis``,
    ``redis.asyncio.RedisCluster``, or an asyncio ``Sentinel.master_for(...)``). The
    options are RedisCache's. ``Mutex(redis.asyncio.Redis(...))`` builds one for you."""

    def _connect(self, client: Any) -> bool:
        execute = getattr(client, "execute_command", None)
        if not inspect.iscoroutinefunction(execute):
            raise ConstraintTypeError(
                f"AsyncRedisCache needs a redis.asyncio client (redis.asyncio.Redis, "
                f"redis.asyncio.RedisCluster or an asyncio Sentinel master), got "
                f"{type(client).__name__}; for a sync redis.Redis use RedisCache"
            )
        pool = _own_pool(client)
        self._own = None if pool is None else _OwnConnections(pool)
        self._execute: Execute = execute if self._own is None else self._own.call
        self._listeners: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Listeners] = (
            weakref.WeakKeyDictionary()
        )
        return self._own is not None

    async def close(self) -> None:
        """Close this cache's own connections on the running loop (the client stays
        open; close it yourself), as ``close`` does on the other asyncio caches."""
        if self._own is not None:
            await self._own.close()

    aclose = close  # its first name, kept: redis-py's asyncio clients say aclose

    async def _evalsha(self, execute: Execute, script: str, request: Request) -> Any:
        try:
            return await execute(*self._script_command(script, request))
        except NoScriptError:
            # A restarted or failed-over server forgot the script: load it again.
            self._loaded(script, await execute(*load_command(script)))
            return await execute(*self._script_command(script, request))

    async def _call_script(
        self, script: str, operation: str, key: str, request: Request
    ) -> tuple[Any, bool]:
        """RedisCache._call_script, awaited: the reply, and whether the write counts."""
        with self._faults(operation, key):
            if not self._waits_for_replicas(script):
                return await self._evalsha(self._execute, script, request), True
            assert self._own is not None  # replicas=N needs our own connections
            async with self._own.lent() as execute:
                reply = await self._evalsha(execute, script, request)
                try:
                    acked = await execute(*self._replicas_command())
                except RedisError:  # no answer (a socket timeout below replica_timeout)
                    acked = 0
        return reply, self._replicated(acked)

    async def _check_eviction(self, key: str) -> None:
        with self._eviction_check(key) as replies:
            replies.append(await self._execute(*CONFIG_GET))

    async def get(self, key: str) -> Entry | None:
        with self._faults("get", key):
            payload = await self._execute(*self._get_command(key))
        return self._read_entry(key, payload)

    async def scan(self, prefix: str) -> list[tuple[str, Entry]]:
        """RedisCache.scan for asyncio: every live entry under ``prefix``, as ``get``
        reads it (a list: a scan is for operators' tools, not a hot path)."""
        if self.index:
            with self._faults("scan", prefix):
                prune, members = self._index_commands(prefix, await self._execute("TIME"))
                await self._execute(*prune)
                names = await self._execute(*members)
                payloads = [p for m in self._mget_commands(names) for p in await self._execute(*m)]
            return self._indexed_entries(names, payloads, prefix)
        with self._faults("scan", prefix):
            pattern = self._scan_pattern(prefix)
            names = [name async for name in self.client.scan_iter(match=pattern, count=1000)]
        found = []
        for key in self._scanned_keys(names, prefix):
            entry = await self.get(key)
            if entry is not None:
                found.append((key, entry))
        return found

    async def get_many(self, keys: Sequence[str]) -> list[Entry | None]:
        """RedisCache.get_many for asyncio: ``get`` of each of ``keys``, by ``MGET``."""
        if not keys:
            return []
        with self._faults("get", keys[0]):
            mgets = self._mget_commands(self._entry_keys(keys))
            payloads = [payload for mget in mgets for payload in await self._execute(*mget)]
        return [self._read_entry(key, p) for key, p in zip(keys, payloads, strict=True)]

    async def persistence(self) -> Persistence | None:
        """RedisCache.persistence for asyncio: what the server keeps across a restart."""
        try:
            with self._faults("persistence", ""):
                replies = [await self._execute(*command) for command in PERSISTENCE_GETS]
        except MalfunctionError as fault:
            if isinstance(fault.__cause__, ResponseError):
                return None
            raise
        return persistence_of(*replies)

    async def waited_on(self, key: str) -> bool:
        """RedisCache.waited_on for asyncio: is a waiter blocked on ``key``?"""
        with self._faults("waited_on", key):
            return bool(await self._execute(*self._waited_on_command(key)))

    async def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:
        if not self._checked:
            await self._check_eviction(key)
        request, expires = self._put_request(key, value, ttl)
        reply, replicated = await self._call_script(PUT, "put_if_absent", key, request)
        entry = self._put_reply(key, value, expires, reply)
        if not replicated:
            raise self._unreplicated_grant(key, await self._withdraw(key, entry))
        return entry

    async def _withdraw(self, key: str, entry: Entry) -> bool:
        """RedisCache._withdraw, awaited: undo a grant too few replicas took; was it?"""
        try:
            await self.compare_and_delete(key, version=entry.version)
        except (MalfunctionError, SimpleCacheConditionError):
            return False
        return True

    async def compare_and_set(self, key: str, value: str, *, ttl: float, version: str) -> Entry:
        request, expires = self._cas_request(key, value, ttl, version)
        n, replicated = await self._call_script(CAS, "compare_and_set", key, request)
        entry = self._cas_reply(key, value, version, expires, n)
        if not replicated:
            raise self._unreplicated_renewal(key)
        return entry

    async def compare_and_delete(self, key: str, *, version: str) -> bool:
        request = self._delete_request(key, version)
        freed, _ = await self._call_script(DELETE, "compare_and_delete", key, request)
        return self._delete_reply(key, version, freed)

    async def wait(self, keys: Sequence[str], timeout: float) -> None:
        block = self._block(timeout)
        if block < 0.001 or not keys:
            await asyncio.sleep(max(block, 0.0))
            return
        with self._faults("wait", keys[0]):
            if self._own is None:  # a cluster or an instrumented client: a BLPOP of our own
                await self._execute(*self._blpop_command(keys, block))
            else:
                # Not cut to one BLPOP's length: the listener blocks again and again, and
                # keeps the waiter mark alive while anyone here waits, so a release still
                # signals.
                await self._listeners_here().wait(self._signals(keys), timeout)

    @property
    def wait_then_put(self) -> None:
        """The contract's optional fused wait: none on this face. Its waiters share one
        BLPOP per key and loop (``_Listeners``), and a put pipelined behind it would be
        one waiter's, chosen before the token says which local waiter is first."""
        return None

    def _listeners_here(self) -> _Listeners:
        """The listeners of the running loop (and of this process)."""
        assert self._own is not None
        loop = asyncio.get_running_loop()
        listeners = self._listeners.get(loop)
        if listeners is None or listeners.pid != os.getpid():
            listeners = self._listeners[loop] = _Listeners(self._own, self._max_block)
        return listeners


class _Listeners:
    """The waiters of one cache on one event loop: futures, woken in arrival order by one
    task per signal list that blocks in ``BLPOP`` on a connection of its own.

    A token is pushed once per release that found a waiter marked, and the task that pops
    it wakes exactly one local waiter, so a release still wakes one waiter in the whole
    fleet. A release between a waiter's failed put and its ``wait`` left the token in
    the list (for 1 s): the next ``BLPOP`` returns it at once."""

    def __init__(self, own: _OwnConnections, max_block: float) -> None:
        self.pid = os.getpid()
        self._own = own
        self._max_block = max_block
        self._waiters: dict[str, dict[asyncio.Future[None], None]] = {}  # ordered sets
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def wait(self, signals: list[str], timeout: float) -> None:
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()
        for signal in signals:
            self._waiters.setdefault(signal, {})[woken] = None
            if signal not in self._tasks and len(self._tasks) < _MAX_LISTENERS:
                self._tasks[signal] = loop.create_task(self._listen(signal))
        timer = loop.call_later(timeout, _settle, woken)
        try:
            await woken  # raises the listener's fault, if it failed
        finally:
            timer.cancel()
            for signal in signals:
                waiting = self._waiters.get(signal)
                if waiting is not None:
                    waiting.pop(woken, None)
                    if not waiting and signal not in self._tasks:
                        del self._waiters[signal]

    async def _listen(self, signal: str) -> None:
        conn = None
        blpop = blpop_command([signal], self._max_block)
        marked = time.monotonic()  # the waiter's failed put has just set the mark
        try:
            conn = self._own.spare()
            while True:
                if not self._waiters.get(signal):
                    # Checked and forgotten with no await in between: a waiter that comes
                    # later finds no task and starts one.
                    self._waiters.pop(signal, None)
                    del self._tasks[signal]
                    return
                if time.monotonic() - marked > WAITER_MARK_MS / 3000:
                    # Waiters here may park past the mark's life (a long poll interval):
                    # keep it, or releases would stop pushing tokens.
                    marked = time.monotonic()
                    await _run(conn, mark_command(signal))
                    continue  # the waiters may have left meanwhile
                if await _run(conn, blpop) is not None:
                    woken = next((w for w in self._waiters.get(signal, ()) if not w.done()), None)
                    if woken is not None:
                        woken.set_result(None)
                        await asyncio.sleep(0)  # its put goes out before our next BLPOP
                    else:
                        # Its waiter gave up meanwhile: put the token back for a waiter in
                        # another process (one release must wake someone).
                        for command in token_back_commands(signal):
                            await _run(conn, command)
        except BaseException as exc:
            self._tasks.pop(signal, None)
            for woken in self._waiters.pop(signal, {}):
                if not woken.done():
                    if isinstance(exc, Exception):
                        woken.set_exception(exc)
                    else:
                        woken.set_result(None)  # cancelled (the loop closing): just return
            if not isinstance(exc, Exception):
                raise
        finally:
            if conn is not None:
                await self._own.give_spare(conn)


def _settle(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)


def _own_pool(client: Any) -> Any:
    """The connection pool of a plain pooled ``redis.asyncio.Redis`` (Sentinel masters
    included), or None to use the client's own ``execute_command``: the rule of
    ``sync._own_connections``, which says why."""
    method = getattr(type(client), "execute_command", None)
    pool: Any = getattr(client, "connection_pool", None)
    if (
        not isinstance(client, redis.asyncio.Redis)
        or not isinstance(method, types.FunctionType)
        or method.__qualname__ != "Redis.execute_command"
        or method.__module__ != "redis.asyncio.client"
        or "execute_command" in vars(client)
        or getattr(client, "single_connection_client", False)
        or not callable(getattr(pool, "connection_class", None))
        or not isinstance(getattr(pool, "connection_kwargs", None), dict)
    ):
        return None
    return pool


class _OwnConnections:
    """Up to ``_MAX_OWN`` connections per event loop that this cache opens itself, with
    its client's connection class and settings but no retry policy (``sync.py``:
    ``_own_connections`` says why) and outside the client's pool, each lent to one
    command at a time; a command that finds them all busy waits its turn (first come,
    first served) instead of opening another socket. The listeners' connections
    (``spare``) come and go beside them.

    A connection belongs to the event loop and the process that opened it, so each loop
    has its own set (two threads each running ``asyncio.run`` share the cache safely); a
    closed loop's connections are dropped with it. In a forked child the parent's are
    kept out of reach (never closed there) and the child opens its own."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self._loops: dict[asyncio.AbstractEventLoop, _LoopConnections] = {}
        self._pid = os.getpid()

    def _here(self) -> _LoopConnections:
        """The set of the running loop (made on its first command)."""
        loop = asyncio.get_running_loop()
        if self._pid != os.getpid():
            self._pid = os.getpid()
            _inherited.extend(self._loops.values())
            self._loops = {}
        own = self._loops.get(loop)
        if own is None:
            for other in list(self._loops):
                if other.is_closed():
                    self._loops.pop(other, None)
            own = self._loops[loop] = _LoopConnections()
        return own

    async def call(self, *args: Any) -> Any:
        own = self._here()
        conn = own.idle.pop() if own.idle else await self.take()
        try:
            return await _run(conn, args)
        finally:
            self.give(conn)

    @contextlib.asynccontextmanager
    async def lent(self) -> AsyncIterator[Execute]:
        """One connection for several commands in a row (a write and its ``WAIT``)."""
        conn = await self.take()
        try:
            yield lambda *args: _run(conn, args)
        finally:
            self.give(conn)

    async def take(self) -> Any:
        own = self._here()
        if own.idle:
            return own.idle.pop()
        if own.opened < _MAX_OWN:
            own.opened += 1
            return self._open()
        turn: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        own.queue.append(turn)
        try:
            return await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.give(turn.result())  # handed to us just as we were cancelled
            raise

    def give(self, conn: Any) -> None:
        own = self._loops.get(asyncio.get_running_loop())
        if own is None or self._pid != os.getpid():
            return  # the process forked since: the child opens its own
        while own.queue:
            turn = own.queue.popleft()
            if not turn.done():
                turn.set_result(conn)
                return
        own.idle.append(conn)

    def spare(self) -> Any:
        """A connection for a listener's ``BLPOP``, beside the command connections."""
        own = self._here()
        return own.spares.pop() if own.spares else self._open()

    async def give_spare(self, conn: Any) -> None:
        try:
            own = self._loops.get(asyncio.get_running_loop())
        except RuntimeError:
            return  # a listener closed outside its loop (collected): nothing to await on
        if own is not None and self._pid == os.getpid() and len(own.spares) < _MAX_SPARES:
            own.spares.append(conn)
        else:
            with contextlib.suppress(RedisError, OSError, RuntimeError):
                await conn.disconnect(nowait=True)

    def _open(self) -> Any:
        return own_connection(self.pool, Retry(NoBackoff(), 0))

    async def close(self) -> None:
        """Close this loop's idle connections."""
        own = self._loops.get(asyncio.get_running_loop())
        if own is None or self._pid != os.getpid():
            return
        idle, own.idle, own.opened = own.idle + own.spares, [], 0
        own.spares = []
        for conn in idle:
            with contextlib.suppress(RedisError, OSError, RuntimeError):
                await conn.disconnect()


class _LoopConnections:
    """One event loop's own connections: idle ones, how many are open, who waits, and
    the listeners' idle ones."""

    def __init__(self) -> None:
        self.idle: list[Any] = []
        self.opened = 0
        self.queue: deque[asyncio.Future[Any]] = deque()
        self.spares: list[Any] = []


_MAX_SPARES = 4  # idle listener connections kept per loop
# In a forked child: the parent's connections, never closed here. Closing one would
# unregister its socket from the parent's epoll set (a forked child shares it), and the
# parent would never hear its replies again.
_inherited: list[Any] = []


async def _run(conn: Any, args: tuple[Any, ...]) -> Any:
    """One command on ``conn``; the rules of ``sync._run``: no retry policy with backoff
    sleeps, one immediate retry for an idle connection the server closed, and a
    connection left mid-reply (a fault, a cancellation) is closed, never reused."""
    try:
        try:
            reply = await _send_and_read(conn, args)
        except ConnectionError as exc:
            await conn.disconnect()
            if refused(exc):
                raise
            reply = await _send_and_read(conn, args)
    except ResponseError:
        raise  # a whole reply, read to its end: the connection is in step
    except BaseException:
        await conn.disconnect(nowait=True)
        raise
    if getattr(conn, "should_reconnect", bool)():  # the server announced maintenance
        await conn.disconnect()
    return reply


async def _send_and_read(conn: Any, args: tuple[Any, ...]) -> Any:
    if not conn.is_connected:
        # The class's own connect, not the one sending would do: a Sentinel master's
        # asks the sentinels where the master is (sending connects to the default).
        await conn.connect()
    # No health check per command (a PING every health_check_interval): a dead
    # connection fails the command itself, which _run retries once on a new one.
    await conn.send_command(*args, check_health=False)
    return await conn.read_response()
