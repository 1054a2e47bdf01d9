"""simple_mutex.fenced against real stores: PostgreSQL (psycopg, SQLAlchemy Core and ORM),
SQLite (SQLAlchemy), Redis, S3 (SeaweedFS). Missing versus stale, equal fences, NULL
fence columns, several rows, injection attempts, bad input, and FencedOutError itself."""

from __future__ import annotations

import pickle
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
import sqlalchemy as sa
from fenced_support import (
    POSTGRES_URL,
    REDIS_URL,
    S3_BUCKET,
    SA_URL,
    drop_table,
    new_table,
    s3_client,
)
from servers import s3_bucket
from sqlalchemy import orm

from simple_mutex import (
    ConstraintTypeError,
    ConstraintValueError,
    FencedOutError,
    MalfunctionError,
    SimpleMutexLeaseExpiredError,
)
from simple_mutex.fenced import (
    fenced_get,
    fenced_put,
    fenced_set,
    fenced_update,
    fenced_upsert,
)

pytestmark = pytest.mark.backends


@pytest.fixture
def conn() -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(POSTGRES_URL, autocommit=True) as c:
        yield c


@pytest.fixture
def table() -> Iterator[str]:
    name = new_table()
    yield name
    drop_table(name)


def rows(conn: psycopg.Connection[Any], table: str) -> list[tuple[Any, ...]]:
    return conn.execute(f'SELECT id, writer, fence FROM "{table}" ORDER BY id').fetchall()


# -- FencedOutError -----------------------------------------------------------------------


def test_fenced_out_error_is_a_lost_lease_that_pickles_with_its_fences():
    """Code that handles a lost lease handles it; .fence/.current/.store survive pickle
    (Celery and RQ pickle errors) and the message names the store and the key."""
    error = FencedOutError.refused("redis", "key 'acct.7'", 5, 9)
    assert isinstance(error, SimpleMutexLeaseExpiredError)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is FencedOutError
    assert (again.fence, again.current, again.store, again.key) == (5, 9, "redis", "key 'acct.7'")
    assert str(again) == str(error)
    for words in ("redis", "acct.7", "fence 9"):
        assert words in str(error)
    import simple_mutex

    assert simple_mutex.FencedOutError is FencedOutError


# -- PostgreSQL through psycopg ----------------------------------------------------------


def test_update_writes_when_not_stale_and_accepts_an_equal_fence(conn, table):
    """NULL counts as fence 0: the first fenced write lands; the same fence again lands
    (one holder writes many times); a larger one lands."""
    assert fenced_update(conn, table, {"id": 1}, {"writer": "a"}, fence=5) == 1
    assert fenced_update(conn, table, {"id": 1}, {"writer": "b"}, fence=5) == 1
    assert fenced_update(conn, table, {"id": 1}, {"writer": "c"}, fence=6) == 1
    assert rows(conn, table) == [(1, "c", 6)]


def test_update_of_a_missing_row_returns_0_and_a_stale_one_raises(conn, table):
    """Missing is not stale: 0 rows. A row holding a larger fence: FencedOutError naming
    both fences, and the row is untouched."""
    assert fenced_update(conn, table, {"id": 99}, {"writer": "x"}, fence=1) == 0
    fenced_update(conn, table, {"id": 1}, {"writer": "new"}, fence=10)
    with pytest.raises(FencedOutError) as info:
        fenced_update(conn, table, {"id": 1}, {"writer": "old"}, fence=9)
    assert (info.value.fence, info.value.current, info.value.store) == (9, 10, "postgresql")
    assert table in str(info.value)
    assert "'id': 1" in str(info.value)
    assert rows(conn, table) == [(1, "new", 10)]


def test_update_of_several_rows_writes_all_or_none(conn, table):
    """A where matching several rows writes every one; when any holds a larger fence, the
    statement writes none of them (the stale holder leaves no partial write)."""
    conn.execute(f"INSERT INTO \"{table}\" VALUES (2, 'nobody', 3), (3, 'nobody', NULL)")
    conn.execute(f"UPDATE \"{table}\" SET writer = 'grp'")
    assert fenced_update(conn, table, {"writer": "grp"}, {"writer": "grp"}, fence=4) == 3
    conn.execute(f'UPDATE "{table}" SET fence = 8 WHERE id = 3')
    with pytest.raises(FencedOutError) as info:
        fenced_update(conn, table, {"writer": "grp"}, {"writer": "late"}, fence=5)
    assert info.value.current == 8
    assert rows(conn, table) == [(1, "grp", 4), (2, "grp", 4), (3, "grp", 8)]


def test_where_none_matches_null(conn, table):
    """None in where is SQL NULL, matched by IS NULL (``= NULL`` would match nothing)."""
    conn.execute(f'UPDATE "{table}" SET writer = NULL')
    assert fenced_update(conn, table, {"writer": None}, {"writer": "set"}, fence=1) == 1


def test_update_inside_a_transaction_commits_with_it(table):
    """On a connection in a transaction, the write is the caller's to commit or roll back."""
    with psycopg.connect(POSTGRES_URL) as c:
        assert fenced_update(c, table, {"id": 1}, {"writer": "rolled back"}, fence=3) == 1
        c.rollback()
        with psycopg.connect(POSTGRES_URL, autocommit=True) as other:
            assert rows(other, table) == [(1, "nobody", None)]


def test_upsert_inserts_updates_and_refuses_a_stale_fence(conn, table):
    """Insert when absent; update on an equal or larger fence; FencedOutError on a lower
    one, with the stored fence, and the row untouched. NULL counts as 0."""
    fenced_upsert(conn, table, {"id": 2}, {"writer": "first"}, fence=4)
    fenced_upsert(conn, table, {"id": 2}, {"writer": "again"}, fence=4)
    fenced_upsert(conn, f"public.{table}", {"id": 1}, {"writer": "over NULL"}, fence=1)
    with pytest.raises(FencedOutError) as info:
        fenced_upsert(conn, table, {"id": 2}, {"writer": "stale"}, fence=3)
    assert (info.value.fence, info.value.current) == (3, 4)
    assert rows(conn, table) == [(1, "over NULL", 1), (2, "again", 4)]


def test_a_schema_qualified_table_and_a_custom_fence_column(conn):
    """'schema.table' is split and quoted part by part; fence_column names the column."""
    schema = f"s_{uuid.uuid4().hex[:8]}"
    conn.execute(f'CREATE SCHEMA "{schema}"')
    try:
        conn.execute(f'CREATE TABLE "{schema}".t (id int PRIMARY KEY, v text, "Epoch" bigint)')
        conn.execute(f"INSERT INTO \"{schema}\".t VALUES (1, 'x', 7)")
        target = f"{schema}.t"
        assert fenced_update(conn, target, {"id": 1}, {"v": "y"}, fence=7, fence_column="Epoch")
        with pytest.raises(FencedOutError):
            fenced_update(conn, target, {"id": 1}, {"v": "z"}, fence=6, fence_column="Epoch")
        assert conn.execute(f'SELECT v FROM "{schema}".t').fetchone() == ("y",)
    finally:
        conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.mark.parametrize(
    "name",
    [
        'x"; DROP TABLE {t}; --',
        "{t} WHERE true; DROP TABLE {t}",
        "{t}%s",
        "{t}'",
    ],
)
def test_injection_in_table_and_column_names_is_quoted(conn, table, name):
    """A hostile table or column name is quoted as one identifier: the statement fails
    (no such relation / column) as a MalfunctionError, and nothing else ran."""
    hostile = name.format(t=table)
    with pytest.raises(MalfunctionError, match="postgresql fenced_update"):
        fenced_update(conn, hostile, {"id": 1}, {"writer": "x"}, fence=1)
    with pytest.raises(MalfunctionError, match="postgresql fenced_update"):
        fenced_update(conn, table, {"id": 1}, {hostile: "x"}, fence=1)
    with pytest.raises(MalfunctionError, match="postgresql fenced_upsert"):
        fenced_upsert(conn, table, {hostile: 1}, {"writer": "x"}, fence=1)
    assert rows(conn, table) == [(1, "nobody", None)]  # the table is still there, untouched


def test_a_column_name_with_quotes_and_percent_is_written(conn):
    """Odd but legal names work, quoted: a '%' is not taken for a placeholder."""
    name = f"odd_{uuid.uuid4().hex[:8]}"
    conn.execute(f'CREATE TABLE "{name}" (id int PRIMARY KEY, "we""ird %s" text, fence bigint)')
    try:
        conn.execute(f"INSERT INTO \"{name}\" VALUES (1, 'a', 1)")
        assert fenced_update(conn, name, {"id": 1}, {'we"ird %s': "b"}, fence=2) == 1
        assert conn.execute(f'SELECT "we""ird %s" FROM "{name}"').fetchone() == ("b",)
    finally:
        conn.execute(f'DROP TABLE "{name}"')


U, P = fenced_update, fenced_upsert  # short, for the table below


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda c, t: U(c, t, {"id": 1}, {}, fence="7"), ConstraintTypeError, "lease.fence"),
        (lambda c, t: U(c, t, {"id": 1}, {}, fence=True), ConstraintTypeError, "int"),
        (lambda c, t: U(c, t, {"id": 1}, {}, fence=-1), ConstraintValueError, "2**63"),
        (lambda c, t: U(c, t, {"id": 1}, {}, fence=2**63), ConstraintValueError, "2**63"),
        (lambda c, t: U(c, t, {}, {"writer": 1}, fence=1), ConstraintValueError, "whole table"),
        (lambda c, t: U(c, t, [("id", 1)], {}, fence=1), ConstraintTypeError, "mapping"),
        (lambda c, t: U(c, t, {"id": 1}, {"fence": 3}, fence=1), ConstraintValueError, "fence="),
        (lambda c, t: U(c, t, {"": 1}, {}, fence=1), ConstraintValueError, "non-empty"),
        (lambda c, t: U(c, "a.b.c", {"id": 1}, {}, fence=1), ConstraintValueError, "schema.table"),
        (lambda c, t: U(c, 7, {"id": 1}, {}, fence=1), ConstraintTypeError, "table name"),
        (lambda c, t: U(object(), t, {"id": 1}, {}, fence=1), ConstraintTypeError, "psycopg"),
        (lambda c, t: P(c, t, {"id": None}, {}, fence=1), ConstraintValueError, "NULL"),
        (lambda c, t: P(c, t, {"id": 1}, {"id": 2}, fence=1), ConstraintValueError, "key only"),
    ],
)  # fmt: skip
def test_bad_input_names_the_fix(conn, table, call, error, words):
    """Bad arguments raise ConstraintValueError / ConstraintTypeError before any I/O."""
    with pytest.raises(error, match=words.replace("*", r"\*").replace(".", r"\.")):
        call(conn, table)
    assert rows(conn, table) == [(1, "nobody", None)]


def test_an_async_connection_is_refused(table):
    """An AsyncConnection would hand back coroutines: refused up front, naming the fix."""
    import asyncio

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(POSTGRES_URL) as aconn:
            with pytest.raises(ConstraintTypeError, match=r"blocking psycopg\.Connection"):
                fenced_update(aconn, table, {"id": 1}, {"writer": "x"}, fence=1)

    asyncio.run(main())


def test_a_down_server_is_a_malfunction(table):
    """A driver failure is a MalfunctionError naming the backend and the operation."""
    c = psycopg.connect(POSTGRES_URL, autocommit=True)
    c.close()
    with pytest.raises(MalfunctionError, match="postgresql fenced_update"):
        fenced_update(c, table, {"id": 1}, {"writer": "x"}, fence=1)


# -- SQLAlchemy: Core (Engine, Connection), ORM (Session, mapped class), SQLite ----------


class Base(orm.DeclarativeBase):
    pass


def mapped(table_name: str) -> type[Any]:
    return type(
        f"Row_{table_name}", (Base,),
        {"__tablename__": table_name, "id": orm.mapped_column(sa.Integer, primary_key=True),
         "writer": orm.mapped_column(sa.Text), "fence": orm.mapped_column(sa.BigInteger)},
    )  # fmt: skip


@pytest.fixture(scope="module")
def engine() -> Iterator[sa.Engine]:
    e = sa.create_engine(SA_URL)
    yield e
    e.dispose()


def test_sqlalchemy_core_engine_and_connection(engine, conn, table):
    """An Engine commits its own transaction; a Connection writes in the caller's."""
    t = sa.Table(table, sa.MetaData(), autoload_with=engine)
    assert fenced_update(engine, t, {"id": 1}, {"writer": "engine"}, fence=2) == 1
    with engine.connect() as c:
        assert fenced_update(c, table, {"id": 1}, {"writer": "conn"}, fence=3) == 1
        with pytest.raises(FencedOutError) as info:
            fenced_update(c, t, {"id": 1}, {"writer": "stale"}, fence=2)
        assert info.value.current == 3
        assert fenced_update(c, t, {"id": 5}, {"writer": "none"}, fence=9) == 0
        fenced_upsert(c, t, {"id": 5}, {"writer": "ins"}, fence=9)
        c.commit()
    assert rows(conn, table) == [(1, "conn", 3), (5, "ins", 9)]
    with pytest.raises(ConstraintValueError, match="no column"):
        fenced_update(engine, t, {"id": 1}, {"nope": 1}, fence=4)


def test_sqlalchemy_orm_session_and_mapped_class(engine, conn, table):
    """A Session writes in its transaction; a FencedOutError inside session.begin()
    rolls the whole unit of work back."""
    row_class = mapped(table)
    with orm.Session(engine) as session, session.begin():
        assert fenced_update(session, row_class, {"id": 1}, {"writer": "orm"}, fence=4) == 1
        fenced_upsert(session, row_class, {"id": 2}, {"writer": "orm2"}, fence=4)
    with orm.Session(engine) as session:  # noqa: SIM117 (raises must sit inside the session)
        with pytest.raises(FencedOutError), session.begin():  # noqa: PT012 (the unit of work)
            session.add(row_class(id=3, writer="side effect", fence=None))
            session.flush()
            fenced_update(session, row_class, {"id": 1}, {"writer": "stale"}, fence=3)
    assert rows(conn, table) == [(1, "orm", 4), (2, "orm2", 4)]


def test_sqlalchemy_sqlite_two_statements_under_its_write_lock(tmp_path: Path):
    """SQLite: the same rules (missing 0, stale raises, equal accepted, NULL is 0,
    all-or-none) through its two statements in one transaction."""
    e = sa.create_engine(f"sqlite:///{tmp_path / 'f.db'}")
    with e.begin() as c:
        c.exec_driver_sql("CREATE TABLE t (id INTEGER PRIMARY KEY, g TEXT, v TEXT, fence INTEGER)")
        c.exec_driver_sql("INSERT INTO t VALUES (1, 'g', 'a', NULL), (2, 'g', 'b', 5)")
    assert fenced_update(e, "t", {"id": 9}, {"v": "x"}, fence=1) == 0
    assert fenced_update(e, "t", {"id": 1}, {"v": "x"}, fence=1) == 1
    assert fenced_update(e, "t", {"id": 1}, {"v": "y"}, fence=1) == 1
    with pytest.raises(FencedOutError) as info:
        fenced_update(e, "t", {"g": "g"}, {"v": "late"}, fence=4)
    assert (info.value.current, info.value.store) == (5, "sqlite")
    fenced_upsert(e, "t", {"id": 3}, {"g": "h", "v": "new"}, fence=2)
    with pytest.raises(FencedOutError):
        fenced_upsert(e, "t", {"id": 2}, {"v": "stale"}, fence=4)
    with e.connect() as c:
        got = c.exec_driver_sql("SELECT id, v, fence FROM t ORDER BY id").fetchall()
    assert [tuple(r) for r in got] == [(1, "y", 1), (2, "b", 5), (3, "new", 2)]


# -- Redis ---------------------------------------------------------------------------------


@pytest.fixture
def rkey() -> Iterator[str]:
    k = f"fenced.{uuid.uuid4().hex[:10]}"
    yield k
    redis.Redis.from_url(REDIS_URL).delete(k)


def test_redis_set_get_equal_stale_and_ttl(rkey):
    """Missing reads (None, None); the pair is written and read back; an equal fence is
    accepted, a lower one refused with the stored fence; a ttl expires the pair."""
    client = redis.Redis.from_url(REDIS_URL)
    assert fenced_get(client, rkey) == (None, None)
    fenced_set(client, rkey, b"one", fence=10)
    fenced_set(client, rkey, "two", fence=10)
    assert fenced_get(client, rkey) == (b"two", 10)
    with pytest.raises(FencedOutError) as info:
        fenced_set(client, rkey, b"stale", fence=9)
    assert (info.value.fence, info.value.current, info.value.store) == (9, 10, "redis")
    assert rkey in str(info.value)
    assert fenced_get(redis.Redis.from_url(REDIS_URL, decode_responses=True), rkey) == (b"two", 10)
    fenced_set(client, rkey, b"short", fence=11, ttl={"milliseconds": 200})
    assert 0 < client.pttl(rkey) <= 200
    fenced_set(client, rkey, b"kept", fence=11)
    assert client.pttl(rkey) == -1  # no ttl: the fence is kept for good


def test_redis_fences_compare_exactly_beyond_doubles(rkey):
    """Fences past 2**53 (where Lua's doubles lose digits) still compare exactly."""
    client = redis.Redis.from_url(REDIS_URL)
    fenced_set(client, rkey, b"big", fence=2**53 + 1)
    with pytest.raises(FencedOutError):
        fenced_set(client, rkey, b"equal as doubles", fence=2**53)
    fenced_set(client, rkey, b"max", fence=2**63 - 1)
    with pytest.raises(FencedOutError):
        fenced_set(client, rkey, b"one less", fence=2**63 - 2)
    with pytest.raises(FencedOutError):
        fenced_set(client, rkey, b"shorter", fence=9)
    assert fenced_get(client, rkey) == (b"max", 2**63 - 1)


def test_redis_bad_input_and_wrong_type(rkey):
    client = redis.Redis.from_url(REDIS_URL)
    with pytest.raises(ConstraintTypeError, match="serialize"):
        fenced_set(client, rkey, {"a": 1}, fence=1)
    with pytest.raises(ConstraintValueError, match="ttl"):
        fenced_set(client, rkey, b"x", fence=1, ttl=-1)
    client.set(rkey, "a plain string")
    with pytest.raises(MalfunctionError, match="redis fenced_set"):
        fenced_set(client, rkey, b"x", fence=1)


# -- S3 (SeaweedFS) -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_endpoint(seaweed: str) -> str:
    """The session's SeaweedFS, with the fenced suites' bucket."""
    s3_bucket(seaweed, S3_BUCKET)
    return seaweed


def test_s3_put_new_equal_stale_and_an_object_from_before_fences(s3_endpoint):
    """A new object is created (If-None-Match: *); an equal fence replaces it; a lower one
    is refused with the stored fence; an object without fence metadata counts as 0."""
    s3 = s3_client(s3_endpoint)
    key = f"o/{uuid.uuid4().hex}"
    fenced_put(s3, S3_BUCKET, key, b"one", fence=5)
    fenced_put(s3, S3_BUCKET, key, "two", fence=5)
    with pytest.raises(FencedOutError) as info:
        fenced_put(s3, S3_BUCKET, key, b"stale", fence=4)
    assert (info.value.fence, info.value.current, info.value.store) == (4, 5, "s3")
    got = s3.get_object(Bucket=S3_BUCKET, Key=key)
    assert (got["Body"].read(), got["Metadata"]) == (b"two", {"fence": "5"})
    old = f"o/{uuid.uuid4().hex}"
    s3.put_object(Bucket=S3_BUCKET, Key=old, Body=b"legacy")
    fenced_put(s3, S3_BUCKET, old, b"fenced", fence=1)
    assert s3.get_object(Bucket=S3_BUCKET, Key=old)["Metadata"] == {"fence": "1"}
    with open(__file__, "rb") as stream, pytest.raises(ConstraintTypeError, match="bytes"):
        fenced_put(s3, S3_BUCKET, old, stream, fence=2)


def test_s3_a_lost_race_is_retried_and_judged_again(s3_endpoint):
    """A writer that lands between our HEAD and our PUT makes the PUT fail 412: we read
    again; its larger fence then refuses us, its smaller one lets our retry land."""
    real = s3_client(s3_endpoint)
    key = f"o/{uuid.uuid4().hex}"
    fenced_put(real, S3_BUCKET, key, b"base", fence=1)

    class Intruder:
        """Writes with ``fence`` once, right after our first HEAD."""

        def __init__(self, fence: int) -> None:
            self.fence, self.heads = fence, 0

        def head_object(self, **kw: Any) -> Any:
            head = real.head_object(**kw)
            self.heads += 1
            if self.heads == 1:
                real.put_object(Bucket=S3_BUCKET, Key=key, Body=f"intruder {self.fence}".encode(),
                                Metadata={"fence": str(self.fence)})  # fmt: skip
            return head

        def put_object(self, **kw: Any) -> Any:
            return real.put_object(**kw)

    late = Intruder(9)
    with pytest.raises(FencedOutError) as info:
        fenced_put(late, S3_BUCKET, key, b"ours", fence=5)
    assert (late.heads, info.value.current) == (2, 9)
    early = Intruder(3)
    fenced_put(early, S3_BUCKET, key, b"ours", fence=10)
    assert early.heads == 2
    assert real.get_object(Bucket=S3_BUCKET, Key=key)["Body"].read() == b"ours"


def test_redis_cluster_runs_the_script_on_whichever_master_holds_the_key(redis_servers, tmp_path):
    """A three-master Redis Cluster: keys spread over several masters are each written,
    read back and guarded (the value and its fence share one key, so one slot)."""
    from servers import own_cluster

    ports = own_cluster(redis_servers, tmp_path)
    cluster = redis.RedisCluster(host="127.0.0.1", port=ports[0], socket_timeout=5)
    keys = [f"fenced.{n}" for n in range(12)]
    assert len({cluster.get_node_from_key(k).port for k in keys}) > 1
    for key in keys:
        fenced_set(cluster, key, b"v", fence=7)
        assert fenced_get(cluster, key) == (b"v", 7)
        with pytest.raises(FencedOutError):
            fenced_set(cluster, key, b"stale", fence=6)
    cluster.close()


# -- with_simple_mutex: the function's own lease through current_lease() -----------------


def test_a_with_simple_mutex_function_writes_with_its_own_fence(conn, table, tmp_path):
    """Inside a decorated function (sync and async), current_lease() is its lease, so it
    can pass the fence; outside, None again."""
    import asyncio

    from simple_mutex import DiskCache, with_simple_mutex
    from simple_mutex.fenced import current_lease

    locks = DiskCache(tmp_path / "locks")

    @with_simple_mutex(key="account.{account_id}", cache=locks, lease=30)
    def settle(account_id: int, who: str) -> int:
        lease = current_lease()
        assert lease is not None
        assert lease.key == f"account.{account_id}"
        fenced_update(conn, table, {"id": account_id}, {"writer": who}, fence=lease.fence)
        return lease.fence

    @with_simple_mutex(key="account.{account_id}", cache=locks, lease=30)
    async def settle_async(account_id: int, who: str) -> int:
        lease = current_lease()
        assert lease is not None
        fenced_update(conn, table, {"id": account_id}, {"writer": who}, fence=lease.fence)
        return lease.fence

    first = settle(1, "sync")
    assert rows(conn, table) == [(1, "sync", first)]
    second = asyncio.run(settle_async(1, "async"))
    assert second > first
    assert rows(conn, table) == [(1, "async", second)]
    assert current_lease() is None
