"""The application under test: charge an order at most once at a time."""

from __future__ import annotations

from celery import Celery

from celery_mutex import MutexTask, current_lease
from simple_mutex import Mutex

LEDGER: dict[int, list[int]] = {}  # order -> fences of the charges that went through


def charge(locks: Mutex, order_id: int, amount: int) -> int:
    """Charge an order, one call per order at a time; the fence goes to the ledger."""
    with locks.acquire(f"order.{order_id}", timeout=0, renew=True) as lease:
        LEDGER.setdefault(order_id, []).append(lease.fence)
        return amount


app = Celery("billing", set_as_current=False)
app.conf.mutex_cache = "memory://"


@app.task(base=MutexTask, mutex={"key": "order.{order_id}", "on_busy": "skip"})
def charge_task(order_id: int, amount: int) -> int:
    lease = current_lease()
    assert lease is not None  # a direct call takes the lock too
    LEDGER.setdefault(order_id, []).append(lease.fence)
    return amount
