"""``cache_from_url``: build a cache from a URL in configuration."""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

from simple_mutex.contract import ConditionalCache
from simple_mutex.errors import ConstraintError

from .disk import DiskCache
from .memory import InMemoryCache

_SCHEMES = (
    "memory://, file:///path, redis://, rediss://, redis+sentinel://, postgresql://, "
    "mongodb://, mongodb+srv://, s3://bucket/prefix"
)


def cache_from_url(url: str) -> ConditionalCache:
    """``memory://`` (this process) or ``file:///var/lock/myapp`` (this machine).

    Each call builds a new cache: build it once and share it, since two ``memory://``
    caches are two separate lock spaces."""
    if not isinstance(url, str):
        raise ConstraintError(f"cache URL must be a str like 'memory://', got {url!r}")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "memory":
        return InMemoryCache()
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ConstraintError(
                f"file URL {url!r} names host {parts.netloc!r}; a DiskCache is local, "
                "write file:///absolute/path"
            )
        if not parts.path.startswith("/"):
            raise ConstraintError(
                f"file URL {url!r} needs an absolute path; write file:///absolute/path"
            )
        return DiskCache(unquote(parts.path))
    if scheme in ("redis", "rediss", "redis+sentinel"):
        # Raises ConstraintError naming simple-mutex[redis] when redis-py is missing.
        from .redis import from_url

        return from_url(url)
    if scheme in ("postgresql", "postgres"):
        # Raises ConstraintError naming simple-mutex[postgres] when psycopg is missing.
        from .postgres import from_url as postgres_from_url

        return postgres_from_url(url)
    if scheme in ("mongodb", "mongodb+srv"):
        # Raises ConstraintError naming simple-mutex[mongo] when pymongo is missing.
        from .mongo import from_url as mongo_from_url

        return mongo_from_url(url)
    if scheme == "s3":
        # Raises ConstraintError naming simple-mutex[s3] when boto3 is missing.
        from .s3 import from_url as s3_from_url

        return s3_from_url(url)
    # Only the scheme is echoed: the rest of a URL may hold a password.
    raise ConstraintError(f"unknown cache URL scheme {scheme!r}; supported: {_SCHEMES}")
