"""Every timing rule of the lock in one place: how a lease's deadline, renewals and
retries fall, how waiters poll, how a hand-off holds back, and the defaults. Plain
functions of a lease length (no clock is read here): the lease, the engine and the
drivers call them.

Change one and the tests that pin it (``tests/test_lease.py``, ``tests/test_engine.py``)
and the nemesis (its late-interrupt slack) say what it moved.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import random


DEFAULT_LEASE = 30 * 60.0
"""A lease's length when the caller names none (the seed's 30 minutes)."""
DEFAULT_INTERVAL = 1.0
"""The longest a waiter sleeps between two tries when no release wakes it."""


def lapse_margin(length: float) -> float:
    """How much before the cache's own expiry the holder's deadline falls. The interrupt
    reaches the work within this (a keeper wake-up and a GIL switch take milliseconds), so
    the work stops before the cache could grant the key to anyone else."""
    return min(length / 10.0, 0.05)


def renew_after(length: float) -> float:
    """Renew at a third of the lease: two renewals can fail before the lease lapses."""
    return length / 3.0


def retry_renew_after(length: float) -> float:
    """After a failed renewal (backend fault), try again soon but without hammering."""
    return min(max(length / 10.0, 0.01), 1.0)


def poll_pause(interval: float, rng: random.Random) -> float:
    """A jittered poll (0.5x to 1.5x) so waiters that started together do not stay in step."""
    return interval * (0.5 + rng.random())


def hand_over_block(length: float) -> float:
    """The longest one fused wait (``WaitThenPut``) may block, for a lease of ``length``:
    the grant's lease runs from before the wait on the holder's side, so a wait that
    ends in a grant takes up to this much off the first renewal's head start."""
    return length / 4.0


FAULT_RIDE_OUT = 30.0
"""How long a waiter rides out faults in a row once the cache has answered it (an etcd
election, a Sentinel or PostgreSQL failover, a restart): it tries again at its poll
interval until its deadline, and without one for this long at most; then the last fault
is raised. A fault before the cache ever answered is raised at once: a server that is
down or misconfigured is reported, not waited out."""


HANDOFF_COURTESY = 0.005
"""How long a holder that just woke a waiter by releasing a key holds back from taking
that key again. The releaser is already running while the woken waiter still has to be
scheduled, so without it a worker looping on one key wins nearly every race and starves
the others (measured on Redis: fairness 0.52-0.79 of the mean without, 1.00 with). A
single-slot acquire on a cache with a fused wait (``wait_then_put``: Redis) skips it:
there the woken waiter holds the key before the releaser's reply is read."""
