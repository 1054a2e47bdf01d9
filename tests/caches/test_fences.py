"""Fences never go backwards, and state stays bounded, on every tier but Redis (issue 12).

A grant's fence is max(the key's previous fence + 1, the clock in µs), and a freed or
expired key's record is kept only for a window (``gc_after``) before it is collected. Per
tier, against its real server (PostgreSQL at POSTGRES_URL, a secantusd-py of this module's
own whose TTL monitor runs every half second, SeaweedFS), each test here shows:

* a fence after a release, after an expiry, and after the key's record was collected is
  larger than every fence before, and fences sit at the clock (the floor);
* the key's counter lost while the lock is held (a row deleted, a collection dropped, a
  directory replaced, an object deleted, a cache made anew) never restarts its fences;
* where the tier keeps a per-key counter, a counter ahead of the clock still counts on;
* where the library collects (memory, disk, PostgreSQL), 10,000 distinct keys locked and
  released leave a bounded number of records.

Removing the clock floor fails every ``FenceBehaviour`` test (fences restart at 1 once a
record is gone); removing the collection fails the footprint assertions.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import psycopg
import pymongo
import pytest
from servers import OwnServer, free_port, s3_bucket, scripts

from simple_mutex import ConditionalCache, DiskCache, InMemoryCache, Mutex
from simple_mutex.caches._base import clock_fence
from simple_mutex.caches.disk import cache as disk
from simple_mutex.caches.mongo import MongoCache
from simple_mutex.caches.mongo import core as mongo_core
from simple_mutex.caches.postgres import PostgresCache
from simple_mutex.caches.postgres import statements as postgres_core
from simple_mutex.caches.s3 import S3Cache, client_config

pytestmark = pytest.mark.backends

POSTGRES_URL = os.environ.get("POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
RUN = f"f{uuid.uuid4().hex[:8]}"
BUCKET = "simple-mutex-fences"
SHORT = 0.4  # a lease that lapses within the test
MANY = 10_000

NewCache = Callable[..., ConditionalCache]


def new_key() -> str:
    return f"k{uuid.uuid4().hex[:12]}"


def assert_at_the_clock(fence: int) -> None:
    """The floor: a fence is the grant's clock in µs (give or take a few seconds)."""
    assert abs(fence / 1e6 - time.time()) < 5, f"fence {fence} is not the clock in µs"


def assert_growing(fences: list[int]) -> None:
    assert fences == sorted(set(fences)), f"fences went back or repeated: {fences}"


class FenceBehaviour:
    """Every tier. A subclass gives ``new_cache`` (a factory: a fresh, empty lock space
    per call, ``gc_after=`` its window) and the hooks below."""

    window = 0.0
    """The ``gc_after`` the tests pass: how long a freed key's record is kept."""

    @pytest.fixture
    def new_cache(self) -> NewCache:  # pragma: no cover - always overridden
        raise NotImplementedError

    def footprint(self, cache: Any) -> int:  # pragma: no cover
        """How many records the cache's lock space holds."""
        raise NotImplementedError

    def collect(self, cache: Any) -> None:  # pragma: no cover
        """Run (or wait for) the collection of records older than the window."""
        raise NotImplementedError

    def lose(self, cache: Any, cache_key: str) -> Any:  # pragma: no cover
        """Lose the key's record as a fault or an operator would; the cache to go on with."""
        raise NotImplementedError

    def collected(self, cache: Any, within: float = 10.0) -> bool:
        """Collect until the lock space is empty: True once it is, False if a record is
        still there ``within`` seconds on. Called once the window has passed; the record's
        own expiry on the server may lie a little past the holder's deadline (the write's
        trip, longer on a loaded machine), so one pass at the earliest moment may be early."""
        deadline = time.monotonic() + within
        while True:
            self.collect(cache)
            if self.footprint(cache) == 0:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)

    def test_fences_grow_across_releases_and_the_collection_of_the_record(
        self, new_cache: NewCache
    ) -> None:
        """Released again and again, then collected after the window: each fence is
        larger than the one before, and the first is the clock."""
        cache = new_cache(gc_after=self.window)
        mutex, key = Mutex(cache, lease=30), new_key()
        fences = []
        for _ in range(3):
            lease = mutex.acquire(key, timeout=5)
            fences.append(lease.fence)
            assert lease.release()
        assert_at_the_clock(fences[0])
        time.sleep(self.window + 0.05)
        assert self.collected(cache), "the freed key's record outlived its window"
        fences.append(mutex.acquire(key, timeout=5).fence)  # no counter left: the clock
        assert_growing(fences)

    def test_fences_grow_across_expiries_and_the_collection_of_the_record(
        self, new_cache: NewCache
    ) -> None:
        """A lease that lapses is taken over with a larger fence; once the lapsed record is
        collected, the next grant's fence is larger still."""
        cache = new_cache(gc_after=self.window)
        key = new_key()
        first = Mutex(cache, lease=SHORT).acquire(key, timeout=5)
        second = Mutex(cache, lease=SHORT).acquire(key, timeout=5)  # after the lapse
        assert second.expires_at.timestamp() - SHORT >= first.expires_at.timestamp() - 0.05
        time.sleep(max(second.expires_at.timestamp() - time.time(), 0) + self.window + 0.05)
        assert self.collected(cache), "the lapsed key's record outlived its window"
        third = Mutex(cache, lease=30).acquire(key, timeout=5)
        assert_growing([first.fence, second.fence, third.fence])
        assert_at_the_clock(third.fence)

    def test_a_record_lost_while_held_never_restarts_the_fences(self, new_cache: NewCache) -> None:
        """The key's record vanishes under a holder (a restart without persistence, a flush,
        a failover that missed it): the lock is free at once, and its next fence is still
        larger than the lost one."""
        cache = new_cache(gc_after=self.window)
        mutex, key = Mutex(cache, lease=30), new_key()
        before = [mutex.acquire(key, timeout=5).fence]
        time.sleep(0.002)  # a counter lost and regranted within one clock tick is no fault
        cache = self.lose(cache, mutex.prefix + key)
        after = Mutex(cache, lease=30).acquire(key, timeout=0)
        assert_growing([*before, after.fence])


class PerKeyCounter:
    """Tiers that keep a counter per key. ``set_fence`` writes a freed record with the
    given fence, as a clock behind another's (or grants within one µs) would leave it."""

    def set_fence(self, cache: Any, cache_key: str, fence: int) -> None:  # pragma: no cover
        raise NotImplementedError

    def test_a_counter_ahead_of_the_clock_counts_on(self, new_cache: NewCache) -> None:
        """The fence is max(previous + 1, clock): a stored fence an hour ahead of the
        clock is not undercut by it."""
        cache = new_cache()
        mutex, key = Mutex(cache, lease=30), new_key()
        mutex.acquire(key, timeout=5).release()
        ahead = int((time.time() + 3600) * 1e6)
        self.set_fence(cache, mutex.prefix + key, ahead)
        assert mutex.acquire(key, timeout=5).fence == ahead + 1


class CollectedByTheLibrary:
    """Tiers whose records the library itself collects."""

    many_window = 0.2

    def test_many_distinct_keys_leave_bounded_state(self, new_cache: NewCache) -> None:
        """10,000 per-entity keys, each locked and released once: while they run, only the
        keys freed within the window (and a short backlog) keep records, and a while after
        the window only the key still in use does."""
        cache = new_cache(gc_after=self.many_window)
        mutex = Mutex(cache, lease=30)
        peak, start = 0, time.monotonic()
        for i in range(MANY):
            mutex.acquire(f"entity.{i}", timeout=5).release()
            if i % 1000 == 999:
                peak = max(peak, self.footprint(cache))  # type: ignore[attr-defined]
        took = time.monotonic() - start
        time.sleep(self.many_window + 0.05)
        for _ in range(3000):  # about 47 collection passes of up to 256 records each
            mutex.acquire("settle", timeout=5).release()
        left = self.footprint(cache)  # type: ignore[attr-defined]
        print(f"\n{type(self).__name__}: {MANY} keys in {took:.1f} s; at most {peak} records "
              f"during the run (window {self.many_window} s), {left} after it")  # fmt: skip
        assert peak < MANY / 2
        assert left <= 1


# -- InMemoryCache ---------------------------------------------------------------------


class TestMemoryFences(CollectedByTheLibrary, FenceBehaviour):
    """One counter per cache, started at the wall clock; freed keys are dropped, expired
    ones by the sweep every 4096 writes once they are ``gc_after`` old."""

    @pytest.fixture
    def new_cache(self) -> NewCache:
        return lambda gc_after=60.0: InMemoryCache(gc_after=gc_after)

    def footprint(self, cache: Any) -> int:
        return len(cache._entries)

    def collect(self, cache: Any) -> None:
        for _ in range(4096):  # writes enough to run the sweep once
            cache.compare_and_delete("scratch", version=cache.put_if_absent(
                "scratch", "v", ttl=30).version)  # fmt: skip

    def lose(self, cache: Any, cache_key: str) -> Any:
        return InMemoryCache()

    def test_a_new_process_grants_larger_fences(self) -> None:
        """Fences keep growing across process restarts, for a store that outlives them."""
        code = "import simple_mutex as s; print(s.Mutex(s.InMemoryCache()).acquire('k').fence)"
        fences = [Mutex(InMemoryCache()).acquire("k").fence]
        for _ in range(2):
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True)
            fences.append(int(out.stdout))
        assert_growing(fences)


# -- DiskCache -------------------------------------------------------------------------


class TestDiskFences(CollectedByTheLibrary, PerKeyCounter, FenceBehaviour):
    """SQLite rows, collected by the library; a new directory (a tmpfs after a reboot)
    starts from the clock."""

    window = 0.3
    many_window = 0.05  # about 0.1 ms a cycle: some 500 rows freed within it

    @pytest.fixture
    def new_cache(self, tmp_path: Path) -> NewCache:
        dirs = (tmp_path / f"locks{n}" for n in itertools.count())
        return lambda gc_after=60.0: DiskCache(next(dirs), gc_after=gc_after)

    def _sql(self, cache: Any, statement: str, *params: object) -> Any:
        with contextlib.closing(sqlite3.connect(cache.path, isolation_level=None)) as conn:
            return conn.execute(statement, params).fetchall()

    def footprint(self, cache: Any) -> int:
        return int(self._sql(cache, "SELECT count(*) FROM entries")[0][0])

    def collect(self, cache: Any) -> None:
        cache.collect()

    def lose(self, cache: Any, cache_key: str) -> Any:
        directory = cache.path.parent
        shutil.rmtree(directory)
        return DiskCache(directory, gc_after=cache.gc_after)

    def set_fence(self, cache: Any, cache_key: str, fence: int) -> None:
        self._sql(cache, "UPDATE entries SET fence = ? WHERE key = ?", fence, cache_key)

    def test_a_pass_looks_at_1024_rows_from_where_the_last_one_stopped(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The collection walks the keys a slice at a time, from a cursor kept in the
        store, round from the first key after the last: every row is looked at in turn,
        and no pass looks at more than 1024."""
        monkeypatch.setattr(disk, "gc_due", lambda: False)  # only the passes below
        now = [2_000_000_000.0]
        cache = DiskCache(tmp_path / "locks", gc_after=60, clock=lambda: now[0])

        def freed(*keys: str) -> None:
            for key in keys:
                cache.compare_and_delete(key, version=cache.put_if_absent(key, "v", ttl=1).version)

        freed(*(f"k{n:04}" for n in range(2000)))
        now[0] += 61
        assert cache.collect() == 1024  # k0000..k1023
        freed(*(f"a{n:03}" for n in range(100)))  # before the cursor, in key order
        now[0] += 61
        assert cache.collect() == 976 + 48  # k1024..k1999, then round: a000..a047
        assert cache.collect() == 52  # a048..a099: every row looked at, the cursor back
        assert self.footprint(cache) == 0

    def test_a_clock_step_back_within_the_window_still_grows_fences(self, tmp_path: Path):
        """While a freed row is kept, a clock stepped back (less than the window) cannot
        undercut it: the row's counter counts on."""
        now = [2_000_000_000.0]
        cache = DiskCache(tmp_path / "locks", gc_after=60, clock=lambda: now[0])
        first = cache.put_if_absent("k", "v", ttl=30)
        cache.compare_and_delete("k", version=first.version)
        now[0] -= 50
        assert cache.put_if_absent("k", "v", ttl=30).fence == first.fence + 1


# -- PostgreSQL ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def admin() -> Iterator[psycopg.Connection[Any]]:
    """A connection to the shared server; drops every table of this run at the end."""
    try:
        conn = psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3)
    except psycopg.Error as exc:
        pytest.fail(f"no PostgreSQL answers at {POSTGRES_URL}: {exc}")
    yield conn
    rows = conn.execute("SELECT tablename FROM pg_tables WHERE tablename LIKE %s", (RUN + "%",))
    for (name,) in rows.fetchall():
        conn.execute(f'DROP TABLE "{name}"')
    conn.close()


class TestPostgresFences(CollectedByTheLibrary, PerKeyCounter, FenceBehaviour):
    """Rows floored at clock_timestamp(), collected by the library after the window."""

    window = 0.3
    many_window = 0.3

    @pytest.fixture(autouse=True)
    def _admin(self, admin: psycopg.Connection[Any]) -> None:
        self.admin = admin

    @pytest.fixture
    def new_cache(self) -> Iterator[NewCache]:
        made: list[PostgresCache] = []

        def make(gc_after: float = 60.0) -> PostgresCache:
            made.append(PostgresCache(POSTGRES_URL, table=f"{RUN}_{uuid.uuid4().hex[:8]}",
                                      gc_after=gc_after))  # fmt: skip
            return made[-1]

        yield make
        for cache in made:
            cache.close()

    def footprint(self, cache: Any) -> int:
        return int(self.admin.execute(f'SELECT count(*) FROM "{cache.table}"').fetchone()[0])

    def collect(self, cache: Any) -> None:
        cache.collect()

    def lose(self, cache: Any, cache_key: str) -> Any:
        self.admin.execute(f'DELETE FROM "{cache.table}" WHERE key = %s', (cache_key,))
        return cache

    def set_fence(self, cache: Any, cache_key: str, fence: int) -> None:
        self.admin.execute(
            f'UPDATE "{cache.table}" SET fence = %s WHERE key = %s', (fence, cache_key)
        )

    def test_a_table_of_an_earlier_version_is_indexed_and_collected(self, admin, monkeypatch):
        """A table made before collection existed (no index, small fences, freed rows
        stamped with their lease's end) gains the index, has its old rows collected,
        and its keys' fences jump to the clock."""
        monkeypatch.setattr(postgres_core, "gc_due", lambda: False)  # only the passes below
        table = f"{RUN}_old"
        admin.execute(
            f'CREATE TABLE "{table}" (key text PRIMARY KEY, value text, version text NOT NULL, '
            "fence bigint NOT NULL, expires_at timestamptz NOT NULL)"
        )
        admin.execute(
            f"INSERT INTO \"{table}\" SELECT 'mutex.old' || n, NULL, 'v', 6, "
            "now() - interval '1 day' FROM generate_series(1, 300) AS n"
        )
        cache = PostgresCache(POSTGRES_URL, table=table)
        lease = Mutex(cache).acquire("old1", timeout=5)
        assert lease.fence > 6
        assert_at_the_clock(lease.fence)
        assert admin.execute("SELECT to_regclass(%s)", (f"{table}_gc",)).fetchone() != (None,)
        assert cache.collect() == 256  # one bounded pass, the oldest first
        assert cache.collect() == 299 - 256  # the held key stays
        assert self.footprint(cache) == 1
        cache.close()

    def test_a_role_without_delete_keeps_locking_and_is_told_once(self, admin, caplog):
        """The documented GRANT used to omit DELETE: such a role still locks, collects
        nothing, and a warning names the missing grant once."""
        role, table = f"{RUN}_nodelete", f"{RUN}_nodelete"
        owner = PostgresCache(POSTGRES_URL, table=table)
        owner.get("k")  # the table and its index, made by their owner
        owner.close()
        admin.execute(f'CREATE ROLE "{role}" LOGIN')
        try:
            admin.execute(f'GRANT SELECT, INSERT, UPDATE ON "{table}" TO "{role}"')
            cache = PostgresCache(f"{POSTGRES_URL}?user={role}", table=table, gc_after=0)
            with caplog.at_level(logging.WARNING, logger="simple_mutex"):
                for _ in range(3):
                    assert cache.collect() == 0
                mutex = Mutex(cache)
                mutex.acquire("k", timeout=5).release()
            warnings = [r.getMessage() for r in caplog.records if "GRANT DELETE" in r.getMessage()]
            assert len(warnings) == 1
            cache.close()
        finally:
            admin.execute(f'DROP OWNED BY "{role}"')
            admin.execute(f'DROP ROLE "{role}"')


# -- MongoDB ---------------------------------------------------------------------------


def _mongo_answers(url: str) -> bool:
    with pymongo.MongoClient(url, serverSelectionTimeoutMS=300) as probe:
        try:
            return bool(probe.admin.command("ping"))
        except pymongo.errors.PyMongoError:
            return False


# secantusd-py reads ttl_sweep_seconds from its config file but does not pass it on
# (secantusdb 0.7.0b3): the server class takes it directly.
_SECANTUS = """
import sys
import threading
from secantus.server import SecantusDBServer
server = SecantusDBServer("127.0.0.1", int(sys.argv[1]), "data", ttl_sweep_seconds=0.5)
server.start()
server.wait()
"""


@pytest.fixture(scope="module")
def mongo_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """MONGODB_URL, or a secantusdb server of our own whose TTL monitor runs every 0.5 s
    (mongod's and its default: 60 s) so that its collection shows within a test."""
    given = os.environ.get("MONGODB_URL")
    if given:
        yield given
        return
    workdir, port = tmp_path_factory.mktemp("secantus-ttl"), free_port()
    url = f"mongodb://127.0.0.1:{port}/"
    args = [sys.executable, "-c", _SECANTUS, str(port)]
    server = OwnServer(args, workdir, lambda: _mongo_answers(url)).start()
    yield url
    server.stop(grace=0)  # it ignores SIGTERM; its data directory is all it has


class TestMongoFences(PerKeyCounter, FenceBehaviour):
    """Documents floored at $$NOW, collected by the TTL index gc_after after their lease
    ended or they were freed."""

    window = 1.0  # the TTL index counts whole seconds
    clock = "server"

    @pytest.fixture
    def new_cache(self, mongo_url: str) -> Iterator[NewCache]:
        self.client: pymongo.MongoClient[Any] = pymongo.MongoClient(mongo_url)
        database = f"{RUN}_{self.clock}"

        def make(gc_after: float = 86_400.0) -> MongoCache:
            collection = f"c{uuid.uuid4().hex[:8]}"
            return MongoCache(self.client, database=database, collection=collection,
                              clock=self.clock, gc_after=gc_after)  # fmt: skip

        yield make
        self.client.drop_database(database)
        self.client.close()

    def _collection(self, cache: Any) -> Any:
        return self.client[cache.database][cache.collection_name]

    def footprint(self, cache: Any) -> int:
        return int(self._collection(cache).count_documents({}))

    def collect(self, cache: Any) -> None:
        # The server's TTL monitor collects: wait for it (mongod's runs once a minute).
        patience = 150 if os.environ.get("MONGODB_URL") else 15
        deadline = time.monotonic() + patience
        while self.footprint(cache) and time.monotonic() < deadline:
            time.sleep(0.1)

    def lose(self, cache: Any, cache_key: str) -> Any:
        self._collection(cache).drop()
        return cache

    def set_fence(self, cache: Any, cache_key: str, fence: int) -> None:
        self._collection(cache).update_one({"_id": cache_key}, {"$set": {"fence": fence}})


class TestMongoClientClockFences(TestMongoFences):
    """...and with clock="client", whose take-over reaches the max in conditional steps."""

    clock = "client"


# -- S3 --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_client(seaweed: str) -> Any:
    """A client of the session's SeaweedFS (tests/servers.py); the bucket exists."""
    s3_bucket(seaweed, BUCKET)
    return boto3.client(
        "s3", endpoint_url=seaweed, region_name="us-east-1", config=client_config(),
        aws_access_key_id=scripts.S3_ACCESS_KEY, aws_secret_access_key=scripts.S3_SECRET_KEY,
    )  # fmt: skip


class TestS3Fences(PerKeyCounter, FenceBehaviour):
    """Objects floored at the client's clock. Nothing is collected by the library: a
    bucket lifecycle rule deletes objects N days old (docs/guides/s3.md), which ``collect``
    stands for by deleting every object under the prefix."""

    @pytest.fixture
    def new_cache(self, s3_client: Any) -> NewCache:
        self.client = s3_client
        return lambda gc_after=None: S3Cache(s3_client, BUCKET, f"{RUN}/{uuid.uuid4().hex}/")

    def _names(self, cache: Any) -> list[str]:
        listed = self.client.list_objects_v2(Bucket=BUCKET, Prefix=cache.prefix)
        return [item["Key"] for item in listed.get("Contents", [])]

    def footprint(self, cache: Any) -> int:
        return len(self._names(cache))

    def collect(self, cache: Any) -> None:
        for name in self._names(cache):
            self.client.delete_object(Bucket=BUCKET, Key=name)

    def lose(self, cache: Any, cache_key: str) -> Any:
        self.client.delete_object(Bucket=BUCKET, Key=cache.prefix + cache_key)
        return cache

    def set_fence(self, cache: Any, cache_key: str, fence: int) -> None:
        body = {"value": None, "fence": fence, "expires_at": 0.0, "nonce": uuid.uuid4().hex}
        self.client.put_object(Bucket=BUCKET, Key=cache.prefix + cache_key,
                               Body=json.dumps(body).encode())  # fmt: skip


# -- A grant that stalls between reading its clock and landing (issue 20, item 6) -------
#
# A fence floored at a clock read *before* the grant waited (for the cache's guard, for
# SQLite's write lock, for a reply) is stale once it lands: a record granted meanwhile,
# with a larger fence, may have been collected, and the late grant would undercut it.
# Each test makes the stall happen there deterministically, on a fake clock (a paused VM:
# no clock step, only time passing), and checks that the late grant's fence is larger.


class _FakeClock:
    """Time in seconds that moves only when told; ``read`` is set once a thread other
    than the test's has read it."""

    def __init__(self, start: float = 2_000_000_000.0) -> None:
        self.now = start
        self.read = threading.Event()
        self._main = threading.get_ident()

    def __call__(self) -> float:
        if threading.get_ident() != self._main:
            self.read.set()
        return self.now


_WRITER = """
import sys
import threading
from simple_mutex import DiskCache
directory, key, granted_at = sys.argv[1], sys.argv[2], float(sys.argv[3])
b = DiskCache(directory, gc_after=None, clock=lambda: granted_at)
b._conn = b._connect()
b._conn.execute("BEGIN IMMEDIATE")  # SQLite's write lock, held from here to COMMIT
print("locked", flush=True)
sys.stdin.readline()  # the stalled grant has read its clock and waits for the lock
grant = b.put_if_absent(key, "b", ttl=30)  # a grant with a later clock than the stalled one
b.compare_and_delete(key, version=grant.version)
b._conn.execute("DELETE FROM entries WHERE key = ?", (key,))  # collected, gc_after later
print(grant.fence, flush=True)
sys.stdin.readline()
b._conn.execute("COMMIT")
"""


class TestStalledGrants:
    def _late_grant(self, cache: Any, key: str, clock: _FakeClock) -> tuple[Any, list[Any]]:
        """Start ``cache.put_if_absent(key)`` in a thread (a lease that outlives the
        stall); return it and its result box once it has read the clock."""
        result: list[Any] = []
        thread = threading.Thread(
            target=lambda: result.append(cache.put_if_absent(key, "a", ttl=300)), daemon=True
        )
        thread.start()
        assert clock.read.wait(10), "the grant never read its clock"
        return thread, result

    def _granted_and_freed(self, cache: Any, key: str) -> int:
        """Another cache's grant of ``key`` (after the stalled one read its clock), freed
        at once; its fence."""
        grant = cache.put_if_absent(key, "b", ttl=30)
        cache.compare_and_delete(key, version=grant.version)
        return int(grant.fence)

    def _landed_above(self, thread: Any, result: list[Any], other: int) -> Any:
        """The stalled grant, once it landed: its fence is above the one granted meanwhile."""
        thread.join(20)
        assert result, "the stalled grant never finished"
        assert result[0].fence > other, (
            f"the stalled grant got fence {result[0].fence}, below the {other} granted "
            "before it landed"
        )
        return result[0]

    def test_disk_a_grant_stalled_at_the_cache_guard(self, tmp_path: Path) -> None:
        """The grant reads its clock, then waits for its cache's guard (another thread's
        statement); meanwhile another process's cache grants the key with a later clock,
        frees it, and the row is collected gc_after later. The late grant's fence is
        larger than that grant's."""
        clock = _FakeClock()
        late = DiskCache(tmp_path / "locks", gc_after=60, clock=clock)
        other = DiskCache(tmp_path / "locks", gc_after=60, clock=clock)
        late.get("k")  # the store exists
        with late._guard:  # the stall: the grant's statement cannot start
            thread, result = self._late_grant(late, "k", clock)
            clock.now += 0.5
            granted = self._granted_and_freed(other, "k")
            clock.now += 61
            assert other.collect() == 1  # the row, and its counter, are gone
        landed = self._landed_above(thread, result, granted)
        assert landed.fence == clock_fence(clock.now)  # the clock as it landed, in µs

    def test_disk_a_grant_stalled_at_sqlites_write_lock(self, tmp_path: Path) -> None:
        """Another process holds SQLite's write lock: the grant reads its clock and waits
        for the lock, while inside that process's transaction the key is granted with a
        later clock, freed and collected; 61 s pass before it commits. The stalled grant's
        fence, read under the write lock, is larger. (This also proves that SQLite calls
        the clock function after the statement took the write lock.)"""
        clock = _FakeClock()
        directory = tmp_path / "locks"
        late = DiskCache(directory, gc_after=60, clock=clock)
        late.get("k")  # the store exists
        writer = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(directory), "k", str(clock.now + 0.5)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert writer.stdout is not None
            assert writer.stdin is not None
            assert writer.stdout.readline().strip() == "locked"
            thread, result = self._late_grant(late, "k", clock)
            time.sleep(0.5)  # let it reach SQLite's busy wait (10 s at most)
            writer.stdin.write("\n")
            writer.stdin.flush()
            other = int(writer.stdout.readline())
            clock.now += 61.5
            writer.stdin.write("\n")
            writer.stdin.flush()
            assert writer.wait(10) == 0
        finally:
            if writer.poll() is None:
                writer.kill()
        self._landed_above(thread, result, other)

    # -- MongoDB with clock="client", S3: the client's clock floors the fence -------------
    #
    # Neither server can compute the floor (S3 has only conditional PUTs; a server without
    # $$NOW is why clock="client" exists), so the stall is between the client's clock read
    # and its create landing: the create is held back, by a wrapper of the collection or
    # the client, while another cache grants the key, frees it, and its record is
    # collected (the TTL monitor, a lifecycle rule: deleted here by hand).

    def test_mongo_client_clock_a_create_stalled_in_flight(
        self, mongo_url: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """MongoCache(clock="client"): the insert that creates the key's document is held
        back past the window of the TTL index; the fence it lands with is larger than the
        one granted (and collected) meanwhile."""
        clock = _FakeClock()
        monkeypatch.setattr(mongo_core, "_now_ms", lambda: int(clock() * 1000))
        client: pymongo.MongoClient[Any] = pymongo.MongoClient(mongo_url)
        coll = client[f"{RUN}_stall"][f"c{uuid.uuid4().hex[:8]}"]
        held = _HeldBack(coll, "insert_one")
        late = MongoCache(held, clock="client", gc_after=60)
        other = MongoCache(coll, clock="client", gc_after=60)
        try:
            late.ready()
            with held:
                thread, result = self._late_grant(late, "k", clock)
                assert held.entered.wait(10)
                clock.now += 0.5
                granted = self._granted_and_freed(other, "k")
                assert coll.delete_one({"_id": "k"}).deleted_count == 1  # the TTL monitor
                clock.now += 61
            landed = self._landed_above(thread, result, granted)
            assert late.get("k") == landed  # the fence it reports is the one stored
        finally:
            client.drop_database(f"{RUN}_stall")
            client.close()

    def test_s3_a_create_stalled_in_flight(self, s3_client: Any) -> None:
        """S3Cache: the ``PUT If-None-Match: *`` that creates the key's object is held back
        for a minute, while another client grants the key, frees it, and a lifecycle rule
        deletes the object; the fence the late grant holds is larger than that grant's."""
        clock = _FakeClock()
        prefix = f"{RUN}/{uuid.uuid4().hex}/"
        held = _HeldBack(s3_client, "put_object")
        late = S3Cache(held, BUCKET, prefix, clock=clock)
        other = S3Cache(s3_client, BUCKET, prefix, clock=clock)
        with held:
            thread, result = self._late_grant(late, "k", clock)
            assert held.entered.wait(10)
            clock.now += 0.5
            granted = self._granted_and_freed(other, "k")
            s3_client.delete_object(Bucket=BUCKET, Key=prefix + "k")  # the lifecycle rule
            clock.now += 61
        landed = self._landed_above(thread, result, granted)
        assert other.get("k") == landed  # the fence it reports is the one stored


class _HeldBack:
    """A collection or client whose first call of ``method`` (once entered) waits until
    the ``with`` block ends; everything else goes straight through."""

    def __init__(self, target: Any, method: str) -> None:
        self._target, self._method = target, method
        self.entered, self._go = threading.Event(), threading.Event()

    def __enter__(self) -> _HeldBack:
        return self

    def __exit__(self, *exc: object) -> None:
        self._go.set()

    def with_options(self, **options: Any) -> _HeldBack:  # pymongo's write concern
        twin = _HeldBack(self._target.with_options(**options), self._method)
        twin.entered, twin._go = self.entered, self._go
        return twin

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._target, name)
        if name != self._method:
            return attribute

        def held(*args: Any, **kwargs: Any) -> Any:
            if not self.entered.is_set():
                self.entered.set()
                assert self._go.wait(20), "never let go"
            return attribute(*args, **kwargs)

        return held
