"""The one-machine tier: a SQLite file every process of the machine opens.

``cache.py`` DiskCache, ``gate.py`` the file lock that wakes waiters on a release.
"""

from __future__ import annotations

from .cache import FILENAME, GATE_FILENAME, DiskCache, from_url

__all__ = ["FILENAME", "GATE_FILENAME", "DiskCache", "from_url"]
