"""The MongoDB tier: one document per key, one conditional write per contract step.

``sync.py`` MongoCache (pymongo), ``asyncio.py`` AsyncMongoCache (pymongo >= 4.13's
asyncio client), ``core.py`` the documents, the statements and the flows both run.
"""

from __future__ import annotations

from .asyncio import AsyncMongoCache
from .sync import MongoCache, from_url

__all__ = ["AsyncMongoCache", "MongoCache", "from_url"]
