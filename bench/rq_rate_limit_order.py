"""Does RQ's own ``RateLimit`` keep send order? (The evaluation behind ``on_busy="queue"``
being built beside it: docs/design/queue.md.) Not a test; one run.

    python bench/rq_rate_limit_order.py      # REDIS_URL (default db 9); needs rq >= 3.0

20 jobs of one ``RateLimit(key, 1)`` are enqueued in a row (well within one second) and a
burst worker drains them; the script prints the order they ran in. RQ scores a waiting
job by ``current_timestamp()``, whole seconds, so the jobs of one second tie and are
promoted in the order of their (random) job ids. Seen here, RQ 3.0.0:
[0, 2, 6, 10, 5, 17, 13, 11, 8, 15, 4, 18, 3, 12, 16, 19, 1, 9, 14, 7].
"""

from __future__ import annotations

import os
import sys
import uuid

import redis
from rq import Queue, SimpleWorker

try:
    from rq import RateLimit
except ImportError:  # rq < 3.0 has no RateLimit at all
    raise SystemExit("this rq has no RateLimit") from None

URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/9")
RAN = f"rq-rate-limit-order.{uuid.uuid4().hex[:8]}"


def note(n: int, ran: str) -> None:
    redis.Redis.from_url(URL).rpush(ran, n)


def main() -> None:
    conn = redis.Redis.from_url(URL)
    queue = Queue(f"rq-rate-limit-order-{uuid.uuid4().hex[:8]}", connection=conn)
    for n in range(20):
        queue.enqueue(f"{__package__ or 'bench'}.rq_rate_limit_order.note", n, RAN,
                      rate_limit=RateLimit(f"entity.{RAN}", 1))  # fmt: skip
    worker = SimpleWorker([queue], connection=conn)
    for _ in range(25):  # each run promotes the next: drain until all ran
        worker.work(burst=True, logging_level="ERROR")
        if conn.llen(RAN) == 20:
            break
    ran = [int(n) for n in conn.lrange(RAN, 0, -1)]
    conn.delete(RAN)
    queue.delete(delete_jobs=True)
    print(f"sent 0..19, ran {ran}: {'in' if ran == sorted(ran) else 'out of'} send order")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
