"""What ``RedisCache`` and ``AsyncRedisCache`` share, with no I/O: the key layout, the Lua
scripts, the commands each operation sends, how each reply is read, and how a redis-py
error becomes a ``MalfunctionError`` (``RedisLayout._faults``, around every operation's
I/O on both faces). Each cache class adds only its I/O (blocking or awaited), so the two
can never drift apart in what they write, how they read it or what they raise.

Keys, for a cache key ``base`` or ``base#N`` (semaphore slot N), all under the hash tag
``{base}``, so one script's keys and every slot of a semaphore share a Cluster slot; every
one of them expires::

    {base}, {base}#N       string  "<fence>.<n> <expires ms> <value>", PX ttl
    {base}:f               string  the last fence granted, PX max(2 x ttl, 60 s)
    {base}:h, {base}:h#N   string  "1": the entry (slot N) was granted and not freed since;
                                   set by a grant and each renewal, PX max(2 x ttl, 60 s);
                                   a release sets it to the version it freed, PX 60 s, and
                                   the grant after a release to "1 <that version>"
    {base}:w               string  waiters are blocked, PX 3 s (renewed by each failed put)
    {base}:signal          list    one wake-up token, PX 1 s; only around a hand-off

The held mark outlives the entry it marks (PX lapses it first): a grant that finds it
took over from a holder that never freed the key (``Entry.took_over``), for as long as
the mark is kept after the holder's last grant or renewal. After a release it names the
version freed, so a release sent again (the client resends a command whose connection
broke before the reply came) finds its own earlier release, not a lost lease, even when
the waiter that release woke holds the key already. An operator's release first moves the
record to a version of its own, so a holder's release never mistakes it for its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import socket
import time
from collections.abc import Iterator, Sequence
from typing import Any, Literal

from simple_mutex._core.durations import positive_seconds
from simple_mutex._core.keys import check_prefix
from simple_mutex.caches._base import driver_imports, fault, malformed, ttl_ms
from simple_mutex.contract import Entry
from simple_mutex.errors import (
    ConstraintError,
    ConstraintTypeError,
    ConstraintValueError,
    MalfunctionError,
    SimpleCacheConditionError,
)

with driver_imports("redis"):
    from redis.exceptions import (
        AuthenticationError,
        AuthorizationError,
        ConnectionError,
        RedisError,
        ResponseError,
        TimeoutError,
    )

# redis-py 8 reads its own version from the installed metadata each time it builds a
# connection whose settings name no ``driver_info`` (a URL's pool names none), and that
# read lists every sys.path folder inside the standard library's ``suppress(Exception)``
# (importlib.metadata's ``FastPath.children``; on 3.11 a missing sys.path entry clears
# its cache, so every read lists again). A job timeout's exception raised there by its
# signal handler (RQ's, Celery's soft limit) is swallowed: the alarm is lost and the job
# runs on. So the version is read once, here, and the cache's own connections
# are given it (``own_connection``). None: a redis-py that reads it at import already.
DRIVER_INFO: Any = None
with contextlib.suppress(ImportError):
    from redis.driver_info import DriverInfo

    DRIVER_INFO = DriverInfo()
# The settings through which a connection can be told its client name and version.
_DRIVER_SETTINGS = ("driver_info", "lib_name", "lib_version")

MAX_BLOCK_S = 2.0  # longest single BLPOP; the engine simply calls wait again
WAITER_MARK_MS = 3000  # > MAX_BLOCK_S: a blocked waiter's mark outlives its BLPOP
SIGNAL_MS = 1000  # how long a token waits for a waiter that has not reached BLPOP yet
_MIN_KEEP_MS = 60_000  # a freed key's last fence (a lapsed one's held mark) kept this long

# The index of the entries under one lock prefix (``RedisLayout.index_prefix``): a
# sorted set of entry keys scored by the server's time (ms) at which each lapses. A grant
# or renewal (KEYS[i] the index, ``now`` the server's time in ms, ARGV[2] the ttl) drops
# the members lapsed by now and adds or rescores its own; the index lives at least as
# long as the fence and held mark it writes ({keep}), never shortened by a shorter lease.
# ``pcall`` and type checks throughout: the index is for listing, and a refused or broken
# index must never fail (nor undo) the grant it follows.
INDEX_ADD = """\
        redis.pcall('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
        redis.pcall('ZADD', KEYS[i], now + ARGV[2], KEYS[1])
        local left = redis.pcall('PTTL', KEYS[i])
        if type(left) == 'number' and left < tonumber({keep}) then
            redis.pcall('PEXPIRE', KEYS[i], {keep})
        end"""

# KEYS[1] entry, KEYS[2] last fence, KEYS[3] waiter mark, KEYS[4] held mark, KEYS[5...]
# the indexes the entry is listed in
# ARGV[1] "<expires ms> <value>", ARGV[2] ttl (ms), ARGV[3] how long to keep the fence and
# the held mark (ms)
# Returns the new fence (an integer) when written, negated when the held mark was there
# (the last holder never freed the key: the grant took over; an integer reply, not a pair,
# costs the client nothing to parse); "<version> <expires ms>" of the live entry when it
# already holds the same value (our own write whose reply was lost: a retry must not
# report "busy"); 0 when the key holds something we never write (malformed); nil when
# another value holds it, after marking a waiter.
# The fence is the server's clock in µs unless the last fence kept is at or past it (two
# grants in one µs, or a clock stepped back): then that one plus one. Lua numbers are
# doubles, exact to 2**53: µs since 1970 stay below that until the year 2255.
PUT = f"""
local t = redis.call('TIME')
local fence = t[1] * 1000000 + t[2]
local last = tonumber(redis.call('GET', KEYS[2]))
if last and last >= fence then fence = last + 1 end
fence = string.format('%d', fence)
if redis.call('SET', KEYS[1], fence .. '.1 ' .. ARGV[1], 'NX', 'PX', ARGV[2]) then
    redis.call('SET', KEYS[2], fence, 'PX', ARGV[3])
    local held = redis.call('GET', KEYS[4])
    local took = held == '1' or (held and string.sub(held, 1, 2) == '1 ')
    redis.call('SET', KEYS[4], (held and not took) and ('1 ' .. held) or '1', 'PX', ARGV[3])
    local now = t[1] * 1000 + math.floor(t[2] / 1000)
    for i = 5, #KEYS do
{INDEX_ADD.format(keep="ARGV[3]")}
    end
    if took then return -tonumber(fence) end
    return tonumber(fence)
end
local cur = redis.pcall('GET', KEYS[1])
if type(cur) == 'table' then return 0 end
local head, value = string.match(cur or '', '^(%d+%.%d+ %d+) (.*)$')
if cur and not head then return 0 end
if value and value == string.match(ARGV[1], '^%d+ (.*)$') then return head end
redis.call('SET', KEYS[3], 1, 'PX', {WAITER_MARK_MS})
return nil
"""

# KEYS[1] entry, KEYS[2] held mark, KEYS[3...] the indexes the entry is listed in
# ARGV[1] "<expires ms> <value>", ARGV[2] ttl (ms), ARGV[3] expected version, ARGV[4] how
# long to keep the held mark (ms): a lease renewed for longer than its grant kept it
# must still be known as unfreed when it lapses
# Returns the new write count n (the version becomes "<fence>.<n>") after replacing the
# value and restarting the expiry; nil when the entry is absent (freed, expired) or at
# another version.
CAS = f"""
local cur = redis.call('GET', KEYS[1])
if not cur or string.sub(cur, 1, #ARGV[3] + 1) ~= ARGV[3] .. ' ' then return nil end
local fence, n = string.match(ARGV[3], '^(%d+)%.(%d+)$')
n = n + 1
redis.call('SET', KEYS[1], fence .. '.' .. n .. ' ' .. ARGV[1], 'PX', ARGV[2])
redis.call('SET', KEYS[2], 1, 'PX', ARGV[4])
if #KEYS > 2 then
    local t = redis.call('TIME')
    local now = t[1] * 1000 + math.floor(t[2] / 1000)
    for i = 3, #KEYS do
{INDEX_ADD.format(keep="ARGV[4]")}
    end
end
return n
"""

# KEYS[1] entry, KEYS[2] waiter mark, KEYS[3] signal list, KEYS[4] held mark, KEYS[5...]
# the indexes the entry is listed in (the freed entry leaves them)
# ARGV[1] expected version, ARGV[2] how long the held mark keeps the version freed (ms)
# Returns 2 when the entry was freed and one wake-up token pushed for waiters marked
# lately (the list is reset first, so tokens never pile up), 1 when freed with nobody
# waiting, or when the held mark says this very version was freed, with nothing or one
# grant since (our own release sent again after its reply was lost, a waiter it woke
# holding the key already), 0 when absent or at another version. The last fence stays;
# the held mark names the version freed (the next grant takes over nothing, and keeps
# that name after its "1").
DELETE = f"""
local cur = redis.call('GET', KEYS[1])
if not cur or string.sub(cur, 1, #ARGV[1] + 1) ~= ARGV[1] .. ' ' then
    local held = redis.call('GET', KEYS[4])
    if held == ARGV[1] or held == '1 ' .. ARGV[1] then return 1 end
    return 0
end
redis.call('DEL', KEYS[1])
redis.call('SET', KEYS[4], ARGV[1], 'PX', ARGV[2])
for i = 5, #KEYS do redis.pcall('ZREM', KEYS[i], KEYS[1]) end
if redis.call('EXISTS', KEYS[2]) == 1 then
    redis.call('DEL', KEYS[3])
    redis.call('LPUSH', KEYS[3], 1)
    redis.call('PEXPIRE', KEYS[3], {SIGNAL_MS})
    return 2
end
return 1
"""

_SCRIPT_NAMES = {"put": PUT, "cas": CAS, "delete": DELETE}
FUNCTIONS_VERSION = hashlib.sha1(
    "".join(_SCRIPT_NAMES.values()).encode(), usedforsecurity=False
).hexdigest()[:12]
"""Names the scripts of this version: a library loaded for other scripts is another."""
FUNCTION_NAMES = {
    script: f"simple_mutex_{name}_{FUNCTIONS_VERSION}" for name, script in _SCRIPT_NAMES.items()
}
"""The function that runs each script, in the library ``functions_library()`` returns."""


def functions_library() -> str:
    """The Redis functions library (``FUNCTION LOAD`` text, Redis >= 7.0) that runs the
    three scripts by ``FCALL`` for a cache built with ``functions=True``: loaded once by
    an administrator (``simple-mutex redis-functions URL``), so the lock user needs no
    ``EVAL``/``EVALSHA``/``SCRIPT`` right, which would let it run any Lua (an endless
    loop leaves every client of the server with ``BUSY``). The same Lua, its ``KEYS``
    and ``ARGV`` now the function's two arguments; named for this version's scripts, so
    two versions' libraries live side by side."""
    functions = "\n".join(
        f"redis.register_function('{FUNCTION_NAMES[script]}', function(KEYS, ARGV)\n"
        f"{script.strip()}\nend)"
        for script in _SCRIPT_NAMES.values()
    )
    return f"#!lua name=simple_mutex_{FUNCTIONS_VERSION}\n{functions}\n"


# Every command a Redis cache sends, in its scripts or directly (asyncio's wake-up listener
# sends SET, LPUSH and PEXPIRE itself), and nothing else: Redis 7 checks each command a
# script calls against the user's ACL too. Not CONFIG: ``CONFIG GET *`` would also show
# ``requirepass``; a user without it skips the eviction check (as on a managed server).
# SELECT: redis-py sends it on connect for a URL's /db other than 0. SCRIPT LOAD: a
# restarted server forgets the scripts. WAIT: only with replicas=N (acl_rules(replicas=True)).
# The Z* commands, PTTL and MGET keep and read the index (``index_prefix``) and read many
# slots at once (``get_many``).
ACL_COMMANDS = (
    "evalsha", "script|load", "get", "set", "del", "exists", "pexpire", "lpush", "blpop",
    "time", "scan", "select", "zadd", "zrem", "zremrangebyscore", "zrange", "pttl", "mget",
)  # fmt: skip
# A cache with functions=True: FCALL of the functions an administrator loaded instead of
# any Lua, no SCRIPT, no SCAN (``list`` reads the index), no SELECT (the user stays in
# database 0: a URL's /db other than 0 is refused), so the user can neither stall the
# server, nor list the keys of others, nor reach another database's.
FUNCTION_ACL_COMMANDS = (
    "fcall", "get", "set", "del", "exists", "pexpire", "lpush", "blpop", "time", "zadd",
    "zrem", "zremrangebyscore", "zrange", "pttl", "mget",
)  # fmt: skip


def acl_rules(
    prefixes: Sequence[str] = ("mutex.",),
    *,
    cache_prefix: str = "",
    replicas: bool = False,
    functions: bool = False,
) -> list[str]:
    """The ``ACL SETUSER`` words a Redis user needs to take, hold, free, wait for and list
    the locks of a ``Mutex`` / ``Semaphore`` whose ``prefix`` is one of ``prefixes``, on a
    cache built with ``prefix=cache_prefix``: one key pattern per prefix (every companion
    key of a lock, ``{base}:f``, ``:h``, ``:w``, ``:signal``, shares its entry's
    ``{base`` head) and the exact commands. No channel rule: nothing is published, so a
    user made with ``resetchannels`` (Redis 7's default) works. ``replicas=True`` adds
    ``WAIT``, for a cache with ``replicas=N``. ``functions=True``: the words for a cache
    built with ``functions=True`` (``FUNCTION_ACL_COMMANDS``): ``FCALL`` in place of
    ``EVALSHA`` and ``SCRIPT LOAD``, and neither ``SCAN`` nor ``SELECT``."""
    cache_prefix = check_prefix(cache_prefix)
    if isinstance(prefixes, str) or not isinstance(prefixes, Sequence) or not prefixes:
        raise ConstraintTypeError(
            "acl_rules(prefixes=...) takes a non-empty tuple of lock prefixes, e.g. "
            f"('mutex.', 'semaphore.'), got {prefixes!r}"
        )
    patterns = [
        f"~{_glob_escape(cache_prefix + '{' + check_prefix(prefix))}*" for prefix in prefixes
    ]
    names = FUNCTION_ACL_COMMANDS if functions else ACL_COMMANDS
    commands = [f"+{name}" for name in (*names, *(("wait",) if replicas else ()))]
    return [*dict.fromkeys(patterns), *commands]


Request = tuple[Any, ...]
"""The arguments of one script call after its SHA-1: numkeys, KEYS, ARGV."""
Command = tuple[Any, ...]
"""One command as ``execute_command`` takes it: its name, then its arguments."""


def _sentinel_managed(client: Any) -> bool:
    """Is ``client`` a Sentinel's master (``Sentinel.master_for``), blocking or asyncio?"""
    pool = getattr(client, "connection_pool", None)
    return type(pool).__name__ == "SentinelConnectionPool" and getattr(pool, "is_master", False)


class RedisLayout:
    """The I/O-free half of a Redis cache: options, keys, requests and replies. A subclass
    sends the requests (blocking or awaited) and hands the replies back here."""

    name = "redis"
    driver_errors: tuple[type[Exception], ...] = (RedisError,)
    client: Any
    prefix: str
    replicas: int
    replica_timeout: float
    allow_eviction: bool

    def __init__(
        self,
        client: Any,
        *,
        prefix: str = "",
        replicas: int | None = None,
        replica_timeout: float = 0.5,
        allow_eviction: bool = False,
        index: bool = True,
        functions: bool = False,
    ) -> None:
        same_connection = self._connect(client)
        if replicas is None:
            # A Sentinel-managed master is one a failover is expected to replace, and a
            # grant it had not yet passed on would be lost in it (a waiter then holds the
            # key beside its holder): wait for one replica unless told replicas=0.
            sentinel = _sentinel_managed(client)
            if sentinel and not same_connection:
                logging.getLogger("simple_mutex").warning(
                    "%s: this Sentinel master's commands go through a wrapped or replaced "
                    "execute_command (tracing?), so a grant cannot wait for a replica "
                    "(WAIT must follow it on the same connection): a failover may lose a "
                    "grant and let a second holder in. Give the cache the master itself, "
                    "or pass replicas=0 to accept it",
                    type(self).__name__,
                )
            replicas = 1 if same_connection and sentinel else 0
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ConstraintValueError(
                f"{type(self).__name__} replicas must be an int >= 0, got {replicas!r}"
            )
        if replicas and not same_connection:
            raise ConstraintTypeError(
                f"{type(self).__name__}(replicas=...) needs a plain Redis client or a "
                "Sentinel master: WAIT must follow the write on the same connection"
            )
        self.client = client
        self.prefix = check_prefix(prefix)
        self.replicas = replicas
        self.replica_timeout = positive_seconds(replica_timeout, "replica_timeout")
        self.allow_eviction = allow_eviction
        self._checked = allow_eviction  # the eviction policy is read on first use
        if not isinstance(index, bool):
            raise ConstraintTypeError(
                f"{type(self).__name__}(index=...) takes True or False, got {index!r}"
            )
        # A Cluster keeps each lock's keys in its hash tag's slot, and a script may touch
        # one slot only: the index (another slot) cannot be written there, so a Cluster
        # lists by SCAN, as index=False does.
        self.index = index and not _clustered(client)
        if not isinstance(functions, bool) or (functions and not self.index):
            raise ConstraintValueError(
                f"{type(self).__name__}(functions=...) takes True or False, and True needs "
                f"the index (a user without SCAN lists through it; not on a Cluster, nor "
                f"with index=False), got functions={functions!r}, index={index!r}"
            )
        # FCALL of the library an administrator loaded (functions_library), not EVALSHA.
        self.functions = functions
        self._indexed: tuple[str, ...] = ()  # the prefixes whose entries are indexed
        # SHA-1s computed here, so start-up costs no round trip (NOSCRIPT loads them).
        self._shas = {
            s: hashlib.sha1(s.encode(), usedforsecurity=False).hexdigest()
            for s in (PUT, CAS, DELETE)
        }
        self._max_block = max_block(connection_kwargs(client).get("socket_timeout"))

    acl_rules = staticmethod(acl_rules)

    def index_prefix(self, prefix: str) -> None:
        """List the entries this cache writes under the lock prefix ``prefix`` in its
        index (``{prefix}:index``), so ``scan(prefix)`` reads them without reading the
        whole keyspace. ``Mutex``, ``Semaphore`` and ``Lines`` call it with their prefix;
        an entry under several noted prefixes is listed in each."""
        if not isinstance(prefix, str) or "{" in prefix or "}" in prefix:
            raise ConstraintValueError(
                f"index_prefix takes a key prefix with no brace (the hash tag's), got {prefix!r}"
            )
        if self.index and prefix not in self._indexed:
            self._indexed = (*self._indexed, prefix)

    def _index_key(self, prefix: str) -> str:
        """The index of the entries under ``prefix``: under the hash tag ``{prefix}``,
        so the key pattern a user for that prefix has covers it; no entry's or side
        key's name ends in ``}:index``."""
        return f"{self.prefix}{{{prefix}}}:index"

    def _indexes(self, key: str) -> tuple[str, ...]:
        """The indexes that list ``key``: one per noted prefix it starts with."""
        return tuple(self._index_key(p) for p in self._indexed if key.startswith(p))

    def _connect(self, client: Any) -> bool:
        """The subclass's I/O: refuse a client it cannot drive (ConstraintError), set up
        its command path, and say whether a ``WAIT`` can follow a write on the connection
        that sent it."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.client!r}, prefix={self.prefix!r})"

    def _faults(self, operation: str, key: str, *, unsent: bool = False) -> _Faults:
        """Around the I/O of one operation on ``key``, on either face: a redis-py error
        raised inside becomes the ``MalfunctionError`` ``_fault`` makes of it."""
        return _Faults((self._fault, operation, key, unsent))

    def _fault(self, operation: str, key: str, exc: RedisError) -> MalfunctionError:
        """The one mapping of a redis-py error: a malformed entry for a key of another type,
        else a fault naming redis, where, the operation and the key, and the ACL word a
        refused command lacked; ``unsent`` when the request provably never left;
        ``lasting`` for a refused login or a missing ACL permission (a waiter raises it at
        once: a restart, a reset or a timeout it rides out)."""
        if isinstance(exc, ResponseError) and "WRONGTYPE" in str(exc):
            return malformed(self.name, operation, key, "a Redis key of another type")
        redis_key = None if operation == "scan" else self._entry_key(key)
        missing = missing_permission(exc, operation, redis_key)
        denied = missing is not None or isinstance(exc, AuthenticationError | AuthorizationError)
        error = fault(self.name, operation, key, exc, _where(self.client), lasting=denied)
        if isinstance(exc, ConnectionError | TimeoutError) and not denied:
            error.message += "; is Redis up and reachable there?"
        if self.functions and "Function not found" in str(exc):
            error.message += (
                f"; this cache calls the functions of library simple_mutex_{FUNCTIONS_VERSION}"
                ": an administrator loads them once (simple-mutex redis-functions URL, again "
                "after a restart of a server that keeps no data)"
            )
        if missing is not None:
            error.denied = True
            # NOPERM says "a key" or "this command" at best; the operator needs the word.
            error.message += (
                f"; the Redis user lacks {missing}: grant it the words "
                "RedisCache.acl_rules(prefixes=(...)) returns (docs/guides/redis.md)"
            )
        error.args = (error.message, error.key)
        error.unsent = refused(exc)
        return error

    def _keys(self, key: str) -> tuple[str, str]:
        """The Redis key of an entry, and the hash-tagged stem of its companions."""
        base, hash_, slot = key.partition("#")
        stem = f"{self.prefix}{{{base}}}"
        return stem + hash_ + slot, stem

    def _held_mark(self, entry_key: str, stem: str) -> str:
        """The held mark of an entry: ``{base}:h``, or ``{base}:h#N`` for slot N (no side
        key's name ends in ``}`` or holds ``}#``, so a scan never takes one for an entry)."""
        return stem + ":h" + entry_key[len(stem) :]

    # -- get ------------------------------------------------------------------------------

    def _entry_key(self, key: str) -> str:
        return self._keys(key)[0]

    def _get_command(self, key: str) -> Command:
        # A bare GET, never client.get(): redis-py's client-side cache (RESP3) only serves
        # commands sent with keys=..., and a lock must not read a stale copy.
        return ("GET", self._entry_key(key))

    def _read_entry(self, key: str, payload: bytes | str | None) -> Entry | None:
        if payload is None:
            return None
        try:
            version, expiry, value = text(payload).split(" ", 2)
            return Entry(value, version, int(version.partition(".")[0]), int(expiry) / 1000)
        except (ValueError, OverflowError):  # OverflowError: an expiry of 10**400 ms
            raise malformed(
                self.name, "get", key, f"{self._entry_key(key)!r} is not an entry"
            ) from None

    # -- the scripts (put_if_absent, compare_and_set, compare_and_delete) -------------------

    def _script_command(self, script: str, request: Request) -> Command:
        if self.functions:
            return ("FCALL", FUNCTION_NAMES[script], *request)
        return ("EVALSHA", self._shas[script], *request)

    def _loaded(self, script: str, sha: bytes | str) -> None:
        """``SCRIPT LOAD``'s reply (the faces send ``load_command(script)`` when a restarted
        or failed-over server forgot the script, then the script again)."""
        self._shas[script] = text(sha)

    def _waits_for_replicas(self, script: str) -> bool:
        """Does a write by ``script`` count only once ``replicas`` replicas took it? A grant
        or a renewal does; a release never waits."""
        return bool(self.replicas) and script != DELETE

    def _replicas_command(self) -> Command:
        """``WAIT``, sent after a write on the connection that sent it (WAIT counts the
        writes of its own connection), with ``replicas=N``."""
        return ("WAIT", self.replicas, ttl_ms(self.replica_timeout))

    def _replicated(self, acked: Any) -> bool:
        """``WAIT``'s reply: did enough replicas take the write in time (an unanswered
        WAIT reads 0)?"""
        return int(acked) >= self.replicas

    # -- put_if_absent ----------------------------------------------------------------------

    def _put_request(self, key: str, value: str, ttl: float) -> tuple[Request, int]:
        """The script's arguments, and the expiry (Unix ms) the entry will report."""
        entry_key, stem = self._keys(key)
        ms, expires = _ttl(ttl)
        held = self._held_mark(entry_key, stem)
        indexes = self._indexes(key) if self._indexed else ()
        request = (
            4 + len(indexes), entry_key, stem + ":f", stem + ":w", held, *indexes,
            f"{expires} {value}", ms, _keep(ms),
        )  # fmt: skip
        return request, expires

    def _put_reply(self, key: str, value: str, expires: int, reply: Any) -> Entry:
        if reply is None:
            raise SimpleCacheConditionError(f"redis: {key!r} is held")
        if reply == 0:
            raise malformed(
                self.name, "put_if_absent", key, f"{self._entry_key(key)!r} is not an entry"
            )
        if isinstance(reply, int):
            fence = abs(reply)  # negative: the grant took over (the PUT script)
            return Entry(value, f"{fence}.1", fence, expires / 1000, reply < 0)
        version, expires_text = text(reply).split(" ")
        return Entry(value, version, int(version.partition(".")[0]), int(expires_text) / 1000)

    def _unreplicated_grant(self, key: str, undone: bool) -> MalfunctionError:
        """A grant too few replicas took would not survive a failover (it was undone, or
        lapses with its lease)."""
        return MalfunctionError(
            f"redis cache: fewer than {self.replicas} replica(s) acknowledged the grant of "
            f"{key!r} within {self.replica_timeout:g} s, so it was "
            f"{'withdrawn' if undone else 'not counted (it lapses with its lease)'}; check "
            "the replicas, or lower replicas= / raise replica_timeout= (a "
            "redis+sentinel:// URL waits for one replica unless it says replicas=0)",
            key=key,
            unsent=undone,
            withheld=True,  # if the withdrawal failed, a read-back must not grant it
        )

    # -- compare_and_set --------------------------------------------------------------------

    def _cas_request(self, key: str, value: str, ttl: float, version: str) -> tuple[Request, int]:
        entry_key, stem = self._keys(key)
        ms, expires = _ttl(ttl)
        held = self._held_mark(entry_key, stem)
        indexes = self._indexes(key) if self._indexed else ()
        request = (2 + len(indexes), entry_key, held, *indexes,
                   f"{expires} {value}", ms, version, _keep(ms))  # fmt: skip
        return request, expires

    def _cas_reply(self, key: str, value: str, version: str, expires: int, n: Any) -> Entry:
        if n is None:
            raise SimpleCacheConditionError(f"redis: {key!r} is not at version {version}")
        fence = version.partition(".")[0]
        return Entry(value, f"{fence}.{n}", int(fence), expires / 1000)

    def _unreplicated_renewal(self, key: str) -> MalfunctionError:
        return MalfunctionError(
            f"redis cache: fewer than {self.replicas} replica(s) acknowledged the "
            f"renewal of {key!r} within {self.replica_timeout:g} s; it does not count",
            key=key,
        )

    # -- compare_and_delete -----------------------------------------------------------------

    def _delete_request(self, key: str, version: str) -> Request:
        entry_key, stem = self._keys(key)
        held = self._held_mark(entry_key, stem)
        indexes = self._indexes(key) if self._indexed else ()
        return (4 + len(indexes), entry_key, stem + ":w", stem + ":signal", held, *indexes,
                version, _MIN_KEEP_MS)  # fmt: skip

    def _delete_reply(self, key: str, version: str, freed: Any) -> bool:
        if not freed:
            raise SimpleCacheConditionError(f"redis: {key!r} is not at version {version}")
        return bool(freed == 2)  # a waiter was signalled

    # -- waited_on ----------------------------------------------------------------------------

    def _waited_on_command(self, key: str) -> Command:
        """Is the waiter mark (``{base}:w``) there: did a put on ``key`` fail lately?"""
        return ("EXISTS", self._keys(key)[1] + ":w")

    # -- wait -------------------------------------------------------------------------------

    def _block(self, timeout: float) -> float:
        """How long one BLPOP may block; below 1 ms, sleep instead (BLPOP counts whole
        milliseconds, and 0 would mean "block forever")."""
        return min(timeout, self._max_block)

    def _signals(self, keys: Sequence[str]) -> list[str]:
        """The signal lists of ``keys`` (a semaphore's slots share one)."""
        return list(dict.fromkeys(self._keys(key)[1] + ":signal" for key in keys))

    def _blpop_command(self, keys: Sequence[str], block: float) -> Command:
        """One wait for a release's token on the signal lists of ``keys``."""
        return blpop_command(self._signals(keys), block)

    # -- scan -------------------------------------------------------------------------------

    def _scan_pattern(self, prefix: str) -> str:
        """A ``SCAN MATCH`` pattern for entries whose cache key starts with ``prefix``, its
        glob characters escaped."""
        return _glob_escape(f"{self.prefix}{{") + _glob_escape(prefix) + "*"

    def _scanned_keys(self, names: Sequence[bytes | str], prefix: str) -> list[str]:
        """The cache keys of the entries among ``names`` that ``SCAN`` found (once each, in
        order): ``{base}`` is ``base``, ``{base}#N`` is ``base#N`` (a base never holds
        ``#``); the side keys (``:f``, ``:h``, ``:w``, ``:signal``) are no entries."""
        keys = []
        for name in dict.fromkeys(text(name) for name in names):  # SCAN may repeat a key
            key = _cache_key(name[len(self.prefix) :])
            if key is not None and key.startswith(prefix):
                keys.append(key)
        return keys

    # -- the index: scan and read many ------------------------------------------------------

    def _index_commands(self, prefix: str, now: Any) -> tuple[Command, Command]:
        """Given ``TIME``'s reply: drop the members lapsed by then, and read the rest."""
        index = self._index_key(prefix)
        seconds, micros = (int(part) for part in now)
        ms = seconds * 1000 + micros // 1000
        return ("ZREMRANGEBYSCORE", index, "-inf", ms), ("ZRANGE", index, 0, -1)

    def _mget_commands(self, names: Sequence[bytes | str]) -> list[Command]:
        """``MGET`` of ``names`` (Redis keys), ``MGET_CHUNK`` at a time."""
        return [("MGET", *names[i : i + MGET_CHUNK]) for i in range(0, len(names), MGET_CHUNK)]

    def _indexed_entries(
        self, names: Sequence[bytes | str], payloads: Sequence[Any], prefix: str
    ) -> list[tuple[str, Entry]]:
        """The live entries under ``prefix`` among the index's members ``names`` and
        their payloads (a freed or lapsed one reads None and is skipped)."""
        found = []
        for name, payload in zip(names, payloads, strict=True):
            keys = self._scanned_keys([name], prefix)
            entry = self._read_entry(keys[0], payload) if keys else None
            if entry is not None:
                found.append((keys[0], entry))
        return found

    def _entry_keys(self, keys: Sequence[str]) -> list[str]:
        return [self._entry_key(key) for key in keys]

    # -- the eviction check -----------------------------------------------------------------

    @contextlib.contextmanager
    def _eviction_check(self, key: str) -> Iterator[list[Any]]:
        """Around sending ``CONFIG_GET``, whose reply goes in the list it yields: judge
        it, or trust a server that renamed or denied CONFIG (a managed service). Any other
        error is the put's, which was never sent (nothing to read back)."""
        replies: list[Any] = []
        with self._faults("put_if_absent", key, unsent=True):
            try:
                yield replies
            except ResponseError:
                self._checked = True
                return
        self._judge_eviction(config_pairs(replies[0]))

    def _judge_eviction(self, config: dict[Any, Any]) -> None:
        """Refuse a server that may evict lock keys: an evicted lock is held twice."""
        config = {text(name): value for name, value in config.items()}  # raw replies: bytes
        policy = text(config.get("maxmemory-policy", "noeviction"))
        if int(config.get("maxmemory", 0) or 0) and policy != "noeviction":
            raise ConstraintError(
                f"this Redis may evict lock keys (maxmemory-policy {policy} with a "
                "maxmemory limit): an evicted lock would be granted twice. Set "
                "maxmemory-policy noeviction (or use a Redis of its own for locks), or pass "
                f"{type(self).__name__}(..., allow_eviction=True) to accept the risk"
            )
        self._checked = True


class _Faults(tuple[Any, ...]):
    """``RedisLayout._faults``: (the mapping, operation, key, unsent), a context that
    raises the mapped ``MalfunctionError`` in place of a redis-py error. A tuple, built
    in C, and no generator: it wraps every hot command (a class with ``__init__`` cost a
    cycle 1 µs more)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, traceback: object) -> None:
        if isinstance(exc, RedisError):
            map_error, operation, key, unsent = self
            error = map_error(operation, key, exc)
            error.unsent = error.unsent or unsent
            raise error from exc


BLPOP_LATE_S = 0.15
"""How late Redis may end a BLPOP that timed out: on its next timer tick, 1/hz s (100 ms
at the default ``hz 10``), plus a margin."""


def max_block(socket_timeout: float | None) -> float:
    """The longest one BLPOP may block on a client with this socket timeout. Its reply
    (and, in a fused wait, the put's right behind it) must arrive inside the timeout, or
    redis-py calls the connection dead and a busy key reads as a fault: so the block
    leaves room for Redis ending it up to ``BLPOP_LATE_S`` late, and at most 80 % of the
    timeout (half of a timeout too short for that room)."""
    if not socket_timeout:
        return MAX_BLOCK_S
    timeout = float(socket_timeout)
    return min(MAX_BLOCK_S, 0.8 * timeout, max(timeout - BLPOP_LATE_S, timeout / 2))


def load_command(script: str) -> Command:
    # One word, as redis-py's own script_load sends it (a client path's response callback
    # and its instrumentation see "SCRIPT LOAD"); redis-py splits it on the wire.
    return ("SCRIPT LOAD", script)


# The eviction check's read: maxmemory and maxmemory-policy (``_eviction_check``).
CONFIG_GET: Command = ("CONFIG GET", "maxmemory*")


def blpop_command(signals: Sequence[str], block: float) -> Command:
    """Block up to ``block`` s (whole ms) for a token on one of ``signals``."""
    return ("BLPOP", *signals, round(block, 3))


def waiter_mark(signal: str) -> str:
    """The waiter mark beside a signal list."""
    return signal.removesuffix(":signal") + ":w"


def mark_command(signal: str) -> Command:
    """Keep the waiter mark beside ``signal`` (asyncio's listener, while waiters park)."""
    return ("SET", waiter_mark(signal), 1, "PX", WAITER_MARK_MS)


def token_back_commands(signal: str) -> tuple[Command, Command]:
    """Put a token back (its local waiter gave up meanwhile: one release must wake
    someone), with the life the release gave it."""
    return ("LPUSH", signal, 1), ("PEXPIRE", signal, SIGNAL_MS)


MGET_CHUNK = 1000  # keys per MGET: a bounded request and reply


def _clustered(client: Any) -> bool:
    """Is ``client`` a Redis Cluster client (blocking or asyncio)?"""
    return any(cls.__name__ == "RedisCluster" for cls in type(client).__mro__)


def _glob_escape(literal: str) -> str:
    """``literal`` as a literal in a Redis glob pattern."""
    return "".join("\\" + c if c in "*?[]^\\" else c for c in literal)


def _cache_key(name: str) -> str | None:
    """The cache key of an entry's Redis key (after our prefix), or None for a side key."""
    if not name.startswith("{"):
        return None
    base, tagged, slot = name[1:].partition("}#")
    if tagged and "#" not in base:
        return f"{base}#{slot}"
    if name.endswith("}") and "#" not in name:
        return name[1:-1]
    return None


def refused(exc: BaseException) -> bool:
    """Did the request provably never reach a server (refused, no such host)?"""
    seen: BaseException | None = exc
    for _ in range(8):  # the cause chain, bounded
        if seen is None:
            return False
        if isinstance(seen, ConnectionRefusedError | socket.gaierror):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _keep(ms: int) -> int:
    """How long the last fence and the held mark are kept after a grant or renewal of
    ``ms``: past the entry's own expiry, for the next grant to read."""
    return max(2 * ms, _MIN_KEEP_MS)


def _ttl(ttl: float) -> tuple[int, int]:
    """The ttl in ms, and the wall-clock expiry in Unix ms that the entry reports."""
    ms = ttl_ms(ttl)
    return ms, int(time.time() * 1000) + ms


def own_connection(pool: Any, retry: Any) -> Any:
    """A connection of ``pool``'s class with its settings, outside its books, whose retry
    policy is ``retry`` (none: the engine retries within its deadline). Connected on
    first use."""
    settings = pool.connection_kwargs
    if DRIVER_INFO is not None and not any(name in settings for name in _DRIVER_SETTINGS):
        settings = {**settings, "driver_info": DRIVER_INFO}  # what Redis() itself passes
    conn = pool.connection_class(**settings)
    conn.retry = retry
    return conn


def config_pairs(reply: Any) -> dict[Any, Any]:
    """CONFIG GET's raw reply as a dict: a flat list in RESP2, a map in RESP3."""
    if isinstance(reply, dict):
        return reply
    return dict(zip(reply[::2], reply[1::2], strict=True))


# The persistence check's reads: an RDB snapshot schedule, and the append-only file.
PERSISTENCE_GETS: tuple[Command, Command] = (("CONFIG GET", "save"), ("CONFIG GET", "appendonly"))


Persistence = Literal["append-only file", "snapshots", "none"]


def persistence_of(*replies: Any) -> Persistence:
    """What a server whose ``PERSISTENCE_GETS`` replied so keeps across a restart: every
    write (``appendonly yes``), its data as of its last snapshot (a ``save`` schedule: a
    crash loses the writes since), or nothing."""
    config = {text(name): text(value) for reply in replies
              for name, value in config_pairs(reply).items()}  # fmt: skip
    if config.get("appendonly", "") == "yes":
        return "append-only file"
    return "snapshots" if config.get("save", "").strip() else "none"


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def connection_kwargs(client: Any) -> dict[str, Any]:
    getter = getattr(client, "get_connection_kwargs", None)  # redis-py >= 5
    kwargs = getter() if callable(getter) else None
    if not isinstance(kwargs, dict):  # older redis-py: the pool holds them
        kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None)
    return kwargs if isinstance(kwargs, dict) else {}


_SCRIPTS = {"put_if_absent": PUT, "compare_and_set": CAS, "compare_and_delete": DELETE}


def missing_permission(exc: BaseException, operation: str, redis_key: str | None) -> str | None:
    """The ACL permission a refused command lacked, as an ``ACL SETUSER`` word where the
    reply tells which (a command), else the key it was refused on; None when ``exc`` is no
    ACL refusal. Inside a script Redis names only the script's line: the command on it
    is ours to read."""
    message = str(exc)
    command = re.search(r"no permissions to run the '([^']+)' command", message)
    if command:
        return f"the command +{command.group(1).lower()}"
    line = re.search(r"executing the script can't run this command.*@user_script:(\d+)", message)
    if line:
        lines = _SCRIPTS.get(operation, "").split("\n")
        number = int(line.group(1)) - 1
        called = re.search(r"redis\.p?call\('(\w+)'", lines[number] if number < len(lines) else "")
        if called:
            return f"the command +{called.group(1).lower()} (called by the {operation} script)"
        return f"a command the {operation} script calls"
    if "NOPERM" in message or "no permissions to access" in message or "can't access" in message:
        where = f" {redis_key!r}" if redis_key else ""
        return f"access to the key{where} (a key pattern covering its lock prefix)"
    return None


def _where(client: Any) -> str:
    """`` at redis://host:port/db`` (never a password), for messages; "" if unknown."""
    kwargs = connection_kwargs(client)
    if kwargs.get("path"):
        return f" at unix://{kwargs['path']}"
    if kwargs.get("host"):
        # A TLS connection's class (redis.SSLConnection) or its options give the scheme
        # away: a message must say rediss:// for a rediss:// URL, or the reader hunts a
        # plaintext port.
        pool = getattr(client, "connection_pool", None)
        tls = "SSL" in getattr(getattr(pool, "connection_class", None), "__name__", "") or any(
            name.startswith("ssl_") for name in kwargs
        )
        scheme = "rediss" if tls else "redis"
        return f" at {scheme}://{kwargs['host']}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"
    return ""
