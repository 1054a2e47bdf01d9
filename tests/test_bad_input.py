"""Bad input is refused up front with a ConstraintError that names the fix, never hangs,
and never touches the cache.

Each row of TABLE is one wrong call, the exact error type it must raise, and a piece of
the message that tells the caller what to do instead. Every row runs against a cache that
records every call made to it and already holds a lock: after the rejection, the cache
must have seen no call at all and the held lock must be exactly as it was.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from simple_mutex import (
    ConstraintError,
    DiskCache,
    InMemoryCache,
    Lease,
    Mutex,
    Semaphore,
    cache_from_url,
    with_simple_mutex,
)
from simple_mutex.contract import Entry
from simple_mutex.durations import MAX_SECONDS


class SpyCache(InMemoryCache):
    """An InMemoryCache that logs every contract call."""

    name = "spy"

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def get(self, key: str) -> Entry | None:
        self.calls.append(("get", key))
        return super().get(key)

    def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:
        self.calls.append(("put_if_absent", key))
        return super().put_if_absent(key, value, ttl=ttl)

    def compare_and_set(self, key: str, value: str, *, ttl: float, version: str) -> Entry:
        self.calls.append(("compare_and_set", key))
        return super().compare_and_set(key, value, ttl=ttl, version=version)

    def compare_and_delete(self, key: str, *, version: str) -> None:
        self.calls.append(("compare_and_delete", key))
        super().compare_and_delete(key, version=version)

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        self.calls.append(("wait", ",".join(keys)))
        super().wait(keys, timeout)


@dataclass
class Ctx:
    cache: SpyCache
    mutex: Mutex
    lease: Lease
    tmp_path: Path


Call = Callable[[Ctx], object]


def plain(a: Any, b: Any = 1) -> None:
    """A function to decorate."""


def a_file(ctx: Ctx) -> str:
    path = ctx.tmp_path / "not-a-directory"
    path.write_text("keep me")
    return str(path)


TABLE: list[tuple[str, Call, type[Exception], str]] = [
    # leases: (0, 2**31-1 ms], seconds / timedelta / {"unit": n}
    ("lease negative", lambda c: Mutex(c.cache, lease=-1), ConstraintError, "greater than 0"),
    ("lease zero", lambda c: Mutex(c.cache, lease=0), ConstraintError, "greater than 0"),
    ("lease nan", lambda c: Mutex(c.cache, lease=float("nan")), ConstraintError, "at most"),
    ("lease inf", lambda c: Mutex(c.cache, lease=float("inf")), ConstraintError, "at most"),
    ("lease bool", lambda c: Mutex(c.cache, lease=True), ConstraintError, "not a bool"),
    ("lease str", lambda c: Mutex(c.cache, lease="30s"), ConstraintError, "{'minutes': 5}"),
    ("lease None", lambda c: Mutex(c.cache, lease=None), ConstraintError, "timedelta"),  # type: ignore[arg-type]
    (
        "lease negative timedelta",
        lambda c: Mutex(c.cache, lease=timedelta(seconds=-1)),
        ConstraintError,
        "greater than 0",
    ),
    (
        "lease unknown unit",
        lambda c: Mutex(c.cache, lease={"mins": 5}),
        ConstraintError,
        "use one of: weeks",
    ),
    ("lease empty mapping", lambda c: Mutex(c.cache, lease={}), ConstraintError, "{'seconds'"),
    (
        "lease unit amount str",
        lambda c: Mutex(c.cache, lease={"minutes": "5"}),  # type: ignore[dict-item]
        ConstraintError,
        "must be a number",
    ),
    (
        "lease above 2**31-1 ms",
        lambda c: Mutex(c.cache, lease=MAX_SECONDS + 0.001),
        ConstraintError,
        "renew=True",
    ),
    (
        "lease 30 days",
        lambda c: Mutex(c.cache, lease={"days": 30}),
        ConstraintError,
        "24.8 days",
    ),
    (
        "decorator lease zero",
        lambda c: with_simple_mutex(plain, key="k.{a}", cache=c.cache, lease=0),
        ConstraintError,
        "greater than 0",
    ),
    (
        "lease huge int",
        lambda c: Mutex(c.cache, lease=10**400),
        ConstraintError,
        "at most",
    ),
    (
        "lease huge unit amount",
        lambda c: Mutex(c.cache, lease={"days": 10**400}),
        ConstraintError,
        "at most",
    ),
    ("interval zero", lambda c: Mutex(c.cache, interval=0), ConstraintError, "interval must"),
    (
        "acquire interval negative",
        lambda c: c.mutex.acquire("k", interval=-0.5),
        ConstraintError,
        "interval must",
    ),
    # wait timeouts: None, 0 or a positive duration
    (
        "timeout negative",
        lambda c: c.mutex.acquire("k", timeout=-1),
        ConstraintError,
        "None (wait forever), 0 (try once)",
    ),
    (
        "timeout nan",
        lambda c: c.mutex.acquire("k", timeout=float("nan")),
        ConstraintError,
        "None (wait forever)",
    ),
    (
        "timeout str",
        lambda c: c.mutex.acquire("k", timeout="5"),  # type: ignore[arg-type]
        ConstraintError,
        "timeout must be seconds",
    ),
    (
        "decorator timeout negative",
        lambda c: with_simple_mutex(plain, key="k.{a}", cache=c.cache, timeout=-1),
        ConstraintError,
        "0 (try once)",
    ),
    (
        "timeout huge int",
        lambda c: c.mutex.acquire("k", timeout=10**400),
        ConstraintError,
        "None (wait forever)",
    ),
    # permits
    ("permits zero", lambda c: Semaphore(c.cache, permits=0), ConstraintError, "from 1 to"),
    ("permits float", lambda c: Semaphore(c.cache, permits=1.5), ConstraintError, "an int"),  # type: ignore[arg-type]
    ("permits bool", lambda c: Semaphore(c.cache, permits=True), ConstraintError, "an int"),
    ("permits huge", lambda c: Semaphore(c.cache, permits=10**6), ConstraintError, "from 1 to"),
    # prefixes
    ("prefix slash", lambda c: Mutex(c.cache, prefix="a/b"), ConstraintError, "A-Z a-z 0-9"),
    ("prefix glob", lambda c: Mutex(c.cache, prefix="*"), ConstraintError, "A-Z a-z 0-9"),
    ("prefix 65 chars", lambda c: Mutex(c.cache, prefix="p" * 65), ConstraintError, "at most 64"),
    ("prefix not str", lambda c: Mutex(c.cache, prefix=None), ConstraintError, "prefix must"),  # type: ignore[arg-type]
    # keys
    ("key empty", lambda c: c.mutex.acquire(""), ConstraintError, "non-empty str"),
    ("key int", lambda c: c.mutex.acquire(5), ConstraintError, "non-empty str"),  # type: ignore[arg-type]
    ("key None try", lambda c: c.mutex.try_acquire(None), ConstraintError, "non-empty str"),  # type: ignore[arg-type]
    ("key None locked", lambda c: c.mutex.locked(None), ConstraintError, "non-empty str"),  # type: ignore[arg-type]
    ("key bytes holder", lambda c: c.mutex.holder(b"k"), ConstraintError, "non-empty str"),  # type: ignore[arg-type]
    # caches
    ("cache None", lambda c: Mutex(None), ConstraintError, "ConditionalCache"),
    (
        "cache class, not instance",
        lambda c: Mutex(InMemoryCache),
        ConstraintError,
        "instance",
    ),
    (
        "cache URL string",
        lambda c: Mutex("redis://:hunter2@localhost:6379/0"),
        ConstraintError,
        "cache_from_url",
    ),
    (
        "decorator cache None",
        lambda c: with_simple_mutex(plain, key="k", cache=None),
        ConstraintError,
        "ConditionalCache",
    ),
    (
        "url unknown scheme",
        lambda c: cache_from_url("ftp://user:hunter2@example.com/locks"),
        ConstraintError,
        "supported: memory://",
    ),
    (
        "url file with host",
        lambda c: cache_from_url("file://otherhost/var/lock"),
        ConstraintError,
        "file:///absolute/path",
    ),
    ("url file no path", lambda c: cache_from_url("file://"), ConstraintError, "absolute path"),
    (
        "url file relative path",
        lambda c: cache_from_url("file:relative/dir"),
        ConstraintError,
        "file:///absolute/path",
    ),
    ("disk path empty", lambda c: DiskCache(""), ConstraintError, "directory path"),
    ("url not str", lambda c: cache_from_url(None), ConstraintError, "'memory://'"),  # type: ignore[arg-type]
    ("disk path is a file", lambda c: DiskCache(a_file(c)), ConstraintError, "pass a directory"),
    # decorator keys
    (
        "template missing arg",
        lambda c: with_simple_mutex(plain, key="k.{phone}", cache=c.cache),
        ConstraintError,
        "does not take",
    ),
    (
        "template positional field",
        lambda c: with_simple_mutex(plain, key="k.{0}", cache=c.cache),
        ConstraintError,
        "must name arguments",
    ),
    (
        "template malformed",
        lambda c: with_simple_mutex(plain, key="k.{a", cache=c.cache),
        ConstraintError,
        "malformed",
    ),
    (
        "key neither str nor callable",
        lambda c: with_simple_mutex(plain, key=5, cache=c.cache),  # type: ignore[call-overload]
        ConstraintError,
        "or a callable",
    ),
    (
        "template on a function without signature",
        lambda c: with_simple_mutex(int, key="k.{x}", cache=c.cache),
        ConstraintError,
        "signature",
    ),
    # flags and labels
    (
        "renew str acquire",
        lambda c: c.mutex.acquire("k", renew="yes"),  # type: ignore[arg-type]
        ConstraintError,
        "True or False",
    ),
    (
        "renew str decorator",
        lambda c: with_simple_mutex(plain, key="k", cache=c.cache, renew="yes"),  # type: ignore[call-overload]
        ConstraintError,
        "True or False",
    ),
    ("label int", lambda c: Mutex(c.cache, label=5), ConstraintError, "str or None"),  # type: ignore[arg-type]
    (
        "acquire label int",
        lambda c: c.mutex.acquire("k", label=5),  # type: ignore[arg-type]
        ConstraintError,
        "str or None",
    ),
    # an existing lease
    ("renew negative length", lambda c: c.lease.renew(lease=-1), ConstraintError, "greater than 0"),
    ("renew mapping typo", lambda c: c.lease.renew(lease={"secs": 1}), ConstraintError, "unit"),
]


@pytest.fixture
def ctx(tmp_path: Path) -> Ctx:
    cache = SpyCache()
    mutex = Mutex(cache)
    lease = mutex.acquire("held")
    cache.calls.clear()
    return Ctx(cache, mutex, lease, tmp_path)


def snapshot(ctx: Ctx) -> Entry | None:
    return InMemoryCache.get(ctx.cache, "mutex.held")


def test_table_has_enough_rows():
    """The table covers at least 25 distinct bad inputs."""
    assert len(TABLE) >= 25
    assert len({row[0] for row in TABLE}) == len(TABLE)


@pytest.mark.parametrize(
    ("call", "error", "fix"), [row[1:] for row in TABLE], ids=[row[0] for row in TABLE]
)
def test_bad_input_is_refused_naming_the_fix_without_touching_the_cache(
    ctx: Ctx, call: Call, error: type[Exception], fix: str
):
    """Each bad input raises its exact error naming the fix, and the cache is untouched."""
    before = snapshot(ctx)
    with pytest.raises(ConstraintError) as info:
        call(ctx)
    assert type(info.value) is error
    assert fix in str(info.value)
    assert ctx.cache.calls == []
    assert snapshot(ctx) == before
    assert ctx.lease.lost is False


def test_the_whole_table_runs_fast_and_never_hangs(tmp_path: Path):
    """The whole table runs in under a second under a watchdog: no bad input hangs."""
    results: list[object] = []

    def run_all() -> None:
        for index, (_, call, _, _) in enumerate(TABLE):
            cache = SpyCache()
            mutex = Mutex(cache)
            row = Ctx(cache, mutex, mutex.acquire("held"), tmp_path / str(index))
            row.tmp_path.mkdir()
            try:
                call(row)
            except Exception as exc:  # the row tests check the type; here only speed
                results.append(exc)

    start = time.monotonic()
    worker = threading.Thread(target=run_all, daemon=True)
    worker.start()
    worker.join(5)
    elapsed = time.monotonic() - start
    assert not worker.is_alive(), "a bad input hung"
    assert len(results) == len(TABLE)  # every row raised
    assert elapsed < 1.0


@pytest.mark.parametrize(
    "url",
    [
        "ftp://user:hunter2@example.com/x",
        "mysql://admin:hunter2@db.internal:3306/app",
        "memcached://:hunter2@cache:11211",
        "HUNTER://hunter2@host",
    ],
)
def test_unknown_url_scheme_does_not_echo_the_password(url: str):
    """The error for an unknown scheme names the scheme but never the URL's secret."""
    with pytest.raises(ConstraintError) as info:
        cache_from_url(url)
    assert "hunter2" not in str(info.value)
    assert "hunter2" not in repr(info.value)
    assert "supported" in str(info.value)


def test_disk_cache_on_a_file_leaves_the_file_alone(tmp_path: Path):
    """DiskCache refuses a file path without writing to or replacing the file."""
    path = tmp_path / "precious.txt"
    path.write_text("keep me")
    with pytest.raises(ConstraintError):
        DiskCache(path)
    assert path.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious.txt"]


def test_template_error_happens_at_decoration_not_at_call(memory_cache):
    """A template naming a missing argument fails when decorating, not on the first call."""
    decorate = with_simple_mutex(key="k.{nope}", cache=memory_cache)
    with pytest.raises(ConstraintError, match="nope"):
        decorate(plain)
