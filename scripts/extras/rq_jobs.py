"""The RQ job a real ``rq worker`` runs during scripts/check_extras.sh."""

from __future__ import annotations

import os

from rq_mutex import current_lease, mutex_job


@mutex_job(key="order.{order_id}", on_busy="retry", lease=30)
def charge(order_id: int) -> dict[str, object]:
    """Return what the work horse saw while it held the lock: the check reads it back."""
    lease = current_lease()
    assert lease is not None, "mutex_job ran the body without a lease"
    return {"key": lease.key, "fence": lease.fence, "pid": os.getpid()}
