"""MongoCache: every machine that reaches one MongoDB (replica set, sharded or standalone).

One collection holds every lock, one document per key::

    {_id: key, value: str | null, version: str, fence: int, expires_at: Date}

* Each operation is one statement on one document, applied atomically; writes use
  ``w="majority"`` by default. ``value`` is null once freed: the document stays, and its
  fence counts on. A grant's fence is max(fence + 1, the clock in µs), so a key whose
  document was collected, or lost in a fail-over, still gets larger fences.
* ``clock="server"`` (default): ``$$NOW`` decides expiry (MongoDB >= 4.2; ``ready()``
  proves it). ``clock="client"``: this machine's clock, for servers without it; every
  client's clock must then agree to well within a lease.
* ``ready()`` (run on first use) creates a TTL index on ``expires_at`` that deletes
  documents ``gc_after`` seconds after their lease ended or they were freed: garbage
  collection only.
* ``wait`` sleeps: the engine's jittered poll finds releases and expiries.
* A forked child opens its own client. Every pymongo error is a ``MalfunctionError``
  naming mongo, the operation and the key; a retried put finds its own value.

Rationale: docs/design/mongo.md.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator, Mapping
from datetime import datetime, timezone
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from simple_mutex.contract import Entry
from simple_mutex.errors import ConstraintError, MalfunctionError, SimpleCacheConditionError

from .common import (
    CacheBase,
    driver_imports,
    fault,
    gc_after_seconds,
    malformed,
    new_version,
    prefix_end,
    ttl_ms,
)

with driver_imports("mongo"):
    import pymongo
    from pymongo import ReturnDocument
    from pymongo.collection import Collection
    from pymongo.database import Database
    from pymongo.errors import DuplicateKeyError, OperationFailure, PyMongoError
    from pymongo.write_concern import WriteConcern

DEFAULT_GC_AFTER = 86_400.0  # TTL garbage collection, seconds after a lease ended
_INDEX_NAME = "simple_mutex_gc"
_WTIMEOUT_MS = 10_000  # a majority write waits at most this for the secondaries
# Set by from_url unless the URL says otherwise: nothing may hang on a dead server.
_URL_TIMEOUTS = {
    "serverSelectionTimeoutMS": 5000,
    "connectTimeoutMS": 5000,
    "socketTimeoutMS": 10_000,
}
# A collection-like object that is not pymongo's (a wrapper) needs these.
_COLLECTION_METHODS = ("find_one", "find_one_and_update", "update_one", "insert_one")

# Dates compared as $toLong ms: secantusdb (the tests' server) silently misjudges a Date
# compared with $$NOW, and MongoDB compares either form alike.
_NOW_MS = {"$toLong": "$$NOW"}
_EXPIRES_MS = {"$toLong": "$expires_at"}
_LIVE_SERVER: dict[str, Any] = {"$expr": {"$gt": [_EXPIRES_MS, _NOW_MS]}}
_FREE_SERVER: dict[str, Any] = {
    "$or": [{"value": None}, {"$expr": {"$lte": [_EXPIRES_MS, _NOW_MS]}}]
}
_ENTRY_FIELDS = {"_id": 0, "value": 1, "version": 1, "fence": 1, "expires_at": 1}


class MongoCache(CacheBase):
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
        gc_after = gc_after_seconds("MongoCache", gc_after)
        if write_concern is not None and not isinstance(write_concern, (str, int)):
            raise ConstraintError(
                f"MongoCache write_concern must be 'majority', an int or None, got "
                f"{write_concern!r}"
            )
        coll = _collection_of(client_or_collection, database, collection)
        super().__init__()
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
                return self._given  # not pymongo's, or a pymongo without _duplicate
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

    def ready(self, operation: str = "ready", key: str = "") -> None:
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
            except OperationFailure as exc:
                raise MalfunctionError(
                    f"mongo cache could not create its TTL index on "
                    f"{self.database}.{self.collection_name}.expires_at "
                    f"(expireAfterSeconds={int(self.gc_after)}): {exc!r}; drop or align "
                    "an existing index on expires_at, or pass gc_after=None"
                ) from exc
            except PyMongoError as exc:
                raise fault(self.name, operation, key, exc) from exc
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
                ok = expired and second.fence > first.fence
            finally:
                self._op("ready", key, lambda c: c.delete_one({"_id": key}))
        except MalfunctionError as exc:
            cause = exc.__cause__
            if isinstance(cause, PyMongoError) and not isinstance(cause, OperationFailure):
                raise  # unreachable, timed out...: not a question of the clock
            ok = False  # the server refused the statements, or wrote nonsense
        except SimpleCacheConditionError:
            ok = False
        if not ok:
            self._ready = False
            raise ConstraintError(
                f"the MongoDB server behind {self.database}.{self.collection_name} does not "
                "evaluate $$NOW in filters and pipeline updates as MongoDB >= 4.2 does; "
                "pass clock='client' to judge expiry by this machine's clock"
            )

    def _op(self, operation: str, key: str, call: Any) -> Any:
        if not self._ready:
            self.ready(operation, key)  # idempotent: threads racing here do no harm
        try:
            return call(self._collection())
        except DuplicateKeyError:
            raise
        except PyMongoError as exc:
            raise fault(self.name, operation, key, exc) from exc

    # -- the contract --------------------------------------------------------------------

    def get(self, key: str) -> Entry | None:
        return self._read("get", key)

    def _read(self, operation: str, key: str) -> Entry | None:
        match = {"_id": key, "value": {"$ne": None}, **self._live()}
        doc = self._op(operation, key, lambda c: c.find_one(match, _ENTRY_FIELDS))
        return None if doc is None else _entry(doc, operation, key)

    def scan(self, prefix: str) -> Iterator[tuple[str, Entry]]:
        """A range on ``_id`` (its index; strings compare by UTF-8 bytes, code point
        order), so no pattern is parsed and every character of the prefix is literal."""
        end = prefix_end(prefix)
        ids: dict[str, Any] = {"$gte": prefix} if end is None else {"$gte": prefix, "$lt": end}
        match = {"_id": ids, "value": {"$ne": None}, **self._live()}
        docs = self._op("scan", prefix, lambda c: list(c.find(match, {**_ENTRY_FIELDS, "_id": 1})))
        found = []
        for doc in docs:
            key = doc.pop("_id")
            if isinstance(key, str) and key.startswith(prefix):
                found.append((key, _entry(doc, "scan", key)))
        return iter(found)

    def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:
        ms = ttl_ms(ttl)
        version = new_version()
        if self.clock == "client":
            return self._put_by_client_clock(key, value, version, ms)
        try:
            doc = self._op(
                "put_if_absent", key,
                lambda c: c.find_one_and_update(
                    {"_id": key, **_FREE_SERVER},
                    [{"$set": {
                        "value": {"$literal": value},
                        "version": version,
                        "fence": {"$max": [
                            {"$add": [{"$ifNull": ["$fence", 0]}, 1]},
                            {"$multiply": [_NOW_MS, 1000]},
                        ]},
                        "expires_at": {"$add": ["$$NOW", ms]},
                    }}],
                    projection=_ENTRY_FIELDS, upsert=True,
                    return_document=ReturnDocument.AFTER,
                ),
            )  # fmt: skip
        except DuplicateKeyError:
            doc = None  # a live document holds the key (or a racing put created it)
        if doc is not None:
            return _entry(doc, "put_if_absent", key)
        return _ours_or_held(key, value, self._read("put_if_absent", key))

    def _put_by_client_clock(self, key: str, value: str, version: str, ms: int) -> Entry:
        """Plain update operators (servers without pipeline updates), so the fence's
        max(fence + 1, clock) is reached in steps, each conditional: a take-over when the
        clock is past the stored fence (one request, the usual case), else an insert, else
        a read of the document and a take-over of exactly that state."""
        now_ms = _now_ms()
        floor = now_ms * 1000
        expires_at = _date(now_ms + ms)
        fields = {"value": value, "version": version, "expires_at": expires_at}
        free = {"$or": [{"value": None}, {"expires_at": {"$lte": _date(now_ms)}}]}

        def take(match: dict[str, Any], fence: int) -> Entry | None:
            done = self._op(
                "put_if_absent", key,
                lambda c: c.find_one_and_update(
                    {"_id": key, **match, **free}, {"$set": {**fields, "fence": fence}},
                    projection={"_id": 1},
                ),
            )  # fmt: skip
            return None if done is None else Entry(value, version, fence, _seconds(expires_at))

        taken = take({"fence": {"$lt": floor}}, floor)
        if taken is not None:
            return taken
        try:
            self._op(
                "put_if_absent", key,
                lambda c: c.insert_one({"_id": key, **fields, "fence": floor}),
            )  # fmt: skip
            return Entry(value, version, floor, _seconds(expires_at))
        except DuplicateKeyError:
            pass
        doc = self._op("put_if_absent", key, lambda c: c.find_one({"_id": key}, _ENTRY_FIELDS))
        if doc is None:
            raise SimpleCacheConditionError(f"mongo: {key!r} was deleted meanwhile")
        if doc.get("value") is not None:
            current = _entry(doc, "put_if_absent", key)
            if current.expires_at * 1000 > now_ms:
                return _ours_or_held(key, value, current)
        fence = doc.get("fence")
        if not isinstance(fence, int):
            raise malformed(self.name, "put_if_absent", key, f"document: fence {fence!r}")
        # Free, with a fence at or past this clock (grants within a µs, or this clock
        # behind another client's): count on from it, if it is still exactly that state.
        same = {"version": doc.get("version"), "value": doc.get("value"), "fence": fence}
        taken = take(same, max(fence + 1, floor))
        if taken is None:
            raise SimpleCacheConditionError(f"mongo: {key!r} changed meanwhile")
        return taken

    def compare_and_set(self, key: str, value: str, *, ttl: float, version: str) -> Entry:
        ms = ttl_ms(ttl)
        new = new_version()
        match = {"_id": key, "version": version, "value": {"$ne": None}, **self._live()}
        if self.clock == "server":
            doc = self._op(
                "compare_and_set", key,
                lambda c: c.find_one_and_update(
                    match,
                    [{"$set": {"value": {"$literal": value}, "version": new,
                               "expires_at": {"$add": ["$$NOW", ms]}}}],
                    projection=_ENTRY_FIELDS, return_document=ReturnDocument.AFTER,
                ),
            )  # fmt: skip
        else:
            expires_at = _date(_now_ms() + ms)
            doc = self._op(
                "compare_and_set", key,
                lambda c: c.find_one_and_update(
                    match, {"$set": {"value": value, "version": new, "expires_at": expires_at}},
                    projection={"_id": 0, "fence": 1}, return_document=ReturnDocument.BEFORE,
                ),
            )  # fmt: skip
            if doc is not None:
                doc = {"value": value, "version": new, "fence": doc["fence"],
                       "expires_at": expires_at}  # fmt: skip
        if doc is None:
            raise SimpleCacheConditionError(f"mongo: {key!r} is not at version {version}")
        return _entry(doc, "compare_and_set", key)

    def compare_and_delete(self, key: str, *, version: str) -> None:
        match = {"_id": key, "version": version, "value": {"$ne": None}, **self._live()}
        # Stamped with the moment it was freed: the TTL index collects it gc_after later.
        freed: Any = (
            [{"$set": {"value": None, "expires_at": "$$NOW"}}]
            if self.clock == "server"
            else {"$set": {"value": None, "expires_at": _date(_now_ms())}}
        )
        result = self._op("compare_and_delete", key, lambda c: c.update_one(match, freed))
        if result.matched_count != 1:
            raise SimpleCacheConditionError(f"mongo: {key!r} is not at version {version}")

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
    # Types first: pymongo's Database and Collection answer any attribute (a sub-collection).
    if isinstance(obj, Collection):
        return obj
    if isinstance(obj, Database):
        return obj[collection]
    if isinstance(obj, pymongo.MongoClient):
        return obj[database][collection]
    if all(callable(getattr(obj, method, None)) for method in _COLLECTION_METHODS):
        return obj  # collection-like: a wrapper of one
    raise ConstraintError(
        f"MongoCache needs a pymongo MongoClient, Database or Collection, got {type(obj).__name__}"
    )


def _ours_or_held(key: str, value: str, current: Entry | None) -> Entry:
    """After a put that did not take the key: our own earlier write whose reply was lost
    holds exactly this value; anything else holds it."""
    if current is not None and current.value == value:
        return current
    raise SimpleCacheConditionError(f"mongo: {key!r} is held")


def _entry(doc: Mapping[str, Any], operation: str, key: str) -> Entry:
    try:
        value, version, fence = doc["value"], doc["version"], doc["fence"]
        if not isinstance(value, str) or not isinstance(version, str):
            raise TypeError("value and version must be strings")
        return Entry(value, version, int(fence), _seconds(doc["expires_at"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise malformed("mongo", operation, key, f"document: {exc}") from None


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
