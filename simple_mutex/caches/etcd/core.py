"""What an etcd cache's faces share: the key layout, the records, the transactions each
operation runs and the meaning of their replies. No I/O here: each operation is a *flow*,
a generator yielding the requests it needs (``Grant``, ``Revoke``, ``Txn``, ``Range``) and
sent each reply; ``simple_mutex._runtime.steps`` runs them, ``sync.py`` performing each
request with etcd3gw, ``asyncio.py`` awaiting it with aetcd. What both faces do around
their I/O is here too: the one error mapping, the order members are tried in, the
revision a waiter's watch starts from. Rationale: docs/design/etcd.md.

Under the cache's prefix ``P`` (always ending in ``/``), a lock key ``k`` is two etcd keys:

* ``P`` ``k/`` ``k``: the entry, attached to an etcd lease, so the *server* deletes it when
  the lease runs out. Its ``create_revision`` is the grant's fence (the cluster's revision
  of the transaction that created it: raft-replicated, so it never goes back, across
  restarts and leader changes), its ``mod_revision`` the entry's version (every write
  changes it). The value is a small JSON record: the engine's value and ``expires_at``.
* ``P`` ``t/`` ``k``: the trace, with no lease: ``held`` from a grant on, ``freed`` once
  ``compare_and_delete`` freed the key. A grant that finds ``held`` took over a holder
  that never freed the key (its lease ran out). One small key per lock key ever used.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

from simple_mutex._runtime.steps import StepFlow
from simple_mutex.caches._base import CacheBase, fault, malformed, prefix_end
from simple_mutex.contract import Entry
from simple_mutex.errors import (
    ConstraintTypeError,
    ConstraintValueError,
    MalfunctionError,
    SimpleCacheConditionError,
)

DEFAULT_PREFIX = "simple_mutex/"
DEFAULT_TIMEOUT = 5.0  # seconds a request may take: nothing may hang on a dead member
DEFAULT_PORT = 2379
_HELD_AT_KEYS = 4096  # keys whose last revision seen held is remembered
# What asyncio raises when a gRPC channel is used on a loop other than its own.
_OTHER_LOOP = ("attached to a different loop", "Event loop is closed")
HELD, FREED = b"held", b"freed"
_RECORD = "simple_mutex.etcd/1"  # the record's mark: anything else there is not ours

T = TypeVar("T")


class KV(NamedTuple):
    """One etcd key-value as a reply carries it (keys and values as bytes)."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class Request:
    """One request a flow needs, named by the operation and key it serves (for errors)."""

    operation: str
    key: str


@dataclass(frozen=True, slots=True)
class Grant(Request):
    """LeaseGrant: a lease of ``ttl`` whole seconds; replied ``(lease id, granted ttl)``."""

    ttl: int


@dataclass(frozen=True, slots=True)
class Revoke(Request):
    """LeaseRevoke of a lease nothing needs any more (its keys, if any, are deleted)."""

    lease: int


@dataclass(frozen=True, slots=True)
class Put:
    key: bytes
    value: bytes
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Get:
    key: bytes


@dataclass(frozen=True, slots=True)
class Delete:
    key: bytes


Op = Put | Get | Delete


@dataclass(frozen=True, slots=True)
class Txn(Request):
    """One etcd transaction: if ``target`` (``CREATE`` or ``MOD``) revision of ``subject``
    equals ``revision``, run ``success``, else ``failure``. Replied as ``TxnReply``."""

    subject: bytes
    target: str
    revision: int
    success: tuple[Op, ...]
    failure: tuple[Op, ...] = ()


class TxnReply(NamedTuple):
    succeeded: bool
    ranges: list[list[KV]]
    """The key-values of each ``Get`` of the branch that ran, in order."""


@dataclass(frozen=True, slots=True)
class Watch:
    """What ``wait`` watches: deletions of ``start`` (or of [start, end): a semaphore's
    slots, where the others in the range wake it spuriously) from ``revision`` on (None:
    from now)."""

    start: bytes
    end: bytes | None
    revision: int | None


@dataclass(frozen=True, slots=True)
class Range(Request):
    """A linearizable read of the keys in [start, end) (``end`` None: ``start`` alone);
    replied as a list of ``KV``."""

    start: bytes
    end: bytes | None = None


Step = Request
Flow = StepFlow[Step, T]


def lease_seconds(ttl: float) -> int:
    """An etcd lease is whole seconds: rounded up, never shorter than the lock's lease
    (the server raises it further to its own minimum TTL, 2 s by default)."""
    return max(1, math.ceil(ttl))


def normal_prefix(prefix: object) -> str:
    """The cache's prefix, ending in ``/``: every key the cache writes starts with it."""
    if not isinstance(prefix, str):
        raise ConstraintTypeError(f"EtcdCache prefix must be a str, got {prefix!r}")
    prefix = prefix.strip("/")
    if not prefix:
        raise ConstraintValueError("EtcdCache prefix must not be empty: it bounds every key")
    return prefix + "/"


class EtcdCore(CacheBase):
    """The flows of the five operations and scan, over one prefix."""

    name = "etcd"
    driver_errors: tuple[type[Exception], ...] = ()  # each face's driver's errors

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        super().__init__()
        self.prefix = normal_prefix(prefix)
        self._entries = self.prefix + "k/"
        self._traces = self.prefix + "t/"
        self._current = 0  # the member that answered last
        # key -> the latest revision at which this process saw the key held (by a grant, or
        # by a failed one): any release a waiter must hear of comes after it.
        self._held_at: dict[str, int] = {}

    def entry_key(self, key: str) -> bytes:
        return (self._entries + key).encode()

    def trace_key(self, key: str) -> bytes:
        return (self._traces + key).encode()

    # -- what both faces do around their I/O ------------------------------------------------

    def _failed(self, step: Step, exc: Exception) -> Exception | None:
        """The one place a driver error becomes what the flow sees: any error of the
        face's driver (``driver_errors``) is the MalfunctionError of the step's
        operation on its key; None for anything else (a signal handler's exception, a
        bug), which propagates as it is. A gRPC channel used on another event loop than
        the one it was opened on (the asyncio face's) fails at once, before sending: the
        caller's to fix, not a fault."""
        if isinstance(exc, RuntimeError) and any(m in str(exc) for m in _OTHER_LOOP):
            return self._bound_elsewhere(str(exc)[:120])
        if not isinstance(exc, self.driver_errors):
            return None
        error = fault(self.name, step.operation, step.key, exc, lasting=self._lasting(exc))
        error.__cause__ = exc
        return error

    def _lasting(self, exc: Exception) -> bool:
        """Is ``exc`` (one of ``driver_errors``) a refusal that does not pass by itself
        (permission denied, not logged in, a request etcd calls invalid, a reply that is
        not etcd's)? A waiter raises it at once. Anything else it rides out: a member down
        or timing out, no leader, a proposal dropped in an election. Each face's own."""
        return False

    def _bound_elsewhere(self, detail: str) -> ConstraintTypeError:
        """The error for a client used on another event loop than its first."""
        return ConstraintTypeError(
            f"{type(self).__name__}: its aetcd client is bound to the event loop it was "
            f"first used on ({detail}); build the client and the cache inside each event "
            "loop (each asyncio.run, each thread running a loop)"
        )

    def _members(self, count: int) -> list[int]:
        """The order to try ``count`` members in: the one that answered last first. A
        member that refuses (down, partitioned, no leader) is passed over for the next;
        the face calls ``_answered`` with the one that did."""
        return [(self._current + attempt) % count for attempt in range(count)]

    def _answered(self, index: int) -> None:
        self._current = index

    def _granted(self, key: str, entry: Entry | None, seen: int) -> Entry:
        """A grant's outcome (``_putting``'s), remembered for a later ``wait`` on the key."""
        self._saw_held(key, seen if entry is None else int(entry.version))
        if entry is None:
            raise SimpleCacheConditionError(f"etcd: {key!r} is held")
        return entry

    def _saw_held(self, key: str, revision: int) -> None:
        """Remember the latest revision ``key`` was seen held at. Kept for a bounded
        number of keys: a key forgotten only costs its waiter a wake-up by its poll."""
        held_at = self._held_at
        if len(held_at) >= _HELD_AT_KEYS and key not in held_at:
            held_at.clear()
        held_at[key] = max(revision, held_at.get(key, 0))

    def _watch(self, keys: Sequence[str]) -> Watch:
        """What ``wait(keys)`` watches: from just after the latest revision at which this
        process saw a key held (its failed grant, in whatever thread), so a release in
        between is replayed at once."""
        revisions = [self._held_at[key] for key in keys if key in self._held_at]
        subjects = sorted(self.entry_key(key) for key in keys)
        end = subjects[-1] + b"\0" if len(subjects) > 1 else None
        return Watch(subjects[0], end, min(revisions) + 1 if revisions else None)

    # -- the contract, as flows ------------------------------------------------------------

    def _reading(self, operation: str, key: str) -> Flow[Entry | None]:
        found = yield Range(operation, key, self.entry_key(key))
        return _entry(found[0], operation, key) if found else None

    def _putting(self, key: str, value: str, *, ttl: float) -> Flow[tuple[Entry | None, int]]:
        """The grant; when the key is held by another, ``(None, revision it was seen
        held at)`` (the waiter's watch starts after it: no release is missed)."""
        asked = time.time()  # the server's lease starts later: expires_at is never late
        lease, granted = yield Grant("put_if_absent", key, lease_seconds(ttl))
        record = _record(value, asked + granted)
        subject, trace = self.entry_key(key), self.trace_key(key)
        # The entry read back after its write: its create_revision is the fence, its
        # mod_revision the version (the transaction's revision, which only a face whose
        # client tells it could read otherwise).
        reply: TxnReply = yield Txn(
            "put_if_absent", key, subject, "CREATE", 0,
            success=(Get(trace), Put(subject, record, lease), Put(trace, HELD), Get(subject)),
            failure=(Get(subject),),
        )  # fmt: skip
        if reply.succeeded:
            traced, written = reply.ranges
            took_over = bool(traced) and traced[0].value == HELD
            return _entry(written[0], "put_if_absent", key)._replace(took_over=took_over), 0
        yield from self._revoking("put_if_absent", key, lease)
        current = reply.ranges[0]
        if not current:  # the transaction is atomic: a failed compare means an entry
            raise malformed("etcd", "put_if_absent", key, "held, but no entry read")
        entry = _entry(current[0], "put_if_absent", key)
        if entry.value == value:
            return entry, 0  # our own earlier write, whose reply was lost
        # Seen held at its last write: the release a waiter must hear of comes after it.
        return None, current[0].mod_revision

    def _setting(self, key: str, value: str, *, ttl: float, version: str) -> Flow[Entry]:
        revision = _revision(version)
        if revision is None:
            raise SimpleCacheConditionError(f"etcd: {key!r} is not at version {version}")
        asked = time.time()
        lease, granted = yield Grant("compare_and_set", key, lease_seconds(ttl))
        record = _record(value, asked + granted)
        subject = self.entry_key(key)
        reply: TxnReply = yield Txn(
            "compare_and_set", key, subject, "MOD", revision,
            success=(Get(subject), Put(subject, record, lease), Get(subject)),
        )  # fmt: skip
        if not reply.succeeded:
            yield from self._revoking("compare_and_set", key, lease)
            raise SimpleCacheConditionError(f"etcd: {key!r} is not at version {version}")
        (old,), (new,) = reply.ranges
        _entry(old, "compare_and_set", key)  # a record of ours it replaced
        yield from self._revoking("compare_and_set", key, old.lease)
        return _entry(new, "compare_and_set", key)

    def _deleting(self, key: str, *, version: str) -> Flow[None]:
        revision = _revision(version)
        if revision is None:
            raise SimpleCacheConditionError(f"etcd: {key!r} is not at version {version}")
        subject = self.entry_key(key)
        reply: TxnReply = yield Txn(
            "compare_and_delete", key, subject, "MOD", revision,
            success=(Get(subject), Delete(subject), Put(self.trace_key(key), FREED)),
        )  # fmt: skip
        if not reply.succeeded:
            raise SimpleCacheConditionError(f"etcd: {key!r} is not at version {version}")
        yield from self._revoking("compare_and_delete", key, reply.ranges[0][0].lease)

    def _revoking(self, operation: str, key: str, lease: int) -> Flow[None]:
        """Free a lease nothing uses now. Only tidiness (a lease without keys runs out by
        itself), so a failure to revoke is no failure of the operation."""
        if not lease:
            return
        with contextlib.suppress(MalfunctionError):
            yield Revoke(operation, key, lease)

    def _scanning(self, prefix: str) -> Flow[list[tuple[str, Entry]]]:
        """A range over the entries under ``prefix``: no pattern, every character literal."""
        start = self._entries + prefix
        end = prefix_end(start)
        assert end is not None  # the cache's prefix is never empty
        found = yield Range("scan", prefix, start.encode(), end.encode())
        listed = []
        for kv in found:
            key = kv.key.decode()[len(self._entries) :]
            listed.append((key, _entry(kv, "scan", key)))
        return listed


# -- records -------------------------------------------------------------------------------


def _record(value: str, expires_at: float) -> bytes:
    return json.dumps({"record": _RECORD, "value": value, "expires_at": expires_at}).encode()


def _entry(kv: KV, operation: str, key: str) -> Entry:
    """The Entry of an entry key's key-value; a value this library did not write is a
    malfunction, never a busy key."""
    try:
        record = json.loads(kv.value)
        if not isinstance(record, dict) or record.get("record") != _RECORD:
            raise ValueError("not a simple-mutex record")
        value, expires_at = record["value"], record["expires_at"]
        if not isinstance(value, str) or not isinstance(expires_at, (int, float)):
            raise TypeError("value must be a string, expires_at a number")
        if not kv.lease:
            raise ValueError("no lease: it would never expire")
    except (ValueError, TypeError, KeyError) as exc:
        raise malformed("etcd", operation, key, f"value: {exc}") from None
    return Entry(value, str(kv.mod_revision), kv.create_revision, float(expires_at))


def _revision(version: str) -> int | None:
    """The mod_revision a version names, or None for one no entry can have (a revision
    is >= 1; 0 would match an absent key)."""
    if not isinstance(version, str) or not (version.isascii() and version.isdigit()):
        return None
    revision = int(version)
    return revision if revision >= 1 else None
