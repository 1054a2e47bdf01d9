"""PostgresCache against the real PostgreSQL at POSTGRES_URL
(default postgresql://postgres@127.0.0.1:5432/test).

Every table this module writes is named ``t<random>_...`` and dropped at the end; nothing
else in the database is touched. If the server does not answer, the tests fail: they
never skip. The restart test stops and starts the local cluster with ``pg_ctlcluster``
(and starts it again in a ``finally``, whatever happened).

Child processes are forked (the target functions live here) and build their own caches;
times are ``time.monotonic()``, one clock (CLOCK_MONOTONIC) for every process.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from contract import CacheContract, unique_key
from psycopg_pool import ConnectionPool

from simple_mutex import (
    ConstraintError,
    MalfunctionError,
    Mutex,
    Semaphore,
    SimpleCacheConditionError,
    SimpleMutexLeaseExpiredError,
)
from simple_mutex.caches.postgres import PostgresCache, from_url

POSTGRES_URL = os.environ.get("POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
RUN = f"t{uuid.uuid4().hex[:8]}"
TABLE = f"{RUN}_locks"
FORK = multiprocessing.get_context("fork")
POLL_INTERVAL = 5.0  # a notified waiter runs well before its poll would
WAKE_BOUND = 1.0


def connect() -> psycopg.Connection[Any]:
    return psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3)


@pytest.fixture(scope="module")
def admin() -> Iterator[psycopg.Connection[Any]]:
    """A connection to the server; fails (never skips) when it does not answer. Drops
    every table of this run at the end."""
    try:
        conn = connect()
    except psycopg.Error as exc:
        pytest.fail(
            f"no PostgreSQL answers at {POSTGRES_URL} ({exc}); start one (pg_ctlcluster "
            "--skip-systemctl-redirect 15 main start) or point POSTGRES_URL at one"
        )
    yield conn
    conn = _reconnect_after_restart(conn)
    rows = conn.execute(
        "SELECT tablename FROM pg_tables WHERE tablename LIKE %s", (RUN + "%",)
    ).fetchall()
    for (name,) in rows:
        conn.execute(f'DROP TABLE "{name}"')
    conn.close()


def _reconnect_after_restart(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    try:
        conn.execute("SELECT 1")
        return conn
    except psycopg.Error:
        return connect()


@pytest.fixture
def cache(admin: psycopg.Connection[Any]) -> Iterator[PostgresCache]:
    cache = PostgresCache(POSTGRES_URL, table=TABLE)
    yield cache
    _close(cache)


def _close(cache: PostgresCache) -> None:
    for conn in (cache._conn, cache._listener):
        if conn is not None:
            conn.close()


@pytest.fixture
def mutex(cache: PostgresCache) -> Mutex:
    return Mutex(cache, lease=30, interval=POLL_INTERVAL)


class TestPostgresCacheContract(CacheContract):
    """The shared contract, on a cache that opens its own connection."""

    @pytest.fixture
    def cache(self, admin: psycopg.Connection[Any]) -> Iterator[PostgresCache]:
        cache = PostgresCache(POSTGRES_URL, table=TABLE)
        yield cache
        _close(cache)


class TestPostgresCacheContractOnGivenConnection(CacheContract):
    """...on an autocommit psycopg connection the caller passes."""

    @pytest.fixture
    def cache(self, admin: psycopg.Connection[Any]) -> Iterator[PostgresCache]:
        conn = connect()
        cache = PostgresCache(conn, table=TABLE)
        yield cache
        _close(cache)
        conn.close()


class TestPostgresCacheContractOnPool(CacheContract):
    """...on a psycopg_pool ConnectionPool (transactional connections, a new table)."""

    @pytest.fixture
    def cache(self, admin: psycopg.Connection[Any]) -> Iterator[PostgresCache]:
        with ConnectionPool(POSTGRES_URL, min_size=1, max_size=2, open=True) as pool:
            cache = PostgresCache(pool, table=f"{RUN}_pool")
            yield cache
            _close(cache)


# -- layout, clock, construction -----------------------------------------------------------


def test_a_freed_row_stays_with_its_fence(cache: PostgresCache, admin):
    """Release sets value NULL and keeps the row, so the fence counts on."""
    key = unique_key()
    for _ in range(3):
        entry = cache.put_if_absent(key, "v", ttl=30)
        cache.compare_and_delete(key, version=entry.version)
    row = admin.execute(f'SELECT value, fence FROM "{TABLE}" WHERE key = %s', (key,)).fetchone()
    assert row == (None, 3)


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


def test_a_retried_put_returns_our_entry_even_after_a_renewal(cache: PostgresCache):
    key = unique_key()
    first = cache.put_if_absent(key, "ours", ttl=30)
    renewed = cache.compare_and_set(key, "ours", ttl=60, version=first.version)
    assert cache.put_if_absent(key, "ours", ttl=30) == renewed
    cache.compare_and_delete(key, version=renewed.version)
    assert cache.put_if_absent(key, "ours", ttl=30).fence == first.fence + 1


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
    _close(cache)


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
        _close(cache)
    finally:
        admin.execute(f'DROP TABLE "{table}"')
        admin.execute(f'DROP OWNED BY "{role}"')
        admin.execute(f'DROP ROLE "{role}"')


def test_a_driver_error_is_a_malfunction_naming_postgres_the_operation_and_key(admin):
    """A table of another shape: psycopg's error becomes MalfunctionError."""
    table = f"{RUN}_wrong"
    admin.execute(f'CREATE TABLE "{table}" (key text PRIMARY KEY)')
    cache = PostgresCache(POSTGRES_URL, table=table)
    with pytest.raises(MalfunctionError) as info:
        cache.put_if_absent("the-key", "v", ttl=30)
    assert "postgres cache failed during put_if_absent on 'the-key'" in str(info.value)
    assert info.value.key == "the-key"
    assert not isinstance(info.value, psycopg.Error)
    _close(cache)


@pytest.mark.parametrize("given", [False, True], ids=["own", "given-connection"])
def test_a_broken_connection_is_replaced_on_the_next_call(admin, given: bool):
    """The server ends our session: that call raises MalfunctionError, the next one runs
    on a fresh connection (for a connection the caller passed too)."""
    conn = connect() if given else None
    cache = PostgresCache(conn if given else POSTGRES_URL, table=TABLE)
    key = unique_key()
    entry = cache.put_if_absent(key, "v", ttl=30)
    assert cache._conn is not None
    admin.execute("SELECT pg_terminate_backend(%s)", (cache._conn.info.backend_pid,))
    with pytest.raises(MalfunctionError, match="during get on"):
        cache.get(key)
    assert cache.get(key) == entry
    cache.compare_and_delete(key, version=entry.version)
    _close(cache)


def test_no_server_is_a_prompt_malfunction():
    """Nothing listens: every operation raises MalfunctionError, quickly."""
    cache = PostgresCache("postgresql://postgres@127.0.0.1:1/test")
    start = time.monotonic()
    for call in (lambda: cache.get("k"), lambda: cache.wait(["k"], 0.5)):
        with pytest.raises(MalfunctionError, match="postgres cache failed"):
            call()
    assert time.monotonic() - start < 2


def test_importing_simple_mutex_does_not_import_psycopg():
    code = "import sys, simple_mutex, simple_mutex.caches; sys.exit('psycopg' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# -- waiting -------------------------------------------------------------------------------


def test_release_wakes_a_waiter_by_notify_not_the_poll(mutex: Mutex):
    """A waiter blocked in acquire (poll 5 s) gets the lock well under 1 s after release."""
    key = unique_key()
    lease = mutex.acquire(key)
    got: list[float] = []

    def waiter() -> None:
        other = Mutex(PostgresCache(POSTGRES_URL, table=TABLE), interval=POLL_INTERVAL)
        taken = other.acquire(key, timeout=POLL_INTERVAL * 2)
        got.append(time.monotonic())
        taken.release()
        _close(other.cache)  # type: ignore[arg-type]

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.5)  # the waiter failed its put and listens
    released = time.monotonic()
    lease.release()
    thread.join(POLL_INTERVAL * 2)
    assert got, "waiter never acquired"
    assert got[0] - released < WAKE_BOUND


def test_a_release_just_before_the_wait_is_not_missed(cache: PostgresCache):
    """The lost wake-up race: the release lands between the waiter's failed put and its
    LISTEN. The check after LISTEN sees the key free, so wait() returns at once."""
    key = unique_key()
    entry = cache.put_if_absent(key, "holder", ttl=30)
    with pytest.raises(SimpleCacheConditionError):
        cache.put_if_absent(key, "waiter", ttl=30)
    other = PostgresCache(POSTGRES_URL, table=TABLE)
    other.compare_and_delete(key, version=entry.version)
    start = time.monotonic()
    cache.wait([key], 2.0)
    assert time.monotonic() - start < 0.5
    _close(other)


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
    _close(other)


def test_a_stale_holders_release_and_renew_are_refused(cache: PostgresCache):
    key = unique_key()
    short = Mutex(cache, lease=0.3, interval=0.05)
    stale = short.acquire(key)
    time.sleep(0.45)
    fresh = Mutex(cache, lease=30).acquire(key, timeout=1)
    assert fresh.fence > stale.fence
    assert stale.release() is False
    with pytest.raises(SimpleMutexLeaseExpiredError):
        stale.renew()
    holder = short.holder(key)
    assert holder is not None
    assert holder.fence == fresh.fence
    assert fresh.release() is True


def test_semaphore_hand_off_wakes_a_waiter_on_any_slot(cache: PostgresCache):
    """Two permits held, a third waiter listens on both slots' channels; releasing
    either lets it in at once, with a larger fence than that slot's last holder."""
    key = unique_key()
    semaphore = Semaphore(cache, permits=2, lease=30, interval=POLL_INTERVAL)
    leases = [semaphore.acquire(key, timeout=0) for _ in range(2)]
    got: list[Any] = []

    def waiter() -> None:
        other = Semaphore(
            PostgresCache(POSTGRES_URL, table=TABLE), permits=2, interval=POLL_INTERVAL
        )
        got.append((other.acquire(key, timeout=4), time.monotonic()))
        _close(other.cache)  # type: ignore[arg-type]

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.5)
    released = time.monotonic()
    leases[1].release()
    thread.join(5)
    third, at = got[0]
    assert at - released < WAKE_BOUND
    assert third.slot == leases[1].slot
    assert third.fence > leases[1].fence  # fences count per slot row, as in DiskCache
    assert third.release()
    assert leases[0].release()


# -- processes and the server going away (slow) ---------------------------------------------


def _contend(key: str, iterations: int, counter: str, log: str) -> None:
    """Child: read-modify-write a counter file under the lock, logging each hold."""
    mutex = Mutex(PostgresCache(POSTGRES_URL, table=TABLE), lease=30, interval=POLL_INTERVAL)
    lines = []
    for _ in range(iterations):
        with mutex.acquire(key, timeout=30) as lease:
            start = time.monotonic()
            value = int(Path(counter).read_text() or 0)
            time.sleep(0.001)
            Path(counter).write_text(str(value + 1))
            end = time.monotonic()
        lines.append(json.dumps([os.getpid(), start, end, lease.fence]) + "\n")
    Path(log).write_text("".join(lines))


@pytest.mark.slow
def test_processes_exclude_each_other(admin, tmp_path: Path):
    """Six processes x 25 read-modify-write increments: exact count, no two holds overlap,
    fences strictly increase in the order the holds happened."""
    key, counter = unique_key(), tmp_path / "counter"
    counter.write_text("0")
    procs = [
        FORK.Process(target=_contend, args=(key, 25, str(counter), str(tmp_path / f"log{n}")))
        for n in range(6)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
    assert [proc.exitcode for proc in procs] == [0] * 6
    assert counter.read_text() == "150"
    holds = [json.loads(line) for n in range(6) for line in (tmp_path / f"log{n}").open()]
    holds.sort(key=lambda row: row[1])
    assert len(holds) == 150
    for before, after in itertools.pairwise(holds):
        assert before[2] <= after[1], f"overlapping holds: {before} and {after}"
        assert before[3] < after[3]


def _first_use(table: str, barrier: Any) -> None:
    cache = PostgresCache(POSTGRES_URL, table=table)
    barrier.wait(10)
    Mutex(cache, lease=30, interval=POLL_INTERVAL).acquire("k", timeout=10).release()


@pytest.mark.slow
def test_processes_creating_the_table_at_once_all_succeed(admin):
    """CREATE TABLE IF NOT EXISTS racing in several sessions can fail on pg_type's unique
    index; the loser carries on with the winner's table."""
    table = f"{RUN}_race"
    barrier = FORK.Barrier(6)
    procs = [FORK.Process(target=_first_use, args=(table, barrier)) for _ in range(6)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(30)
    assert [proc.exitcode for proc in procs] == [0] * 6
    assert admin.execute(f'SELECT fence FROM "{table}"').fetchone() == (6,)  # one row, 6 grants


def _hold_forever(key: str, lease: float, report: str) -> None:
    held = Mutex(PostgresCache(POSTGRES_URL, table=TABLE), lease=lease).acquire(key)
    Path(report + ".tmp").write_text(json.dumps([held.fence, time.monotonic()]))
    os.replace(report + ".tmp", report)
    time.sleep(3600)


@pytest.mark.slow
def test_a_sigkilled_holders_lock_is_taken_over_after_its_lease(mutex: Mutex, tmp_path: Path):
    """The holder dies without releasing: nobody gets in before its lease ends; the next
    holder gets in soon after, with a larger fence."""
    key, report, lease = unique_key(), str(tmp_path / "report"), 1.0
    proc = FORK.Process(target=_hold_forever, args=(key, lease, report))
    proc.start()
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(report):
            assert time.monotonic() < deadline, "holder never reported"
            time.sleep(0.01)
        fence, granted = json.loads(Path(report).read_text())
        assert mutex.holder(key).pid == proc.pid  # type: ignore[union-attr]
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)
    taker = Mutex(mutex.cache, lease=30, interval=0.05)
    taken = taker.acquire(key, timeout=5)
    at = time.monotonic()
    assert at >= granted + lease - 0.05
    assert at < granted + lease + 0.5
    assert taken.fence > fence
    assert taken.release()


def _cluster(action: str) -> None:
    version = sorted(os.listdir("/etc/postgresql"))[-1]
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", action],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip


def _wait_until_up(timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            connect().close()
            return
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.mark.slow
def test_server_restart_mid_test(admin):
    """PostgreSQL stops while a lock is held and a waiter blocks: every operation raises
    MalfunctionError (never a psycopg error) by its deadline, and once the server is back
    the same cache works again, the held lock and its fence intact (the table is durable)."""
    cache = PostgresCache(POSTGRES_URL, table=TABLE)
    mutex = Mutex(cache, lease=30, interval=POLL_INTERVAL)
    key = unique_key()
    held = mutex.acquire(key)
    outcome: list[Any] = []

    def waiter() -> None:
        other = Mutex(PostgresCache(POSTGRES_URL, table=TABLE), interval=POLL_INTERVAL)
        start = time.monotonic()
        try:
            other.acquire(key, timeout=3)
        except Exception as exc:  # the type is what the test checks
            outcome.append((exc, time.monotonic() - start))

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.5)  # blocked listening
    try:
        _cluster("stop")
        thread.join(5)
        assert not thread.is_alive(), "waiter hung after the server went away"
        error, took = outcome[0]
        assert isinstance(error, MalfunctionError), repr(error)
        assert error.key == key
        assert took <= 3.5
        for call, operation in [
            (lambda: cache.get("k"), "get"),
            (lambda: cache.put_if_absent("k", "v", ttl=1), "put_if_absent"),
            (lambda: cache.compare_and_set("k", "v", ttl=1, version="x"), "compare_and_set"),
            (lambda: cache.compare_and_delete("k", version="x"), "compare_and_delete"),
            (lambda: cache.wait(["k"], 0.1), "wait"),
        ]:
            start = time.monotonic()
            with pytest.raises(MalfunctionError) as info:
                call()
            assert time.monotonic() - start < 1
            assert not isinstance(info.value, psycopg.Error)
            assert f"postgres cache failed during {operation} on 'k'" in str(info.value)
        start = time.monotonic()
        with pytest.raises(MalfunctionError):
            mutex.acquire("other", timeout=1)
        assert time.monotonic() - start <= 1.5
    finally:
        _cluster("start")
        _wait_until_up()
    with pytest.raises(SimpleCacheConditionError):  # still held: the row survived
        cache.put_if_absent(mutex.prefix + key, "someone else", ttl=30)
    assert held.release()
    again = mutex.acquire(key, timeout=1)
    assert again.fence == held.fence + 1
    assert again.release()
    _close(cache)
