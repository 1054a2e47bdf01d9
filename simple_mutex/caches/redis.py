"""RedisCache: every machine that reaches one Redis (or Valkey, a Sentinel master, a Cluster).

Keys, for a cache key ``base`` or ``base#N`` (semaphore slot N), all under the hash tag
``{base}``, so one script's keys and every slot of a semaphore share a Cluster slot::

    {base}, {base}#N   string  "<fence>.<n> <expires ms> <value>", PX ttl
    {base}:meta        hash    f = fence counter, w = waiters seen until (server ms)
    {base}:signal      list    one wake-up token, PEXPIRE 1 s; only around a hand-off

* Each operation is one round trip (a Lua script; ``get`` a plain ``GET``): compare and act
  are atomic, and the server's clock decides expiry (``PX``). Needs Redis >= 6.0.
* Fences live in ``{base}:meta``, so they survive release and expiry and count across a
  semaphore's slots; they are as durable as the server's data. It is the one key left
  behind per lock key.
* A release wakes one waiter that marked itself (its ``BLPOP`` takes the token), and says so.
* Every redis-py error is a ``MalfunctionError`` naming redis, the operation and the key;
  a retried put finds its own value (the idempotent put). A wait or command lasts at most
  the client's socket timeout per try.

Rationale and figures: docs/design/redis.md, bench/README-redis.md.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import threading
import time
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import parse_qsl, unquote

from simple_mutex.contract import Entry
from simple_mutex.errors import ConstraintError, MalfunctionError, SimpleCacheConditionError
from simple_mutex.keys import check_prefix

from .common import driver_imports, fault, malformed, ttl_ms

with driver_imports("redis"):
    import redis
    from redis.exceptions import NoScriptError, RedisError, ResponseError

_MAX_BLOCK_S = 2.0  # longest single BLPOP; the engine simply calls wait again
_WAITER_MARK_MS = 3000  # > _MAX_BLOCK_S: a blocked waiter's mark outlives its BLPOP
_SIGNAL_MS = 1000  # how long a token waits for a waiter that has not reached BLPOP yet
_NOW_MS = "local t = redis.call('TIME') local now = t[1] * 1000 + math.floor(t[2] / 1000)"

# KEYS[1] entry, KEYS[2] meta
# ARGV[1] "<expires ms> <value>", ARGV[2] ttl (ms)
# Returns the new fence (an integer) when written, or "<version> <expires ms>" of the live
# entry when it already holds the same value (our own write whose reply was lost: a retry
# must not report "busy"); 0 when the key holds something we never write (malformed);
# nil when another value holds it, after marking a waiter.
# The fence is taken before SET NX and handed back on failure, so the common case runs
# two commands; nobody sees the difference, as a script is atomic.
_PUT = f"""
local fence = redis.call('HINCRBY', KEYS[2], 'f', 1)
if redis.call('SET', KEYS[1], fence .. '.1 ' .. ARGV[1], 'NX', 'PX', ARGV[2]) then
    return fence
end
redis.call('HINCRBY', KEYS[2], 'f', -1)
local cur = redis.pcall('GET', KEYS[1])
if type(cur) == 'table' then return 0 end
local head, value = string.match(cur or '', '^(%d+%.%d+ %d+) (.*)$')
if cur and not head then return 0 end
if value and value == string.match(ARGV[1], '^%d+ (.*)$') then return head end
{_NOW_MS}
redis.call('HSET', KEYS[2], 'w', string.format('%d', now + {_WAITER_MARK_MS}))
return nil
"""

# KEYS[1] entry
# ARGV[1] "<expires ms> <value>", ARGV[2] ttl (ms), ARGV[3] expected version
# Returns the new write count n (the version becomes "<fence>.<n>") after replacing the
# value and restarting the expiry; nil when the entry is absent (freed, expired) or at
# another version.
_CAS = """
local cur = redis.call('GET', KEYS[1])
if not cur or string.sub(cur, 1, #ARGV[3] + 1) ~= ARGV[3] .. ' ' then return nil end
local fence, n = string.match(ARGV[3], '^(%d+)%.(%d+)$')
n = n + 1
redis.call('SET', KEYS[1], fence .. '.' .. n .. ' ' .. ARGV[1], 'PX', ARGV[2])
return n
"""

# KEYS[1] entry, KEYS[2] meta, KEYS[3] signal list
# ARGV[1] expected version
# Returns 2 when the entry was freed and one wake-up token pushed for a waiter marked
# lately (the list is reset first, so tokens never pile up), 1 when freed with nobody
# waiting, 0 when absent or at another version. The fence counter stays.
_DELETE = f"""
local cur = redis.call('GET', KEYS[1])
if not cur or string.sub(cur, 1, #ARGV[1] + 1) ~= ARGV[1] .. ' ' then return 0 end
redis.call('DEL', KEYS[1])
local waiters = redis.call('HGET', KEYS[2], 'w')
if waiters then
    {_NOW_MS}
    if tonumber(waiters) > now then
        redis.call('DEL', KEYS[3])
        redis.call('LPUSH', KEYS[3], 1)
        redis.call('PEXPIRE', KEYS[3], {_SIGNAL_MS})
        return 2
    end
end
return 1
"""


class RedisCache:
    """A ConditionalCache over a sync redis-py client (``redis.Redis``,
    ``redis.RedisCluster``, or ``Sentinel.master_for(...)``). ``prefix`` goes in front of
    every Redis key, outside the hash tag."""

    name = "redis"

    def __init__(self, client: Any, *, prefix: str = "") -> None:
        execute = getattr(client, "execute_command", None)
        if not callable(execute) or inspect.iscoroutinefunction(execute):
            raise ConstraintError(
                f"RedisCache needs a sync redis-py client (redis.Redis, redis.RedisCluster "
                f"or a Sentinel master), got {type(client).__name__}"
            )
        self.client = client
        self.prefix = check_prefix(prefix)
        self._execute = _pooled_executor(client) or execute
        # SHA-1s computed here, so start-up costs no round trip (NOSCRIPT loads them).
        self._shas = {
            s: hashlib.sha1(s.encode(), usedforsecurity=False).hexdigest()
            for s in (_PUT, _CAS, _DELETE)
        }
        # A BLPOP must finish inside the socket timeout, or redis-py would call it a
        # dead connection (and retry it): block for at most 80 % of it.
        socket_timeout = _connection_kwargs(client).get("socket_timeout")
        self._max_block = (
            _MAX_BLOCK_S if not socket_timeout else min(_MAX_BLOCK_S, 0.8 * float(socket_timeout))
        )

    def __repr__(self) -> str:
        return f"RedisCache({self.client!r}, prefix={self.prefix!r})"

    def _keys(self, key: str) -> tuple[str, str]:
        """The Redis key of an entry, and the hash-tagged stem of its companions."""
        base, hash_, slot = key.partition("#")
        stem = f"{self.prefix}{{{base}}}"
        return stem + hash_ + slot, stem

    def _script(self, script: str, operation: str, key: str, *args: Any) -> Any:
        try:
            try:
                return self._execute("EVALSHA", self._shas[script], *args)
            except NoScriptError:
                # A restarted or failed-over server forgot the script: load it again.
                self._shas[script] = self.client.script_load(script)
                return self._execute("EVALSHA", self._shas[script], *args)
        except RedisError as exc:
            raise _fault(operation, key, exc) from exc

    def get(self, key: str) -> Entry | None:
        entry_key, _ = self._keys(key)
        try:
            # A bare GET, never client.get(): redis-py's client-side cache (RESP3) only
            # serves commands sent with keys=..., and a lock must not read a stale copy.
            payload = self._execute("GET", entry_key)
        except RedisError as exc:
            raise _fault("get", key, exc) from exc
        if payload is None:
            return None
        try:
            version, expiry, value = _text(payload).split(" ", 2)
            return Entry(value, version, int(version.partition(".")[0]), int(expiry) / 1000)
        except ValueError:
            raise malformed(self.name, "get", key, f"{entry_key!r} is not an entry") from None

    def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:
        entry_key, stem = self._keys(key)
        ms, expires = _ttl(ttl)
        reply = self._script(
            _PUT, "put_if_absent", key, 2, entry_key, stem + ":meta", f"{expires} {value}", ms
        )
        if reply is None:
            raise SimpleCacheConditionError(f"redis: {key!r} is held")
        if reply == 0:
            raise malformed(self.name, "put_if_absent", key, f"{entry_key!r} is not an entry")
        if isinstance(reply, int):
            return Entry(value, f"{reply}.1", reply, expires / 1000)
        version, expires_text = _text(reply).split(" ")
        return Entry(value, version, int(version.partition(".")[0]), int(expires_text) / 1000)

    def compare_and_set(self, key: str, value: str, *, ttl: float, version: str) -> Entry:
        entry_key, _ = self._keys(key)
        ms, expires = _ttl(ttl)
        n = self._script(
            _CAS, "compare_and_set", key, 1, entry_key, f"{expires} {value}", ms, version
        )
        if n is None:
            raise SimpleCacheConditionError(f"redis: {key!r} is not at version {version}")
        fence = version.partition(".")[0]
        return Entry(value, f"{fence}.{n}", int(fence), expires / 1000)

    def compare_and_delete(self, key: str, *, version: str) -> bool:
        entry_key, stem = self._keys(key)
        freed = self._script(
            _DELETE, "compare_and_delete", key,
            3, entry_key, stem + ":meta", stem + ":signal", version,
        )  # fmt: skip
        if not freed:
            raise SimpleCacheConditionError(f"redis: {key!r} is not at version {version}")
        return bool(freed == 2)  # a waiter was signalled

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        block = min(timeout, self._max_block)
        if block < 0.001 or not keys:
            # BLPOP counts whole milliseconds, and 0 would mean "block forever".
            time.sleep(max(block, 0.0))
            return
        signals = list(dict.fromkeys(self._keys(key)[1] + ":signal" for key in keys))
        try:
            self.client.blpop(signals, timeout=round(block, 3))
        except RedisError as exc:
            raise _fault("wait", keys[0], exc) from exc


def _pooled_executor(client: Any) -> Callable[..., Any] | None:
    """A leaner ``execute_command`` for a plain pooled ``redis.Redis`` (Sentinel masters
    included), or None to use the client's own.

    It keeps what matters (the client's pool, connection settings and retry policy) and
    skips what a lock's two hot commands do not need: redis-py 8 spends about 25 µs per
    command on observability hooks, event dispatch and checking a connection out of the
    pool and back, a quarter of a loopback cycle (bench/README-redis.md). A client whose
    ``execute_command`` was replaced or wrapped (tracing instrumentation), a
    single-connection client or a RedisCluster keeps its own path, so instrumentation
    still sees every command.
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
        or not callable(getattr(pool, "get_connection", None))
    ):
        return None
    return _OwnConnection(pool)


class _OwnConnection:
    """One connection this cache keeps out of its client's pool (the pool's own
    check-out costs as much as the round trip), for one command at a time; a thread that
    finds it busy, or a forked child, borrows from the pool as usual. It goes back to
    the pool when the cache is collected."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._busy = threading.Lock()
        self._held: list[Any] = []  # [connection] once taken; shared with the finalizer
        self._pid = os.getpid()
        weakref.finalize(self, _give_back, pool, self._held, self._pid)

    def __call__(self, *args: Any) -> Any:
        if self._pid == os.getpid() and self._busy.acquire(blocking=False):
            try:
                if not self._held:
                    self._held.append(_check_out(self._pool))
                return _run(self._held[0], args)
            finally:
                self._busy.release()
        conn = _check_out(self._pool)
        try:
            return _run(conn, args)
        finally:
            self._pool.release(conn)


def _check_out(pool: Any) -> Any:
    try:
        return pool.get_connection()
    except TypeError:  # redis-py < 5.3 wants a command name (5.3 deprecated it)
        return pool.get_connection("EVALSHA")


def _give_back(pool: Any, held: list[Any], pid: int) -> None:
    if held and os.getpid() == pid:
        pool.release(held[0])


def _run(conn: Any, args: tuple[Any, ...]) -> Any:
    try:
        reply = conn.retry.call_with_retry(
            lambda: _send_and_read(conn, args), lambda _error: conn.disconnect()
        )
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
    conn.send_command(*args)
    return conn.read_response()


def _ttl(ttl: float) -> tuple[int, int]:
    """The ttl in ms, and the wall-clock expiry in Unix ms that the entry reports."""
    ms = ttl_ms(ttl)
    return ms, int(time.time() * 1000) + ms


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _connection_kwargs(client: Any) -> dict[str, Any]:
    getter = getattr(client, "get_connection_kwargs", None)
    kwargs = getter() if callable(getter) else None
    return kwargs if isinstance(kwargs, dict) else {}


def _fault(operation: str, key: str, exc: RedisError) -> MalfunctionError:
    if isinstance(exc, ResponseError) and "WRONGTYPE" in str(exc):
        return malformed("redis", operation, key, "a Redis key of another type")
    return fault("redis", operation, key, exc)


def from_url(url: str) -> RedisCache:
    """A RedisCache from ``redis://``, ``rediss://`` or ``redis+sentinel://`` URL.

    ``redis[s]://[[user]:password@]host[:port][/db][?socket_timeout=5&...]`` is passed to
    ``redis.Redis.from_url``. ``redis+sentinel://[[user]:password@]host:port[,host:port...]
    /service[/db][?socket_timeout=..&sentinel_password=..]`` asks the sentinels for the
    master of ``service``; the password is the master's (``sentinel_password`` is the
    sentinels' own, if they need one).
    """
    scheme = url.partition(":")[0].lower()
    try:
        if scheme in ("redis", "rediss"):
            return RedisCache(redis.Redis.from_url(url))
        if scheme == "redis+sentinel":
            return RedisCache(_sentinel_master(url))
    except (TypeError, ValueError) as exc:
        # Only the scheme is echoed: the rest of a URL may hold a password.
        raise ConstraintError(f"bad {scheme}:// URL: {type(exc).__name__}") from None
    raise ConstraintError(
        f"unknown Redis URL scheme {scheme!r}; use redis://, rediss:// or redis+sentinel://"
    )


def _sentinel_master(url: str) -> Any:
    from redis.sentinel import Sentinel

    sentinels, service, options, sentinel_options = parse_sentinel_url(url)
    socket_options = {k: v for k, v in options.items() if k.startswith("socket_")}
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        sentinels, sentinel_kwargs=sentinel_options or None, **socket_options
    )
    return sentinel.master_for(service, **options)  # type: ignore[no-untyped-call]


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
