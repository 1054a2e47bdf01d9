"""How the billing code behaves when locks are busy, lost or broken."""

from __future__ import annotations

import billing
import pytest

from celery_mutex import is_skipped
from simple_mutex import (
    MalfunctionError,
    Mutex,
    SimpleMutexAcquireTimeoutError,
    SimpleMutexLeaseExpiredError,
)


def test_a_second_charge_of_a_busy_order_is_refused(mutex_cache):
    locks = Mutex(mutex_cache)
    with locks.acquire("order.7"), pytest.raises(SimpleMutexAcquireTimeoutError):
        billing.charge(locks, 7, 10)


def test_charges_record_growing_fences(mutex_cache, mutex_events):
    locks = Mutex(mutex_cache)
    billing.charge(locks, 8, 10)
    billing.charge(locks, 8, 5)
    fences = billing.LEDGER[8]
    assert fences == sorted(fences)
    assert len(set(fences)) == 2
    assert [e.kind for e in mutex_events] == ["acquired", "released"] * 2


def test_a_backend_fault_surfaces_as_a_malfunction(faulty_cache):
    faulty_cache.fail("put_if_absent")
    with pytest.raises(MalfunctionError):
        billing.charge(Mutex(faulty_cache), 9, 10)


def outlive_the_lease(locks: Mutex) -> None:
    with locks.acquire("order.10", renew=True):
        while True:  # work longer than the lease: interrupted when it is lost
            pass


def test_a_lost_lease_fails_the_charge(faulty_cache):
    faulty_cache.fail("compare_and_set", times=100)  # every renewal fails
    with pytest.raises(SimpleMutexLeaseExpiredError):
        outlive_the_lease(Mutex(faulty_cache, lease=0.3))


def test_the_celery_task_skips_a_busy_order(mutex_cache):
    billing.app.conf.mutex_cache = mutex_cache  # the plugin resets the task's settings after
    with Mutex(mutex_cache).acquire("order.11"):
        assert is_skipped(billing.charge_task.apply(args=(11, 10)).get())
    assert billing.charge_task.apply(args=(11, 10)).get() == 10
