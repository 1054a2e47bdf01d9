"""RQ's own ``Worker`` and ``SimpleWorker`` for the tests that run a plain RQ worker, with
one change: shutting down never waits a minute for the worker's pubsub thread.

RQ 3.0's pubsub thread waits up to 60 s for a message, and redis-py 8.2's ``stop()``
waits for it: now and then a burst worker took a minute to return, which says nothing of
the lock and ate a test's time budget. ``rq_mutex.Worker`` carries the fix for its users
(and ``tests/rq_mutex/test_rq.py`` tests it there); these take the same method, so what
they test is RQ's worker as it is, but for how long its exit takes. Start them from the
command line with ``-w rq_support.workers.Worker`` (the worker's PYTHONPATH holds tests/).
"""

from __future__ import annotations

from rq import SimpleWorker as RQSimpleWorker
from rq import Worker as RQWorker

from rq_mutex import Worker as RQMutexWorker


class Worker(RQWorker):
    """RQ's forking worker, whose shutdown waits a second at most for its pubsub thread."""

    unsubscribe = RQMutexWorker.unsubscribe


class SimpleWorker(RQSimpleWorker):
    """RQ's in-process worker, whose shutdown waits a second at most for its pubsub thread."""

    unsubscribe = RQMutexWorker.unsubscribe
