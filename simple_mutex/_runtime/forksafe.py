"""Objects that hold thread locks must survive ``fork()`` in a usable state.

``fork()`` copies only the calling thread. A lock another thread held at that instant
stays held forever in the child, and a thread caught inside SQLite leaves SQLite's own
mutexes held too: the child then hangs on its first lock operation. Celery's prefork pool
and RQ's work horses fork from processes whose keeper thread may be inside a cache right
then. So, around every fork, each registered object's guard is taken first (no thread is
inside the object while the process is copied), released in the parent afterwards, and in
the child the object gets ``_after_fork()`` to drop what belongs to the parent.

``OnePerProcess`` holds a process's one object of a kind, built on first use (the keeper,
Celery's exit watch): a forked child builds its own.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")


class ForkAware(Protocol):
    _guard: threading.Lock

    def _before_fork(self) -> None:
        """Called in the parent with ``_guard`` held, just before the process is copied."""

    def _after_fork(self) -> None:
        """Called in the child once its ``_guard`` is free again."""


generation = 0
"""How many forks separate this process from the first one: a value saved before a fork
and read after it in the child differs. A Lease keeps it, so that its copy in a forked
child knows it is not the holder (lifecycle rule 14)."""

_objects: weakref.WeakSet[ForkAware] = weakref.WeakSet()
_registry_lock = threading.Lock()
_held: list[ForkAware] = []


class OnePerProcess(Generic[T]):
    """``get()``: this process's one ``build()``, built on first use (two threads asking
    at once get the same one). A forked child builds its own: the parent's (whose threads
    do not exist here) goes to ``forget`` first, and the lock is a new one, since a thread
    of the parent may have held the old one at the instant of the fork. For a module's
    globals: the fork hook keeps it alive."""

    def __init__(self, build: Callable[[], T], forget: Callable[[T], None] | None = None) -> None:
        self._build = build
        self._forget = forget
        self._value: T | None = None
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._start_over)

    def get(self) -> T:
        value = self._value
        if value is None:
            with self._lock:
                value = self._value
                if value is None:
                    value = self._value = self._build()
        return value

    def _start_over(self) -> None:
        if self._value is not None and self._forget is not None:
            self._forget(self._value)
        self._value, self._lock = None, threading.Lock()


def register(obj: ForkAware) -> None:
    with _registry_lock:
        _objects.add(obj)


def _before_fork() -> None:
    # Objects never take each other's guards, so taking them one by one cannot deadlock.
    _registry_lock.acquire()
    _held[:] = list(_objects)
    for obj in _held:
        obj._guard.acquire()
        obj._before_fork()


def _after_in_parent() -> None:
    for obj in _held:
        obj._guard.release()
    _held.clear()
    _registry_lock.release()


def _after_in_child() -> None:
    global _registry_lock, generation
    generation += 1
    for obj in _held:
        obj._guard.release()
        obj._after_fork()
    _held.clear()
    _registry_lock = threading.Lock()


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_in_parent, after_in_child=_after_in_child
)
