"""A lease belongs to the process that took it (DESIGN §4 rule 14): a child forked inside
``with mutex.acquire(k)`` (multiprocessing's fork, a subprocess helper, gunicorn's
preload) leaves the block with a copy of the Lease, and that copy never releases, renews
or frees the parent's record. Real forks, on the tiers that span processes: DiskCache and
the Redis at REDIS_URL (a missing server fails the test)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from simple_mutex import ConstraintError, DiskCache, Mutex, cache_from_url
from simple_mutex._core.lifecycle import Released

pytestmark = pytest.mark.backends

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture(params=["disk", "redis"])
def mutex(request: pytest.FixtureRequest, tmp_path: Path) -> Mutex:
    cache = DiskCache(tmp_path / "locks") if request.param == "disk" else cache_from_url(REDIS_URL)
    return Mutex(cache, lease=30, prefix=f"fork-{uuid.uuid4().hex[:8]}.")


def in_child(work) -> int:  # type: ignore[no-untyped-def]
    """Fork; the child runs ``work`` and exits with what it returns (99 if it raised)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child's coverage is not collected)
        code = 99
        try:
            code = work()
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_forked_child_leaving_the_block_keeps_the_parents_lock(mutex):
    """The child's copy leaves the ``with`` block (no error: it is not the holder) and
    the parent's lock is still held: nobody else gets the key until the parent lets go."""
    with mutex.acquire("k", renew=True) as lease:

        def child_leaves_the_block() -> int:
            copy_released = lease.release()
            return 0 if copy_released is False else 1

        assert in_child(child_leaves_the_block) == 0
        assert mutex.try_acquire("k") is None, "the child's copy freed the parent's lock"
        assert not lease.lost
    assert not mutex.locked("k")  # the parent's own exit frees it


def test_a_child_that_runs_on_out_of_the_with_block_frees_nothing(mutex):
    """``os.fork()`` inside the block, and the child runs on out of it, as code after a
    fork does: the block's exit in the child is quiet and frees nothing."""
    pid = 0
    try:
        with mutex.acquire("k") as lease:
            pid = os.fork()
        if pid == 0:  # pragma: no cover: the child, out of the block without an error
            os._exit(0 if isinstance(lease._state, Released) else 2)
    except BaseException:
        if pid == 0:  # pragma: no cover: the child's exit raised
            os._exit(3)
        raise
    # The parent left the block too (and released): check what the child did first.
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def test_the_childs_exit_of_the_block_leaves_the_parent_holding(mutex):
    """The same, with the parent still inside its block while the child leaves it."""
    lease = mutex.acquire("k")
    with lease:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover: the child
            try:
                lease.__exit__(None, None, None)  # what leaving the block runs
                os.write(write, b"ok")
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(read, 2) == b"ok"
        assert mutex.try_acquire("k") is None, "the child's exit freed the parent's lock"
        assert mutex.holder("k") is not None
    assert not mutex.locked("k")


def test_a_forked_copy_cannot_renew_or_enter(mutex):
    """Renewing or entering the parent's lease in the child is refused with the fix;
    the parent's record is untouched."""
    lease = mutex.acquire("k")
    fence = lease.fence

    def misuse() -> int:
        refused = 0
        for attempt in (lease.renew, lease.__enter__):
            try:
                attempt()
            except ConstraintError as exc:
                refused += "forked child" in str(exc)
        return 0 if refused == 2 else 1

    assert in_child(misuse) == 0
    holder = mutex.holder("k")
    assert holder is not None
    assert holder.fence == fence
    assert lease.release() is True
