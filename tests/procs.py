"""Bodies of the child processes used by ``test_disk_processes.py``.

They live in their own module so that the ``spawn`` start method can import them by name
in a fresh interpreter. Each child reports through files in the test's ``tmp_path`` (never
through pipes a SIGKILL could leave half-written in a way the parent cannot tell apart):
logs are appended with one ``os.write`` per line on an ``O_APPEND`` descriptor, and
one-shot reports are written to a temporary name and renamed into place.

Times are ``time.monotonic()``: on Linux that is ``CLOCK_MONOTONIC``, one clock for every
process on the machine, so intervals logged by different processes can be compared.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from simple_mutex import DiskCache, Mutex, Semaphore, SimpleMutexLeaseExpiredError

POLL = 0.005  # short poll interval: DiskCache has no cross-process wake-up


def write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` so that a reader never sees a half-written file."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def read_json(path: str | Path) -> Any:
    with open(path) as f:
        return json.load(f)


def wait_for_file(path: str | Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


# -- a. exclusion ---------------------------------------------------------------------


def contend(
    cache_dir: str,
    key: str,
    permits: int,
    iterations: int,
    hold: float,
    counter_path: str | None,
    log_path: str,
    barrier: Any,
) -> None:
    """``iterations`` critical sections on ``key``; log ``pid start end fence slot seen lost``.

    With ``counter_path`` each section is a read-modify-write of the shared counter file
    with a sleep in between: two holders at once would lose an increment. Between sections
    a worker pauses briefly (as real work does): the lock is not fair, and a releaser that
    re-acquired at once would keep it from waiters that poll."""
    cache = DiskCache(cache_dir)
    space: Mutex | Semaphore
    if permits == 1:
        space = Mutex(cache, lease=30, interval=POLL)
    else:
        space = Semaphore(cache, permits=permits, lease=30, interval=POLL)
    lines = []
    barrier.wait(60)  # start together, so that every process contends
    for _ in range(iterations):
        # A broken lock must show up as overlaps and lost counts in the parent's checks,
        # not as a crash here: tolerate what a second holder would do to us.
        lost = 0
        try:
            with space.acquire(key, timeout=60) as lease:
                start = time.monotonic()
                seen = -1
                if counter_path is not None:
                    with open(counter_path) as f:
                        text = f.read()  # empty if another holder is mid-write
                    seen = int(text) if text else -1
                    time.sleep(hold)
                    with open(counter_path, "w") as f:
                        f.write(str(seen + 1))
                else:
                    time.sleep(hold)
                end = time.monotonic()
        except SimpleMutexLeaseExpiredError:
            lost = 1
        lines.append(f"{os.getpid()} {start!r} {end!r} {lease.fence} {lease.slot} {seen} {lost}\n")
        time.sleep(random.uniform(0, 2 * POLL))
    Path(log_path).write_text("".join(lines))


# -- b. a holder killed with SIGKILL --------------------------------------------------


def hold_forever(cache_dir: str, key: str, lease: float, info_path: str) -> None:
    """Take ``key`` without renewal, report it, then hang until killed."""
    mutex = Mutex(DiskCache(cache_dir), lease=lease, interval=POLL)
    held = mutex.acquire(key, timeout=10)
    write_json(
        info_path,
        {
            "pid": os.getpid(),
            "fence": held.fence,
            "expires_at": held.expires_at.timestamp(),
        },
    )
    while True:
        time.sleep(3600)


# -- c. crashes mid-write -------------------------------------------------------------


def hammer(cache_dir: str, key: str, lease: float, log_path: str) -> None:
    """Acquire and release ``key`` as fast as possible, logging every fence, until killed."""
    mutex = Mutex(DiskCache(cache_dir), lease=lease, interval=0.001)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    while True:
        held = mutex.acquire(key, timeout=30)
        os.write(fd, f"{held.fence}\n".encode())
        held.release()


# -- d. fork after use (run as a script: python procs.py fork CACHE_DIR RESULT) --------


def fork_after_use(cache_dir: str, result_path: str) -> int:
    """Use simple_mutex (keeper thread running), fork, and hold a renewed lease in the child.

    The child takes ``child-key`` with a 0.3 s lease and ``renew=True`` and holds it for
    1.2 s (four leases). Only a keeper thread running in the child can keep it: the
    parent's keeper thread did not survive the fork. The parent watches the key from
    outside. Returns the exit code for the script."""
    mutex = Mutex(DiskCache(cache_dir), lease=0.3, interval=POLL)
    # Use the library in the parent: its keeper thread starts and renews this lease.
    parent_lease = mutex.acquire("parent-key", renew=True, timeout=5)
    time.sleep(0.35)  # past a renewal, and past the lease length
    if parent_lease.lost:
        write_json(result_path, {"error": "the parent lost its own renewed lease"})
        return 1
    child_report = f"{result_path}.child"
    pid = os.fork()
    if pid == 0:  # the child: never return into the caller's stack
        code = 1
        report: dict[str, Any] = {"pid": os.getpid()}
        try:
            lease = mutex.acquire("child-key", renew=True, timeout=5)
            report["fence"] = lease.fence
            report["acquired"] = time.monotonic()
            with lease:
                until = time.monotonic() + 1.2
                while time.monotonic() < until:
                    time.sleep(0.01)
            report["released"] = time.monotonic()
            report["lost"] = lease.lost
            report["keeper_threads"] = [
                t.name for t in threading.enumerate() if t.name == "simple-mutex-keeper"
            ]
            code = 0
        except SimpleMutexLeaseExpiredError as exc:
            report["error"] = f"lease lost in the forked child: {exc}"
        except BaseException:
            report["error"] = traceback.format_exc()
        finally:
            try:
                write_json(child_report, report)
            finally:
                os._exit(code)
    # The parent: while the child holds, the key must stay locked by the child.
    observations = []
    deadline = time.monotonic() + 20
    status = None
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        holder = mutex.holder("child-key")
        observations.append([time.monotonic(), None if holder is None else holder.pid])
        time.sleep(0.02)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        write_json(result_path, {"error": "the forked child did not finish in 20 s"})
        return 1
    parent_still_held = not parent_lease.lost
    parent_released = parent_lease.release()
    write_json(
        result_path,
        {
            "child_pid": pid,
            "child_exit": os.waitstatus_to_exitcode(status),
            "child": read_json(child_report) if os.path.exists(child_report) else None,
            "observations": observations,
            "parent_still_held": parent_still_held,
            "parent_released": parent_released,
        },
    )
    return 0


def fork_while_busy(cache_dir: str, result_path: str, forks: int) -> int:
    """Fork repeatedly while another thread of this process is inside DiskCache calls.

    Each child uses the *same* DiskCache object once (acquire + release) and exits. A lock
    or SQLite handle caught mid-use by ``fork()`` would hang the child; the parent gives
    each child 3 s and stops at the first that hangs."""
    cache = DiskCache(cache_dir)
    mutex = Mutex(cache, lease=5, interval=POLL)
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            mutex.locked("busy-key")

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    hung = failed = done_forks = 0
    for _ in range(forks):
        if hung:
            break
        time.sleep(0.002)
        done_forks += 1
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                mutex.acquire("child-key", timeout=5).release()
                code = 0
            finally:
                os._exit(code)
        deadline = time.monotonic() + 3
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                if os.waitstatus_to_exitcode(status) != 0:
                    failed += 1
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                hung += 1
                break
            time.sleep(0.005)
    stop.set()
    thread.join(5)
    write_json(result_path, {"forks": done_forks, "hung": hung, "failed": failed})
    return 0


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "fork":
        sys.exit(fork_after_use(*args))
    if command == "fork-busy":
        sys.exit(fork_while_busy(args[0], args[1], int(args[2])))
    sys.exit(f"unknown command {command!r}")
