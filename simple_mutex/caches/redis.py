"""RedisCache: every machine that reaches one Redis (or Valkey, a Sentinel master, a Cluster).

Keys, for a cache key ``base`` or ``base#N`` (semaphore slot N), all under the hash tag
``{base}``, so one script's keys and every slot of a semaphore share a Cluster slot; every
one of them expires::

    {base}, {base}#N   string  "<fence>.<n> <expires ms> <value>", PX ttl
    {base}:f           string  the last fence granted, PX max(2 x ttl, 60 s)
    {base}:w           string  waiters are blocked, PX 3 s (renewed by each failed put)
    {base}:signal      list    one wake-up token, PX 1 s; only around a hand-off

* Each operation is one round trip (a Lua script; ``get`` a plain ``GET``): compare and act
  are atomic, and the server's clock decides expiry (``PX``). Needs Redis >= 6.0.
* A fence is max(last fence + 1, the server's ``TIME`` in µs): a counter lost to a restart
  without persistence, a flush or a failover never makes one go back (the server's clock
  must not step back further than the ``{base}:f`` window).
* A release wakes one waiter that marked itself (its ``BLPOP`` takes the token), and says so.
* Every redis-py error is a ``MalfunctionError`` naming redis, the operation and the key
  (``unsent`` when the connection was refused); a retried put finds its own value.
* ``replicas=N``: a grant or renewal counts only once N replicas have it (``WAIT``).
* A server that may evict keys (``maxmemory`` with a policy other than ``noeviction``) is
  refused at first use unless ``allow_eviction=True``: an evicted lock is a lock held twice.

Rationale and figures: docs/design/redis.md, bench/README-redis.md.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import socket
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from urllib.parse import parse_qsl, unquote

from simple_mutex.contract import Entry
from simple_mutex.durations import positive_seconds
from simple_mutex.errors import ConstraintError, MalfunctionError, SimpleCacheConditionError
from simple_mutex.keys import check_prefix

from .common import driver_imports, fault, malformed, ttl_ms

with driver_imports("redis"):
    import redis
    from redis.exceptions import (
        ConnectionError,
        NoScriptError,
        RedisError,
        ResponseError,
        TimeoutError,
    )

_MAX_BLOCK_S = 2.0  # longest single BLPOP; the engine simply calls wait again
_WAITER_MARK_MS = 3000  # > _MAX_BLOCK_S: a blocked waiter's mark outlives its BLPOP
_SIGNAL_MS = 1000  # how long a token waits for a waiter that has not reached BLPOP yet
_MIN_KEEP_MS = 60_000  # a freed key's last fence is kept at least this long

# KEYS[1] entry, KEYS[2] last fence, KEYS[3] waiter mark
# ARGV[1] "<expires ms> <value>", ARGV[2] ttl (ms), ARGV[3] how long to keep the fence (ms)
# Returns the new fence (an integer) when written, or "<version> <expires ms>" of the live
# entry when it already holds the same value (our own write whose reply was lost: a retry
# must not report "busy"); 0 when the key holds something we never write (malformed);
# nil when another value holds it, after marking a waiter.
# The fence is the server's clock in µs unless the last fence kept is at or past it (two
# grants in one µs, or a clock stepped back): then that one plus one. Lua numbers are
# doubles, exact to 2**53: µs since 1970 stay below that until the year 2255.
_PUT = f"""
local t = redis.call('TIME')
local fence = t[1] * 1000000 + t[2]
local last = tonumber(redis.call('GET', KEYS[2]))
if last and last >= fence then fence = last + 1 end
fence = string.format('%d', fence)
if redis.call('SET', KEYS[1], fence .. '.1 ' .. ARGV[1], 'NX', 'PX', ARGV[2]) then
    redis.call('SET', KEYS[2], fence, 'PX', ARGV[3])
    return tonumber(fence)
end
local cur = redis.pcall('GET', KEYS[1])
if type(cur) == 'table' then return 0 end
local head, value = string.match(cur or '', '^(%d+%.%d+ %d+) (.*)$')
if cur and not head then return 0 end
if value and value == string.match(ARGV[1], '^%d+ (.*)$') then return head end
redis.call('SET', KEYS[3], 1, 'PX', {_WAITER_MARK_MS})
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

# KEYS[1] entry, KEYS[2] waiter mark, KEYS[3] signal list
# ARGV[1] expected version
# Returns 2 when the entry was freed and one wake-up token pushed for waiters marked
# lately (the list is reset first, so tokens never pile up), 1 when freed with nobody
# waiting, 0 when absent or at another version. The last fence stays.
_DELETE = f"""
local cur = redis.call('GET', KEYS[1])
if not cur or string.sub(cur, 1, #ARGV[1] + 1) ~= ARGV[1] .. ' ' then return 0 end
redis.call('DEL', KEYS[1])
if redis.call('EXISTS', KEYS[2]) == 1 then
    redis.call('DEL', KEYS[3])
    redis.call('LPUSH', KEYS[3], 1)
    redis.call('PEXPIRE', KEYS[3], {_SIGNAL_MS})
    return 2
end
return 1
"""


class RedisCache:
    """A ConditionalCache over a sync redis-py client (``redis.Redis``,
    ``redis.RedisCluster``, or ``Sentinel.master_for(...)``). ``prefix`` goes in front of
    every Redis key, outside the hash tag. ``replicas=N`` makes a grant or renewal count
    only once N replicas acknowledged it within ``replica_timeout`` seconds (``WAIT``; a
    plain ``redis.Redis`` or Sentinel master). ``allow_eviction=True`` accepts a server
    whose ``maxmemory-policy`` may evict lock keys."""

    name = "redis"

    def __init__(
        self,
        client: Any,
        *,
        prefix: str = "",
        replicas: int = 0,
        replica_timeout: float = 0.5,
        allow_eviction: bool = False,
    ) -> None:
        execute = getattr(client, "execute_command", None)
        if not callable(execute) or inspect.iscoroutinefunction(execute):
            raise ConstraintError(
                f"RedisCache needs a sync redis-py client (redis.Redis, redis.RedisCluster "
                f"or a Sentinel master), got {type(client).__name__}"
            )
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ConstraintError(f"RedisCache replicas must be an int >= 0, got {replicas!r}")
        self.client = client
        self.prefix = check_prefix(prefix)
        self.replicas = replicas
        self.replica_timeout = positive_seconds(replica_timeout, "replica_timeout")
        self.allow_eviction = allow_eviction
        self._checked = allow_eviction  # the eviction policy is read on first use
        own = _pooled_executor(client)
        if replicas and own is None:
            raise ConstraintError(
                "RedisCache(replicas=...) needs a plain redis.Redis or a Sentinel master: "
                "WAIT must follow the write on the same connection"
            )
        self._own = own
        self._execute = own or execute
        # SHA-1s computed here, so start-up costs no round trip (NOSCRIPT loads them).
        self._shas = {
            s: hashlib.sha1(s.encode(), usedforsecurity=False).hexdigest()
            for s in (_PUT, _CAS, _DELETE)
        }
        # A BLPOP must finish inside the socket timeout, or redis-py would call it a
        # dead connection: block for at most 80 % of it.
        socket_timeout = _connection_kwargs(client).get("socket_timeout")
        self._max_block = (
            _MAX_BLOCK_S if not socket_timeout else min(_MAX_BLOCK_S, 0.8 * float(socket_timeout))
        )

    def _fault(self, operation: str, key: str, exc: RedisError) -> MalfunctionError:
        return _fault(operation, key, exc, _where(self.client))

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
            raise self._fault(operation, key, exc) from exc

    def _replicated(self, operation: str, key: str) -> bool:
        """After a write: did ``replicas`` replicas take it within ``replica_timeout``?"""
        assert self._own is not None
        try:
            acked = self._own("WAIT", self.replicas, ttl_ms(self.replica_timeout))
        except RedisError as exc:
            raise self._fault(operation, key, exc) from exc
        return int(acked) >= self.replicas

    def _check_eviction(self, key: str) -> None:
        """Refuse a server that may evict lock keys: an evicted lock is held twice."""
        try:
            config = self.client.config_get("maxmemory*")
        except ResponseError:
            self._checked = True  # CONFIG is renamed or denied (a managed service): trust it
            return
        except RedisError as exc:
            raise self._fault("put_if_absent", key, exc) from exc
        policy = _text(config.get("maxmemory-policy", "noeviction"))
        if int(config.get("maxmemory", 0) or 0) and policy != "noeviction":
            raise ConstraintError(
                f"this Redis may evict lock keys (maxmemory-policy {policy} with a "
                "maxmemory limit): an evicted lock would be granted twice. Set "
                "maxmemory-policy noeviction (or use a Redis of its own for locks), or pass "
                "RedisCache(..., allow_eviction=True) to accept the risk"
            )
        self._checked = True

    def get(self, key: str) -> Entry | None:
        entry_key, _ = self._keys(key)
        try:
            # A bare GET, never client.get(): redis-py's client-side cache (RESP3) only
            # serves commands sent with keys=..., and a lock must not read a stale copy.
            payload = self._execute("GET", entry_key)
        except RedisError as exc:
            raise self._fault("get", key, exc) from exc
        if payload is None:
            return None
        try:
            version, expiry, value = _text(payload).split(" ", 2)
            return Entry(value, version, int(version.partition(".")[0]), int(expiry) / 1000)
        except ValueError:
            raise malformed(self.name, "get", key, f"{entry_key!r} is not an entry") from None

    def scan(self, prefix: str) -> Iterator[tuple[str, Entry]]:
        """``SCAN`` (never ``KEYS``: it would stall the server) with a ``MATCH`` whose glob
        characters are escaped, then each entry read as ``get`` reads it. Only entry keys
        (``{base}``, ``{base}#N``) are cache keys; the side keys (``:f``, ``:w``,
        ``:signal``) are skipped. A key that lapses between the two steps is skipped."""
        pattern = _glob_escape(f"{self.prefix}{{") + _glob_escape(prefix) + "*"
        try:
            names = [_text(name) for name in self.client.scan_iter(match=pattern, count=1000)]
        except RedisError as exc:
            raise self._fault("scan", prefix, exc) from exc
        for name in dict.fromkeys(names):  # SCAN may return a key twice
            key = _cache_key(name[len(self.prefix) :])
            if key is not None and key.startswith(prefix):
                entry = self.get(key)
                if entry is not None:
                    yield key, entry

    def waited_on(self, key: str) -> bool:
        """Did a put on ``key`` (any slot) fail within the last few seconds, i.e. is a
        waiter blocked on it? The waiter mark (``{base}:w``) says so."""
        _, stem = self._keys(key)
        try:
            return bool(self._execute("EXISTS", stem + ":w"))
        except RedisError as exc:
            raise self._fault("waited_on", key, exc) from exc

    def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:
        if not self._checked:
            self._check_eviction(key)
        entry_key, stem = self._keys(key)
        ms, expires = _ttl(ttl)
        keep = max(2 * ms, _MIN_KEEP_MS)
        reply = self._script(
            _PUT, "put_if_absent", key,
            3, entry_key, stem + ":f", stem + ":w", f"{expires} {value}", ms, keep,
        )  # fmt: skip
        if reply is None:
            raise SimpleCacheConditionError(f"redis: {key!r} is held")
        if reply == 0:
            raise malformed(self.name, "put_if_absent", key, f"{entry_key!r} is not an entry")
        if isinstance(reply, int):
            entry = Entry(value, f"{reply}.1", reply, expires / 1000)
        else:
            version, expires_text = _text(reply).split(" ")
            fence = int(version.partition(".")[0])
            entry = Entry(value, version, fence, int(expires_text) / 1000)
        if self.replicas and not self._replicated("put_if_absent", key):
            self._withdraw(key, entry)
        return entry

    def _withdraw(self, key: str, entry: Entry) -> None:
        """A grant too few replicas took would not survive a failover: undo it."""
        try:
            self.compare_and_delete(key, version=entry.version)
            undone = True
        except (RedisError, MalfunctionError, SimpleCacheConditionError):
            undone = False
        raise MalfunctionError(
            f"redis cache: fewer than {self.replicas} replica(s) acknowledged the grant of "
            f"{key!r} within {self.replica_timeout:g} s, so it was "
            f"{'withdrawn' if undone else 'not counted (it lapses with its lease)'}; check "
            "the replicas, or lower replicas= / raise replica_timeout=",
            key=key,
            unsent=undone,
        )

    def compare_and_set(self, key: str, value: str, *, ttl: float, version: str) -> Entry:
        entry_key, _ = self._keys(key)
        ms, expires = _ttl(ttl)
        n = self._script(
            _CAS, "compare_and_set", key, 1, entry_key, f"{expires} {value}", ms, version
        )
        if n is None:
            raise SimpleCacheConditionError(f"redis: {key!r} is not at version {version}")
        if self.replicas and not self._replicated("compare_and_set", key):
            raise MalfunctionError(
                f"redis cache: fewer than {self.replicas} replica(s) acknowledged the "
                f"renewal of {key!r} within {self.replica_timeout:g} s; it does not count",
                key=key,
            )
        fence = version.partition(".")[0]
        return Entry(value, f"{fence}.{n}", int(fence), expires / 1000)

    def compare_and_delete(self, key: str, *, version: str) -> bool:
        entry_key, stem = self._keys(key)
        freed = self._script(
            _DELETE, "compare_and_delete", key,
            3, entry_key, stem + ":w", stem + ":signal", version,
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
            self._execute("BLPOP", *signals, round(block, 3))
        except RedisError as exc:
            raise self._fault("wait", keys[0], exc) from exc


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis glob pattern."""
    return "".join("\\" + c if c in "*?[]^\\" else c for c in text)


def _cache_key(name: str) -> str | None:
    """The cache key of an entry's Redis key (after our prefix), or None for a side key:
    ``{base}`` is ``base``, ``{base}#N`` is ``base#N`` (a base never holds ``#``)."""
    if not name.startswith("{"):
        return None
    base, tagged, slot = name[1:].partition("}#")
    if tagged and "#" not in base:
        return f"{base}#{slot}"
    if name.endswith("}") and "#" not in name:
        return name[1:-1]
    return None


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
    """One command on ``conn``. Not the client's retry policy (its backoff sleeps would
    make a refused connection cost seconds): a connection error is retried once, at
    once, for the pooled connection the server closed while it sat idle."""
    try:
        try:
            reply = _send_and_read(conn, args)
        except ConnectionError as exc:
            conn.disconnect()
            if _refused(exc):
                raise
            reply = _send_and_read(conn, args)
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


def _refused(exc: BaseException) -> bool:
    """Did the request provably never reach a server (refused, no such host)?"""
    seen: BaseException | None = exc
    for _ in range(8):  # the cause chain, bounded
        if seen is None:
            return False
        if isinstance(seen, ConnectionRefusedError | socket.gaierror):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


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
    getter = getattr(client, "get_connection_kwargs", None)  # redis-py >= 5
    kwargs = getter() if callable(getter) else None
    if not isinstance(kwargs, dict):  # older redis-py: the pool holds them
        kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None)
    return kwargs if isinstance(kwargs, dict) else {}


def _fault(operation: str, key: str, exc: RedisError, where: str = "") -> MalfunctionError:
    if isinstance(exc, ResponseError) and "WRONGTYPE" in str(exc):
        return malformed("redis", operation, key, "a Redis key of another type")
    error = fault("redis", operation, key, exc, where)
    if isinstance(exc, ConnectionError | TimeoutError):
        error.message += "; is Redis up and reachable there?"
        error.args = (error.message, error.key)
    error.unsent = _refused(exc)
    return error


def _where(client: Any) -> str:
    """`` at redis://host:port/db`` (never a password), for messages; "" if unknown."""
    kwargs = _connection_kwargs(client)
    if kwargs.get("path"):
        return f" at unix://{kwargs['path']}"
    if kwargs.get("host"):
        return f" at redis://{kwargs['host']}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"
    return ""


_OWN_OPTIONS = {"allow_eviction", "replicas", "replica_timeout"}


def from_url(url: str) -> RedisCache:
    """A RedisCache from a ``redis://``, ``rediss://``, ``unix://``, ``redis+socket://`` or
    ``redis+sentinel://`` URL.

    ``redis[s]://[[user]:password@]host[:port][/db][?socket_timeout=5&...]`` and
    ``unix:///path/to/redis.sock[?db=2]`` are passed to ``redis.Redis.from_url``;
    ``redis+socket:///path[?virtual_host=2]`` is celery-once's spelling of a Unix socket.
    ``redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]
    [?socket_timeout=..&sentinel_password=..]`` asks the sentinels for the master of
    ``service``; the password is the master's (``sentinel_password`` is the sentinels'
    own, if they need one). ``allow_eviction=true``, ``replicas=N`` and
    ``replica_timeout=S`` in the query go to ``RedisCache``.
    """
    scheme = url.partition(":")[0].lower()
    head, _, query = url.partition("?")
    pairs = parse_qsl(query, keep_blank_values=True)
    own = {name: value for name, value in pairs if name in _OWN_OPTIONS}
    rest = "&".join(f"{name}={value}" for name, value in pairs if name not in _OWN_OPTIONS)
    url = head + (f"?{rest}" if rest else "")
    try:
        make = functools.partial(
            RedisCache,
            allow_eviction=own.get("allow_eviction", "false").lower() in ("1", "true", "yes"),
            replicas=int(own.get("replicas", "0")),
            replica_timeout=float(own.get("replica_timeout", "0.5")),
        )
        if scheme in ("redis", "rediss", "unix"):
            return make(redis.Redis.from_url(url))
        if scheme == "redis+socket":
            path = unquote(head.partition("://")[2]) or "/"
            given = dict(parse_qsl(rest))
            return make(redis.Redis(unix_socket_path=path, db=int(given.get("virtual_host", 0))))
        if scheme == "redis+sentinel":
            return make(_sentinel_master(url))
    except (TypeError, ValueError) as exc:
        # Only the scheme is echoed: the rest of a URL may hold a password.
        raise ConstraintError(f"bad {scheme}:// URL: {type(exc).__name__}") from None
    raise ConstraintError(
        f"unknown Redis URL scheme {scheme!r}; use redis://, rediss://, unix://, "
        "redis+socket:// or redis+sentinel://"
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
