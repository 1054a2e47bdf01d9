"""The default cache: Redis on the job's (or the ``rq cron`` scheduler's) own connection,
one ``RedisCache`` per connection in each process (a work horse builds its own)."""

from __future__ import annotations

from typing import Any

from simple_mutex.busy import PerProcess
from simple_mutex.caches import RedisCache

_caches: PerProcess[RedisCache] = PerProcess(RedisCache, limit=16)  # old queues' drop off


def cache_on(connection: Any) -> RedisCache:
    return _caches.get(connection)
