"""RedisCache: every machine that reaches one Redis (or Valkey, a Sentinel master, a Cluster).

The key layout and the Lua scripts live in ``protocol.py``, shared with
``AsyncRedisCache`` (``asyncio.py``); this module does the blocking I/O.

* Each operation is one round trip (a Lua script; ``get`` a plain ``GET``): compare and act
  are atomic, and the server's clock decides expiry (``PX``). Needs Redis >= 6.0.
* A fence is max(last fence + 1, the server's ``TIME`` in µs): a counter lost to a restart
  without persistence, a flush or a failover never makes one go back (the server's clock
  must not step back further than the ``{base}:f`` window).
* A release wakes one waiter that marked itself (its ``BLPOP`` takes the token), and says so.
* Every redis-py error is a ``MalfunctionError`` naming redis, the operation and the key
  (``unsent`` when the connection was refused); a retried put finds its own value.
* A plain client's commands go on connections of the cache's own, with the client's
  settings and no retry policy: a call is bounded by one socket timeout, whatever the
  client's retries (its own commands keep them).
* ``replicas=N``: a grant or renewal counts only once N replicas have it (``WAIT``).
* A server that may evict keys (``maxmemory`` with a policy other than ``noeviction``) is
  refused at first use unless ``allow_eviction=True``: an evicted lock is a lock held twice.

Rationale and figures: docs/design/redis.md, bench/README-redis.md.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import time
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from urllib.parse import parse_qsl, unquote

from simple_mutex.caches._base import driver_imports
from simple_mutex.contract import Entry
from simple_mutex.errors import (
    ConstraintError,
    ConstraintTypeError,
    ConstraintValueError,
    MalfunctionError,
    SimpleCacheConditionError,
)

from .protocol import (
    CAS,
    CONFIG_GET,
    DELETE,
    PERSISTENCE_GETS,
    PUT,
    Persistence,
    RedisLayout,
    Request,
    load_command,
    own_connection,
    persistence_of,
    refused,
)

with driver_imports("redis"):
    import redis
    import redis.asyncio
    from redis.backoff import NoBackoff
    from redis.exceptions import ConnectionError, NoScriptError, RedisError, ResponseError
    from redis.retry import Retry


class RedisCache(RedisLayout):
    """A ConditionalCache over a sync redis-py client (``redis.Redis``,
    ``redis.RedisCluster``, or ``Sentinel.master_for(...)``). ``prefix`` goes in front of
    every Redis key, outside the hash tag. ``replicas=N`` makes a grant or renewal count
    only once N replicas acknowledged it within ``replica_timeout`` seconds (``WAIT``; a
    plain ``redis.Redis`` or Sentinel master). ``allow_eviction=True`` accepts a server
    whose ``maxmemory-policy`` may evict lock keys. For ``redis.asyncio`` clients, see
    ``AsyncRedisCache``."""

    def _connect(self, client: Any) -> bool:
        execute = getattr(client, "execute_command", None)
        if not callable(execute) or inspect.iscoroutinefunction(execute):
            raise ConstraintTypeError(
                f"RedisCache needs a sync redis-py client (redis.Redis, redis.RedisCluster "
                f"or a Sentinel master), got {type(client).__name__}; for a redis.asyncio "
                "client use AsyncRedisCache (or pass the client to Mutex as it is)"
            )
        self._own = _own_connections(client)
        self._execute: Callable[..., Any] = execute if self._own is None else self._own
        return self._own is not None

    def _evalsha(self, execute: Callable[..., Any], script: str, request: Request) -> Any:
        try:
            return execute(*self._script_command(script, request))
        except NoScriptError:
            # A restarted or failed-over server forgot the script: load it again.
            self._loaded(script, execute(*load_command(script)))
            return execute(*self._script_command(script, request))

    def _call_script(
        self, script: str, operation: str, key: str, request: Request
    ) -> tuple[Any, bool]:
        """The script's reply, and whether the write counts: with ``replicas=N``, once a
        ``WAIT`` on the connection that sent it says N replicas took it."""
        with self._faults(operation, key):
            if not self._waits_for_replicas(script):
                return self._evalsha(self._execute, script, request), True
            assert self._own is not None  # replicas=N needs our own connections
            with self._own.lent() as execute:
                reply = self._evalsha(execute, script, request)
                try:
                    acked = execute(*self._replicas_command())
                except RedisError:  # no answer (a socket timeout below replica_timeout)
                    acked = 0
        return reply, self._replicated(acked)

    def _check_eviction(self, key: str) -> None:
        with self._eviction_check(key) as replies:
            replies.append(self._execute(*CONFIG_GET))

    def get(self, key: str) -> Entry | None:
        with self._faults("get", key):
            payload = self._execute(*self._get_command(key))
        return self._read_entry(key, payload)

    def scan(self, prefix: str) -> Iterator[tuple[str, Entry]]:
        """The live entries under the lock prefix ``prefix``: the members of its index
        (``index_prefix``; lapsed ones dropped first), read by ``MGET``, so the cost
        follows the locks, not the database. With ``index=False`` or on a Cluster:
        ``SCAN`` (never ``KEYS``: it would stall the server) for the entry keys, then
        each entry read as ``get`` reads it. A key that lapses meanwhile is skipped."""
        if self.index:
            with self._faults("scan", prefix):
                prune, members = self._index_commands(prefix, self._execute("TIME"))
                self._execute(*prune)
                names = self._execute(*members)
                payloads = [p for mget in self._mget_commands(names) for p in self._execute(*mget)]
            yield from self._indexed_entries(names, payloads, prefix)
            return
        with self._faults("scan", prefix):
            names = list(self.client.scan_iter(match=self._scan_pattern(prefix), count=1000))
        for key in self._scanned_keys(names, prefix):
            entry = self.get(key)
            if entry is not None:
                yield key, entry

    def get_many(self, keys: Sequence[str]) -> list[Entry | None]:
        """``get`` of each of ``keys``, by ``MGET`` (a thousand a request): for keys of
        one lock (a semaphore's slots share its hash tag, so a Cluster takes them too)."""
        if not keys:
            return []
        with self._faults("get", keys[0]):
            mgets = self._mget_commands(self._entry_keys(keys))
            payloads = [payload for mget in mgets for payload in self._execute(*mget)]
        return [self._read_entry(key, p) for key, p in zip(keys, payloads, strict=True)]

    def close(self) -> None:
        """Close this cache's own connections (the client stays open; close it
        yourself), as ``close`` does on the other caches."""
        if self._own is not None:
            self._own.close()

    def persistence(self) -> Persistence | None:
        """What the server keeps across a restart: ``"append-only file"`` (every write),
        ``"snapshots"`` (its data as of the last save: a crash loses the writes since),
        ``"none"``; None when it will not say (CONFIG renamed or denied, as managed
        services do). Data that must outlive a restart (a line's parked calls) is only
        as durable as this."""
        try:
            with self._faults("persistence", ""):
                replies = [self._execute(*command) for command in PERSISTENCE_GETS]
        except MalfunctionError as fault:
            if isinstance(fault.__cause__, ResponseError):
                return None
            raise
        return persistence_of(*replies)

    def waited_on(self, key: str) -> bool:
        """Did a put on ``key`` (any slot) fail within the last few seconds, i.e. is a
        waiter blocked on it? The waiter mark (``{base}:w``) says so."""
        with self._faults("waited_on", key):
            return bool(self._execute(*self._waited_on_command(key)))

    def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:
        if not self._checked:
            self._check_eviction(key)
        request, expires = self._put_request(key, value, ttl)
        reply, replicated = self._call_script(PUT, "put_if_absent", key, request)
        entry = self._put_reply(key, value, expires, reply)
        if not replicated:
            raise self._unreplicated_grant(key, self._withdraw(key, entry))
        return entry

    def _withdraw(self, key: str, entry: Entry) -> bool:
        """Undo a grant too few replicas took (it would not survive a failover): was it?"""
        try:
            self.compare_and_delete(key, version=entry.version)
        except (MalfunctionError, SimpleCacheConditionError):
            return False
        return True

    def compare_and_set(self, key: str, value: str, *, ttl: float, version: str) -> Entry:
        request, expires = self._cas_request(key, value, ttl, version)
        n, replicated = self._call_script(CAS, "compare_and_set", key, request)
        entry = self._cas_reply(key, value, version, expires, n)
        if not replicated:
            raise self._unreplicated_renewal(key)
        return entry

    def compare_and_delete(self, key: str, *, version: str) -> bool:
        request = self._delete_request(key, version)
        freed, _ = self._call_script(DELETE, "compare_and_delete", key, request)
        return self._delete_reply(key, version, freed)

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        block = self._block(timeout)
        if block < 0.001 or not keys:
            time.sleep(max(block, 0.0))
            return
        with self._faults("wait", keys[0]):
            self._execute(*self._blpop_command(keys, block))

    @property
    def wait_then_put(self) -> Callable[..., Entry] | None:
        """The contract's optional fused wait: on the cache's own connections (no
        ``replicas``: a grant's ``WAIT`` would follow the put), else None."""
        return self._wait_then_put if self._own is not None and not self.replicas else None

    def _wait_then_put(
        self, keys: Sequence[str], timeout: float, key: str, value: str, *, ttl: float
    ) -> Entry:
        """``wait(keys, timeout)``, then ``put_if_absent(key, value)``: the PUT script is
        pipelined behind the BLPOP, and Redis holds a blocked client's next command until
        the BLPOP returns, so the put runs the moment a release's token wakes us, before
        the releaser (or anyone whose request was not already in) can ask again."""
        assert self._own is not None
        block = self._block(timeout)
        if block < 0.001 or not keys or not self._checked:
            self.wait(keys, timeout)
            return self.put_if_absent(key, value, ttl=ttl)
        request, expires = self._put_request(key, value, ttl)
        with self._faults("wait_then_put", key):
            woken, reply = self._own.pair(
                self._blpop_command(keys, block), self._script_command(PUT, request)
            )
            if isinstance(reply, NoScriptError):
                self._loaded(PUT, self._own(*load_command(PUT)))
                reply = self._own(*self._script_command(PUT, request))
            if isinstance(reply, RedisError):
                raise reply
        if reply is None and isinstance(woken, RedisError):
            raise self._fault("wait_then_put", key, woken)  # the wait failed, not the put
        return self._put_reply(key, value, expires, reply)


def _own_connections(client: Any) -> _OwnConnections | None:
    """The cache's own connections for a plain pooled ``redis.Redis`` (Sentinel masters
    included), or None to use the client's ``execute_command``.

    Own connections keep what matters of the client (its connection class and every
    setting: address, credentials, TLS, timeouts, Sentinel lookups) and skip what a
    lock's two hot commands do not need: redis-py 8 spends about 25 µs per command on
    observability hooks, event dispatch and checking a connection out of the pool and
    back, a quarter of a loopback cycle (bench/README-redis.md). And they have no retry
    policy: redis-py 8's default retries a refused or unanswered connect with backoff
    sleeps, which held ``acquire(timeout=1)`` for 3 to 15 s on a server that was down;
    the engine retries itself, within its deadline. The client itself is left as it is.
    A client whose ``execute_command`` was replaced or wrapped (tracing
    instrumentation), a single-connection client or a RedisCluster keeps its own path,
    so instrumentation still sees every command (and the client's retries apply).
    """
    method = getattr(type(client), "execute_command", None)
    pool: Any = getattr(client, "connection_pool", None)
    if (
        not isinstance(client, redis.Redis)
        or not isinstance(method, types.FunctionType)
        or method.__qualname__ != "Redis.execute_command"
        or method.__module__ != "redis.client"
        or "execute_command" in vars(client)
        or getattr(client, "connection", None) is not None
        or not callable(getattr(pool, "connection_class", None))
        or not isinstance(getattr(pool, "connection_kwargs", None), dict)
    ):
        return None
    return _OwnConnections(pool)


class _OwnConnections:
    """Connections this cache opens itself with its client's connection class and
    settings, outside the client's pool (whose ``max_connections`` does not count them),
    each lent to one command at a time: one serves every command of a single thread;
    a thread that finds it busy opens another, and up to ``_MAX_IDLE`` are kept.
    A forked child opens its own. They are closed when the cache is collected."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._idle: list[Any] = []  # list.pop and append are atomic: no lock needed
        self._lent_at: dict[int, int] = {}  # id of a lent connection -> closes before it
        self._closes = 0
        self._pid = os.getpid()
        weakref.finalize(self, _close_all, self._idle, self._pid)

    def __call__(self, *args: Any) -> Any:
        conn = self.take()
        try:
            return _run(conn, args)
        finally:
            self.give(conn)

    def pair(self, first: tuple[Any, ...], second: tuple[Any, ...]) -> tuple[Any, Any]:
        """Two commands sent together, and their replies; an error reply is returned in
        its place (the other reply is still read: the connection stays in step)."""
        conn = self.take()
        try:
            return _run(conn, (first, second), _send_two_and_read)  # type: ignore[no-any-return]
        finally:
            self.give(conn)

    @contextlib.contextmanager
    def lent(self) -> Iterator[Callable[..., Any]]:
        """One connection for several commands in a row (a write and its ``WAIT``)."""
        conn = self.take()
        try:
            yield lambda *args: _run(conn, args)
        finally:
            self.give(conn)

    def take(self) -> Any:
        if self._pid != os.getpid():
            # The parent's sockets: never used (nor closed) here; the parent keeps them.
            self._pid, self._idle, self._lent_at = os.getpid(), [], {}
            weakref.finalize(self, _close_all, self._idle, self._pid)
        try:
            conn = self._idle.pop()
        except IndexError:
            conn = own_connection(self._pool, Retry(NoBackoff(), 0))
        self._lent_at[id(conn)] = self._closes
        return conn

    def close(self) -> None:
        """Disconnect the idle ones; one lent out (a waiter's BLPOP) is disconnected when
        it comes back. Later commands open new ones."""
        self._closes += 1
        _close_all(self._idle, self._pid)

    def give(self, conn: Any) -> None:
        if self._lent_at.pop(id(conn), self._closes) != self._closes:
            conn.disconnect()  # lent out before a close(): it goes with the others
        elif len(self._idle) < _MAX_IDLE:
            self._idle.append(conn)
        else:
            conn.disconnect()


_MAX_IDLE = 16  # idle own connections kept per cache


def _close_all(idle: list[Any], pid: int) -> None:
    if os.getpid() == pid:
        while idle:
            idle.pop().disconnect()


def _run(
    conn: Any, args: tuple[Any, ...], exchange: Callable[[Any, Any], Any] | None = None
) -> Any:
    """One command on ``conn`` (or what ``exchange`` sends and reads). Not the client's
    retry policy (its backoff sleeps would make a refused connection cost seconds): a
    connection error is retried once, at once, for the pooled connection the server
    closed while it sat idle (a retried write finds its own value)."""
    send = _send_and_read if exchange is None else exchange
    try:
        try:
            reply = send(conn, args)
        except ConnectionError as exc:
            conn.disconnect()
            if refused(exc):
                raise
            reply = send(conn, args)
    except ResponseError:
        raise  # a whole reply, read to its end: the connection is in step
    except BaseException:
        # A fault or an interrupt (a lease's, a signal) may leave a reply unread; the
        # next command must never read it as its own.
        conn.disconnect()
        raise
    if getattr(conn, "should_reconnect", bool)():  # the server announced maintenance
        conn.disconnect()
    return reply


def _send_and_read(conn: Any, args: tuple[Any, ...]) -> Any:
    if not getattr(conn, "is_connected", False):
        # The class's own connect (a Sentinel master's asks the sentinels where the master
        # is; the connect that sending does goes to the default address). redis-py < 8
        # has no public is_connected: there connect() itself is the test, returning at
        # once when connected (about 1 µs on redis-py 7.4, under 1 % of a cycle).
        conn.connect()
    conn.send_command(*args)
    return conn.read_response()


def _send_two_and_read(conn: Any, commands: tuple[Any, ...]) -> tuple[Any, Any]:
    if not getattr(conn, "is_connected", False):
        conn.connect()  # as _send_and_read does
    conn.send_packed_command(conn.pack_commands(commands))
    return _reply_or_error(conn), _reply_or_error(conn)


def _reply_or_error(conn: Any) -> Any:
    try:
        return conn.read_response()
    except ResponseError as exc:
        return exc  # a whole reply, read to its end


_OWN_OPTIONS = {
    "allow_eviction", "replicas", "replica_timeout", "asyncio", "index", "functions"
}  # fmt: skip


def from_url(url: str) -> Any:
    """A RedisCache from a ``redis://``, ``rediss://``, ``unix://``, ``redis+socket://`` or
    ``redis+sentinel://`` URL; with ``asyncio=true`` in the query, an ``AsyncRedisCache``
    over the ``redis.asyncio`` client of the same URL.

    ``redis[s]://[[user]:password@]host[:port][/db][?socket_timeout=5&...]`` and
    ``unix:///path/to/redis.sock[?db=2]`` are passed to ``redis.Redis.from_url``;
    ``redis+socket:///path[?virtual_host=2]`` is celery-once's spelling of a Unix socket.
    ``redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]
    [?socket_timeout=..&sentinel_password=..]`` asks the sentinels for the master of
    ``service``; the password is the master's (``sentinel_password`` is the sentinels'
    own, if they need one). ``allow_eviction=true``, ``replicas=N``,
    ``replica_timeout=S``, ``index=false`` and ``functions=true`` in the query go to
    the cache. A
    ``redis+sentinel://`` URL means a failover is expected, and a grant the primary had
    not yet passed on is lost in one (a waiter then holds the key beside its first
    holder), so it waits for one replica by default: ``replicas=0`` says, by name, that
    losing a grant is acceptable.
    """
    scheme = url.partition(":")[0].lower()
    head, _, query = url.partition("?")
    pairs = parse_qsl(query, keep_blank_values=True)
    own = {name: value for name, value in pairs if name in _OWN_OPTIONS}
    rest = "&".join(f"{name}={value}" for name, value in pairs if name not in _OWN_OPTIONS)
    url = head + (f"?{rest}" if rest else "")
    driver: types.ModuleType = redis
    cache_class: Callable[..., Any] = RedisCache
    if _yes(own.get("asyncio", "false")):
        from .asyncio import AsyncRedisCache

        driver, cache_class = redis.asyncio, AsyncRedisCache
    try:
        make = functools.partial(
            cache_class,
            allow_eviction=_yes(own.get("allow_eviction", "false")),
            index=_yes(own.get("index", "true")),
            functions=_yes(own.get("functions", "false")),
            replicas=int(own["replicas"]) if "replicas" in own else None,
            replica_timeout=float(own.get("replica_timeout", "0.5")),
        )
        if scheme in ("redis", "rediss", "unix"):
            return make(driver.Redis.from_url(url))
        if scheme == "redis+socket":
            path = unquote(head.partition("://")[2]) or "/"
            given = dict(parse_qsl(rest))
            return make(driver.Redis(unix_socket_path=path, db=int(given.get("virtual_host", 0))))
        if scheme == "redis+sentinel":
            return make(_sentinel_master(url, driver))
    except ConstraintError:
        raise  # our own checks name the fix and echo no secret
    except (TypeError, ValueError) as exc:
        # Only the scheme is echoed: the rest of a URL may hold a password.
        raise ConstraintValueError(f"bad {scheme}:// URL: {type(exc).__name__}") from None
    raise ConstraintValueError(
        f"unknown Redis URL scheme {scheme!r}; use redis://, rediss://, unix://, "
        "redis+socket:// or redis+sentinel://"
    )


def _yes(flag: str) -> bool:
    return flag.lower() in ("1", "true", "yes")


def _sentinel_master(url: str, driver: Any) -> Any:
    """The master of a ``redis+sentinel://`` URL, as a client of ``driver`` (``redis``
    or ``redis.asyncio``)."""
    sentinels, service, options, sentinel_options = parse_sentinel_url(url)
    socket_options = {k: v for k, v in options.items() if k.startswith("socket_")}
    sentinel = driver.sentinel.Sentinel(
        sentinels, sentinel_kwargs=sentinel_options or None, **socket_options
    )
    return sentinel.master_for(service, **options)


def parse_sentinel_url(
    url: str,
) -> tuple[list[tuple[str, int]], str, dict[str, Any], dict[str, Any]]:
    """``redis+sentinel://`` parts: sentinel addresses, service name, options for the
    master's connections, options for the sentinels' (raises ValueError)."""
    rest, _, query = url.partition("://")[2].partition("?")
    netloc, _, path = rest.partition("/")
    userinfo, _, hosts = netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    parts = [unquote(p) for p in path.split("/") if p]
    if not hosts or not parts or len(parts) > 2:
        raise ValueError("expected redis+sentinel://host:port[,host:port]/service[/db]")
    options: dict[str, Any] = {"db": int(parts[1]) if len(parts) > 1 else 0}
    sentinel_options: dict[str, Any] = {}
    for name, value in parse_qsl(query, strict_parsing=bool(query)):
        if name in ("socket_timeout", "socket_connect_timeout"):
            options[name] = sentinel_options[name] = float(value)
        elif name in ("sentinel_password", "sentinel_username"):
            sentinel_options[name.removeprefix("sentinel_")] = unquote(value)
        else:
            raise ValueError(f"unknown option {name}")
    if user:
        options["username"] = unquote(user)
    if password:
        options["password"] = unquote(password)
    return [_address(host) for host in hosts.split(",")], parts[0], options, sentinel_options


def _address(text: str) -> tuple[str, int]:
    if text.endswith("]") or ":" not in text:
        return text.strip("[]") or "localhost", 26379
    host, _, port = text.rpartition(":")
    return host.strip("[]") or "localhost", int(port)
