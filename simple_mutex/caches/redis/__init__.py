"""The Redis tier: one Lua script per contract step, shared by both faces.

``sync.py`` RedisCache (redis-py's blocking client), ``asyncio.py`` AsyncRedisCache
(``redis.asyncio``), ``protocol.py`` what both send and how they read the replies.
"""

from __future__ import annotations

from .asyncio import AsyncRedisCache
from .sync import RedisCache, from_url, parse_sentinel_url

__all__ = ["AsyncRedisCache", "RedisCache", "from_url", "parse_sentinel_url"]
