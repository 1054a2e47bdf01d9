"""``cache_from_url``: build a cache from a URL in configuration."""

from __future__ import annotations

from urllib.parse import urlsplit

from simple_mutex.contract import ConditionalCache
from simple_mutex.errors import ConstraintTypeError, ConstraintValueError

from . import registry


def cache_from_url(url: str) -> ConditionalCache:
    """``memory://`` (this process), ``file:///var/lock/myapp`` (this machine), or a
    server: ``redis://``, ``postgresql://``, ``mongodb://``, ``s3://bucket/prefix``...

    Each call builds a new cache: build it once and share it, since two ``memory://``
    caches are two separate lock spaces. A missing driver raises ConstraintError naming
    the extra to install."""
    backend = backend_of(url)
    cache: ConditionalCache = registry.module(backend).from_url(url)
    return cache


def backend_of(url: object) -> registry.Backend:
    """The backend a cache URL names, checked without building anything (no client, no
    connection): what a decorator can check at once, with the message every integration
    gives."""
    if not isinstance(url, str):
        raise ConstraintTypeError(f"cache URL must be a str like 'memory://', got {url!r}")
    scheme = urlsplit(url).scheme.lower()
    backend = registry.by_scheme(scheme)
    if backend is None:
        # Only the scheme is echoed: the rest of a URL may hold a password.
        known = ", ".join(f"{s}://" for b in registry.BACKENDS for s in b.schemes)
        raise ConstraintValueError(f"unknown cache URL scheme {scheme!r}; supported: {known}")
    return backend
