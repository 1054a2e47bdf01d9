"""The one table of backends, read by ``cache_from_url``, ``as_cache`` and ``simple_mutex.caches``.

A backend with a driver is imported only when one of these asks for it, so
``import simple_mutex`` needs nothing beyond the standard library.
"""

from __future__ import annotations

import importlib
from typing import Any, NamedTuple


class Backend(NamedTuple):
    name: str
    """The cache's ``name`` in messages."""
    cls: str
    """The cache class that module defines."""
    schemes: tuple[str, ...]
    """URL schemes ``cache_from_url`` hands to the module's ``from_url``."""
    clients: tuple[str, ...]
    """Raw driver objects ``as_cache`` wraps, as ``"package.Class"`` (the class or a base)."""
    drivers: tuple[str, ...]
    """Top-level packages the module imports (never by ``import simple_mutex``)."""
    extra: str | None
    """The install extra that brings the drivers: ``pip install 'simple-mutex[<extra>]'``."""
    needs: str = ""
    """What a raw client alone lacks, when ``as_cache`` cannot wrap it by itself."""
    where: str = ""
    """The module defining ``cls`` (and ``from_url``), under ``simple_mutex.caches``:
    ``<folder>.sync`` or ``<folder>.asyncio`` for a backend with a folder."""

    @property
    def module(self) -> str:
        return f"{__package__}.{self.where or self.name}"


BACKENDS = (
    Backend("memory", "InMemoryCache", ("memory",), (), (), None),
    Backend("disk", "DiskCache", ("file",), (), (), None, where="disk.cache"),
    Backend(
        "redis", "RedisCache", ("redis", "rediss", "unix", "redis+socket", "redis+sentinel"),
        ("redis.Redis", "redis.RedisCluster"), ("redis",), "redis",
        where="redis.sync",
    ),
    Backend(
        "redis_async", "AsyncRedisCache", (),
        ("redis.asyncio.Redis", "redis.asyncio.RedisCluster"), ("redis",), "redis",
        where="redis.asyncio",
    ),
    Backend(
        "postgres", "PostgresCache", ("postgresql", "postgres"),
        ("psycopg.Connection", "psycopg_pool.ConnectionPool"), ("psycopg", "psycopg_pool"),
        "postgres", where="postgres.sync",
    ),
    # asyncio twins: no URL scheme (cache_from_url builds the blocking caches); their
    # drivers' async classes derive from none of the blocking ones.
    Backend(
        "postgres_async", "AsyncPostgresCache", (),
        ("psycopg.AsyncConnection", "psycopg_pool.AsyncConnectionPool"),
        ("psycopg", "psycopg_pool"), "postgres", where="postgres.asyncio",
    ),
    Backend(
        "mongo", "MongoCache", ("mongodb", "mongodb+srv"),
        ("pymongo.MongoClient", "pymongo.Database", "pymongo.Collection"), ("pymongo", "bson"),
        "mongo", where="mongo.sync",
    ),
    Backend(
        "mongo_async", "AsyncMongoCache", (),
        ("pymongo.AsyncMongoClient", "pymongo.AsyncDatabase", "pymongo.AsyncCollection"),
        ("pymongo", "bson"), "mongo", where="mongo.asyncio",
    ),
    Backend(
        "etcd", "EtcdCache", ("etcd",), ("etcd3gw.Etcd3Client",), ("etcd3gw", "requests"),
        "etcd", where="etcd.sync",
    ),
    Backend(
        "etcd_async", "AsyncEtcdCache", (), ("aetcd.Client",), ("aetcd", "grpc"), "etcd",
        where="etcd.asyncio",
    ),
    Backend(
        "s3", "S3Cache", ("s3",), ("botocore.BaseClient",), ("boto3", "botocore"), "s3",
        needs="a bucket: pass S3Cache(client, 'bucket', 'prefix/')",
    ),
)  # fmt: skip


def named(name: str) -> Backend:
    return next(backend for backend in BACKENDS if backend.name == name)


def by_scheme(scheme: str) -> Backend | None:
    return next((b for b in BACKENDS if scheme in b.schemes), None)


def by_class(cls: str) -> Backend | None:
    return next((b for b in BACKENDS if b.cls == cls), None)


def by_client(obj: object) -> Backend | None:
    """The backend whose driver made ``obj``, judged by its classes' names (never by
    importing a driver): pymongo's Database answers any attribute, so duck typing would
    take it for a cache. ``"package.Class"`` matches a class of that name defined anywhere
    under ``package``; the deepest package wins, so ``redis.asyncio.client.Redis`` is an
    ``"redis.asyncio.Redis"``, not a ``"redis.Redis"``."""
    best, depth = None, 0
    for cls in type(obj).__mro__:
        module = cls.__module__ + "."
        for backend in BACKENDS:
            for client in backend.clients:
                package, _, name = client.rpartition(".")
                deep = package.count(".") + 1
                if name == cls.__name__ and module.startswith(package + ".") and deep > depth:
                    best, depth = backend, deep
    return best


def module(backend: Backend) -> Any:
    """The backend's module, imported now (a missing driver raises ConstraintError)."""
    return importlib.import_module(backend.module)


def cache_class(backend: Backend) -> Any:
    return getattr(module(backend), backend.cls)
