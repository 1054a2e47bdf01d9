"""The caches a lock can live in; the one you pass sets who the lock excludes.

=============  ============  =========================================
cache          scope         extra
=============  ============  =========================================
InMemoryCache  one process   none
DiskCache      one machine   none
=============  ============  =========================================

Backends with a driver are imported only when named here, so ``import simple_mutex``
needs nothing beyond the standard library.
"""

from __future__ import annotations

from .adapt import as_cache
from .disk import DiskCache
from .memory import InMemoryCache
from .url import cache_from_url

__all__ = ["DiskCache", "InMemoryCache", "as_cache", "cache_from_url"]
