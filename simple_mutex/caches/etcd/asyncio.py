"""AsyncEtcdCache: EtcdCache on aetcd, etcd's asyncio gRPC client (``aetcd.Client``).

The same keys, records, transactions, leases, fences and fault mapping as ``EtcdCache``:
every operation is a flow of ``core.py``, which this module only awaits, and each
request goes to the members in ``core``'s order. ``Mutex(aetcd.Client)`` wraps the
client in this cache.

* aetcd speaks gRPC (grpcio, protobuf >= 4), maintained, and installs beside current
  grpcio and protobuf; it is the ``etcd`` extra's second driver.
* ``wait`` is a watch on the keys (deletions only) from the revision at which a failed
  grant saw them held, as ``EtcdCache``'s: no polling, no thread.
* gRPC and fork(): a forked child cannot use the parent's channels, nor gRPC at all once
  the parent had used gRPC's asyncio layer (measured with grpcio 1.85: the child's first
  call hangs, or the child dies of SIGSEGV, with or without ``GRPC_ENABLE_FORK_SUPPORT``;
  closing the parent's channels first did not make it safe in every run: gRPC's poller
  thread lives on until the channels are collected). So, given a client factory (a
  function of no arguments returning a new ``aetcd.Client``, or a list of them, one per
  member), the cache calls it on first use in each process; and a forked child is refused
  at once with a ``ConstraintError`` naming the fix, never left to hang, when the cache
  was given its clients as they are (they are the parent's), or when any AsyncEtcdCache
  of the parent had sent a request before the fork. For Celery prefork or RQ: give a
  factory, and lock only in the forked children. gRPC used in the parent outside any
  AsyncEtcdCache is not seen.
"""

from __future__ import annotations

import asyncio
import os
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from simple_mutex._runtime.steps import drive_async
from simple_mutex.caches._base import driver_imports
from simple_mutex.contract import Entry
from simple_mutex.errors import ConstraintError, ConstraintTypeError, ConstraintValueError

from . import core
from .core import DEFAULT_PREFIX, KV, EtcdCore, Flow, Step, Watch

with driver_imports("etcd"):
    import aetcd  # type: ignore[import-untyped, unused-ignore]
    from aetcd import exceptions as grpc_errors  # type: ignore[import-untyped, unused-ignore]
    from aetcd import rpc, rtypes, transactions  # type: ignore[import-untyped, unused-ignore]

T = TypeVar("T")


class _Grpc:
    """Whether an AsyncEtcdCache of this process, or of a process it was forked from,
    sent a request (and so started gRPC's asyncio layer): a forked child inherits it."""

    used_in: int | None = None  # the pid of the process that first did


class AsyncEtcdCache(EtcdCore):
    """An AsyncConditionalCache over an aetcd ``Client`` (or a list of them, one per
    member: a refused request goes to the next), or a function of no arguments that
    returns a new one or a new list (called in each process). Keys as ``EtcdCache``'s,
    under ``prefix``: both may share one cluster and prefix. ``close_clients``:
    ``close()`` closes given clients too (a factory's are always closed)."""

    driver_errors: tuple[type[Exception], ...] = (grpc_errors.ClientError,)

    def __init__(
        self, client: Any, *, prefix: str = DEFAULT_PREFIX, close_clients: bool = False
    ) -> None:
        factory = None if _clients_of(client) else client
        if factory is not None and not callable(factory):
            raise ConstraintTypeError(
                "AsyncEtcdCache needs an aetcd Client (or a list of them), or a function "
                f"that returns one, got {type(client).__name__}"
            )
        super().__init__(prefix)
        # What makes this process's clients, called on first use and again in a forked
        # child: None when clients were given, which a forked child must not use.
        self._connect: Callable[[], Any] | None = factory
        self._clients: list[Any] | None = None if factory else _clients_of(client)
        self._owned = close_clients or factory is not None
        self._given_to_parent = False  # given clients, and this is a forked child
        # The loop the clients were first used on (weakly: a closed loop may go). Another
        # loop is refused before a call: gRPC would fail it too, but only after making
        # a coroutine it never awaits.
        self._first_loop: weakref.ref[asyncio.AbstractEventLoop] | None = None

    def _lasting(self, exc: Exception) -> bool:
        # aetcd has classes for UNAUTHENTICATED and INVALID_ARGUMENT; PERMISSION_DENIED
        # is a plain ClientError raised from the gRPC error. UNAVAILABLE (a member down,
        # no leader) and DEADLINE_EXCEEDED are ridden out.
        if isinstance(exc, grpc_errors.UnauthenticatedError | grpc_errors.InvalidArgumentError):
            return True
        code = getattr(exc.__cause__, "code", None)
        return callable(code) and code() == rpc.StatusCode.PERMISSION_DENIED

    def __repr__(self) -> str:
        return f"AsyncEtcdCache(prefix={self.prefix!r})"

    async def close(self) -> None:
        """Close the clients this cache's factory made (given ones with
        ``close_clients``); a factory's next use makes others."""
        clients = self._clients
        if clients is None or not self._owned or self._given_to_parent:
            return
        if self._connect is not None:
            self._clients = None
        for client in clients:
            await client.close()

    def _after_fork(self) -> None:
        # The parent's channels are dropped, never closed: closing would talk on them.
        if self._connect is not None:
            self._clients = None
        else:
            self._given_to_parent = True

    def _members_now(self) -> list[Any]:
        """This process's clients: made by the factory on first use."""
        if self._given_to_parent:
            raise ConstraintError(
                "AsyncEtcdCache: its aetcd clients are the parent's of this forked "
                "process, and a gRPC channel must not be used after fork(); for forked "
                "children, give the cache a function that makes the client instead"
            )
        used_in = _Grpc.used_in
        if used_in is not None and used_in != os.getpid():
            raise ConstraintError(
                f"AsyncEtcdCache: this process was forked from one (pid {used_in}) whose "
                "AsyncEtcdCache had used gRPC, and gRPC cannot run in such a child; give "
                "the cache a function that makes the client, and lock only in the "
                "forked children, never in the parent before it forks"
            )
        _Grpc.used_in = os.getpid()
        clients, loop = self._clients, asyncio.get_running_loop()
        if clients is not None and self._first_loop is not None and self._first_loop() is not loop:
            raise self._bound_elsewhere(f"now used on {loop!r}")
        if clients is None:
            assert self._connect is not None  # else the clients were given
            made = self._connect()
            clients = _clients_of(made)
            if not clients:
                raise ConstraintTypeError(
                    f"AsyncEtcdCache's client factory {self._connect!r} must return an "
                    f"aetcd Client or a list of them, got {type(made).__name__}; pass a "
                    "plain function (it is called, not awaited)"
                )
            self._clients, self._first_loop = clients, None
        if self._first_loop is None:
            self._first_loop = weakref.ref(loop)
        return clients

    # -- I/O -----------------------------------------------------------------------------

    async def _on_a_member(self, call: Callable[[Any], Any]) -> Any:
        """``await call(client)`` on each member in ``_members``' order, until one answers."""
        clients = self._members_now()
        *others, last = self._members(len(clients))
        for index in others:
            try:
                reply = await call(clients[index])
            except grpc_errors.ConnectionFailedError:
                continue
            self._answered(index)
            return reply
        reply = await call(clients[last])
        self._answered(last)
        return reply

    async def _perform(self, step: Step) -> Any:
        if isinstance(step, core.Grant):
            lease = await self._on_a_member(lambda client: client.lease(step.ttl))
            return int(lease.id), step.ttl
        if isinstance(step, core.Revoke):
            return await self._on_a_member(lambda client: client.revoke_lease(step.lease))
        if isinstance(step, core.Range):
            ranged = transactions.Get(step.start, step.end)
            reply = await self._on_a_member(lambda client: client.transaction([], [ranged], []))
            return _txn_reply(reply).ranges[0]
        if isinstance(step, core.Txn):
            compare = _compare(step)
            success, failure = [_op(op) for op in step.success], [_op(op) for op in step.failure]
            reply = await self._on_a_member(
                lambda client: client.transaction([compare], success, failure)
            )
            return _txn_reply(reply)
        raise TypeError(f"not an etcd request: {step!r}")

    async def _run(self, flow: Flow[T]) -> T:
        return await drive_async(flow, self._perform, self._failed)

    # -- the contract --------------------------------------------------------------------

    async def get(self, key: str) -> Entry | None:
        return await self._run(self._reading("get", key))

    async def scan(self, prefix: str) -> list[tuple[str, Entry]]:
        """As ``EtcdCache.scan``, awaited: the whole listing at once."""
        return await self._run(self._scanning(prefix))

    async def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:
        return self._granted(key, *await self._run(self._putting(key, value, ttl=ttl)))

    async def compare_and_set(self, key: str, value: str, *, ttl: float, version: str) -> Entry:
        return await self._run(self._setting(key, value, ttl=ttl, version=version))

    async def compare_and_delete(self, key: str, *, version: str) -> None:
        await self._run(self._deleting(key, version=version))

    async def wait(self, keys: Sequence[str], timeout: float) -> None:
        """Until a watch on ``keys`` sees one deleted (freed or expired), at most
        ``timeout`` seconds (``EtcdCore._watch``: from the revision a grant saw it held).
        A watch stream that breaks (its member died) ends the wait early: the engine's
        next grant goes to a member that answers."""
        if timeout <= 0 or not keys:
            return
        # The deadline counts from the call: opening the watch stream is part of the wait.
        deadline = time.monotonic() + timeout
        watch = self._watch(keys)
        step = core.Range("wait", keys[0], watch.start)
        try:
            watching = await self._on_a_member(lambda client: _deletions(client, watch))
        except Exception as exc:
            if (error := self._failed(step, exc)) is None:
                raise
            raise error from exc
        try:
            await asyncio.wait_for(_first_event(watching), max(0.0, deadline - time.monotonic()))
        except (asyncio.TimeoutError, grpc_errors.ClientError):
            pass  # the timeout, or a broken stream: either way the engine looks again
        finally:
            await watching.cancel()


async def _deletions(client: Any, watch: Watch) -> Any:
    """aetcd's watch of ``watch``'s deletions, its stream opened (created on the member)."""
    return await client.watch(
        watch.start, range_end=watch.end, start_revision=watch.revision,
        kind=rtypes.EventKind.DELETE,
    )  # fmt: skip


async def _first_event(watching: Any) -> None:
    async for _ in watching:
        return


# -- aetcd's requests and replies ------------------------------------------------------------


def _clients_of(obj: Any) -> list[Any] | None:
    """``obj`` as a list of aetcd clients (a client, or a non-empty list or tuple of
    them), or None when it is none of those (a factory, or not an etcd client)."""
    if isinstance(obj, aetcd.Client):
        return [obj]
    if isinstance(obj, (list, tuple)):
        if not obj:
            raise ConstraintValueError("AsyncEtcdCache needs at least one aetcd Client")
        for given in obj:
            if not isinstance(given, aetcd.Client):
                raise ConstraintTypeError(
                    f"AsyncEtcdCache needs aetcd Clients, got {type(given).__name__}"
                )
        return list(obj)
    return None


def _compare(txn: core.Txn) -> Any:
    target = transactions.Create if txn.target == "CREATE" else transactions.Mod
    return target(txn.subject) == txn.revision


def _op(op: core.Put | core.Get | core.Delete) -> Any:
    if isinstance(op, core.Put):
        return transactions.Put(op.key, op.value, lease=op.lease)
    if isinstance(op, core.Get):
        return transactions.Get(op.key)
    return transactions.Delete(op.key)


def _txn_reply(reply: tuple[bool, list[Any]]) -> core.TxnReply:
    """A TxnReply from aetcd's ``(succeeded, responses)``: each ``Get``'s a list of
    ``(value, rtypes.Get)`` pairs, each write's a protobuf response (skipped)."""
    succeeded, responses = reply
    ranges = [[_kv(kv) for _, kv in found] for found in responses if isinstance(found, list)]
    return core.TxnReply(bool(succeeded), ranges)


def _kv(kv: Any) -> KV:
    return KV(kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.lease)
