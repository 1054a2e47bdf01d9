"""Turn what the user passed as ``cache`` into a ConditionalCache, or say what to pass."""

from __future__ import annotations

from simple_mutex.contract import ConditionalCache
from simple_mutex.errors import ConstraintError

_CACHE_METHODS = ("get", "put_if_absent", "compare_and_set", "compare_and_delete", "wait")


def as_cache(cache: object) -> ConditionalCache:
    if isinstance(cache, str):
        raise ConstraintError(
            f"cache must be a cache object, not the string {cache!r}; "
            "use cache_from_url(...) to build one from a URL"
        )
    if isinstance(cache, type):
        raise ConstraintError(
            f"cache must be a cache instance, not the class {cache.__name__}; "
            f"write {cache.__name__}(...)"
        )
    if type(cache).__module__.split(".")[0] == "redis" and callable(
        getattr(cache, "execute_command", None)
    ):
        from .redis import RedisCache  # a raw redis-py client: wrap it (asyncio ones refused)

        return RedisCache(cache)
    if type(cache).__module__.split(".")[0] in ("psycopg", "psycopg_pool"):
        from .postgres import PostgresCache  # an autocommit Connection or a ConnectionPool

        return PostgresCache(cache)
    if type(cache).__module__.split(".")[0] in ("pymongo", "mongomock") and type(
        cache
    ).__name__ in ("MongoClient", "Database", "Collection"):
        # By class name: pymongo's Database and Collection answer any attribute (with a
        # sub-collection), so duck typing would take them for a cache.
        from .mongo import MongoCache

        return MongoCache(cache)
    if type(cache).__module__.split(".")[0] == "botocore":
        raise ConstraintError(
            "a boto3 S3 client needs a bucket: pass S3Cache(client, 'bucket', 'prefix/')"
        )
    if all(callable(getattr(cache, name, None)) for name in _CACHE_METHODS) and isinstance(
        getattr(cache, "name", None), str
    ):
        return cache  # type: ignore[return-value]
    raise ConstraintError(
        f"cache must implement the ConditionalCache contract (InMemoryCache, DiskCache, "
        f"or a client of a supported server), got {type(cache).__name__}"
    )
