"""The Redis user that may run only the library's own operations: ``functions=True``
(``FCALL`` of a library an administrator loaded) and ``acl_rules(functions=True)``,
against real servers (REDIS_URL, and servers of the tests' own where the library must
be absent). The user locks, renews, frees, lists and shows; Redis itself refuses it
any Lua of its own (an endless loop would stall every client), another database, the
key names of others and the keys of other prefixes.
"""

from __future__ import annotations

import io
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis_acl import lock_user, url_as
from servers import RedisServer, free_port, own_redis
from shared_redis import REDIS_URL, shared_client

from simple_mutex import (
    ConstraintValueError,
    MalfunctionError,
    Mutex,
    Semaphore,
    SimpleMutexAcquireTimeoutError,
    cache_from_url,
)
from simple_mutex.admin import commands
from simple_mutex.caches import RedisCache
from simple_mutex.caches.redis.protocol import FUNCTION_NAMES, functions_library

pytestmark = pytest.mark.backends

RUN = uuid.uuid4().hex[:8]
PREFIX = f"fx{RUN}."
ENDLESS = "while true do end"
ENDLESS_LIBRARY = f"#!lua name=x{RUN}\nredis.register_function('x{RUN}', function() {ENDLESS} end)"


@pytest.fixture(scope="module")
def admin() -> Iterator[redis.Redis]:
    with shared_client(REDIS_URL, f"*fx{RUN}*") as conn:
        assert commands.load_functions(RedisCache(conn), io.StringIO()) == 0
        yield conn


@pytest.fixture(scope="module")
def user(admin: redis.Redis) -> Iterator[str]:
    """A URL of the user made from ``acl_rules(functions=True)`` for ``PREFIX`` and the
    lines beside it, and nothing else."""
    rules = RedisCache.acl_rules((PREFIX, "line." + PREFIX), functions=True)
    with lock_user(admin, rules) as (name, password):
        yield url_as(REDIS_URL, name, password) + "?functions=true"


def test_the_function_words_run_no_lua_of_their_own() -> None:
    """FCALL instead of EVALSHA and SCRIPT LOAD; no SCAN, SELECT, KEYS, FLUSH, CONFIG,
    FUNCTION; the prefix's pattern as before."""
    words = RedisCache.acl_rules(functions=True)
    assert words[0] == "~{mutex.*"
    assert "+fcall" in words
    banned = ("+eval", "+evalsha", "+script", "+function", "+scan", "+select", "+keys",
              "+flush", "+config", "+@")  # fmt: skip
    assert not [w for w in words if w.startswith(banned)], words
    assert RedisCache.acl_rules(functions=True, replicas=True)[-1] == "+wait"


def test_the_user_locks_renews_frees_lists_and_shows(user: str) -> None:
    """Everything a lock and the operator's commands do, as the function user, by FCALL."""
    cache = cache_from_url(user)
    assert cache.functions  # type: ignore[attr-defined]
    mutex = Mutex(cache, prefix=PREFIX, lease=30)
    lease = mutex.acquire("report")
    with pytest.raises(SimpleMutexAcquireTimeoutError):
        mutex.acquire("report", timeout=0)
    lease.renew()
    pool = Semaphore(cache, prefix=PREFIX, permits=2, lease=30)
    permits = [pool.acquire("pool"), pool.acquire("pool")]
    viewer = cache_from_url(user)
    out = io.StringIO()
    assert commands.list_locks(viewer, PREFIX, out) == 0
    assert "report" in out.getvalue()
    assert out.getvalue().count("pool") == 2
    out = io.StringIO()
    assert commands.show_lock(viewer, "pool", PREFIX, out) == 0
    assert out.getvalue().count("key:         pool") == 2
    assert commands.release_lock(viewer, "report", PREFIX, io.StringIO(), yes=True) == 0
    assert mutex.acquire("report", timeout=0).release()
    assert all(permit.release() for permit in permits)
    assert commands.list_locks(viewer, PREFIX, out := io.StringIO()) == 0
    assert "no live locks" in out.getvalue()


@pytest.mark.parametrize(
    "command",
    [
        ("EVAL", ENDLESS, 0),
        ("SCRIPT", "LOAD", ENDLESS),
        ("FUNCTION", "LOAD", ENDLESS_LIBRARY),
        ("SELECT", 1),
        ("SCAN", 0),
        ("KEYS", "*"),
        ("CONFIG", "GET", "*"),
        ("GET", f"{{other{RUN}.k}}"),
        ("FCALL", FUNCTION_NAMES[next(iter(FUNCTION_NAMES))], 1, f"{{other{RUN}.k}}"),
    ],
    ids=lambda c: " ".join(str(w) for w in c[:2]).replace(RUN, ""),  # the same on every worker
)
def test_redis_refuses_the_user_lua_another_database_and_others_keys(
    user: str, admin: redis.Redis, command: tuple[object, ...]
) -> None:
    """Each refused by Redis itself (NOPERM): no Lua of the user's own (an endless loop
    would leave every client with BUSY, and SCRIPT KILL is not the user's), no other
    database (another tenant's locks), no listing or reading of keys not its own."""
    conn = redis.Redis.from_url(user.partition("?")[0])
    with pytest.raises(redis.exceptions.NoPermissionError):
        conn.execute_command(*command)
    assert admin.ping()  # the server still answers everyone
    conn.close()


def test_the_evalsha_user_could_load_an_endless_loop(admin: redis.Redis) -> None:
    """Why the function words exist: the words without ``functions=True`` grant SCRIPT
    LOAD and EVALSHA, so such a user may load any Lua (here one that returns at once)."""
    with lock_user(admin, RedisCache.acl_rules((PREFIX,))) as (name, password):
        conn = redis.Redis.from_url(url_as(REDIS_URL, name, password))
        sha = conn.script_load("return 7")
        assert conn.evalsha(sha, 0) == 7
        conn.close()


def test_without_the_library_a_grant_is_a_fault_naming_the_fix(
    redis_servers: list[RedisServer], tmp_path: Path
) -> None:
    """A server where nobody loaded the library (a fresh one): the fault names the
    library and the command that loads it; loaded, the same cache grants."""
    url = f"redis://127.0.0.1:{own_redis(redis_servers, tmp_path, free_port()).port}/0"
    mutex = Mutex(cache_from_url(url + "?functions=true"), lease=30)
    with pytest.raises(MalfunctionError, match=r"simple-mutex redis-functions URL"):
        mutex.acquire("k", timeout=0)
    done = subprocess.run(
        [sys.executable, "-m", "simple_mutex", "redis-functions", url],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "loaded Redis functions library" in done.stdout
    assert mutex.acquire("k", timeout=0).release()


def test_the_library_text_is_printed_for_an_administrator_to_load() -> None:
    """``redis-functions --print`` writes the FUNCTION LOAD text, one function per
    script, named for this version."""
    done = subprocess.run(
        [sys.executable, "-m", "simple_mutex", "redis-functions", "redis://x", "--print"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == functions_library()
    assert done.stdout.startswith("#!lua name=simple_mutex_")
    assert all(f"'{name}'" in done.stdout for name in FUNCTION_NAMES.values())


def test_functions_need_the_index() -> None:
    """A user with no SCAN lists through the index: functions=True without it is refused,
    naming both options."""
    with pytest.raises(ConstraintValueError, match="index"):
        RedisCache(redis.Redis(), functions=True, index=False)
