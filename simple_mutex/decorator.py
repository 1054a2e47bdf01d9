"""``with_simple_mutex``: wrap a function so calls that share a key never overlap."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar, overload

from ._core.durations import Duration, timeout_seconds
from ._core.keys import check_key, check_template, render_template
from ._core.timing import DEFAULT_INTERVAL, DEFAULT_LEASE
from .current import holding
from .errors import ConstraintTypeError, MalfunctionError, bad_input
from .lease import Lease
from .mutex import Mutex, check_renew

log = logging.getLogger("simple_mutex")

F = TypeVar("F", bound=Callable[..., Any])


def key_function(logic: Callable[..., Any], key: str | Callable[..., str]) -> Callable[..., str]:
    """Make ``key`` (a template or a callable) into a function of ``logic``'s arguments.

    A template is filled from the bound arguments with defaults applied, so ``f(1)`` and
    ``f(phone=1)`` lock the same key; it is checked against the signature right away."""
    if callable(key):

        def from_callable(*args: Any, **kwargs: Any) -> str:
            return check_key(key(*args, **kwargs))

        return from_callable
    if not isinstance(key, str) or not key:
        raise bad_input(
            key, str, f"key must be a template like 'order.{{order_id}}' or a callable, got {key!r}"
        )
    try:
        signature = inspect.signature(logic)
    except (TypeError, ValueError):
        raise ConstraintTypeError(
            f"key template {key!r} needs named arguments, but {logic!r} has no inspectable "
            "signature; pass key as a callable instead"
        ) from None
    params = signature.parameters.values()
    var_keyword = any(p.kind is p.VAR_KEYWORD for p in params)
    check_template(key, [p.name for p in params], accepts_any=var_keyword)

    def from_template(*args: Any, **kwargs: Any) -> str:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise ConstraintTypeError(f"arguments do not fit {logic.__qualname__}: {exc}") from None
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        for param in params:
            if param.kind is param.VAR_KEYWORD:
                arguments.update(arguments.pop(param.name, {}))
        return check_key(render_template(key, arguments))

    return from_template


if TYPE_CHECKING:
    from typing_extensions import NotRequired, TypedDict, Unpack

    class _Options(TypedDict):
        """``with_simple_mutex``'s keywords, for its two overloads (the implementation
        below names each, with its default)."""

        key: str | Callable[..., str]
        cache: object
        lease: NotRequired[Duration]
        timeout: NotRequired[Duration | None]
        interval: NotRequired[Duration]
        renew: NotRequired[bool]
        label: NotRequired[str | None]


# The overloads say only what the return depends on: ``logic`` given, or not.
@overload
def with_simple_mutex(logic: F, **options: Unpack[_Options]) -> F: ...


@overload
def with_simple_mutex(logic: None = None, **options: Unpack[_Options]) -> Callable[[F], F]: ...


def with_simple_mutex(
    logic: F | None = None,
    *,
    key: str | Callable[..., str],
    cache: object,
    lease: Duration = DEFAULT_LEASE,
    timeout: Duration | None = None,
    interval: Duration = DEFAULT_INTERVAL,
    renew: bool = False,
    label: str | None = None,
) -> F | Callable[[F], F]:
    """Return ``logic`` guarded by a mutex on ``key`` in ``cache``.

    ``lease`` is how long a call may hold the lock (it is interrupted with
    SimpleMutexLeaseExpiredError past it, unless ``renew=True`` keeps extending it);
    ``timeout`` how long a call waits for a busy key (None: forever, 0: try once);
    ``interval`` the poll interval where the cache cannot notify; ``label`` what
    ``holder()`` reports as the holder's label. Works on plain and ``async def``
    functions. Without ``logic`` it returns a decorator."""
    wait = timeout_seconds(timeout)
    # The events' name: the template itself (low cardinality), else the function's name.
    mutex = Mutex(
        cache,
        lease=lease,
        interval=interval,
        label=label,
        name=key if isinstance(key, str) and key else "with_simple_mutex",
    )
    check_renew(renew)

    def decorate(fn: F) -> F:
        if not callable(fn):
            raise ConstraintTypeError(f"with_simple_mutex wraps a function, got {fn!r}")
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            # The lock would be taken when the generator is created and freed before its
            # body runs: it would protect nothing.
            raise ConstraintTypeError(
                f"with_simple_mutex cannot guard the generator function {fn.__qualname__}: "
                "its body runs after the call returns. Guard the code that consumes it, "
                "or use `with mutex.acquire(key):` inside the generator"
            )
        key_of = key_function(fn, key)
        if callable(key):
            mutex.name = fn.__qualname__
        if mutex._aio and not _is_coroutine_function(fn):
            raise ConstraintTypeError(
                f"with_simple_mutex on {fn.__qualname__}: an asyncio cache guards only "
                "`async def` functions; pass a blocking cache for a plain function"
            )
        if _is_coroutine_function(fn):

            @functools.wraps(fn)
            async def guarded_async(*args: Any, **kwargs: Any) -> Any:
                lease_ = await mutex.acquire_async(
                    key_of(*args, **kwargs), timeout=wait, renew=renew
                )
                with holding(lease_):  # the work's task copies it: current_lease() there
                    return await run_guarded_async(lease_, lambda: fn(*args, **kwargs))

            return guarded_async  # type: ignore[return-value]

        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            lease = mutex.acquire(key_of(*args, **kwargs), timeout=wait, renew=renew)
            try:  # entered in this frame: nothing runs between the grant and the try
                with lease, holding(lease):
                    result = fn(*args, **kwargs)
                    if inspect.isawaitable(result):
                        # Its body would run after the lock is freed: refuse, loudly.
                        getattr(result, "close", lambda: None)()
                        raise ConstraintTypeError(
                            f"{fn!r} returned an awaitable but is not an `async def` "
                            "function; with_simple_mutex cannot tell: decorate the "
                            "`async def` itself"
                        )
                    return result
            except BaseException:
                lease.let_go_at_the_door()  # an interrupt before the block was entered
                raise

        return guarded  # type: ignore[return-value]

    return decorate if logic is None else decorate(logic)


def _is_coroutine_function(fn: Callable[..., Any]) -> bool:
    return any(inspect.iscoroutinefunction(f) for f in (fn, inspect.unwrap(fn), type(fn).__call__))


async def run_guarded_async(lease: Lease, work: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``work`` while ``lease`` is held; cancel it the moment the lease is lost.

    The work runs as its own task so that a loss (seen by the keeper thread) can cancel it
    without cancelling the caller; the caller then gets SimpleMutexLeaseExpiredError."""
    loop = asyncio.get_running_loop()
    lost: asyncio.Future[None] = loop.create_future()

    def on_lost() -> None:
        loop.call_soon_threadsafe(_settle, lost)

    task = asyncio.ensure_future(work())
    try:
        lease.on_lost(on_lost)
        await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Shielded: a second cancel while the work unwinds must not skip the release
        # (the finishing task runs on and frees the lock).
        try:
            released = await asyncio.shield(_finish(task, lease))
        except MalfunctionError as fault:
            # As in Lease.__exit__: after work that failed, its error leaves carrying this.
            failed = asyncio.CancelledError() if task.cancelled() else task.exception()
            released = lease._release_failed(failed, fault)
    if lost.done() or not released:
        raise lease._expired_error() from (task.exception() if not task.cancelled() else None)
    return task.result()


async def _finish(task: asyncio.Future[Any], lease: Lease) -> bool:
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return await lease.release_async()


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
