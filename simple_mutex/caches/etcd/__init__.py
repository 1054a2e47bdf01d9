"""The etcd tier: one leased key per lock, one transaction per contract step.

``sync.py`` EtcdCache (etcd3gw, the JSON gateway client), ``asyncio.py`` AsyncEtcdCache
(aetcd, the asyncio gRPC client), ``core.py`` the keys, records, transactions and flows
both run (no I/O). The asyncio face is imported on first use: ``import
simple_mutex.caches.etcd`` needs etcd3gw alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .sync import EtcdCache, from_url

if TYPE_CHECKING:
    from .asyncio import AsyncEtcdCache

__all__ = ["AsyncEtcdCache", "EtcdCache", "from_url"]


def __getattr__(name: str) -> object:
    if name == "AsyncEtcdCache":
        from .asyncio import AsyncEtcdCache

        return AsyncEtcdCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
