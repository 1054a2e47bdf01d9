"""What MongoCache and AsyncMongoCache share: options, the statements and the order they
run in, the meaning of their replies, and the one mapping of pymongo's errors
(``MongoCore._failed``). No I/O here: each operation is a *flow*, a generator that yields
the collection calls it needs (``Call``) and pauses (``Pause``) and is sent each reply;
the shared drivers of ``simple_mutex._runtime.steps`` run them, ``sync.py`` performing
each call on pymongo's ``MongoClient``, ``asyncio.py`` awaiting it on its
``AsyncMongoClient``. Rationale: docs/design/mongo.md.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit, urlunsplit

from simple_mutex._core.flows import Pause
from simple_mutex._runtime.steps import StepFlow
from simple_mutex.caches._base import (
    CacheBase,
    driver_imports,
    fault,
    gc_after_seconds,
    malformed,
    new_version,
    prefix_end,
    took_over_version,
    ttl_ms,
)
from simple_mutex.contract import Entry
from simple_mutex.errors import (
    ConstraintError,
    ConstraintTypeError,
    ConstraintValueError,
    MalfunctionError,
    SimpleCacheConditionError,
)

with driver_imports("mongo"):
    import pymongo
    from pymongo import ReturnDocument
    from pymongo.errors import DuplicateKeyError, OperationFailure, PyMongoError
    from pymongo.write_concern import WriteConcern

DEFAULT_GC_AFTER = 86_400.0  # TTL garbage collection, seconds after a lease ended
_INDEX_NAME = "simple_mutex_gc"
# The server's codes for a refusal that does not pass by itself (Unauthorized,
# AuthenticationFailed): a waiter raises it at once, and rides out any other fault.
_DENIED = (13, 18)
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
# Does the document a pipeline stage reads hold a value (a holder that never freed it)?
_HELD_BEFORE = {"$eq": [{"$type": "$value"}, "string"]}


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Call:
    """One collection method call a flow needs: ``collection.<method>(*args, **kwargs)``
    (``find``'s cursor is read to the end). Its failure is thrown back into the flow as
    ``MongoCore._failed`` maps it."""

    operation: str
    key: str
    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


Flow = StepFlow[Call, T]


class MongoCore(CacheBase):
    """Everything MongoCache and AsyncMongoCache share; subclasses only do the I/O."""

    name = "mongo"
    driver_errors: tuple[type[Exception], ...] = (PyMongoError,)

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
        owner = type(self).__name__
        if clock not in ("server", "client"):
            raise ConstraintValueError(f"{owner} clock must be 'server' or 'client', got {clock!r}")
        gc_after = gc_after_seconds(owner, gc_after)
        if write_concern is not None and not isinstance(write_concern, (str, int)):
            raise ConstraintTypeError(
                f"{owner} write_concern must be 'majority', an int or None, got {write_concern!r}"
            )
        for option, name in (("database", database), ("collection", collection)):
            if not isinstance(name, str) or not name:
                raise ConstraintValueError(
                    f"{owner} {option} must be a non-empty str, got {name!r}"
                )
        coll = self._collection_of(client_or_collection, database, collection)
        if coll is None and not callable(client_or_collection):
            raise ConstraintTypeError(
                f"{owner} needs {self._wanted()}, or a function that returns one, "
                f"got {type(client_or_collection).__name__}"
            )
        super().__init__()
        self.database = database if coll is None else coll.database.name
        self.collection_name = collection if coll is None else coll.name
        self.write_concern = write_concern
        self.clock = clock
        self.gc_after = gc_after
        # What makes a client of this process's own, called on first use and again in a
        # forked child: the user's factory, or from_url's. None: the object given is used
        # in every process (pymongo >= 4.3 resets its own client in a forked child).
        self._connect: Callable[[], Any] | None = client_or_collection if coll is None else None
        self._client: Any = None  # the client _connect made in this process, to close
        self._coll: Any = None if coll is None else self._with_options(coll)
        self._ready = False

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(database={self.database!r}, "
            f"collection={self.collection_name!r}, clock={self.clock!r})"
        )

    # -- connections ---------------------------------------------------------------------

    def _collection_of(self, obj: Any, database: str, collection: str) -> Any | None:
        """The collection ``obj`` names (a client, a database, a collection or an object
        with a collection's methods), or None when it is none of them."""
        client_type, database_type, collection_type = self._kinds()
        # Types first: pymongo's Database and Collection answer any attribute.
        if isinstance(obj, collection_type):
            return obj
        if isinstance(obj, database_type):
            return obj[collection]
        if isinstance(obj, client_type):
            return obj[database][collection]
        if all(callable(getattr(obj, method, None)) for method in _COLLECTION_METHODS):
            return obj  # collection-like: a wrapper of one (mongomock's is callable too)
        return None

    def _wanted(self) -> str:
        client_type, database_type, collection_type = self._kinds()
        return (
            f"a pymongo {client_type.__name__}, {database_type.__name__} or "
            f"{collection_type.__name__}"
        )

    def _kinds(self) -> tuple[Any, Any, Any]:
        """pymongo's client, database and collection classes this cache accepts."""
        raise NotImplementedError

    def _with_options(self, coll: Any) -> Any:
        if self.write_concern is None:
            return coll
        return coll.with_options(
            write_concern=WriteConcern(w=self.write_concern, wtimeout=_WTIMEOUT_MS)
        )

    def _after_fork(self) -> None:
        if self._connect is None:
            return  # the object given, used on: pymongo resets its client in the child
        # The parent's client is dropped, not closed: closing would talk on its sockets.
        self._coll = None
        self._client = None

    def _collection(self) -> Any:
        coll = self._coll
        if coll is not None:
            return coll
        with self._guard:
            if self._coll is None:
                self._coll = self._with_options(self._open())
            return self._coll

    def _open(self) -> Any:
        """The collection on a client ``_connect`` makes for this process."""
        assert self._connect is not None  # else _coll is set once and for all
        made = self._connect()
        coll = self._collection_of(made, self.database, self.collection_name)
        if coll is None:
            raise ConstraintTypeError(
                f"{type(self).__name__}'s client factory {self._connect!r} must return "
                f"{self._wanted()}, got {type(made).__name__}; pass a plain function (it "
                "is called, not awaited) that makes a new client each time it is called"
            )
        self._client = getattr(getattr(coll, "database", None), "client", None)
        self.database, self.collection_name = coll.database.name, coll.name
        return coll

    def _failed(self, call: Call, exc: Exception) -> Exception | None:
        """The one place a driver error becomes what the flow sees: a duplicate key as
        it is (the put flows handle it), any other ``PyMongoError`` the MalfunctionError
        of the call's operation on its key; None for anything else (a signal handler's
        exception, a bug), which propagates as it is."""
        if isinstance(exc, DuplicateKeyError):
            return exc
        error: Exception
        if isinstance(exc, RuntimeError) and "different event loop" in str(exc):
            # pymongo binds an AsyncMongoClient to the first loop that used it, and
            # refuses any other before it sends anything: the caller's to fix, not a fault.
            error = ConstraintTypeError(
                f"{type(self).__name__}: its AsyncMongoClient is bound to the event loop it "
                f"was first used on ({exc}); build the client and the cache inside each "
                "event loop (each asyncio.run, each thread running a loop); for forked "
                "children, give the cache a function that makes the client instead"
            )
        elif not isinstance(exc, PyMongoError):
            return None
        elif call.method == "create_index" and isinstance(exc, OperationFailure):
            error = MalfunctionError(
                f"mongo cache could not create its TTL index on "
                f"{self.database}.{self.collection_name}.expires_at "
                f"(expireAfterSeconds={int(self.gc_after or 0)}): {exc!r}; drop or align an "
                "existing index on expires_at, or pass gc_after=None",
                lasting=True,
            )
        else:
            denied = isinstance(exc, OperationFailure) and exc.code in _DENIED
            error = fault(self.name, call.operation, call.key, exc, lasting=denied)
        error.__cause__ = exc
        return error

    # -- ready: index and clock check ----------------------------------------------------

    def _readying(self, operation: str = "ready", key: str = "") -> Flow[None]:
        """Create the TTL index and check the server's clock statements; raises
        ``MalfunctionError`` (server unreachable, rights, conflicting index) or
        ``ConstraintError`` (a server that cannot evaluate ``$$NOW``: use clock="client")."""
        if self.gc_after is not None:
            yield Call(
                operation, key, "create_index", ([("expires_at", pymongo.ASCENDING)],),
                {"expireAfterSeconds": int(self.gc_after), "name": _INDEX_NAME},
            )  # fmt: skip
        self._ready = True
        if self.clock == "server":
            yield from self._checking_server_clock()

    def _checking_server_clock(self) -> Flow[None]:
        """Take over an entry that expired a moment ago: proves the server evaluates the
        ``$$NOW`` statements (a server that silently compares wrongly would otherwise
        never let an abandoned lock go before the TTL monitor deletes it)."""
        key = f"simple-mutex.ready-probe.{random.getrandbits(64):016x}"
        ok = False
        failure: MalfunctionError | None = None
        try:
            first = yield from self._putting(key, "probe-1", ttl=0.001)
            yield Pause(0.01)
            expired = (yield from self._reading("ready", key)) is None
            second = yield from self._putting(key, "probe-2", ttl=30)
            ok = expired and second.fence > first.fence
        except SimpleCacheConditionError:
            pass
        except MalfunctionError as exc:
            failure = exc
        # Not in a ``finally``: a flow closed mid-way (its caller cancelled) must not yield.
        try:
            yield Call("ready", key, "delete_one", ({"_id": key},))
        except MalfunctionError as exc:
            failure = failure or exc
        if failure is not None:
            cause = failure.__cause__
            if isinstance(cause, PyMongoError) and not isinstance(cause, OperationFailure):
                raise failure  # unreachable, timed out...: not a question of the clock
            ok = False  # the server refused the statements, or wrote nonsense
        if not ok:
            self._ready = False
            raise ConstraintError(
                f"the MongoDB server behind {self.database}.{self.collection_name} does not "
                "evaluate $$NOW in filters and pipeline updates as MongoDB >= 4.2 does; "
                "pass clock='client' to judge expiry by this machine's clock"
            )

    # -- the contract, as flows ------------------------------------------------------------

    def _reading(self, operation: str, key: str) -> Flow[Entry | None]:
        match = {"_id": key, "value": {"$ne": None}, **self._live()}
        doc = yield Call(operation, key, "find_one", (match, _ENTRY_FIELDS))
        return None if doc is None else _entry(doc, operation, key)

    def _putting(self, key: str, value: str, *, ttl: float) -> Flow[Entry]:
        ms = ttl_ms(ttl)
        version = new_version()
        if self.clock == "client":
            return (yield from self._putting_by_client_clock(key, value, version, ms))
        # Over a document its holder never freed (it lapsed), the version gets the
        # TOOK_OVER mark: the stage reads the old document, the reply is the new one.
        took_over = took_over_version(version)
        try:
            doc = yield Call(
                "put_if_absent", key, "find_one_and_update",
                (
                    {"_id": key, **_FREE_SERVER},
                    [{"$set": {
                        "value": {"$literal": value},
                        "version": {"$cond": [_HELD_BEFORE, took_over, version]},
                        "fence": {"$max": [
                            {"$add": [{"$ifNull": ["$fence", 0]}, 1]},
                            {"$multiply": [_NOW_MS, 1000]},
                        ]},
                        "expires_at": {"$add": ["$$NOW", ms]},
                    }}],
                ),
                {"projection": _ENTRY_FIELDS, "upsert": True,
                 "return_document": ReturnDocument.AFTER},
            )  # fmt: skip
        except DuplicateKeyError:
            doc = None  # a live document holds the key (or a racing put created it)
        if doc is not None:
            entry = _entry(doc, "put_if_absent", key)
            return entry._replace(took_over=True) if entry.version == took_over else entry
        return _ours_or_held(key, value, (yield from self._reading("put_if_absent", key)))

    def _putting_by_client_clock(self, key: str, value: str, version: str, ms: int) -> Flow[Entry]:
        """Plain update operators (servers without pipeline updates), so the fence's
        max(fence + 1, clock) is reached in steps, each conditional: a take-over when the
        clock is past the stored fence (one request, the usual case), else an insert, else
        a read of the document and a take-over of exactly that state."""
        now_ms = _now_ms()
        floor = now_ms * 1000
        expires_at = _date(now_ms + ms)
        fields = {"value": value, "version": version, "expires_at": expires_at}
        free = {"$or": [{"value": None}, {"expires_at": {"$lte": _date(now_ms)}}]}

        def taking(match: dict[str, Any], fence: int) -> Flow[Entry | None]:
            before = yield Call(
                "put_if_absent", key, "find_one_and_update",
                ({"_id": key, **match, **free}, {"$set": {**fields, "fence": fence}}),
                {"projection": {"_id": 0, "value": 1}},  # the document it replaced
            )  # fmt: skip
            if before is None:
                return None
            lapsed = before.get("value") is not None  # its holder never freed it
            return Entry(value, version, fence, _seconds(expires_at), lapsed)

        taken = yield from taking({"fence": {"$lt": floor}}, floor)
        if taken is not None:
            return taken
        try:
            yield Call(
                "put_if_absent", key, "insert_one", ({"_id": key, **fields, "fence": floor},)
            )
        except DuplicateKeyError:
            pass
        else:
            created = Entry(value, version, floor, _seconds(expires_at))
            return (yield from self._refloored(key, created, now_ms))
        doc = yield Call("put_if_absent", key, "find_one", ({"_id": key}, _ENTRY_FIELDS))
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
        taken = yield from taking(same, max(fence + 1, floor))
        if taken is None:
            raise SimpleCacheConditionError(f"mongo: {key!r} changed meanwhile")
        return taken

    def _refloored(self, key: str, created: Entry, read_ms: int) -> Flow[Entry]:
        """A document this client's insert created, its fence floored at the clock read
        (``read_ms``) before the insert was sent. Were the insert held up (a paused VM, a
        slow link) for half of ``gc_after``, a document granted after that read with a
        larger fence could have been collected by the TTL index in the meantime: the fence
        is raised to the clock read now, after the insert landed, by an update on our own
        version, before the grant counts (lifecycle rule 16: no floor older than the
        write that assigns it)."""
        now_ms = _now_ms()
        if self.gc_after is None or now_ms - read_ms < self.gc_after * 500:
            return created  # nothing granted since the read can have been collected yet
        fence = max(created.fence, now_ms * 1000)
        try:
            done = yield Call(
                "put_if_absent", key, "find_one_and_update",
                ({"_id": key, "version": created.version, "fence": created.fence},
                 {"$set": {"fence": fence}}),
                {"projection": {"_id": 1}},
            )  # fmt: skip
        except MalfunctionError as exc:
            exc.withheld = True  # its fence may still be the stale one: never read back
            raise
        if done is None:
            raise SimpleCacheConditionError(f"mongo: {key!r} was taken over meanwhile")
        return created._replace(fence=fence)

    def _setting(self, key: str, value: str, *, ttl: float, version: str) -> Flow[Entry]:
        ms = ttl_ms(ttl)
        new = new_version()
        match = {"_id": key, "version": version, "value": {"$ne": None}, **self._live()}
        if self.clock == "server":
            doc = yield Call(
                "compare_and_set", key, "find_one_and_update",
                (match, [{"$set": {"value": {"$literal": value}, "version": new,
                                   "expires_at": {"$add": ["$$NOW", ms]}}}]),
                {"projection": _ENTRY_FIELDS, "return_document": ReturnDocument.AFTER},
            )  # fmt: skip
        else:
            expires_at = _date(_now_ms() + ms)
            doc = yield Call(
                "compare_and_set", key, "find_one_and_update",
                (match, {"$set": {"value": value, "version": new, "expires_at": expires_at}}),
                {"projection": {"_id": 0, "fence": 1},
                 "return_document": ReturnDocument.BEFORE},
            )  # fmt: skip
            if doc is not None:
                doc = {"value": value, "version": new, "fence": doc["fence"],
                       "expires_at": expires_at}  # fmt: skip
        if doc is None:
            raise SimpleCacheConditionError(f"mongo: {key!r} is not at version {version}")
        return _entry(doc, "compare_and_set", key)

    def _deleting(self, key: str, *, version: str) -> Flow[None]:
        # A document already freed at this very version (nothing granted since: a grant
        # writes a new version) is our own release sent again after its reply was lost.
        held = {"value": {"$ne": None}, **self._live()}
        match = {"_id": key, "version": version, "$or": [held, {"value": None}]}
        # Stamped with the moment it was freed: the TTL index collects it gc_after later.
        freed: Any = (
            [{"$set": {"value": None, "expires_at": "$$NOW"}}]
            if self.clock == "server"
            else {"$set": {"value": None, "expires_at": _date(_now_ms())}}
        )
        result = yield Call("compare_and_delete", key, "update_one", (match, freed))
        if result.matched_count != 1:
            raise SimpleCacheConditionError(f"mongo: {key!r} is not at version {version}")

    def _scanning(self, prefix: str) -> Flow[list[tuple[str, Entry]]]:
        """The find of the live entries under ``prefix``: a range on ``_id`` (its index;
        strings compare by UTF-8 bytes, code point order), so no pattern is parsed and
        every character of the prefix is literal."""
        end = prefix_end(prefix)
        ids: dict[str, Any] = {"$gte": prefix} if end is None else {"$gte": prefix, "$lt": end}
        match = {"_id": ids, "value": {"$ne": None}, **self._live()}
        docs = yield Call("scan", prefix, "find", (match, {**_ENTRY_FIELDS, "_id": 1}))
        return scanned(docs, prefix)

    def _live(self) -> dict[str, Any]:
        if self.clock == "server":
            return _LIVE_SERVER
        return {"expires_at": {"$gt": _date(_now_ms())}}


# -- helpers ---------------------------------------------------------------------------


def _ours_or_held(key: str, value: str, current: Entry | None) -> Entry:
    """After a put that did not take the key: our own earlier write whose reply was lost
    holds exactly this value; anything else holds it."""
    if current is not None and current.value == value:
        return current
    raise SimpleCacheConditionError(f"mongo: {key!r} is held")


def scanned(docs: list[dict[str, Any]], prefix: str) -> list[tuple[str, Entry]]:
    """The (key, entry) pairs of the scan's documents."""
    found = []
    for doc in docs:
        key = doc.pop("_id")
        if isinstance(key, str) and key.startswith(prefix):
            found.append((key, _entry(doc, "scan", key)))
    return found


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


def url_options(url: str) -> dict[str, Any]:
    """Timeouts for a client made from ``url``, unless it sets its own: nothing may hang
    on a dead server."""
    given = {name.lower() for name, _ in parse_qsl(urlsplit(url).query)}
    if "timeoutms" in given:
        return {}  # client-side operation timeout (CSOT) set: it governs everything
    return {k: v for k, v in _URL_TIMEOUTS.items() if k.lower() not in given}


def split_url(url: str) -> tuple[str, dict[str, Any]]:
    """A ``mongodb://`` or ``mongodb+srv://`` URL: the URL for the client (with our own
    options removed) and the cache's options (database, collection, write_concern, clock).

    ``mongodb[+srv]://[user:password@]host[:port][,host...]/[database][?options]``: the
    database defaults to ``simple_mutex``; three options are read here, not by pymongo:
    ``collection`` (default ``locks``), ``clock`` (``server`` or ``client``) and
    ``w`` (default ``majority``). Everything else (replicaSet, tls, authSource,
    timeouts...) goes to the client.
    """
    scheme = url.partition(":")[0].lower()
    if scheme not in ("mongodb", "mongodb+srv"):
        raise ConstraintValueError(
            f"unknown MongoDB URL scheme {scheme!r}; use mongodb:// or mongodb+srv://"
        )
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
    options = {
        "database": unquote(parts.path.lstrip("/").split("/")[0]) or "simple_mutex",
        "collection": ours.get("collection", "locks") or "locks",
        "write_concern": int(w) if w.isdigit() else w,
        "clock": ours.get("clock", "server"),
    }
    return urlunsplit(parts._replace(query="&".join(kept))), options
