"""The sync and asyncio faces of every part that has both say the same thing: the same
public names, each with the same parameters, coroutines on the asyncio side (issue 22:
``acquire(token=)`` once existed on one side only, ``aclose`` on one asyncio cache where
the others said ``close``). A method added to one face fails here until the other has it.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

import pytest

from simple_mutex import Lease, Mutex, Semaphore
from simple_mutex.caches.etcd import AsyncEtcdCache, EtcdCache
from simple_mutex.caches.mongo import AsyncMongoCache, MongoCache
from simple_mutex.caches.postgres import AsyncPostgresCache, PostgresCache
from simple_mutex.caches.redis import AsyncRedisCache, RedisCache

pytestmark = pytest.mark.fast

CACHES = [
    (RedisCache, AsyncRedisCache),
    (PostgresCache, AsyncPostgresCache),
    (MongoCache, AsyncMongoCache),
    (EtcdCache, AsyncEtcdCache),
]
# Names one face has for a reason of its own: each says why.
ONE_SIDED = {
    "aclose": "AsyncRedisCache's first name for close, kept for code written against it",
}


def _public(cls: type) -> dict[str, Any]:
    return {
        name: inspect.getattr_static(cls, name)
        for name in dir(cls)
        if not name.startswith("_") and name not in ONE_SIDED
    }


def _function(member: Any) -> Any:
    return member.__func__ if isinstance(member, (staticmethod, classmethod)) else member


def _parameters(member: Any) -> list[tuple[str, Any, Any]]:
    parameters = inspect.signature(_function(member)).parameters.values()
    return [(p.name, p.kind, p.default) for p in parameters]


@pytest.mark.parametrize(("sync", "aio"), CACHES, ids=[s.__name__ for s, _ in CACHES])
def test_a_cache_s_two_faces_have_the_same_methods(sync: type, aio: type) -> None:
    ours, theirs = _public(sync), _public(aio)
    assert sorted(ours) == sorted(theirs), "a public name on one face only"
    for name, member in ours.items():
        other = theirs[name]
        if not callable(member) and not isinstance(member, (staticmethod, classmethod)):
            continue  # a property or constant: same name is all a face promises
        assert _parameters(member) == _parameters(other), f"{name}: parameters differ"
        if _function(member) is _function(other):
            continue  # one function serves both (the shared base's, a deploy-time step)
        assert not inspect.iscoroutinefunction(member), f"{sync.__name__}.{name} is async"
        assert inspect.iscoroutinefunction(other), f"{aio.__name__}.{name} is not async"


def _awaitable(function: Any) -> bool:
    if inspect.iscoroutinefunction(function):
        return True
    returns = typing.get_type_hints(function).get("return")
    return isinstance(returns, type) and hasattr(returns, "__await__")


@pytest.mark.parametrize("cls", [Mutex, Semaphore, Lease])
def test_every_blocking_call_has_an_asyncio_twin_with_the_same_parameters(cls: type) -> None:
    """``x`` and ``x_async``: same parameters; every ``x_async`` is a coroutine, or
    returns an awaitable (``acquire_async``: also an ``async with`` context)."""
    names = {name for name in dir(cls) if not name.startswith("_")}
    twins = sorted(name for name in names if name.endswith("_async"))
    assert twins, f"{cls.__name__} has no asyncio face"
    for twin in twins:
        blocking = twin.removesuffix("_async")
        function = getattr(cls, twin)
        assert _awaitable(function), f"{cls.__name__}.{twin} is not async"
        if blocking not in names:
            continue  # an asyncio-only call: checked below that it has a reason
        assert _parameters(getattr(cls, blocking)) == _parameters(function), twin


def test_the_asyncio_only_calls_of_the_lock_spaces_are_the_read_calls() -> None:
    """Reads (holder, holders, locked) are properties or plain calls on the blocking face
    and ``*_async`` coroutines on the other; nothing else is asyncio-only."""
    for cls in (Mutex, Semaphore):
        names = {name for name in dir(cls) if not name.startswith("_")}
        only = sorted(name for name in names if name.endswith("_async") and name[:-6] not in names)
        assert set(only) <= {"holder_async", "holders_async", "locked_async"}, only
