"""Bad input is refused up front with a ConstraintError that names the fix, never hangs,
and never touches the cache.

Each row of TABLE is one wrong call, a piece of the message that tells the caller what to
do instead, and the builtin error it must also be (ValueError for a bad value, TypeError
for a wrong type, as Python code and the peers users migrate from expect). Every row runs
against a cache that records every call made to it and already holds a lock: after the
rejection, the cache must have seen no call at all and the held lock must be as it was.
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
    ConstraintTypeError,
    ConstraintValueError,
    DiskCache,
    InMemoryCache,
    Lease,
    Mutex,
    Semaphore,
    cache_from_url,
    with_simple_mutex,
)
from simple_mutex._core.durations import MAX_SECONDS
from simple_mutex.contract import Entry

pytestmark = pytest.mark.fast


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


def mutex(**options: Any) -> Call:
    return lambda c: Mutex(c.cache, **options)


def semaphore(**options: Any) -> Call:
    return lambda c: Semaphore(c.cache, **options)


def acquire(key: Any = "k", **options: Any) -> Call:
    return lambda c: c.mutex.acquire(key, **options)


def decorate(key: Any = "k.{a}", logic: Any = plain, **options: Any) -> Call:
    return lambda c: with_simple_mutex(logic, **{"key": key, "cache": c.cache, **options})


def url(text: Any) -> Call:
    return lambda c: cache_from_url(text)


def with_acquire_async(ctx: Ctx) -> None:
    with ctx.mutex.acquire_async("k"):  # the mistake itself: `with`, not `async with`
        pass


def a_file(ctx: Ctx) -> str:
    path = ctx.tmp_path / "not-a-directory"
    path.write_text("keep me")
    return str(path)


TABLE: list[tuple[str, Call, str, type[Exception]]] = [
    # leases: (0, 2**31-1 ms], seconds / timedelta / {"unit": n}
    ("lease negative", mutex(lease=-1), "greater than 0", ValueError),
    ("lease zero", mutex(lease=0), "greater than 0", ValueError),
    ("lease nan", mutex(lease=float("nan")), "at most", ValueError),
    ("lease inf", mutex(lease=float("inf")), "at most", ValueError),
    ("lease bool", mutex(lease=True), "not a bool", TypeError),
    ("lease str", mutex(lease="30s"), "{'minutes': 5}", TypeError),
    ("lease None", mutex(lease=None), "timedelta", TypeError),
    ("lease negative timedelta", mutex(lease=timedelta(seconds=-1)), "greater than 0", ValueError),
    ("lease unknown unit", mutex(lease={"mins": 5}), "use one of: weeks", ValueError),
    ("lease empty mapping", mutex(lease={}), "{'seconds'", ValueError),
    ("lease unit amount str", mutex(lease={"minutes": "5"}), "must be a number", TypeError),
    ("lease above 2**31-1 ms", mutex(lease=MAX_SECONDS + 0.001), "renew=True", ValueError),
    ("lease 30 days", mutex(lease={"days": 30}), "24.8 days", ValueError),
    ("decorator lease zero", decorate(lease=0), "greater than 0", ValueError),
    ("lease huge int", mutex(lease=10**400), "at most", ValueError),
    ("lease huge unit amount", mutex(lease={"days": 10**400}), "at most", ValueError),
    ("interval zero", mutex(interval=0), "interval must", ValueError),
    ("acquire interval negative", acquire(interval=-0.5), "interval must", ValueError),
    # wait timeouts: None, 0 or a positive duration
    ("timeout negative", acquire(timeout=-1), "None (wait forever), 0 (try once)", ValueError),
    ("timeout nan", acquire(timeout=float("nan")), "None (wait forever)", ValueError),
    ("timeout str", acquire(timeout="5"), "timeout must be seconds", TypeError),
    ("decorator timeout negative", decorate(timeout=-1), "0 (try once)", ValueError),
    ("timeout huge int", acquire(timeout=10**400), "None (wait forever)", ValueError),
    # permits
    ("permits zero", semaphore(permits=0), "from 1 to", ValueError),
    ("permits float", semaphore(permits=1.5), "an int", TypeError),
    ("permits bool", semaphore(permits=True), "an int", TypeError),
    ("permits huge", semaphore(permits=10**6), "from 1 to", ValueError),
    # prefixes
    ("prefix slash", mutex(prefix="a/b"), "A-Z a-z 0-9", ValueError),
    ("prefix glob", mutex(prefix="*"), "A-Z a-z 0-9", ValueError),
    ("prefix 65 chars", mutex(prefix="p" * 65), "at most 64", ValueError),
    ("prefix not str", mutex(prefix=None), "prefix must", TypeError),
    # keys
    ("key empty", acquire(""), "non-empty str", ValueError),
    ("key int", acquire(5), "non-empty str", TypeError),
    ("key None try", lambda c: c.mutex.try_acquire(None), "non-empty str", TypeError),  # type: ignore[arg-type]
    ("key None locked", lambda c: c.mutex.locked(None), "non-empty str", TypeError),  # type: ignore[arg-type]
    ("key bytes holder", lambda c: c.mutex.holder(b"k"), "non-empty str", TypeError),  # type: ignore[arg-type]
    # caches
    ("cache None", lambda c: Mutex(None), "ConditionalCache", TypeError),
    ("cache without the contract", lambda c: Mutex(object()), "ConditionalCache", TypeError),
    ("cache class, not instance", lambda c: Mutex(InMemoryCache), "instance", TypeError),
    (
        "cache URL string",
        lambda c: Mutex("redis://:hunter2@localhost:6379/0"),
        "cache_from_url",
        TypeError,
    ),
    ("decorator cache None", decorate(key="k", cache=None), "ConditionalCache", TypeError),
    (
        "url unknown scheme",
        url("ftp://user:hunter2@example.com/locks"),
        "supported: memory://",
        ValueError,
    ),
    ("url file with host", url("file://otherhost/var/lock"), "file:///absolute/path", ValueError),
    ("url file no path", url("file://"), "absolute path", ValueError),
    ("url file relative path", url("file:relative/dir"), "file:///absolute/path", ValueError),
    ("disk path empty", lambda c: DiskCache(""), "directory path", ValueError),
    ("url not str", url(None), "'memory://'", TypeError),
    ("disk path is a file", lambda c: DiskCache(a_file(c)), "pass a directory", ValueError),
    # decorator keys
    ("template missing arg", decorate(key="k.{phone}"), "does not take", ValueError),
    ("template positional field", decorate(key="k.{0}"), "must name arguments", ValueError),
    ("template malformed", decorate(key="k.{a"), "malformed", ValueError),
    ("key neither str nor callable", decorate(key=5), "or a callable", TypeError),
    (
        "template on a function without signature",
        decorate(key="k.{x}", logic=int),
        "signature",
        TypeError,
    ),
    (
        "decorate 42",
        lambda c: with_simple_mutex(key="k", cache=c.cache)(42),
        "wraps a function",
        TypeError,
    ),
    # flags and labels
    ("renew str acquire", acquire(renew="yes"), "True or False", TypeError),
    ("renew str decorator", decorate(key="k", renew="yes"), "True or False", TypeError),
    ("label int", mutex(label=5), "str or None", TypeError),
    ("acquire label int", acquire(label=5), "str or None", TypeError),
    ("with acquire_async", with_acquire_async, "async with mutex.acquire_async", TypeError),
    # an existing lease
    ("renew negative length", lambda c: c.lease.renew(lease=-1), "greater than 0", ValueError),
    ("renew mapping typo", lambda c: c.lease.renew(lease={"secs": 1}), "unit", ValueError),
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
    ("call", "fix", "python_error"), [row[1:] for row in TABLE], ids=[row[0] for row in TABLE]
)
def test_bad_input_is_refused_naming_the_fix_without_touching_the_cache(
    ctx: Ctx, call: Call, fix: str, python_error: type[Exception]
):
    """Each bad input raises a ConstraintError naming the fix that is also the ValueError
    (a bad value) or TypeError (a wrong type) Python code expects, and never a busy or
    lost-lease error; the cache is untouched."""
    before = snapshot(ctx)
    with pytest.raises(ConstraintError) as info:
        call(ctx)
    assert isinstance(info.value, python_error)
    assert type(info.value) in (ConstraintValueError, ConstraintTypeError)
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


def test_the_peers_idioms_catch_bad_values_but_never_busy_or_lost():
    """Code written for python-redis-lock or celery-once catches a bad argument as a
    ValueError or TypeError (the issue's three calls); a busy key and a lost lease are
    neither, so an ``except ValueError`` around other code cannot swallow them."""
    from simple_mutex import SimpleMutexAcquireTimeoutError, SimpleMutexLeaseExpiredError

    cache = InMemoryCache()
    with pytest.raises(ValueError, match="greater than 0"):
        Mutex(cache, lease=-1)
    with pytest.raises(TypeError, match="timeout must be seconds"):
        Mutex(cache).acquire("k", timeout="x")
    with pytest.raises(ValueError, match="unknown cache URL scheme 'amqp'"):
        cache_from_url("amqp://guest:guest@localhost//")
    for error in (SimpleMutexAcquireTimeoutError, SimpleMutexLeaseExpiredError):
        assert not issubclass(error, (ValueError, TypeError))
