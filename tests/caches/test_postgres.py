"""PostgresCache against the real PostgreSQL at POSTGRES_URL
(default postgresql://postgres@127.0.0.1:5432/test): the contract, the behaviour suite,
and what is PostgreSQL's own (rows, clock, roles, notifications, connections).

Every table this module writes is named ``t<random>_...`` and dropped at the end; nothing
else in the database is touched. If the server does not answer, the tests fail: they
never skip. The restart test stops and starts a cluster of its own, never the shared one.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

import procs
import psycopg
import pytest
from alarms import Alarm
from behaviour import NotifyBehaviour, SharedBehaviour, assert_each_fails
from contract import CacheContract, ContractSmoke, NotifyContract, NotifySmoke, unique_key
from psycopg_pool import ConnectionPool
from servers import PostgresServer, free_port

from simple_mutex import (
    ConstraintError,
    MalfunctionError,
    Mutex,
    SimpleCacheConditionError,
)
from simple_mutex.caches.postgres import PostgresCache, from_url

pytestmark = pytest.mark.backends

POSTGRES_URL = os.environ.get("POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
RUN = f"t{uuid.uuid4().hex[:8]}"
TABLE = f"{RUN}_locks"
POLL_INTERVAL = 5.0  # a notified waiter runs well before its poll would


def connect() -> psycopg.Connection[Any]:
    return psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3)


def admin_of(run: str) -> Any:
    """The ``admin`` fixture of a module whose tables are named ``run...``: a connection to
    the server (failing, never skipping, when it does not answer) that drops every such
    table at the module's end."""

    @pytest.fixture(scope="module")
    def admin() -> Iterator[psycopg.Connection[Any]]:
        try:
            conn = connect()
        except psycopg.Error as exc:
            pytest.fail(
                f"no PostgreSQL answers at {POSTGRES_URL} ({exc}); start one (pg_ctlcluster "
                "--skip-systemctl-redirect 15 main start) or point POSTGRES_URL at one"
            )
        yield conn
        rows = conn.execute(
            "SELECT tablename FROM pg_tables WHERE tablename LIKE %s", (run + "%",)
        ).fetchall()
        for (name,) in rows:
            conn.execute(f'DROP TABLE "{name}"')
        conn.close()

    return admin


admin = admin_of(RUN)


@pytest.fixture
def cache(admin: psycopg.Connection[Any]) -> Iterator[PostgresCache]:
    cache = PostgresCache(POSTGRES_URL, table=TABLE)
    yield cache
    cache.close()


class TestPostgresCacheContract(NotifyContract, CacheContract):
    """The shared contract (a release NOTIFYs waiters), on a cache that opens its own
    connection."""

    remembers_releases = True  # its freed record (or held mark) names the version freed

    wake_bound = 0.5


class TestPostgresCacheContractOnGivenConnection(NotifySmoke, ContractSmoke):
    """...on an autocommit psycopg connection the caller passes."""

    wake_bound = 0.5

    @pytest.fixture
    def cache(self, admin: psycopg.Connection[Any]) -> Iterator[PostgresCache]:
        conn = connect()
        cache = PostgresCache(conn, table=TABLE)
        yield cache
        cache.close()
        conn.close()


class TestPostgresCacheContractOnPool(NotifySmoke, ContractSmoke):
    """...on a psycopg_pool ConnectionPool (transactional connections, a new table)."""

    wake_bound = 0.5

    @pytest.fixture
    def cache(self, admin: psycopg.Connection[Any]) -> Iterator[PostgresCache]:
        with ConnectionPool(POSTGRES_URL, min_size=1, max_size=2, open=True) as pool:
            cache = PostgresCache(pool, table=f"{RUN}_pool")
            yield cache
            cache.close()


class TestPostgresBehaviour(NotifyBehaviour, SharedBehaviour):
    """The behaviour suite, in a table of this run."""

    @pytest.fixture
    def url(self, admin: psycopg.Connection[Any]) -> str:
        return with_query(POSTGRES_URL, table=TABLE)

    def write_foreign(self, url: str, cache_key: str) -> str:
        """PostgreSQL's typed columns refuse a malformed row, so here the other program
        owns a table of another shape under the lock table's name."""
        table = f"{RUN}_foreign"
        with connect() as conn:
            conn.execute(f'CREATE TABLE "{table}" (key text PRIMARY KEY, payload jsonb)')
            conn.execute(f'INSERT INTO "{table}" VALUES (%s, %s)', (cache_key, "{}"))
        return with_query(POSTGRES_URL, table=table)

    def unreachable_url(self, tmp_path: Path) -> str:
        return f"postgresql://postgres@127.0.0.1:{free_port()}/test?connect_timeout=1"


# -- least privilege: a DML-only role behind a hostile search_path ---------------------------

DML_TABLE = f"{RUN}_dml"
EVIL = f"evil_{RUN}"


@pytest.fixture(scope="module")
def dml_url(admin: psycopg.Connection[Any]) -> Iterator[str]:
    """A role that may only SELECT/INSERT/UPDATE/DELETE the lock table its owner made
    with ``create_schema``, whose search_path puts a hostile schema first: a table of the
    same name (holding a live-looking row for every key) and a clock_timestamp() stuck
    in 1970 (every lock would look expired: granted twice), ahead of pg_catalog."""
    role = f"{RUN}_dml"
    admin.execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        PostgresCache.create_schema(POSTGRES_URL, table=DML_TABLE, grant_to=role)
        admin.execute(f'CREATE SCHEMA "{EVIL}"')
        admin.execute(f'CREATE TABLE "{EVIL}"."{DML_TABLE}" (LIKE public."{DML_TABLE}")')
        admin.execute(
            f'CREATE FUNCTION "{EVIL}".clock_timestamp() RETURNS timestamptz '
            "LANGUAGE sql AS $$ SELECT '1970-01-01'::timestamptz $$"
        )
        admin.execute(f'GRANT USAGE ON SCHEMA "{EVIL}" TO "{role}"')
        admin.execute(f'GRANT ALL ON "{EVIL}"."{DML_TABLE}" TO "{role}"')
        path = quote(f"-c search_path={EVIL},pg_catalog,public")
        parts = urlsplit(POSTGRES_URL)
        host = parts.netloc.rpartition("@")[2]
        yield urlunsplit(parts._replace(netloc=f"{role}@{host}", query=f"options={path}"))
        assert admin.execute(f'SELECT count(*) FROM "{EVIL}"."{DML_TABLE}"').fetchone() == (0,)
    finally:
        admin.execute(f'DROP SCHEMA IF EXISTS "{EVIL}" CASCADE')
        admin.execute(f'DROP TABLE IF EXISTS public."{DML_TABLE}"')
        admin.execute(f'DROP OWNED BY "{role}"')
        admin.execute(f'DROP ROLE "{role}"')


def test_the_hostile_search_path_would_bite_an_unqualified_statement(dml_url: str) -> None:
    """The trap is real: as the DML role, an unqualified table and clock_timestamp() are
    the hostile schema's, and the role may create no table."""
    with psycopg.connect(dml_url, autocommit=True) as conn:
        assert conn.execute("SELECT clock_timestamp()").fetchone()[0].year == 1970  # type: ignore[index]
        schema = conn.execute(
            "SELECT relnamespace::regnamespace::text FROM pg_class WHERE oid = %s::regclass",
            (f'"{DML_TABLE}"',),
        ).fetchone()
        assert schema == (EVIL,)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("CREATE TABLE public.nope (x int)")


class TestPostgresCacheContractAsDmlRole(NotifySmoke, ContractSmoke):
    """The shared contract as the DML-only role behind the hostile search_path."""

    wake_bound = 0.5

    @pytest.fixture
    def cache(self, dml_url: str) -> Iterator[PostgresCache]:
        cache = PostgresCache(dml_url, table=DML_TABLE)
        yield cache
        cache.close()


class TestPostgresBehaviourAsDmlRole(TestPostgresBehaviour):
    """The behaviour suite (processes, killed holders, hand-off) as that role."""

    @pytest.fixture
    def url(self, dml_url: str) -> str:
        return with_query(dml_url, table=DML_TABLE)

    def write_foreign(self, url: str, cache_key: str) -> str:
        """Another program's table of another shape, which the role may read."""
        table = f"{RUN}_foreign_dml"
        with connect() as conn:
            conn.execute(f'CREATE TABLE "{table}" (key text PRIMARY KEY, payload jsonb)')
            conn.execute(f'INSERT INTO "{table}" VALUES (%s, %s)', (cache_key, "{}"))
            conn.execute(f'GRANT SELECT, INSERT, UPDATE, DELETE ON "{table}" TO "{RUN}_dml"')
        return with_query(url, table=table)


def with_query(url: str, **options: str) -> str:
    return url + ("&" if "?" in url else "?") + urlencode(options)


# -- layout, clock, construction -----------------------------------------------------------


def test_a_freed_row_stays_with_its_fence(cache: PostgresCache, admin):
    """Release sets value NULL and keeps the row, so the fence counts on."""
    key = unique_key()
    for _ in range(3):
        entry = cache.put_if_absent(key, "v", ttl=30)
        cache.compare_and_delete(key, version=entry.version)
    row = admin.execute(f'SELECT value, fence FROM "{TABLE}" WHERE key = %s', (key,)).fetchone()
    assert row == (None, entry.fence)


def test_expiry_is_the_servers_clock(cache: PostgresCache, admin):
    """expires_at is the server's clock_timestamp() plus the ttl, and Entry reports it."""
    key = unique_key()
    entry = cache.put_if_absent(key, "v", ttl=20)
    left = admin.execute(
        f'SELECT extract(epoch FROM expires_at - clock_timestamp())::float8 FROM "{TABLE}" '
        "WHERE key = %s",
        (key,),
    ).fetchone()
    assert left is not None
    assert 19 < left[0] <= 20
    server_now = admin.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()
    assert server_now is not None
    assert entry.expires_at == pytest.approx(server_now[0] + left[0], abs=0.05)


def test_constructor_rejects_bad_tables_connections_and_urls():
    for table in ("", "a-b", "x;DROP TABLE y", "s.t", "a" * 64, 3):
        with pytest.raises(ConstraintError, match="plain identifier"):
            PostgresCache(POSTGRES_URL, table=table)  # type: ignore[arg-type]
    conn = psycopg.connect(POSTGRES_URL)  # not autocommit
    with pytest.raises(ConstraintError, match="autocommit"):
        PostgresCache(conn)
    conn.close()
    with pytest.raises(ConstraintError, match="conninfo"):
        PostgresCache(object())
    with pytest.raises(ConstraintError) as info:
        PostgresCache("postgresql://u:s3cret@h/db?bogus_option=1")
    assert "s3cret" not in str(info.value)
    with pytest.raises(ConstraintError, match="scheme"):
        from_url("mysql://h/db")


def test_from_url_takes_the_table_option(admin):
    cache = from_url(POSTGRES_URL + f"?table={RUN}_url&connect_timeout=3")
    assert cache.table == f"{RUN}_url"
    key = unique_key()
    cache.compare_and_delete(key, version=cache.put_if_absent(key, "v", ttl=30).version)
    assert admin.execute(f'SELECT count(*) FROM "{RUN}_url"').fetchone() == (1,)
    cache.close()


def test_a_locked_down_role_uses_a_table_created_beforehand(admin):
    """A role that may not create tables works on the documented table (no CREATE)."""
    role, table = f"{RUN}_role", f"{RUN}_locked"
    admin.execute(
        f'CREATE TABLE "{table}" (key text PRIMARY KEY, value text, version text NOT NULL, '
        "fence bigint NOT NULL, expires_at timestamptz NOT NULL)"
    )
    admin.execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        admin.execute(f'GRANT SELECT, INSERT, UPDATE ON "{table}" TO "{role}"')
        admin.execute(f'REVOKE CREATE ON SCHEMA public FROM "{role}"')
        cache = PostgresCache(f"{POSTGRES_URL}?user={role}", table=table)
        entry = cache.put_if_absent("k", "v", ttl=30)
        cache.compare_and_delete("k", version=entry.version)
        with pytest.raises(MalfunctionError, match="permission denied"):
            PostgresCache(f"{POSTGRES_URL}?user={role}", table=f"{RUN}_nope").get("k")
        cache.close()
    finally:
        admin.execute(f'DROP TABLE "{table}"')
        admin.execute(f'DROP OWNED BY "{role}"')
        admin.execute(f'DROP ROLE "{role}"')


@pytest.mark.parametrize("given", [False, True], ids=["own", "given-connection"])
def test_a_broken_connection_is_replaced_on_the_next_call(admin, given: bool):
    """The server ends our session: the next statement, which never ran, is sent once more
    on a fresh connection and succeeds (for a connection the caller passed too)."""
    conn = connect() if given else None
    cache = PostgresCache(conn if given else POSTGRES_URL, table=TABLE)
    key = unique_key()
    entry = cache.put_if_absent(key, "v", ttl=30)
    assert cache._conn is not None
    ended = cache._conn.info.backend_pid
    admin.execute("SELECT pg_terminate_backend(%s)", (ended,))
    assert cache.get(key) == entry
    assert cache._conn.info.backend_pid != ended
    cache.compare_and_delete(key, version=entry.version)
    cache.close()


def test_a_pooled_session_the_server_ended_is_replaced_on_the_next_call(admin):
    """The server ends the pool's idle session: the next statement, which never ran, is
    sent once more on a fresh session the pool opens, and succeeds."""
    with ConnectionPool(POSTGRES_URL, min_size=1, max_size=1, open=True) as pool:
        cache = PostgresCache(pool, table=TABLE)
        key = unique_key()
        entry = cache.put_if_absent(key, "v", ttl=30)
        with pool.connection() as conn:
            ended = conn.info.backend_pid
        admin.execute("SELECT pg_terminate_backend(%s)", (ended,))
        assert cache.get(key) == entry
        with pool.connection() as conn:
            assert conn.info.backend_pid != ended
        cache.compare_and_delete(key, version=entry.version)
        cache.close()


@pytest.mark.parametrize("pooled", [False, True], ids=["own", "pool"])
def test_a_put_an_alarm_cut_short_never_lands_after_the_clean_up(admin, alarm, pooled: bool):
    """A job timeout lands while the server still runs our put (here its insert waits on
    a table lock another session holds). The cache hangs up; the server would still
    finish the insert, after acquire's clean-up had looked and found nothing, and the key
    stayed held for a whole lease (the alarm test caught it under load). The cache ends
    that server session before its next statement: the key is free once the lock goes."""
    pool = ConnectionPool(POSTGRES_URL, min_size=1, max_size=1, open=True) if pooled else None
    cache = PostgresCache(pool if pool is not None else POSTGRES_URL, table=TABLE)
    mutex = Mutex(cache, lease=60)
    key = unique_key()
    mutex.acquire(key, timeout=0).release()  # the session is open and the table ready
    blocker = connect()
    try:
        with blocker.transaction():
            blocker.execute(f'LOCK TABLE "{TABLE}" IN SHARE ROW EXCLUSIVE MODE')
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            with pytest.raises(Alarm):
                mutex.acquire(key, timeout=5)
        time.sleep(0.3)  # an insert still alive would have landed by now
        assert not mutex.locked(key), "the interrupted put landed after the clean-up"
        mutex.acquire(key, timeout=0).release()  # and the cache still works
    finally:
        blocker.close()
        cache.close()
        if pool is not None:
            pool.close()


# -- waiting -------------------------------------------------------------------------------


def test_a_release_wakes_only_waiters_of_that_key_and_nobody_listens_after(
    cache: PostgresCache,
):
    """Channels are per key: releasing another key does not end the wait; after the wait
    the session listens on nothing (an idle listener would hold back the server's queue)."""
    key, elsewhere = unique_key(), unique_key()
    cache.put_if_absent(key, "holder", ttl=30)
    other = PostgresCache(POSTGRES_URL, table=TABLE)
    entry = other.put_if_absent(elsewhere, "v", ttl=30)
    timer = threading.Timer(0.2, other.compare_and_delete, (elsewhere,), {"version": entry.version})
    timer.start()
    start = time.monotonic()
    cache.wait([key], 0.8)
    assert time.monotonic() - start >= 0.75
    timer.join()
    assert cache._listener is not None
    listening = cache._listener.execute("SELECT count(*) FROM pg_listening_channels()")
    assert listening.fetchone() == (0,)
    other.close()


def test_the_driver_keeps_a_notification_that_arrives_during_a_query():
    """Why psycopg>=3.2.4: ``wait`` LISTENs, then runs its is-a-key-free-already check,
    then reads notifications. A release that commits after the check's snapshot sends its
    notification while the check's reply is still being read; psycopg before 3.2.4 dropped
    such a notification (psycopg#962), and the waiter slept to its timeout with the key
    free (CI on the lower bound: a woken wait took over 0.5 s). Here the notification comes
    from the listening session itself, inside its own query, so the timing is certain."""

    def during_a_query(conn: psycopg.Connection[Any]) -> list[str]:
        conn.execute('LISTEN "during_a_query"')
        conn.execute("SELECT pg_notify('during_a_query', '')").fetchone()
        return [note.channel for note in conn.notifies(timeout=1.0, stop_after=1)]

    async def during_an_async_query() -> list[str]:
        async with await psycopg.AsyncConnection.connect(POSTGRES_URL, autocommit=True) as conn:
            await conn.execute('LISTEN "during_a_query"')
            await (await conn.execute("SELECT pg_notify('during_a_query', '')")).fetchone()
            return [note.channel async for note in conn.notifies(timeout=1.0, stop_after=1)]

    with connect() as conn:
        assert during_a_query(conn) == ["during_a_query"], psycopg.__version__
    assert asyncio.run(during_an_async_query()) == ["during_a_query"], psycopg.__version__


# -- processes and the server going away (slow) ---------------------------------------------
def test_processes_creating_the_table_at_once_all_succeed(admin, children):
    """CREATE TABLE IF NOT EXISTS racing in several sessions can fail on pg_type's unique
    index; the loser carries on with the winner's table."""
    table, barrier = f"{RUN}_race", procs.CTX.Barrier(6)
    url = with_query(POSTGRES_URL, table=table)
    children.extend(procs.start(procs.first_use, url, barrier) for _ in range(6))
    procs.join_all(children, timeout=60)
    assert admin.execute(f'SELECT count(*) FROM "{table}"').fetchone() == (1,)  # one row


@pytest.fixture
def own_server() -> Iterator[PostgresServer]:
    server = PostgresServer()
    server.pg_ctl("start")
    yield server
    server.remove()


def test_server_restart_mid_test(own_server: PostgresServer):
    """PostgreSQL (our own) stops while a lock is held and a waiter blocks: every operation raises
    MalfunctionError (never a psycopg error) by its deadline, and once the server is back
    the same cache works again, the held lock and its fence intact (the table is durable)."""
    cache = PostgresCache(own_server.url)
    mutex = Mutex(cache, lease=30, interval=POLL_INTERVAL)
    key = unique_key()
    held = mutex.acquire(key)
    outcome: list[Any] = []

    def waiter() -> None:
        other = Mutex(PostgresCache(own_server.url), interval=POLL_INTERVAL)
        start = time.monotonic()
        try:
            other.acquire(key, timeout=3)
        except Exception as exc:  # the type is what the test checks
            outcome.append((exc, time.monotonic() - start))

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.5)  # blocked listening
    try:
        own_server.pg_ctl("stop")
        thread.join(5)
        assert not thread.is_alive(), "waiter hung after the server went away"
        error, took = outcome[0]
        assert isinstance(error, MalfunctionError), repr(error)
        assert error.key == key
        assert took <= 3.5
        assert_each_fails(cache, within=1)
        start = time.monotonic()
        with pytest.raises(MalfunctionError):
            mutex.acquire("other", timeout=1)
        assert time.monotonic() - start <= 1.5
    finally:
        own_server.pg_ctl("start")
    with pytest.raises(SimpleCacheConditionError):  # still held: the row survived
        cache.put_if_absent(mutex.prefix + key, "someone else", ttl=30)
    assert held.release()
    again = mutex.acquire(key, timeout=1)
    assert again.fence > held.fence
    assert again.release()
    cache.close()


# A statement_timeout of 1 s: the call's bound is that and a 0.5 s grace (commit_bound),
# then up to the watchdog's 0.1 s poll; "generous" adds seconds for a loaded machine.
SYNC_BOUND = 1.5
GENEROUS = 5.0


def _standby_gone(server: PostgresServer) -> None:
    """The primary now waits for a synchronous standby none streams as: one that is gone,
    or a promoted standby still configured synchronous (its old primary's settings)."""
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
        conn.execute("SELECT pg_reload_conf()")
    # The reload reaches each session by a signal: wait until a new session has the
    # setting (the postmaster has sent the signal), then for open ones to take it.
    deadline = time.monotonic() + 10
    while True:
        with psycopg.connect(server.url, autocommit=True) as conn:
            if conn.execute("SHOW synchronous_standby_names").fetchone() == ("*",):
                break
        assert time.monotonic() < deadline, "the server did not reload its settings"
        time.sleep(0.05)
    time.sleep(0.5)


def _row(server: PostgresServer, key: str) -> tuple[Any, ...] | None:
    with psycopg.connect(server.url, autocommit=True) as conn:
        return conn.execute(
            "SELECT value FROM simple_mutex_locks WHERE key = %s", (key,)
        ).fetchone()


def _timed(call: Any) -> tuple[Any, float]:
    """``call()`` on a thread: what it returned or raised, and how long it took (a call
    that never returns fails the test at GENEROUS seconds instead of hanging it; the
    fixture's stop of the server then ends it)."""
    out: list[Any] = []

    def run() -> None:
        start = time.monotonic()
        try:
            out.append(call())
        except Exception as exc:  # what it raised is what the test checks
            out.append(exc)
        out.append(time.monotonic() - start)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(SYNC_BOUND + GENEROUS)
    assert not thread.is_alive(), "the call waited for the standby past its bound"
    return out[0], out[1]


def test_with_its_synchronous_standby_gone_the_call_that_makes_the_table_ends_in_one_bound(
    own_server: PostgresServer,
) -> None:
    """The first call on a new table creates it (two statements) before its grant: the
    creation waits for no standby, so the call ends within one bound, not three (it
    took 4.5 s for a 1.5 s bound)."""
    _standby_gone(own_server)
    url = f"{own_server.url}?options=-c%20statement_timeout%3D1000"
    mutex = Mutex(PostgresCache(url, table="made_with_its_standby_gone"), lease=30)
    error, took = _timed(lambda: mutex.try_acquire("first"))
    assert isinstance(error, MalfunctionError), repr(error)
    assert "withdrawn" in str(error)
    assert took < 2 * SYNC_BOUND, f"the first call took {took:.2f} s"


def test_with_its_synchronous_standby_gone_every_call_ends_within_its_bound(
    own_server: PostgresServer,
) -> None:
    """A primary whose synchronous standby is gone holds every commit: the statement ran,
    then the commit waits, where statement_timeout no longer counts. The cache cancels it
    at its bound; PostgreSQL answers a success with a WARNING, the write on this server
    only. So a grant is withdrawn and reported (MalfunctionError naming postgres and the
    operation), a renewal does not count, and a release counts (the key is free here)."""
    url = f"{own_server.url}?options=-c%20statement_timeout%3D1000"
    cache = PostgresCache(url)
    assert cache.commit_bound == SYNC_BOUND
    mutex = Mutex(cache, lease=30)
    held = mutex.acquire("held", timeout=5)  # before: the commits are acknowledged
    _standby_gone(own_server)

    error, took = _timed(lambda: mutex.try_acquire("new"))
    assert isinstance(error, MalfunctionError), repr(error)
    assert str(error).startswith("postgres cache: no synchronous standby acknowledged the grant")
    assert "withdrawn" in str(error)
    assert error.key == "new"
    assert took < SYNC_BOUND + GENEROUS
    assert _row(own_server, "mutex.new") == (None,)  # committed locally, then withdrawn

    error, took = _timed(lambda: held.renew(lease=60))
    assert isinstance(error, MalfunctionError), repr(error)
    assert "renewal" in str(error)
    assert took < SYNC_BOUND + GENEROUS

    released, took = _timed(held.release)
    assert released is True, repr(released)  # freed here; a failover may bring it back
    assert took < SYNC_BOUND + GENEROUS
    assert _row(own_server, "mutex.held") == (None,)
