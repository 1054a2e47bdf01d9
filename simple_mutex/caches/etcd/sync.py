"""EtcdCache: every machine that reaches one etcd cluster (etcd >= 3.4).

The client is etcd3gw (``Etcd3Client``), which speaks etcd's own JSON gateway (``/v3/``,
served by every etcd on its client port) over ``requests``: maintained, pure Python, and
free of protobuf and grpc, so it installs beside any version of those. python-etcd3
(``etcd3``) is not used: unmaintained since 2020, it breaks on protobuf >= 4.

* Each operation is one etcd transaction on the entry's ``mod_revision`` (its version);
  a grant compares ``create_revision == 0`` (no entry). The grant's fence is the
  revision of the transaction that created the entry: the cluster's one counter, kept
  by raft, so it grows across restarts and leader changes, with no clock in it.
* Expiry is an etcd lease the server keeps: the entry is attached to it and deleted when
  it runs out. Leases are whole seconds (rounded up: never shorter than the lock's
  lease), and never below the server's minimum TTL (2 s with the default 1 s election
  timeout). A renewal grants a new lease and moves the entry to it in the version's
  transaction (keep-alive cannot change a lease's TTL), then revokes the old one.
* ``wait`` watches the keys (deletions only) from the revision at which the failed grant
  saw them held, so a release in between wakes it at once; no polling.
* Several endpoints (``etcd://h1:2379,h2:2379/prefix``, or a list of clients): a request
  the member refuses (down, or no leader) goes to the next one.
* Every etcd3gw or requests error is a ``MalfunctionError`` naming etcd, the operation
  and the key (``EtcdCore._failed``, the one mapping). A forked child opens clients of
  its own. Rationale: docs/design/etcd.md. The asyncio face: ``AsyncEtcdCache`` (aetcd).
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

from simple_mutex._runtime.steps import drive
from simple_mutex.caches._base import driver_imports
from simple_mutex.contract import Entry
from simple_mutex.errors import ConstraintTypeError, ConstraintValueError

from .core import (
    DEFAULT_PORT,
    DEFAULT_PREFIX,
    DEFAULT_TIMEOUT,
    KV,
    Delete,
    EtcdCore,
    Flow,
    Get,
    Grant,
    Put,
    Range,
    Revoke,
    Step,
    Txn,
    TxnReply,
)

with driver_imports("etcd"):
    import etcd3gw
    import requests
    from etcd3gw import exceptions as gateway
    from etcd3gw.lease import Lease
    from etcd3gw.watch import Watcher

T = TypeVar("T")
API_PATH = "/v3/"  # etcd >= 3.4: no discovery request per client
# The gateway's answers that do not pass by themselves: etcd3gw raises a plain
# Etcd3Exception carrying the reason of a status it has no class for (gRPC's
# INVALID_ARGUMENT, UNAUTHENTICATED, PERMISSION_DENIED, NOT_FOUND). Its own classes
# (member unavailable or timing out, no leader: 503, 504, 500) and requests' errors
# are ridden out by a waiter, as is a 429 (too many requests).
_REFUSALS = frozenset({"Bad Request", "Unauthorized", "Forbidden", "Not Found"})


class BadReply(Exception):
    """A gateway reply without the fields etcd always sends (not an etcd we know)."""


class _Session(requests.Session):
    """A session whose requests time out unless they say otherwise: etcd3gw opens its
    watch streams with no timeout at all."""

    def __init__(self, timeout: float) -> None:
        super().__init__()
        self.default_timeout = timeout

    def request(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("timeout") is None:
            kwargs["timeout"] = self.default_timeout
        return super().request(*args, **kwargs)


class EtcdCache(EtcdCore):
    """A ConditionalCache over etcd3gw ``Etcd3Client`` (or a list of them, one per
    member: a refused request goes to the next). Every key is written under ``prefix``
    (``<prefix>/k/`` entries, ``<prefix>/t/`` traces); nothing else is touched.
    ``close_clients``: ``close()`` closes the clients' sessions too."""

    driver_errors: tuple[type[Exception], ...] = (
        gateway.Etcd3Exception,
        requests.RequestException,
        BadReply,
    )

    def __init__(
        self, client: Any, *, prefix: str = DEFAULT_PREFIX, close_clients: bool = False
    ) -> None:
        clients = list(client) if isinstance(client, (list, tuple)) else [client]
        for given in clients:
            if not isinstance(given, etcd3gw.Etcd3Client):
                raise ConstraintTypeError(
                    f"EtcdCache needs an etcd3gw Etcd3Client (or a list of them), "
                    f"got {type(given).__name__}"
                )
        if not clients:
            raise ConstraintValueError("EtcdCache needs at least one etcd3gw Etcd3Client")
        super().__init__(prefix)
        self._clients: list[Any] = clients
        self._owned = close_clients  # close() closes them: made from a URL, or after a fork

    def _lasting(self, exc: Exception) -> bool:
        if isinstance(exc, BadReply):
            return True
        return type(exc) is gateway.Etcd3Exception and bool(_REFUSALS & set(exc.args))

    def __repr__(self) -> str:
        members = ",".join(f"{c.host}:{c.port}" for c in self._clients)
        return f"EtcdCache({members!r}, prefix={self.prefix!r})"

    def close(self) -> None:
        """Close the sessions of the clients this cache opened itself."""
        if self._owned:
            for client in self._clients:
                client.session.close()

    def _after_fork(self) -> None:
        # The parent's sessions hold its sockets: this process gets clients of its own.
        self._clients = [_copy(client) for client in self._clients]
        self._owned = True

    # -- I/O -----------------------------------------------------------------------------

    def _on_a_member(self, call: Any) -> Any:
        """``call(client)`` on each member in ``_members``' order, until one answers."""
        clients = self._clients
        *others, last = self._members(len(clients))
        for index in others:
            try:
                reply = call(clients[index])
            except gateway.ConnectionFailedError:
                continue
            self._answered(index)
            return reply
        reply = call(clients[last])
        self._answered(last)
        return reply

    def _perform(self, step: Step) -> Any:
        if isinstance(step, Grant):
            lease = self._on_a_member(lambda client: client.lease(step.ttl))
            return int(lease.id), step.ttl
        if isinstance(step, Revoke):
            return self._on_a_member(lambda client: Lease(step.lease, client).revoke())
        if isinstance(step, Range):
            body: dict[str, Any] = {"request_range": {"key": _b64(step.start)}}
            if step.end is not None:
                body["request_range"]["range_end"] = _b64(step.end)
            reply = self._on_a_member(lambda client: client.transaction({"success": [body]}))
            return _txn_reply(reply).ranges[0]
        if isinstance(step, Txn):
            body = _txn_body(step)
            return _txn_reply(self._on_a_member(lambda client: client.transaction(body)))
        raise TypeError(f"not an etcd request: {step!r}")

    def _run(self, flow: Flow[T]) -> T:
        return drive(flow, self._perform, self._failed)

    # -- the contract --------------------------------------------------------------------

    def get(self, key: str) -> Entry | None:
        return self._run(self._reading("get", key))

    def scan(self, prefix: str) -> Iterator[tuple[str, Entry]]:
        return iter(self._run(self._scanning(prefix)))

    def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:
        return self._granted(key, *self._run(self._putting(key, value, ttl=ttl)))

    def compare_and_set(self, key: str, value: str, *, ttl: float, version: str) -> Entry:
        return self._run(self._setting(key, value, ttl=ttl, version=version))

    def compare_and_delete(self, key: str, *, version: str) -> None:
        self._run(self._deleting(key, version=version))

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        """Until a watch on ``keys`` sees one deleted (freed or expired), at most
        ``timeout`` seconds (``EtcdCore._watch``: from the revision a grant saw it held)."""
        if timeout <= 0 or not keys:
            return
        # The deadline counts from the call: opening the watch stream is part of the wait.
        deadline = time.monotonic() + timeout
        watch = self._watch(keys)
        woken = threading.Event()
        options: dict[str, Any] = {"filters": ["NOPUT"]}
        if watch.revision is not None:
            options["start_revision"] = watch.revision
        if watch.end is not None:
            options["range_end"] = watch.end
        step = Range("wait", keys[0], watch.start)
        try:
            watcher = self._on_a_member(lambda client: _watch(client, watch.start, woken, options))
        except Exception as exc:
            if (error := self._failed(step, exc)) is None:
                raise
            raise error from exc
        try:
            woken.wait(max(0.0, deadline - time.monotonic()))
        finally:
            watcher.stop()


# -- the gateway's JSON ---------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _watch(client: Any, key: bytes, woken: threading.Event, options: dict[str, Any]) -> Any:
    """etcd3gw's watcher, its stream opened (it raises here when the member refuses)."""
    try:
        return Watcher(client, key, lambda event: woken.set(), **options)
    except requests.ConnectionError as exc:
        raise gateway.ConnectionFailedError(str(exc)) from exc


def _op(op: Put | Get | Delete) -> dict[str, Any]:
    if isinstance(op, Put):
        put: dict[str, Any] = {"key": _b64(op.key), "value": _b64(op.value)}
        if op.lease:
            put["lease"] = op.lease
        return {"request_put": put}
    if isinstance(op, Get):
        return {"request_range": {"key": _b64(op.key)}}
    return {"request_delete_range": {"key": _b64(op.key)}}


def _txn_body(txn: Txn) -> dict[str, Any]:
    field = "create_revision" if txn.target == "CREATE" else "mod_revision"
    compare = {"key": _b64(txn.subject), "result": "EQUAL", "target": txn.target}
    return {
        "compare": [{**compare, field: txn.revision}],
        "success": [_op(op) for op in txn.success],
        "failure": [_op(op) for op in txn.failure],
    }


def _txn_reply(reply: Any) -> TxnReply:
    """A TxnReply from the gateway's JSON (base64 bytes, int64 as strings; fields at
    their default value are left out)."""
    try:
        ranges = []
        for response in reply.get("responses", []):
            if "response_range" in response:
                ranges.append([_kv(raw) for raw in response["response_range"].get("kvs", [])])
        int(reply["header"]["revision"])  # every reply of etcd's has it: else not etcd
        return TxnReply(bool(reply.get("succeeded")), ranges)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise BadReply(f"unexpected reply from etcd: {exc!r}") from None


def _kv(raw: dict[str, Any]) -> KV:
    return KV(
        base64.b64decode(raw["key"]),
        base64.b64decode(raw.get("value", "")),
        int(raw.get("create_revision", 0)),
        int(raw.get("mod_revision", 0)),
        int(raw.get("lease", 0)),
    )


# -- clients -------------------------------------------------------------------------------


def _client(host: str, port: int, timeout: float, protocol: str = "http") -> Any:
    return etcd3gw.Etcd3Client(
        host=host, port=port, protocol=protocol, timeout=timeout, api_path=API_PATH,
        session=_Session(timeout),
    )  # fmt: skip


def _copy(client: Any) -> Any:
    """A client like ``client`` on a session of its own (its TLS settings copied)."""
    timeout = client.timeout if client.timeout is not None else DEFAULT_TIMEOUT
    copy = _client(client.host, client.port, timeout, client.protocol)
    copy.session.verify, copy.session.cert = client.session.verify, client.session.cert
    return copy


def endpoints(netloc: str) -> list[tuple[str, int]]:
    """``host[:port][,host[:port]...]`` (an IPv6 host in brackets) as (host, port) pairs."""
    found = []
    for part in netloc.split(","):
        if not part:
            raise ValueError("empty endpoint")
        probe = urlsplit(f"//{part}")
        host = probe.hostname
        if not host or probe.username or probe.password:
            raise ValueError("bad endpoint")
        found.append((host, probe.port or DEFAULT_PORT))
    return found


def from_url(url: str) -> EtcdCache:
    """An EtcdCache from ``etcd://host:port[,host:port...]/prefix[?timeout=seconds]``:
    one client per member (plain HTTP, each request timing out after ``timeout``, 5 s by
    default); the path is the prefix every key is written under (``simple_mutex``)."""
    try:
        parts = urlsplit(url)
        if parts.scheme.lower() != "etcd":
            raise ValueError("not etcd://")
        options = dict(parse_qsl(parts.query, keep_blank_values=True))
        unknown = set(options) - {"timeout"}
        if unknown:
            raise ValueError(f"unknown option {sorted(unknown)[0]!r}")
        timeout = float(options.get("timeout", DEFAULT_TIMEOUT))
        if not 0 < timeout < 3600:
            raise ValueError("timeout must be seconds in (0, 3600)")
        members = endpoints(parts.netloc)
    except ValueError as exc:
        raise ConstraintValueError(f"bad etcd:// URL: {exc}") from None
    prefix = unquote(parts.path).strip("/") or DEFAULT_PREFIX
    clients = [_client(host, port, timeout) for host, port in members]
    return EtcdCache(clients, prefix=prefix, close_clients=True)
