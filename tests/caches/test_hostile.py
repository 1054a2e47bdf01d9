"""Hostile data in the store (Hypothesis), on every tier this machine runs: memory, disk,
the Redis at REDIS_URL, the PostgreSQL at POSTGRES_URL, MongoDB (secantusd-py) and S3
(moto) of this module's own; and the CLI reading it.

Another program (or an attacker with write access to the prefix) may leave anything
where a lock record goes: truncated JSON, huge values, wrong types, a fence that is a
string or 2**70, NaN or infinite times, a record claiming another key, a pickle. Whatever
it is, ``holder``, ``locked`` and ``try_acquire`` either answer as for a lock someone
holds, or raise a ``MalfunctionError`` naming the user's key: never another exception,
never a grant over it, never a pickle load. The key encoder keeps every key (each Unicode
category, separators, 10 kB) apart and inside the backends' limits.

Example counts are bounded (``max_examples`` 40 to 80, no deadline) to keep CI short.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pymongo
import pytest
import redis
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from servers import s3_bucket
from test_s3 import BUCKET as S3_BUCKET
from test_s3 import new_client as new_s3_client

from simple_mutex import ConditionalCache, DiskCache, InMemoryCache, MalfunctionError, Mutex
from simple_mutex._core.keys import MAX_KEY_CHARS, MAX_USER_KEY, decode_key, encode_key, is_hashed
from simple_mutex.admin import cli as simple_mutex_cli
from simple_mutex.caches import MongoCache, PostgresCache, RedisCache, S3Cache
from simple_mutex.caches.etcd import from_url as etcd_from_url

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES_URL = os.environ.get("POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
RUN = uuid.uuid4().hex[:8]
PREFIX = f"h{RUN}."  # the Mutex prefix of every lock here
TABLE = f"hostile_{RUN}"
pytestmark = [
    pytest.mark.backends,
    pytest.mark.filterwarnings("ignore:Generating overly large repr"),
]
HOSTILE = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

# -- what a record may be -------------------------------------------------------------------

VALID = {"v": 1, "token": "a" * 32, "host": "h", "pid": 1, "label": None, "acquired_at": 1.0}
odd_scalars = st.one_of(
    st.none(), st.booleans(), st.text(max_size=50),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True), st.just(2**70), st.just("2**70"),
)  # fmt: skip
odd_values = st.recursive(
    odd_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)  # fmt: skip


@st.composite
def wrong_fields(draw: st.DrawFn) -> str:
    """A record with some fields of the wrong type or size (or missing, or extra)."""
    record: dict[str, Any] = dict(VALID)
    for name in draw(st.sets(st.sampled_from([*VALID, "key", "fence"]), max_size=4)):
        if draw(st.booleans()) and name in record:
            del record[name]
        else:
            record[name] = draw(odd_values)
    return json.dumps(record, allow_nan=True)


class _Bomb:
    """Loading this pickle would set PICKLE_LOADED: a lock must never unpickle."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, ("import os; os.environ['SIMPLE_MUTEX_PICKLE_LOADED'] = '1'",))


hostile_values = st.one_of(
    st.integers(min_value=0, max_value=90).map(lambda n: json.dumps(VALID)[:n]),  # truncated
    wrong_fields(),
    st.text(max_size=200),
    st.just("[" * 100_000 + "]" * 100_000).map(str),  # nests past Python's recursion limit
    st.just(json.dumps({**VALID, "label": "x" * 300_000})),  # huge
    st.just('{"token": "t", "pid": 1e400, "acquired_at": NaN, "host": "h"}'),
    st.just(json.dumps({**VALID, "key": "someone.else"})),  # claims another key
    st.just(pickle.dumps(_Bomb()).decode("latin-1")),
)


def assert_refused_or_named(call: Callable[[], Any], key: str) -> Any:
    """``call()``'s answer, or None after a MalfunctionError naming ``key``; anything
    else fails the test."""
    try:
        return call()
    except MalfunctionError as exc:
        fault = exc
    assert fault.key == key
    assert repr(key) in str(fault)
    return None


def check_mutex_on(cache: ConditionalCache, key: str) -> None:
    """What a user sees of a key holding something: a holder or a named fault, never a
    grant, never a pickle load."""
    locks = Mutex(cache, lease=30, prefix=PREFIX)
    assert assert_refused_or_named(lambda: locks.try_acquire(key), key) is None  # never granted
    assert assert_refused_or_named(lambda: locks.locked(key), key) in (True, None)
    assert_refused_or_named(lambda: locks.holder(key), key)
    assert "SIMPLE_MUTEX_PICKLE_LOADED" not in os.environ


# -- the tiers ------------------------------------------------------------------------------


@pytest.fixture(
    scope="module", params=["memory", "disk", "redis", "postgres", "mongo", "s3", "etcd"]
)
def tier(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Each tier's cache, one per module (Hypothesis runs many examples on it): MongoDB,
    S3 (moto) and etcd on the session's servers, under names of this module's own."""
    if request.param == "mongo":
        client: Any = pymongo.MongoClient(
            request.getfixturevalue("mongo_url"), serverSelectionTimeoutMS=5000
        )
        yield MongoCache(client[f"hostile_{RUN}"]["locks"])
        client.drop_database(f"hostile_{RUN}")
        client.close()
    elif request.param == "s3":
        endpoint = request.getfixturevalue("moto")
        yield S3Cache(new_s3_client(endpoint), s3_bucket(endpoint, S3_BUCKET), f"h{RUN}/")
    elif request.param == "etcd":
        cluster = request.getfixturevalue("etcd_cluster")
        etcd = etcd_from_url(f"etcd://{cluster.endpoints[0]}/h{RUN}")
        yield etcd
        etcd.close()
    elif request.param == "memory":
        yield InMemoryCache()
    elif request.param == "disk":
        yield DiskCache(tmp_path_factory.mktemp("hostile") / "locks")
    elif request.param == "redis":
        client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
        yield RedisCache(client)
        for name in client.scan_iter(match="{" + PREFIX + "*", count=1000):
            client.delete(name)
        client.close()
    else:
        cache = PostgresCache(POSTGRES_URL, table=TABLE)
        yield cache
        cache.close()
        with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
            admin.execute(f'DROP TABLE IF EXISTS "{TABLE}"')


@HOSTILE
@given(value=hostile_values)
def test_a_hostile_record_is_a_named_fault_or_a_held_lock(tier: ConditionalCache, value: str):
    """Written where the lock record goes (through the cache itself, so every tier's
    decode path reads it): a holder or a MalfunctionError naming the key."""
    key = f"k{uuid.uuid4().hex[:10]}"
    try:
        tier.put_if_absent(PREFIX + encode_key(key), value, ttl=30)
    except MalfunctionError as exc:  # PostgreSQL text cannot hold NUL: nobody can leave it
        assume("NUL" not in str(exc))
        raise
    check_mutex_on(tier, key)


# -- below the record: each server's own entry format -------------------------------------------

raw_redis_entries = st.one_of(
    st.binary(max_size=300),
    st.builds(
        lambda fence, n, expiry, value: f"{fence}.{n} {expiry} {value}",
        st.sampled_from(["1", "abc", str(2**70), "-1", "1e9", ""]),
        st.sampled_from(["1", "x", str(10**30)]),
        st.sampled_from(["0", "nan", "-5", str(10**400), "9" * 20, "inf"]),
        st.sampled_from([json.dumps(VALID), "", "{"]),
    ),
)


@pytest.fixture(scope="module")
def admin_redis() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    yield client
    for name in client.scan_iter(match="{" + PREFIX + "*", count=1000):
        client.delete(name)
    client.close()


@settings(HOSTILE, max_examples=80)
@given(raw=raw_redis_entries)
def test_a_hostile_redis_entry_is_a_named_fault_or_a_held_lock(admin_redis: redis.Redis, raw):
    """Bytes at the entry's Redis key itself (bad fence, 2**70, an expiry of 10**400 ms,
    NaN, no value), as another client could SET them."""
    key = f"k{uuid.uuid4().hex[:10]}"
    admin_redis.set(f"{{{PREFIX}{key}}}", raw, ex=30)
    check_mutex_on(RedisCache(admin_redis), key)


@pytest.mark.parametrize(
    ("fence", "expires", "version"),
    [
        (2**62, "infinity", "x.1"),
        (-1, "now() + interval '1 hour'", ""),
        (2**53 + 1, "'294276-12-31'::timestamptz", "1.1"),
        (0, "now() + interval '1 hour'", "🙂" * 1000),
    ],
)
def test_a_hostile_postgres_row_is_a_named_fault_or_a_held_lock(fence, expires, version) -> None:
    """Column values no grant writes (an infinite or far-future expiry, a negative or
    near-2**63 fence, an odd version) in the lock table."""
    cache = PostgresCache(POSTGRES_URL, table=TABLE)
    key = f"k{uuid.uuid4().hex[:10]}"
    cache.get(PREFIX + key)  # creates the table
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        at = "'infinity'::timestamptz" if expires == "infinity" else expires
        admin.execute(
            f'INSERT INTO "{TABLE}" (key, value, version, fence, expires_at) '
            f"VALUES (%s, %s, %s, %s, {at})",
            (PREFIX + key, json.dumps(VALID), version, fence),
        )
    check_mutex_on(cache, key)
    cache.close()


@settings(HOSTILE, max_examples=30)
@given(values=st.lists(hostile_values, min_size=1, max_size=3))
def test_the_cli_lists_hostile_records_without_a_traceback(admin_redis: redis.Redis, values):
    """``simple-mutex list`` over a prefix holding hostile records: exit code 0 (it lists
    what it can read) or 2 with a one-line error naming the key, never an exception."""
    prefix = f"c{uuid.uuid4().hex[:8]}."
    cache = RedisCache(admin_redis)
    for n, value in enumerate(values):  # Redis: any bytes, NUL too
        cache.put_if_absent(f"{prefix}k{n}", value, ttl=30)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = simple_mutex_cli.main(["list", REDIS_URL, "--prefix", prefix])
    assert status in (0, 2), (status, err.getvalue()[:300])
    if status:
        assert err.getvalue().count("\n") == 1
        assert "cache holds" in err.getvalue()
    assert "Traceback" not in err.getvalue()
    assert "SIMPLE_MUTEX_PICKLE_LOADED" not in os.environ
    for n in range(len(values)):
        admin_redis.delete(f"{{{prefix}k{n}}}", f"{{{prefix}k{n}}}:h", f"{{{prefix}k{n}}}:f")


# -- the key encoder ------------------------------------------------------------------------

every_character = st.characters(codec=None, categories=None)  # surrogates, controls...
keys = st.one_of(
    st.text(every_character, min_size=1, max_size=60),
    st.text(st.sampled_from("{}#:%~/\\*?[] .\x00\n"), min_size=1, max_size=30),  # separators
    st.text(every_character, min_size=1, max_size=30).map(lambda s: (s * 10_000)[:10_000]),
)
# A lock takes keys up to MAX_USER_KEY characters (longer ones are refused up front); the
# encoder below it is still tested past that, on any length.
lock_keys = keys.map(lambda key: key[:MAX_USER_KEY])


@settings(max_examples=100, deadline=None)
@given(pair=st.tuples(keys, keys))
def test_the_key_encoder_keeps_keys_apart_and_bounded(pair: tuple[str, str]) -> None:
    """Each key encodes to plain characters within MAX_KEY_CHARS, the same way every
    time, decodes back unless hashed, and two different keys never share an encoding."""
    a, b = pair
    for key in pair:
        encoded = encode_key(key)
        assert encoded == encode_key(key)
        assert len(encoded) <= MAX_KEY_CHARS + 1  # a hashed key: 136 + "~" + 64 hex
        assert encoded.isascii()
        assert not set(encoded) & set("{}#/\\*?[] \x00\n")  # no Redis tag, slot, glob
        assert decode_key(encoded) == (None if is_hashed(encoded) else key)
    if a != b:
        assert encode_key(a) != encode_key(b)


@settings(HOSTILE, max_examples=40)
@given(key=lock_keys)
def test_any_key_locks_on_redis_and_disk_and_comes_back_verbatim(key: str, tmp_path: Path) -> None:
    """A lock on any key is granted, shown by holder() and listed by the CLI's scan with
    the key verbatim, and released, on Redis and on disk."""
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    for cache in (RedisCache(client), DiskCache(tmp_path / "keys")):
        locks = Mutex(cache, lease=30, prefix=PREFIX)
        lease = locks.acquire(key, timeout=0)
        assert lease.key == key
        assert locks.holder(key) is not None
        assert lease.release()
    client.close()
