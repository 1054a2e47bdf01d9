"""Processes that lock and know nothing of the journal:
``tests/journal/test_journal_timeline.py`` runs each as
``python tests/journal_children.py ROLE CACHE_DIR KEY [ARG]`` with only the environment
variable SIMPLE_MUTEX_JOURNAL set, the way an operator would turn it on.

Roles:
  worker N LABEL [GROUP]  N cycles: a try-once (busy when another holds it), then a wait
                   for it; with GROUP, first waits until GROUP workers of KEY started
  stuck MARKER     takes KEY with a 3 s lease, writes MARKER (pid, fence, token), hangs
  rescuer          waits for KEY (held by a stuck one), takes it over, releases it
  timeout          one acquire of KEY with a 0.1 s timeout (KEY is held: it times out)
  forker           acquires and releases KEY, forks; the child does the same
  loser            takes KEY with a 0.3 s lease and overruns it: the lease is lost
  permit N         N times: one of 2 permits of the semaphore KEY, held 50 ms
"""

from __future__ import annotations

import json
import os
import sys
import time

from simple_mutex import (
    DiskCache,
    Mutex,
    Semaphore,
    SimpleMutexAcquireTimeoutError,
    SimpleMutexLeaseExpiredError,
)


def _meet(cache_dir: str, key: str, group: int) -> None:
    """Wait (at most 30 s) until ``group`` workers of ``key`` have started: on a loaded
    machine three interpreters started together may otherwise run one after another."""
    os.makedirs(cache_dir, exist_ok=True)
    mark = os.path.join(cache_dir, f"started.{key}.")
    open(mark + str(os.getpid()), "w").close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if sum(name.startswith(os.path.basename(mark)) for name in os.listdir(cache_dir)) >= group:
            return
        time.sleep(0.005)


def _about_to_wait(rest: tuple[str, ...]) -> None:
    """Create the marker file named in ``rest`` (if any): the parent waits for it before
    it kills the holder, so the wait starts while the lock is held, however slowly this
    process started."""
    if rest:
        open(rest[0], "w").close()


def main(role: str, cache_dir: str, key: str, *rest: str) -> None:
    label = rest[1] if role == "worker" else role
    lease = {"stuck": 3.0, "loser": 0.3}.get(role, 10.0)
    mutex = Mutex(DiskCache(cache_dir), lease=lease, interval=0.005, label=label)
    if role == "worker":
        if len(rest) > 2:  # start together with the rest of the group, or they may not overlap
            _meet(cache_dir, key, int(rest[2]))
        for _ in range(int(rest[0])):
            lease = mutex.try_acquire(key) or mutex.acquire(key, timeout=30)
            with lease:
                time.sleep(0.01)
            time.sleep(0.005)
    elif role == "stuck":
        lease = mutex.acquire(key, timeout=30)
        report = {"pid": os.getpid(), "fence": lease.fence, "token": lease.token}
        with open(rest[0] + ".tmp", "w") as f:
            json.dump(report, f)
        os.replace(rest[0] + ".tmp", rest[0])
        time.sleep(3600)  # until SIGKILL
    elif role == "rescuer":
        _about_to_wait(rest)
        mutex.acquire(key, timeout=30).release()
    elif role == "timeout":
        try:
            _about_to_wait(rest)
            mutex.acquire(key, timeout=0.1)
        except SimpleMutexAcquireTimeoutError:
            return
        raise SystemExit("the acquire did not time out")
    elif role == "forker":
        mutex.acquire(key, timeout=30).release()
        child = os.fork()
        if child == 0:
            try:
                mutex.acquire(key, timeout=30).release()
            finally:
                os._exit(0)
        _, status = os.waitpid(child, 0)
        mutex.acquire(key, timeout=30).release()  # the parent's file again, not the child's
        sys.exit(os.waitstatus_to_exitcode(status))
    elif role == "loser":
        try:
            with mutex.acquire(key, timeout=30):
                started = time.monotonic()
                while time.monotonic() - started < 5:  # Python code: the interrupt lands here
                    pass
        except SimpleMutexLeaseExpiredError:
            return
        raise SystemExit("the lease was not lost")
    elif role == "permit":
        pool = Semaphore(DiskCache(cache_dir), permits=2, lease=10.0, interval=0.005)
        for _ in range(int(rest[0])):
            with pool.acquire(key, timeout=30, label="permit"):
                time.sleep(0.05)
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
