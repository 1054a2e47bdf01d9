"""Objects built once per process: a forked child (Celery prefork, an RQ work horse)
builds its own, since the parent's sockets and threads are not its to use.

One idiom for every such memo: ``PerProcess`` forgets everything in a forked child
(``os.register_at_fork``) and builds on first use, under a lock so two threads never
build two different values for one key (two ``memory://`` caches would not exclude
each other). The child gets a fresh lock, since a thread of the parent may have held the
old one at the instant of the fork.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from simple_mutex import cache_from_url

V = TypeVar("V")


class PerProcess(Generic[V]):
    """``get(key)`` builds ``build(key)`` once per key in this process. A str key is
    compared by value, anything else by identity (and kept alive while remembered).
    Past ``limit`` keys (e.g. connections of long-gone queues) it starts over."""

    def __init__(self, build: Callable[[Any], V], *, limit: int | None = None) -> None:
        self._build = build
        self._limit = limit
        self._forget()
        _every.add(self)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[object, tuple[object, V]] = {}

    def get(self, key: object) -> V:
        slot = key if isinstance(key, str) else id(key)
        found = self._values.get(slot)
        if found is not None and (found[0] is key or found[0] == key):
            return found[1]
        with self._lock:
            found = self._values.get(slot)
            if found is None or not (found[0] is key or found[0] == key):
                if self._limit is not None and len(self._values) >= self._limit:
                    self._values.clear()
                found = self._values[slot] = (key, self._build(key))
            return found[1]


_every: weakref.WeakSet[PerProcess[Any]] = weakref.WeakSet()


def reset() -> None:
    """Forget every per-process memo: Celery tasks and RQ jobs read their settings
    (``app.conf.mutex_*``) and build their caches again on their next call. For tests
    that change settings; a forked child does this by itself."""
    for memo in list(_every):
        memo._forget()


os.register_at_fork(after_in_child=reset)


def _build_cache(spec: object) -> object:
    return cache_from_url(spec) if isinstance(spec, str) else spec


_caches: PerProcess[object] = PerProcess(_build_cache)


def shared_cache(spec: object) -> object:
    """The cache of a URL, built once per process and shared by every task of it; a cache
    or raw client is returned as it is (``Mutex`` wraps a client)."""
    return _caches.get(spec)
