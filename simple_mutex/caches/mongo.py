"""MongoCache: every machine that reaches one MongoDB (replica set, sharded or standalone).

One collection holds every lock, one document per key::

    {_id: key, value: str | null, version: str, fence: int, expires_at: Date}

``value`` is null once freed: the document stays, so its ``fence`` keeps counting across
releases and expiries. Each operation is one statement on one document, which MongoDB
applies atomically, and every write uses ``w="majority"`` by default (a ``w:1`` write can
be rolled back on fail-over, and then two processes would hold the lock).

Clock. With ``clock="server"`` (the default) the server's clock decides expiry: filters
compare ``expires_at`` with ``$$NOW`` and writes set it to ``$$NOW + ttl`` in an
aggregation-pipeline update (MongoDB >= 4.2). Both sides are compared as ``$toLong``
milliseconds: MongoDB compares Dates either way, and secantusdb (the wire-protocol server
the tests run against) evaluates a Date compared with ``$$NOW`` as false, silently, but
compares the two numbers correctly.
``clock="client"`` uses this machine's clock instead, for servers without ``$$NOW`` in
filters (mongomock, MongoDB < 4.2, some compatible services); every client machine's
clock must then agree to well within a lease. ``ready()`` checks that the server really
evaluates the server-clock statements (it takes over an entry that expired a moment ago)
and raises ``ConstraintError`` naming ``clock="client"`` when it does not.

Statements (server clock):

* ``put_if_absent``: ONE ``find_one_and_update(upsert=True)`` whose filter matches the key
  only when freed or expired. It takes over such a document (fence + 1) or, for a key
  never seen, inserts it; on a live document the filter misses, the upsert's insert hits
  the unique ``_id`` and MongoDB raises ``DuplicateKeyError``: the race is lost. Then one
  read tells our own earlier write (identical value: a reply lost to a retry) from
  another holder. With ``clock="client"``: a filtered ``find_one_and_update`` (take-over),
  then ``insert_one`` for a new key, then the same read.
* ``compare_and_set``: ``find_one_and_update`` filtered on version, not freed, not expired.
* ``compare_and_delete``: ``update_one`` with the same filter, setting ``value`` to null.
  It cannot tell whether anyone waits, so it returns None.
* ``wait``: sleeps (the engine's jittered poll); change streams are not used.

Fences. A new document's fence starts at the server's clock in microseconds (Unix ms x
1000) and grows by one per grant, so it keeps growing even when the document was
collected and created again (no key gets 1000 grants in a millisecond). Fences are
therefore large (about 1.8e15 in 2026), still exact as JSON numbers (below 2**53).

Garbage collection. ``ready()`` creates a TTL index on ``expires_at`` with
``expireAfterSeconds=gc_after`` (default one day; ``None`` creates none). It never decides
anything: MongoDB's TTL monitor runs about once a minute, and it only deletes documents
whose lease ended ``gc_after`` ago (freed or abandoned keys). An existing index on
``expires_at`` with other options is reported by ``ready()``, not replaced.

``ready()`` runs on first use of each cache object; call it at start-up to
surface a wrong URL, missing rights or an unsupported server before the first lock.

Connections and errors. ``from_url`` builds a client with a 5 s server selection and
connect timeout and a 10 s socket timeout (unless the URL sets them), so no call hangs on
a dead server; a client you pass keeps its own settings (pymongo's defaults wait 30 s for
a server and forever on a socket: set ``serverSelectionTimeoutMS`` and
``socketTimeoutMS``). A forked child never uses its parent's client (pymongo's are not
fork-safe): it opens its own from the URL, or as a duplicate of the client you passed
(pymongo's ``MongoClient._duplicate``; without it, pymongo's own after-fork reset).
Every pymongo error becomes ``MalfunctionError`` naming mongo, the operation and the key.
A write whose outcome is unknown (a socket timeout, a majority write that timed out
waiting for the secondaries) is such an error too; pymongo retries a write once on a
replica set (retryable writes), and a repeated put of the same value returns our own
entry (the contract's idempotent put), so a retry never orphans a lock.
"""

from __future__ import annotations

import math
import random
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from simple_mutex import forksafe
from simple_mutex.contract import Entry
from simple_mutex.errors import ConstraintError, MalfunctionError, SimpleCacheConditionError

try:
    import pymongo
    from pymongo import ReturnDocument
    from pymongo.collection import Collection
    from pymongo.database import Database
    from pymongo.errors import DuplicateKeyError, OperationFailure, PyMongoError
    from pymongo.write_concern import WriteConcern
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ConstraintError("MongoCache needs pymongo: pip install 'simple-mutex[mongo]'") from exc

DEFAULT_GC_AFTER = 86_400.0  # TTL garbage collection, seconds after a lease ended
_INDEX_NAME = "simple_mutex_gc"
_WTIMEOUT_MS = 10_000  # a majority write waits at most this for the secondaries
# Set by from_url unless the URL says otherwise: nothing may hang on a dead server.
_URL_TIMEOUTS = {
    "serverSelectionTimeoutMS": 5000,
    "connectTimeoutMS": 5000,
    "socketTimeoutMS": 10_000,
}

_NOW_MS = {"$toLong": "$$NOW"}
_EXPIRES_MS = {"$toLong": "$expires_at"}
_LIVE_SERVER: dict[str, Any] = {"$expr": {"$gt": [_EXPIRES_MS, _NOW_MS]}}
_FREE_SERVER: dict[str, Any] = {
    "$or": [{"value": None}, {"$expr": {"$lte": [_EXPIRES_MS, _NOW_MS]}}]
}
_ENTRY_FIELDS = {"_id": 0, "value": 1, "version": 1, "fence": 1, "expires_at": 1}


class MongoCache:
    """A ConditionalCache over a pymongo ``MongoClient``, ``Database`` or ``Collection``.

    A client or database gets the collection ``database`` / ``collection``; a collection
    is used as it is. ``write_concern`` ("majority", an int, or None to keep the
    collection's own) applies to every write; ``clock`` is "server" or "client" (module
    docstring); ``gc_after`` is the TTL index's delay in seconds, or None for no index.
    """

    name = "mongo"

    def __init__(
        self,
        client_or_collection: Any,
        *,
        database: str = "simple_mutex",
        collection: str = "locks",
        write_concern: str | int | None = "majority",
        clock: str = "server",
        gc_after: float | None = DEFAULT_GC_AFTER,
    ) -> None:
        if clock not in ("server", "client"):
            raise ConstraintError(f"MongoCache clock must be 'server' or 'client', got {clock!r}")
        if gc_after is not None and (
            not isinstance(gc_after, (int, float)) or not 0 <= gc_after < 2**31
        ):
            raise ConstraintError(
                f"MongoCache gc_after must be seconds in [0, 2**31) or None, got {gc_after!r}"
            )
        if write_concern is not None and not isinstance(write_concern, (str, int)):
            raise ConstraintError(
                f"MongoCache write_concern must be 'majority', an int or None, got "
                f"{write_concern!r}"
            )
        coll = _collection_of(client_or_collection, database, collection)
        self.database = coll.database.name
        self.collection_name = coll.name
        self.write_concern = write_concern
        self.clock = clock
        self.gc_after = gc_after
        self._given = coll
        self._url: str | None = None  # set by from_url: the client is ours
        self._client: Any = None  # a client this process opened (URL or fork), to close
        self._coll: Any = self._with_options(coll)
        self._ready = False
        self._guard = threading.Lock()
        forksafe.register(self)

    def __repr__(self) -> str:
        return (
            f"MongoCache(database={self.database!r}, collection={self.collection_name!r}, "
            f"clock={self.clock!r})"
        )

    # -- connections ---------------------------------------------------------------------

    def _with_options(self, coll: Any) -> Any:
        if self.write_concern is None:
            return coll
        return coll.with_options(
            write_concern=WriteConcern(w=self.write_concern, wtimeout=_WTIMEOUT_MS)
        )

    def _before_fork(self) -> None:
        pass

    def _after_fork(self) -> None:
        # The parent's client (sockets, monitor threads) must not be used here; it is
        # dropped, not closed: closing would talk on the parent's sockets.
        self._coll = None
        self._client = None

    def _collection(self) -> Any:
        coll = self._coll
        if coll is not None:
            return coll
        with self._guard:
            if self._coll is None:
                self._coll = self._with_options(self._reopen())
            return self._coll

    def _reopen(self) -> Any:
        """The collection on a client of this (forked) process's own."""
        if self._url is not None:
            client = _client_from_url(self._url)
        else:
            duplicate = getattr(self._given.database.client, "_duplicate", None)
            if not callable(duplicate):
                return self._given  # mongomock, or a pymongo without _duplicate
            client = duplicate()
        self._client = client
        return client[self.database][self.collection_name]

    def close(self) -> None:
        """Close the client this cache opened itself (from a URL, or in a forked child)."""
        client, self._client = self._client, None
        if client is not None:
            self._coll = None
            client.close()

    # -- ready: index and clock check ----------------------------------------------------

    def ready(self) -> None:
        """Create the TTL index and check the server's clock statements; raises
        ``MalfunctionError`` (server unreachable, rights, conflicting index) or
        ``ConstraintError`` (a server that cannot evaluate ``$$NOW``: use clock="client")."""
        coll = self._collection()
        if self.gc_after is not None:
            try:
                coll.create_index(
                    [("expires_at", pymongo.ASCENDING)],
                    expireAfterSeconds=int(self.gc_after),
                    name=_INDEX_NAME,
                )
            except PyMongoError as exc:
                raise MalfunctionError(
                    f"mongo cache could not create its TTL index on "
                    f"{self.database}.{self.collection_name}.expires_at "
                    f"(expireAfterSeconds={int(self.gc_after)}): {exc!r}; drop or align "
                    "an existing index on expires_at, or pass gc_after=None"
                ) from exc
        self._ready = True
        if self.clock == "server":
            self._check_server_clock()

    def _check_server_clock(self) -> None:
        """Take over an entry that expired a moment ago: proves the server evaluates the
        ``$$NOW`` statements (a server that silently compares wrongly would otherwise
        never let an abandoned lock go before the TTL monitor deletes it)."""
        key = f"simple-mutex.ready-probe.{random.getrandbits(64):016x}"
        try:
            try:
                first = self.put_if_absent(key, "probe-1", ttl=0.001)
                time.sleep(0.01)
                expired = self.get(key) is None
                second = self.put_if_absent(key, "probe-2", ttl=30)
                ok = expired and second.fence == first.fence + 1
            finally:
                self._coll_op("ready", key, lambda c: c.delete_one({"_id": key}))
        except MalfunctionError as exc:
            cause = exc.__cause__
            if isinstance(cause, PyMongoError) and not isinstance(cause, OperationFailure):
                raise  # unreachable, timed out...: not a question of the clock
            ok = False  # the server refused the statements, or wrote nonsense
        except (SimpleCacheConditionError, ValueError, TypeError, KeyError):
            ok = False  # mongomock and other doubles fail in their own ways
        if not ok:
            self._ready = False
            raise ConstraintError(
                f"the MongoDB server behind {self.database}.{self.collection_name} does not "
                "evaluate $$NOW in filters and pipeline updates as MongoDB >= 4.2 does; "
                "pass clock='client' to judge expiry by this machine's clock"
            )

    def _ensure_ready(self) -> None:
        if not self._ready:
            self.ready()  # idempotent: threads racing here do no harm

    def _coll_op(self, operation: str, key: str, call: Any) -> Any:
        try:
            return call(self._collection())
        except DuplicateKeyError:
            raise
        except PyMongoError as exc:
            raise _fault(operation, key, exc) from exc

    # -- the contract --------------------------------------------------------------------

    def get(self, key: str) -> Entry | None:
        self._ensure_ready()
        live = self._live()
        doc = self._coll_op(
            "get", key, lambda c: c.find_one({"_id": key, "value": {"$ne": None}, **live},
                                             _ENTRY_FIELDS)
        )  # fmt: skip
        return None if doc is None else _entry(doc, key)

    def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:
        self._ensure_ready()
        ms = _ms(ttl)
        version = _new_version()
        try:
            if self.clock == "server":
                doc = self._coll_op(
                    "put_if_absent", key,
                    lambda c: c.find_one_and_update(
                        {"_id": key, **_FREE_SERVER},
                        [{"$set": {
                            "value": {"$literal": value},
                            "version": version,
                            "fence": {"$add": [
                                {"$ifNull": ["$fence", {"$multiply": [_NOW_MS, 1000]}]}, 1
                            ]},
                            "expires_at": {"$add": ["$$NOW", ms]},
                        }}],
                        projection=_ENTRY_FIELDS, upsert=True,
                        return_document=ReturnDocument.AFTER,
                    ),
                )  # fmt: skip
            else:
                doc = self._put_by_client_clock(key, value, version, ms)
        except DuplicateKeyError:
            doc = None  # a live document holds the key (or a racing put created it)
        if doc is not None:
            return _entry(doc, key)
        # Held. Our own earlier write whose reply was lost holds exactly this value.
        live = self._live()
        current = self._coll_op(
            "put_if_absent", key,
            lambda c: c.find_one({"_id": key, "value": value, **live}, _ENTRY_FIELDS),
        )  # fmt: skip
        if current is not None:
            return _entry(current, key)
        raise SimpleCacheConditionError(f"mongo: {key!r} is held")

    def _put_by_client_clock(self, key: str, value: str, version: str, ms: int) -> Any:
        now_ms = _now_ms()
        expires_at = _date(now_ms + ms)
        doc = self._coll_op(
            "put_if_absent", key,
            lambda c: c.find_one_and_update(
                {"_id": key, "$or": [{"value": None}, {"expires_at": {"$lte": _date(now_ms)}}]},
                {"$set": {"value": value, "version": version, "expires_at": expires_at},
                 "$inc": {"fence": 1}},
                projection={"_id": 0, "fence": 1},
                # The document before: all else we wrote ourselves (and mongomock finds
                # the AFTER document by the filter, which it no longer matches).
                return_document=ReturnDocument.BEFORE,
            ),
        )  # fmt: skip
        if doc is not None:
            return {"value": value, "version": version, "fence": doc["fence"] + 1,
                    "expires_at": expires_at}  # fmt: skip
        fence = now_ms * 1000 + 1
        self._coll_op(
            "put_if_absent", key,
            lambda c: c.insert_one({"_id": key, "value": value, "version": version,
                                    "fence": fence, "expires_at": expires_at}),
        )  # fmt: skip
        return {"value": value, "version": version, "fence": fence, "expires_at": expires_at}

    def compare_and_set(self, key: str, value: str, *, ttl: float, version: str) -> Entry:
        self._ensure_ready()
        ms = _ms(ttl)
        new_version = _new_version()
        match = {"_id": key, "version": version, "value": {"$ne": None}, **self._live()}
        if self.clock == "server":
            doc = self._coll_op(
                "compare_and_set", key,
                lambda c: c.find_one_and_update(
                    match,
                    [{"$set": {"value": {"$literal": value}, "version": new_version,
                               "expires_at": {"$add": ["$$NOW", ms]}}}],
                    projection=_ENTRY_FIELDS, return_document=ReturnDocument.AFTER,
                ),
            )  # fmt: skip
        else:
            expires_at = _date(_now_ms() + ms)
            doc = self._coll_op(
                "compare_and_set", key,
                lambda c: c.find_one_and_update(
                    match,
                    {"$set": {"value": value, "version": new_version, "expires_at": expires_at}},
                    projection={"_id": 0, "fence": 1}, return_document=ReturnDocument.BEFORE,
                ),
            )  # fmt: skip
            if doc is not None:
                doc = {"value": value, "version": new_version, "fence": doc["fence"],
                       "expires_at": expires_at}  # fmt: skip
        if doc is None:
            raise SimpleCacheConditionError(f"mongo: {key!r} is not at version {version}")
        return _entry(doc, key)

    def compare_and_delete(self, key: str, *, version: str) -> None:
        self._ensure_ready()
        match = {"_id": key, "version": version, "value": {"$ne": None}, **self._live()}
        result = self._coll_op(
            "compare_and_delete", key,
            lambda c: c.update_one(match, {"$set": {"value": None}}),
        )  # fmt: skip
        if result.matched_count != 1:
            raise SimpleCacheConditionError(f"mongo: {key!r} is not at version {version}")

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        # No notification: the engine's jittered poll is the whole strategy.
        time.sleep(max(timeout, 0.0))

    def _live(self) -> dict[str, Any]:
        if self.clock == "server":
            return _LIVE_SERVER
        return {"expires_at": {"$gt": _date(_now_ms())}}


# -- helpers ---------------------------------------------------------------------------


def _collection_of(obj: Any, database: str, collection: str) -> Any:
    if not isinstance(database, str) or not database:
        raise ConstraintError(f"MongoCache database must be a non-empty str, got {database!r}")
    if not isinstance(collection, str) or not collection:
        raise ConstraintError(f"MongoCache collection must be a non-empty str, got {collection!r}")
    kinds = _driver_classes()
    given: Any = obj
    if isinstance(obj, kinds["collection"]):
        return given
    if isinstance(obj, kinds["database"]):
        return given[collection]
    if isinstance(obj, kinds["client"]):
        return given[database][collection]
    raise ConstraintError(
        f"MongoCache needs a pymongo MongoClient, Database or Collection, got {type(obj).__name__}"
    )


def _driver_classes() -> dict[str, tuple[type, ...]]:
    kinds: dict[str, tuple[type, ...]] = {
        "collection": (Collection,),
        "database": (Database,),
        "client": (pymongo.MongoClient,),
    }
    mock = sys.modules.get("mongomock")  # the test double, only if already imported
    if mock is not None:
        kinds["collection"] += (mock.Collection,)
        kinds["database"] += (mock.Database,)
        kinds["client"] += (mock.MongoClient,)
    return kinds


def is_mongo_client(obj: object) -> bool:
    """Is ``obj`` a pymongo (or mongomock) client, database or collection? For as_cache."""
    return isinstance(obj, tuple(c for group in _driver_classes().values() for c in group))


def _entry(doc: Mapping[str, Any], key: str) -> Entry:
    try:
        value, version, fence = doc["value"], doc["version"], doc["fence"]
        if not isinstance(value, str) or not isinstance(version, str):
            raise TypeError("value and version must be strings")
        return Entry(value, version, int(fence), _seconds(doc["expires_at"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise MalfunctionError(
            f"mongo cache holds a malformed document for {key!r} ({exc}); is another "
            "program writing to this collection?"
        ) from None


def _seconds(moment: Any) -> float:
    if isinstance(moment, datetime):
        if moment.tzinfo is None:  # pymongo's default: naive UTC
            moment = moment.replace(tzinfo=timezone.utc)
        return float(moment.timestamp())
    return int(moment) / 1000  # bson DatetimeMS (datetime_conversion options)


def _date(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, timezone.utc)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _ms(ttl: float) -> int:
    """The ttl in whole ms, rounded up: the server's expiry must not come before the
    holder's local deadline."""
    return max(1, math.ceil(ttl * 1000))


def _new_version() -> str:
    return f"{random.getrandbits(64):016x}"


def _fault(operation: str, key: str, exc: Exception) -> MalfunctionError:
    return MalfunctionError(f"mongo cache failed during {operation} on {key!r}: {exc!r}")


def _client_from_url(url: str) -> Any:
    parts = urlsplit(url)
    given = {name.lower() for name, _ in parse_qsl(parts.query)}
    options: dict[str, Any] = {k: v for k, v in _URL_TIMEOUTS.items() if k.lower() not in given}
    if "timeoutms" in given:
        options = {}  # client-side operation timeout (CSOT) set: it governs everything
    return pymongo.MongoClient(url, **options)


def from_url(url: str) -> MongoCache:
    """A MongoCache from a ``mongodb://`` or ``mongodb+srv://`` URL.

    ``mongodb[+srv]://[user:password@]host[:port][,host...]/[database][?options]``: the
    database defaults to ``simple_mutex``; three options are read here, not by pymongo:
    ``collection`` (default ``locks``), ``clock`` (``server`` or ``client``) and
    ``w`` (default ``majority``). Everything else (replicaSet, tls, authSource,
    timeouts...) goes to ``pymongo.MongoClient``.
    """
    scheme = url.partition(":")[0].lower()
    if scheme not in ("mongodb", "mongodb+srv"):
        raise ConstraintError(
            f"unknown MongoDB URL scheme {scheme!r}; use mongodb:// or mongodb+srv://"
        )
    try:
        parts = urlsplit(url)
        ours: dict[str, str] = {}
        kept = []
        for piece in parts.query.split("&") if parts.query else []:
            name, _, value = piece.partition("=")
            if name in ("collection", "clock"):
                ours[name] = unquote(value)
            else:
                kept.append(piece)  # verbatim: pymongo decodes its own options
                if name == "w":
                    ours["w"] = unquote(value)
        w = ours.get("w", "majority")
        database = unquote(parts.path.lstrip("/").split("/")[0]) or "simple_mutex"
        plain = urlunsplit(parts._replace(query="&".join(kept)))
        client = _client_from_url(plain)
    except (PyMongoError, TypeError, ValueError) as exc:
        # Only the scheme is echoed: the rest of a URL may hold a password.
        raise ConstraintError(f"bad {scheme}:// URL: {type(exc).__name__}") from None
    cache = MongoCache(
        client,
        database=database,
        collection=ours.get("collection", "locks") or "locks",
        write_concern=int(w) if w.isdigit() else w,
        clock=ours.get("clock", "server"),
    )
    cache._url = plain
    cache._client = client
    return cache
