"""Job functions of the RQ ``on_busy="replace"`` suite (``tests/rq_mutex/test_rq_replace.py``),
importable by its ``rq worker`` processes.

``writer`` holds ``doc.<doc>`` and runs ``replaced_writer.Writer.loop``: a fenced write
every 20 ms, each outcome logged under ``rqr:<run>:``; a newer job of the same key
replaces it. A 30 s lease: only a stop ends a holder within the tests' waits (its own
renewal would find the record gone 10 s later).
"""

from __future__ import annotations

import redis
from replaced_writer import Writer

from rq_mutex import current_lease, mutex_job
from rq_support.jobs import REDIS_URL

LEASE = 30
_record = redis.Redis.from_url(REDIS_URL)


@mutex_job(key="doc.{run}.{doc}", on_busy="replace", lease=LEASE)
def writer(run: str, doc: str, name: str, writes: int, deaf: bool = False) -> str:
    """``writes`` fenced writes under the key (``Writer.loop``)."""
    lease = current_lease()
    assert lease is not None
    return Writer(_record, f"rqr:{run}:").loop(doc, name, writes, lease.fence, deaf)
