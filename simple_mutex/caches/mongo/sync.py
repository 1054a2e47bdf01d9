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
* A cache built from a URL, or given a client factory, opens a client of its own in
  each process that uses it (a forked child too); one given a client uses that client
  in a forked child as well (pymongo >= 4.3 resets it there, with a warning).
* Every pymongo error is a ``MalfunctionError`` naming mongo, the operation and the key;
  a retried put finds its own value.

The statements, as flows, are shared with ``AsyncMongoCache`` (pymongo's
``AsyncMongoClient``) in ``core.py``. Rationale: docs/design/mongo.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar

from simple_mutex._runtime.steps import drive
from simple_mutex.caches._base import SleepingWait, driver_imports
from simple_mutex.contract import Entry
from simple_mutex.errors import ConstraintError, ConstraintValueError

from .core import Call, Flow, MongoCore, split_url, url_options

with driver_imports("mongo"):
    import pymongo
    from pymongo.collection import Collection
    from pymongo.database import Database
    from pymongo.errors import PyMongoError

T = TypeVar("T")


class MongoCache(SleepingWait, MongoCore):
    """A ConditionalCache over a pymongo ``MongoClient``, ``Database`` or ``Collection``,
    or a function of no arguments that returns a new one (a client factory).

    A client or database gets the collection ``database`` / ``collection``; a collection
    is used as it is. A factory is called on first use in each process (a forked child
    calls it again), and ``close()`` closes the client it made: the way, beside a URL
    (``from_url``), to give each process of a forking host (Celery prefork, RQ) a client
    of its own with options a URL cannot carry (event listeners, a type registry, a TLS
    context). A client given as it is is used in forked children too: pymongo (>= 4.3)
    resets it there (recent versions warn "MongoClient opened before fork").

    ``write_concern`` ("majority", an int, or None to keep the collection's own) applies
    to every write; ``clock`` is "server" or "client" (module docstring); ``gc_after`` is
    the TTL index's delay in seconds, or None for no index.
    """

    def _kinds(self) -> tuple[Any, Any, Any]:
        return pymongo.MongoClient, Database, Collection

    def close(self) -> None:
        """Close the client this cache opened itself (from a URL or its factory); the next
        use opens another."""
        client, self._client = self._client, None
        if client is not None:
            self._coll = None
            client.close()

    def ready(self, operation: str = "ready", key: str = "") -> None:
        """Create the TTL index and check the server's clock statements; raises
        ``MalfunctionError`` (server unreachable, rights, conflicting index) or
        ``ConstraintError`` (a server that cannot evaluate ``$$NOW``: use clock="client")."""
        drive(self._readying(operation, key), self._perform, self._failed)

    def _run(self, operation: str, key: str, flow: Flow[T]) -> T:
        if not self._ready:
            self.ready(operation, key)  # idempotent: threads racing here do no harm
        return drive(flow, self._perform, self._failed)

    def _perform(self, call: Call) -> Any:
        reply = getattr(self._collection(), call.method)(*call.args, **call.kwargs)
        return list(reply) if call.method == "find" else reply  # a cursor read here

    # -- the contract --------------------------------------------------------------------

    def get(self, key: str) -> Entry | None:
        return self._run("get", key, self._reading("get", key))

    def scan(self, prefix: str) -> Iterator[tuple[str, Entry]]:
        return iter(self._run("scan", prefix, self._scanning(prefix)))

    def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:
        return self._run("put_if_absent", key, self._putting(key, value, ttl=ttl))

    def compare_and_set(self, key: str, value: str, *, ttl: float, version: str) -> Entry:
        flow = self._setting(key, value, ttl=ttl, version=version)
        return self._run("compare_and_set", key, flow)

    def compare_and_delete(self, key: str, *, version: str) -> None:
        self._run("compare_and_delete", key, self._deleting(key, version=version))


def from_url(url: str) -> MongoCache:
    """A MongoCache from a ``mongodb://`` or ``mongodb+srv://`` URL (``split_url`` says
    which options are the cache's; the rest go to ``pymongo.MongoClient``)."""
    scheme = url.partition(":")[0].lower()
    try:
        plain, options = split_url(url)
        client = pymongo.MongoClient(plain, **url_options(plain))
    except ConstraintError:
        raise  # our own checks name the fix and echo no secret
    except (PyMongoError, TypeError, ValueError) as exc:
        # Only the scheme is echoed: the rest of a URL may hold a password.
        raise ConstraintValueError(f"bad {scheme}:// URL: {type(exc).__name__}") from None
    cache = MongoCache(client, **options)
    # A client of each process's own: this one here, a new one in a forked child.
    cache._connect = lambda: pymongo.MongoClient(plain, **url_options(plain))
    cache._client = client
    return cache
