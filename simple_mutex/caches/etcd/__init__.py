"""The etcd tier: one leased key per lock, one transaction per contract step.

``sync.py`` EtcdCache (etcd3gw, the JSON gateway client), ``core.py`` the keys, records,
transactions and flows (no I/O).
"""

from __future__ import annotations

from .sync import EtcdCache, from_url

__all__ = ["EtcdCache", "from_url"]
