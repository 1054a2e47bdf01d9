"""The caches a lock can live in; the one you pass sets who the lock excludes.

=============  ============  =========================================
cache          scope         extra
=============  ============  =========================================
InMemoryCache  one process   none
DiskCache      one machine   none
RedisCache     every machine ``simple-mutex[redis]``
PostgresCache  every machine ``simple-mutex[postgres]``
MongoCache     every machine ``simple-mutex[mongo]``
S3Cache        every machine ``simple-mutex[s3]``
=============  ============  =========================================

``AsyncRedisCache`` is RedisCache for ``redis.asyncio`` clients (same extra).

Backends with a driver are imported on first use (``registry.py``), so
``import simple_mutex`` needs nothing beyond the standard library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import registry
from .adapt import as_cache
from .disk import DiskCache
from .memory import InMemoryCache
from .url import cache_from_url

if TYPE_CHECKING:
    from .mongo import MongoCache
    from .postgres import PostgresCache
    from .redis import RedisCache
    from .redis_async import AsyncRedisCache
    from .s3 import S3Cache

__all__ = [
    "AsyncRedisCache",
    "DiskCache",
    "InMemoryCache",
    "MongoCache",
    "PostgresCache",
    "RedisCache",
    "S3Cache",
    "as_cache",
    "cache_from_url",
]


def __getattr__(name: str) -> object:
    backend = registry.by_class(name)
    if backend is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return registry.cache_class(backend)
