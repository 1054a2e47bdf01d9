"""A blocking face on an asyncio cache, for tests only: tests/contract.py (written for the
blocking contract) then checks the asyncio caches too, rule for rule.

Each call runs the cache's coroutine on a private event loop in a thread of its own and
waits for it. A forked child gets a loop thread of its own (the parent's did not come
along), as a Celery prefork child would start its own loop.
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import pytest

from simple_mutex.contract import Entry, is_async

T = TypeVar("T")
CALL_LIMIT = 30.0  # no contract step comes near it; a hang fails instead of blocking
_faces: weakref.WeakSet[BlockingFace] = weakref.WeakSet()


class BlockingFace:
    """The five blocking methods over an AsyncConditionalCache's coroutines."""

    def __init__(self, cache: Any = None) -> None:
        self._start()
        _faces.add(self)
        if cache is not None:
            self.attach(cache)

    @classmethod
    def built(cls, build: Callable[[], Coroutine[Any, Any, Any]]) -> BlockingFace:
        """A face on the cache ``build()`` returns, run on the face's loop: for a cache
        over a connection or pool that must be opened on the loop that uses it."""
        face = cls()
        face.attach(face.call(build()))
        return face

    def attach(self, cache: Any) -> None:
        assert is_async(cache), f"{cache!r} is not an asyncio cache"
        self.cache = cache
        self.name = cache.name
        self.driver_errors = cache.driver_errors  # what escapes stays a fault through the face
        if callable(getattr(cache, "scan", None)):  # the optional capability, if it has it
            self.scan = lambda prefix: iter(self.call(cache.scan(prefix)))
        if callable(getattr(cache, "index_prefix", None)):  # a plain method: no loop needed
            self.index_prefix = cache.index_prefix

    def __repr__(self) -> str:
        return f"BlockingFace({self.cache!r})"

    def _start(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the private loop; its result or its exception."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(CALL_LIMIT)

    def get(self, key: str) -> Entry | None:
        return self.call(self.cache.get(key))

    def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:
        return self.call(self.cache.put_if_absent(key, value, ttl=ttl))

    def compare_and_set(self, key: str, value: str, *, ttl: float, version: str) -> Entry:
        return self.call(self.cache.compare_and_set(key, value, ttl=ttl, version=version))

    def compare_and_delete(self, key: str, *, version: str) -> bool | None:
        return self.call(self.cache.compare_and_delete(key, version=version))

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        self.call(self.cache.wait(keys, timeout))

    def scan(self, prefix: str) -> Iterator[tuple[str, Entry]]:
        """The optional capability: an asyncio cache's ``scan`` returns a list."""
        return iter(self.call(self.cache.scan(prefix)))

    def take_and_free(self, key: str, value: str, times: int = 2) -> None:
        """Grant ``key`` and free it, ``times`` over (a cache used, its clients opened)."""
        for _ in range(times):
            self.compare_and_delete(key, version=self.put_if_absent(key, value, ttl=30).version)

    def close(self, *more: Any) -> None:
        """Close the cache (if it closes) and ``more`` (connections, pools) on the loop,
        then stop the loop."""
        for thing in (self.cache, *more):
            closing = getattr(thing, "close", None)
            if closing is not None:
                self.call(closing())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()


def _refused_in_child(face: BlockingFace, key: str, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        face.put_if_absent(key, "child", ttl=30)


def refused_in_forked_children(
    face: BlockingFace, key: str, error: type[Exception], message: str
) -> None:
    """A cache the parent has used, inherited by two forked children: each is refused at
    once (``error`` matching ``message``) and writes nothing; the parent keeps working."""
    from procs import forked  # the suites' helpers (tests/ is on sys.path)

    face.compare_and_delete(key, version=face.put_if_absent(key, "p", ttl=30).version)
    assert forked(_refused_in_child, [(face, key, error, message)] * 2, 10) == [0, 0]
    assert face.get(key) is None  # the children wrote nothing
    entry = face.put_if_absent(key, "parent", ttl=30)
    assert face.get(key) == entry


def _restart_in_child() -> None:
    for face in list(_faces):
        face._start()


os.register_at_fork(after_in_child=_restart_in_child)
