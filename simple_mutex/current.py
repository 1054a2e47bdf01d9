"""The lease of the body running now, for ``current_lease()``: a leaf module, so that the
decorator (imported while ``simple_mutex`` initialises) and the Celery / RQ glue share one
context variable."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .lease import Lease

_current: ContextVar[Lease | None] = ContextVar("simple_mutex_busy_lease", default=None)


def current_lease() -> Lease | None:
    """The lease of the task or job body (or ``with_simple_mutex`` function) running now:
    its ``key``, ``fence``, ``expires_at``; None outside one. Pass ``fence`` to the store
    you write to (``simple_mutex.fenced``)."""
    return _current.get()


@contextmanager
def holding(lease: Lease) -> Iterator[None]:
    """``current_lease()`` answers with ``lease`` inside the block (asyncio tasks created
    in it too: they copy the context), and with what it said before after it."""
    token = _current.set(lease)
    try:
        yield
    finally:
        _current.reset(token)
