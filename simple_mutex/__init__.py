"""simple-mutex: lease locks (mutex and semaphore) over any conditional-write cache.

The cache you pass sets who the lock excludes: ``InMemoryCache`` one process,
``DiskCache`` one machine, a server-backed cache (``simple_mutex.caches``) every machine.
"""

from __future__ import annotations

import os as _os

__version__ = "0.1.0"  # the one place: pyproject.toml reads it

from ._core.records import Holder
from .caches import DiskCache, InMemoryCache, cache_from_url
from .contract import ConditionalCache, Entry
from .decorator import with_simple_mutex
from .errors import (
    ConstraintError,
    ConstraintTypeError,
    ConstraintValueError,
    FencedOutError,
    LineFullError,
    MalfunctionError,
    SimpleCacheConditionError,
    SimpleMutexAcquireTimeoutError,
    SimpleMutexError,
    SimpleMutexLeaseExpiredError,
)
from .lease import Lease
from .mutex import Mutex, Semaphore

if _os.environ.get("SIMPLE_MUTEX_JOURNAL"):  # opt-in; unset costs this one look-up
    from .journal import start_from_environment as _start_journal

    _start_journal()

__all__ = [
    "ConditionalCache",
    "ConstraintError",
    "ConstraintTypeError",
    "ConstraintValueError",
    "DiskCache",
    "Entry",
    "FencedOutError",
    "Holder",
    "InMemoryCache",
    "Lease",
    "LineFullError",
    "MalfunctionError",
    "Mutex",
    "Semaphore",
    "SimpleCacheConditionError",
    "SimpleMutexAcquireTimeoutError",
    "SimpleMutexError",
    "SimpleMutexLeaseExpiredError",
    "cache_from_url",
    "with_simple_mutex",
]
