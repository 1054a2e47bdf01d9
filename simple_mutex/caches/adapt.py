"""Turn what the user passed as ``cache`` into a ConditionalCache, or say what to pass."""

from __future__ import annotations

from simple_mutex.contract import ConditionalCache
from simple_mutex.errors import ConstraintTypeError, ConstraintValueError

from . import registry

_CACHE_METHODS = ("get", "put_if_absent", "compare_and_set", "compare_and_delete", "wait")


def as_cache(cache: object) -> ConditionalCache:
    if isinstance(cache, str):
        raise ConstraintTypeError(
            f"cache must be a cache object, not the string {cache!r}; "
            "use cache_from_url(...) to build one from a URL"
        )
    if isinstance(cache, type):
        raise ConstraintTypeError(
            f"cache must be a cache instance, not the class {cache.__name__}; "
            f"write {cache.__name__}(...)"
        )
    backend = registry.by_client(cache)
    if backend is not None:  # a raw driver client: wrap it in its backend's cache
        if backend.needs:
            raise ConstraintValueError(f"a {backend.drivers[-1]} client needs {backend.needs}")
        wrapped: ConditionalCache = registry.cache_class(backend)(cache)
        return wrapped
    if all(callable(getattr(cache, name, None)) for name in _CACHE_METHODS) and isinstance(
        getattr(cache, "name", None), str
    ):
        return cache  # type: ignore[return-value]
    raise ConstraintTypeError(
        f"cache must implement the ConditionalCache contract (InMemoryCache, DiskCache, "
        f"or a client of a supported server), got {type(cache).__name__}"
    )


def index_prefix(cache: object, prefix: str) -> None:
    """Tell ``cache`` that entries under ``prefix`` are written through it, if it keeps
    an index of them for listing (``RedisCache.index_prefix``); else nothing."""
    note = getattr(cache, "index_prefix", None)
    if callable(note):
        note(prefix)
