"""MongoCache over the MongoDB wire protocol, and on mongomock.

* The server: ``MONGODB_URL`` when set (a real ``mongod``); otherwise a ``secantusd-py``
  (the PyPI package ``secantusdb``, a MongoDB wire-protocol server, test-only) that the
  test session starts once (tests/servers.py: ``mongo_url``), on a free loopback port.
  If neither answers, the tests FAIL: a proof is never skipped. Every test of this
  module writes into one database named for this run, dropped at the end.
* Against that server: the shared contract with the server's clock (the default) and
  with the client's, the behaviour suite, and the statements' specifics.
* mongomock (no server) for the fast contract run of ``clock="client"``.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import mongomock
import pymongo
import pytest
from behaviour import SharedBehaviour
from contract import CacheContract, ContractSmoke, unique_key
from procs import FORK
from servers import free_port

from simple_mutex import ConstraintError, MalfunctionError, Mutex, SimpleCacheConditionError
from simple_mutex.caches.mongo import MongoCache, from_url
from simple_mutex.caches.mongo import core as mongo_core
from simple_mutex.errors import ConstraintTypeError

pytestmark = pytest.mark.backends

DB = f"smx_test_{uuid.uuid4().hex[:8]}"
HOUR = timedelta(hours=1)


@pytest.fixture(scope="session")
def server_url(mongo_url: str) -> str:
    """The session's MongoDB (tests/servers.py: MONGODB_URL or a secantusd-py)."""
    return mongo_url


@pytest.fixture(scope="module")
def client(server_url: str) -> Iterator[pymongo.MongoClient[Any]]:
    conn: pymongo.MongoClient[Any] = pymongo.MongoClient(
        server_url, serverSelectionTimeoutMS=5000, socketTimeoutMS=10_000
    )
    yield conn
    conn.drop_database(DB)
    conn.close()


@pytest.fixture
def cache(client: pymongo.MongoClient[Any]) -> MongoCache:
    return MongoCache(client, database=DB)


# -- the contract -----------------------------------------------------------------------


class TestMongoContractServerClock(CacheContract):
    """The contract over the wire, expiry judged by the server's $$NOW (the default)."""

    remembers_releases = True  # its freed record (or held mark) names the version freed

    expiry_slack = 0.15


class TestMongoContractClientClock(ContractSmoke):
    """...and with clock="client" (servers without $$NOW in filters)."""

    expiry_slack = 0.15

    @pytest.fixture
    def cache(self, client: pymongo.MongoClient[Any]) -> MongoCache:
        return MongoCache(client, database=DB, collection="locks_client", clock="client")


class TestMongoContractFactory(ContractSmoke):
    """...and on a client its factory makes in each process (the forked children too)."""

    expiry_slack = 0.15

    @pytest.fixture
    def cache(self, server_url: str, client: pymongo.MongoClient[Any]) -> Iterator[MongoCache]:
        made = MongoCache(
            lambda: pymongo.MongoClient(server_url, serverSelectionTimeoutMS=5000),
            database=DB, collection="locks_factory",
        )  # fmt: skip
        yield made
        made.close()


class TestMongomockContract(ContractSmoke):
    """The client-clock statements on a mongomock collection (fast, no server)."""

    @pytest.fixture
    def cache(self) -> MongoCache:
        return MongoCache(mongomock.MongoClient()["simple_mutex"]["locks"], clock="client")


class TestMongoBehaviour(SharedBehaviour):
    """The behaviour suite over the wire, in this run's database."""

    takeover_slack = 0.6

    @pytest.fixture
    def url(self, server_url: str, client: pymongo.MongoClient[Any]) -> str:
        return f"{server_url.rstrip('/')}/{DB}"

    def write_foreign(self, url: str, cache_key: str) -> str:
        with pymongo.MongoClient(url) as conn:
            conn[DB]["locks"].insert_one(
                {"_id": cache_key, "value": 12, "expires_at": datetime.now(timezone.utc) + HOUR}
            )
        return url

    def unreachable_url(self, tmp_path: Path) -> str:
        return f"mongodb://127.0.0.1:{free_port()}/db?serverSelectionTimeoutMS=300"


# -- statements, clocks, fences ------------------------------------------------------------


def test_a_freed_key_keeps_its_document_and_fences_start_from_the_server_clock(
    cache: MongoCache, client
):
    """Release sets value to null and keeps the fence. A new document's fence is the
    server's time in µs: after the TTL monitor deletes a long-dead document, the key's
    next fence is still larger than every earlier one."""
    key = unique_key()
    first = cache.put_if_absent(key, "v1", ttl=30)
    assert abs(first.fence / 1e6 - time.time()) < 5
    cache.compare_and_delete(key, version=first.version)
    doc = client[DB]["locks"].find_one({"_id": key})
    assert (doc["value"], doc["fence"]) == (None, first.fence)
    client[DB]["locks"].delete_one({"_id": key})  # what garbage collection does
    assert cache.put_if_absent(key, "v2", ttl=30).fence > first.fence


def test_expiry_is_judged_by_the_servers_clock(client, monkeypatch: pytest.MonkeyPatch):
    """With clock="server" the local clock is never read: a local clock an hour fast
    neither expires a live entry nor shifts its expiry; with clock="client" it does."""
    server = MongoCache(client, database=DB)
    local = MongoCache(client, database=DB, clock="client")
    key = unique_key()
    entry = server.put_if_absent(key, "v1", ttl=30)
    monkeypatch.setattr(mongo_core, "_now_ms", lambda: int((time.time() + 3600) * 1000))
    assert server.get(key) == entry
    with pytest.raises(SimpleCacheConditionError):
        server.put_if_absent(key, "v2", ttl=30)
    again = server.compare_and_set(key, "v1", ttl=30, version=entry.version)
    assert abs(again.expires_at - (time.time() + 30)) < 2
    assert local.get(key) is None  # the fast local clock thinks it expired
    assert local.put_if_absent(key, "v3", ttl=30).fence > entry.fence


def test_a_value_that_looks_like_an_expression_is_stored_verbatim(cache: MongoCache):
    """Pipeline updates would read "$field" as a field path: values go in as $literal."""
    key = unique_key()
    for value in ("$fence", "$$NOW", '{"$set": 1}'):
        entry = cache.put_if_absent(key, value, ttl=30)
        assert cache.get(key) == entry
        assert entry.value == value
        renewed = cache.compare_and_set(key, value, ttl=30, version=entry.version)
        assert renewed.value == value
        cache.compare_and_delete(key, version=renewed.version)


def test_racing_puts_on_a_new_key_have_exactly_one_winner(server_url: str):
    """Eight threads with their own clients race put_if_absent on fresh keys: the unique
    _id lets exactly one in (the others get DuplicateKeyError, reported as held)."""
    clients = [pymongo.MongoClient(server_url) for _ in range(8)]
    caches = [MongoCache(each, database=DB) for each in clients]
    caches[0].ready()
    for _ in range(5):
        key = unique_key()
        barrier = threading.Barrier(len(caches))
        wins: list[int] = []

        def race(
            n: int, key: str = key, barrier: threading.Barrier = barrier, wins: list[int] = wins
        ) -> None:
            barrier.wait(10)
            try:
                caches[n].put_if_absent(key, f"v{n}", ttl=30)
                wins.append(n)
            except SimpleCacheConditionError:
                pass

        threads = [threading.Thread(target=race, args=(n,)) for n in range(len(caches))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        assert len(wins) == 1
    for each in clients:
        each.close()


def test_writes_use_a_majority_write_concern_with_a_timeout(client):
    """w="majority" by default (a w:1 write can be rolled back on fail-over)."""
    assert MongoCache(client, database=DB)._collection().write_concern.document == {
        "w": "majority",
        "wtimeout": 10_000,
    }
    assert MongoCache(client, write_concern=1)._collection().write_concern.document["w"] == 1
    own = client[DB].get_collection("x")
    assert MongoCache(own, write_concern=None)._collection() is own


def test_ready_creates_the_ttl_index_as_garbage_collection_only(client):
    """ready() (also run on first use) creates the TTL index on expires_at."""
    cache = MongoCache(client, database=DB, collection="gc", gc_after=3600)
    cache.ready()
    index = client[DB]["gc"].index_information()["simple_mutex_gc"]
    assert index["key"] == [("expires_at", 1)]
    assert index["expireAfterSeconds"] == 3600
    lazy = MongoCache(client, database=DB, collection="gc_lazy")
    lazy.get(unique_key())
    assert "simple_mutex_gc" in client[DB]["gc_lazy"].index_information()
    MongoCache(client, database=DB, collection="no_gc", gc_after=None).get(unique_key())
    assert "simple_mutex_gc" not in client[DB]["no_gc"].index_information()


def test_ready_reports_a_conflicting_index_early(client):
    """An index on expires_at with other options is a malfunction named at ready()."""
    client[DB]["clash"].create_index("expires_at", name="simple_mutex_gc", expireAfterSeconds=5)
    cache = MongoCache(client, database=DB, collection="clash", gc_after=3600)
    with pytest.raises(MalfunctionError, match="TTL index"):
        cache.ready()


def test_a_server_without_now_is_refused_naming_the_client_clock():
    """mongomock cannot evaluate $$NOW: the default clock is refused, with the fix."""
    cache = MongoCache(mongomock.MongoClient()["db"]["locks"])
    with pytest.raises(ConstraintError, match="clock='client'"):
        cache.ready()
    with pytest.raises(ConstraintError, match="clock='client'"):
        cache.put_if_absent(unique_key(), "v", ttl=30)


# -- construction and URLs --------------------------------------------------------------


def test_constructor_takes_a_client_a_database_or_a_collection(client):
    """A client gets database/collection; a Database gets the collection; a Collection
    is used as it is; anything else is refused."""
    assert MongoCache(client, database=DB, collection="c1").collection_name == "c1"
    by_db = MongoCache(client[DB], collection="c2")
    assert (by_db.database, by_db.collection_name) == (DB, "c2")
    by_coll = MongoCache(client[DB]["c3"], database="ignored", collection="ignored")
    assert (by_coll.database, by_coll.collection_name) == (DB, "c3")
    for bad in ("mongodb://x", object(), None):
        with pytest.raises(ConstraintTypeError, match=r"MongoClient.*or a function that returns"):
            MongoCache(bad)
    with pytest.raises(ConstraintError, match="clock"):
        MongoCache(client, clock="atomic")
    with pytest.raises(ConstraintError, match="gc_after"):
        MongoCache(client, gc_after=-1)


def test_from_url_builds_a_working_cache_with_timeouts(server_url: str):
    """mongodb:// goes to MongoClient; database from the path, collection and clock from
    the query; timeouts are set unless the URL sets them."""
    base = server_url.split("?")[0].rstrip("/")
    cache = from_url(f"{base}/{DB}?collection=from_url&clock=client&socketTimeoutMS=7000")
    assert (cache.database, cache.collection_name, cache.clock) == (DB, "from_url", "client")
    options = cache._client.options
    assert options.pool_options.socket_timeout == 7
    assert options.server_selection_timeout == 5
    key = unique_key()
    entry = cache.put_if_absent(key, "v", ttl=30)
    assert cache.get(key) == entry
    cache.close()
    default = from_url(base)
    assert (default.database, default.collection_name, default.clock) == (
        "simple_mutex", "locks", "server"
    )  # fmt: skip
    default.close()


def test_from_url_rejects_other_schemes_and_bad_urls_without_echoing_secrets():
    with pytest.raises(ConstraintError, match="mongodb://"):
        from_url("redis://localhost")
    with pytest.raises(ConstraintError) as info:
        from_url("mongodb://user:s3cret@[bad/")
    assert "s3cret" not in str(info.value)


def _use_given(cache: MongoCache, given: pymongo.MongoClient[Any], held: str, key: str) -> None:
    """In a forked child: the cache keeps the client it was given (pymongo resets it
    here; recent versions warn), sees the parent's lock, and takes and frees its own."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "MongoClient opened before fork", UserWarning)
        with pytest.raises(SimpleCacheConditionError):
            cache.put_if_absent(held, "child", ttl=30)
        with Mutex(cache, lease=30).acquire(key, timeout=5) as lease:
            assert cache.get(f"mutex.{key}") is not None, lease
    assert cache._collection().database.client is given


def test_a_forked_child_uses_the_client_it_was_given(server_url: str):
    """A cache given a client uses it in a forked child too (pymongo >= 4.3 resets it
    there): the children see the parent's lock and take and free their own;
    the parent's keeps working, and nothing was opened behind the user's back."""
    given: pymongo.MongoClient[Any] = pymongo.MongoClient(server_url)
    cache = MongoCache(given, database=DB)
    held = unique_key()
    entry = cache.put_if_absent(held, "parent", ttl=30)
    keys = [unique_key() for _ in range(2)]
    children = [FORK.Process(target=_use_given, args=(cache, given, held, k)) for k in keys]
    for child in children:
        child.start()
    for child in children:
        child.join(20)
    assert [child.exitcode for child in children] == [0, 0]
    assert cache.get(held) == entry
    assert [cache.get(f"mutex.{k}") for k in keys] == [None, None]  # freed by the children
    cache.compare_and_delete(held, version=entry.version)
    assert cache._collection().database.client is given
    cache.close()  # not the cache's own: left open
    assert given[DB].command("ping")["ok"] == 1
    given.close()


class Client(pymongo.MongoClient[Any]):
    """pymongo's client, saying whether it was closed (pymongo's own answer to a use
    after close differs across the versions we support)."""

    closed = False

    def close(self) -> None:
        self.closed = True
        super().close()


class Factory:
    """A client factory that records, per call, the process and the client it made."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.made: list[tuple[int, Client]] = []

    def __call__(self) -> Client:
        client = Client(self.url)
        self.made.append((os.getpid(), client))
        return client


def _use_factory(cache: MongoCache, factory: Factory, key: str) -> None:
    """In a forked child: one call of the factory, however much the cache is used, and
    never the parent's client."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            with Mutex(cache, lease=30).acquire(key, timeout=5):
                pass
    (parent, parents_client), (child, own) = factory.made  # the parent's call, then ours
    assert (parent, child) == (os.getppid(), os.getpid())
    assert cache._collection().database.client is own is not parents_client
    assert not [w for w in seen if "before fork" in str(w.message)], "the parent's was used"
    cache.close()


def test_a_client_factory_is_called_once_in_each_process(server_url: str):
    """A factory is called on first use, once per process: a forked child calls it again
    and uses only the client it made; close() closes the factory's client, and the next
    use makes another."""
    factory = Factory(server_url)
    cache = MongoCache(factory, database=DB)
    assert factory.made == []  # lazily: a cache built before the fork opens nothing
    key = unique_key()
    for _ in range(2):
        cache.compare_and_delete(key, version=cache.put_if_absent(key, "p", ttl=30).version)
    assert [pid for pid, _ in factory.made] == [os.getpid()]
    keys = [unique_key() for _ in range(2)]
    children = [FORK.Process(target=_use_factory, args=(cache, factory, k)) for k in keys]
    for child in children:
        child.start()
    for child in children:
        child.join(20)
    assert [child.exitcode for child in children] == [0, 0]
    assert len(factory.made) == 1  # the children's calls were theirs alone
    assert [cache.get(f"mutex.{k}") for k in keys] == [None, None]
    first = factory.made[0][1]
    assert not first.closed
    cache.close()
    assert first.closed  # the factory's client is the cache's to close
    assert cache.get(key) is None
    assert len(factory.made) == 2
    cache.close()
    assert factory.made[1][1].closed


def test_a_client_factory_may_return_a_database_or_a_collection(client):
    """What the factory returns names the collection as an object given would; the
    names are the options' until the first call."""
    by_db = MongoCache(lambda: client[DB], collection="factory_db")
    by_coll = MongoCache(lambda: client[DB]["factory_coll"], database="ignored")
    assert (by_coll.database, by_coll.collection_name) == ("ignored", "locks")
    for cache, names in ((by_db, (DB, "factory_db")), (by_coll, (DB, "factory_coll"))):
        key = unique_key()
        entry = cache.put_if_absent(key, "v", ttl=30)
        assert (cache.database, cache.collection_name) == names
        assert client[names[0]][names[1]].find_one({"_id": key})["version"] == entry.version


def test_a_client_factory_returning_something_else_is_refused_naming_the_fix(server_url):
    """The factory's result is checked as an object given is: on first use, a
    ConstraintTypeError that says what to return; nothing is written."""
    for wrong, got in ((lambda: server_url, "str"), (lambda: None, "NoneType")):
        cache = MongoCache(wrong)
        with pytest.raises(ConstraintTypeError) as info:
            cache.put_if_absent(unique_key(), "v", ttl=30)
        message = str(info.value)
        assert "client factory" in message
        assert "must return a pymongo MongoClient, Database or Collection" in message
        assert f"got {got}" in message
        assert "makes a new client each time" in message
