"""The caches a lock can live in; the one you pass sets who the lock excludes.

==================  ============  =========================================
cache               scope         extra
==================  ============  =========================================
InMemoryCache       one process   none
DiskCache           one machine   none
RedisCache          every machine ``simple-mutex[redis]``
AsyncRedisCache     every machine ``simple-mutex[redis]`` (asyncio)
PostgresCache       every machine ``simple-mutex[postgres]``
AsyncPostgresCache  every machine ``simple-mutex[postgres]`` (asyncio)
MongoCache          every machine ``simple-mutex[mongo]``
AsyncMongoCache     every machine ``simple-mutex[mongo]``, pymongo >= 4.13
EtcdCache           every machine ``simple-mutex[etcd]``
AsyncEtcdCache      every machine ``simple-mutex[etcd]`` (asyncio, aetcd)
S3Cache             every machine ``simple-mutex[s3]``
==================  ============  =========================================

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
    from .etcd import AsyncEtcdCache, EtcdCache
    from .mongo import AsyncMongoCache, MongoCache
    from .postgres import AsyncPostgresCache, PostgresCache
    from .redis import AsyncRedisCache, RedisCache
    from .s3 import S3Cache

__all__ = [
    "AsyncEtcdCache",
    "AsyncMongoCache",
    "AsyncPostgresCache",
    "AsyncRedisCache",
    "DiskCache",
    "EtcdCache",
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
