"""Child processes for the behaviour suite and ``test_disk_processes.py``, and the
parent's helpers to start them and read what they logged.

They live in their own module so that the ``spawn`` start method can import them by name
in a fresh interpreter; a child gets a cache URL, never an inherited object. Children
report through files in the test's ``tmp_path`` (never through pipes a SIGKILL could leave
half-written): logs are written once at the end, and one-shot reports are written to a
temporary name and renamed into place.

Times are ``time.monotonic()``: on Linux that is ``CLOCK_MONOTONIC``, one clock for every
process on the machine, so intervals logged by different processes can be compared.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import multiprocessing
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from simple_mutex import (
    DiskCache,
    Lease,
    Mutex,
    Semaphore,
    SimpleMutexLeaseExpiredError,
    cache_from_url,
)

POLL = 0.01  # a short poll interval: some tiers have no wake-up
CTX = multiprocessing.get_context("spawn")
FORK = multiprocessing.get_context("fork")  # children that inherit the test's objects
STACKS_SIGNAL = signal.SIGUSR2  # a hung child prints its threads' stacks on this signal


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


def start(target: Callable[..., Any], *args: Any) -> multiprocessing.process.BaseProcess:
    proc = CTX.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def forked(target: Callable[..., Any], runs: list[tuple[Any, ...]], timeout: float) -> list[Any]:
    """``target(*args)`` in one forked child per ``args`` of ``runs``, all at once (each
    inherits the test's objects); their exit codes (None: still running after
    ``timeout``, then killed)."""
    children = [FORK.Process(target=target, args=args) for args in runs]
    for child in children:
        child.start()
    deadline = time.monotonic() + timeout
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
        if child.exitcode is None:
            child.kill()
    return [child.exitcode for child in children]


def join_all(procs: list[Any], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    stuck = [p.pid for p in procs if p.is_alive()]
    assert not stuck, f"processes {stuck} still running after {timeout} s: lock wedged?"
    failed = {p.pid: p.exitcode for p in procs if p.exitcode != 0}
    assert not failed, f"child processes failed (pid: exit code): {failed}"


def stopped(pid: int) -> bool:
    """Has the kernel stopped process ``pid`` (state T in /proc)? A SIGSTOP sent is not yet
    a process stopped: it may run on for a moment on the other core."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] in ("T", "t")


def pause(pid: int, writing: Callable[[], bool]) -> None:
    """SIGSTOP ``pid`` at a moment when ``writing()`` is false, resuming and stopping it
    again until it is. A holder stopped inside a database transaction keeps its row locks
    while it sleeps, so the next holder's write would wait for it to resume: a test that
    resumes it only after that write would wait forever. Stopped between two writes it
    holds nothing but its lease, which is the scenario these tests mean."""
    for _ in range(2000):
        os.kill(pid, signal.SIGSTOP)
        while not stopped(pid):
            time.sleep(0.001)
        if not writing():
            return
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.002 * random.random())
    raise AssertionError(f"process {pid} was writing every time it was stopped")


@contextlib.contextmanager
def taken_from_paused(
    holder: multiprocessing.process.BaseProcess,
    url: str,
    key: str,
    held_at: Callable[[], int],
    *,
    join: float,
    writing: Callable[[], bool] = lambda: False,
) -> Iterator[Lease]:
    """Start ``holder``; once ``held_at()`` (which waits for it to hold ``key``) returns
    its fence, SIGSTOP it (between two writes: see ``pause``) and take ``key`` on ``url``
    when its lease lapses: the block runs holding that lease. After the block, still
    holding, the holder is resumed and waited for ``join`` s; a holder still alive then
    (or after an error) is killed."""
    holder.start()
    try:
        old_fence = held_at()
        pause(holder.pid, writing)
        taker = Mutex(cache_from_url(url), lease=10)
        # Renewed: on a loaded machine the resumed holder may take a while to end, and the
        # taker must still hold while it does (its late writes are what is tested).
        with taker.acquire(key, timeout=5, renew=True) as lease:
            assert lease.fence > old_fence  # granted once the paused lease lapsed
            yield lease
            os.kill(holder.pid, signal.SIGCONT)
            holder.join(join)
            if holder.is_alive():  # where it is stuck, on the test's stderr
                os.kill(holder.pid, STACKS_SIGNAL)
                holder.join(2)
            assert not holder.is_alive(), f"the holder still ran {join} s after it resumed"
    finally:
        if holder.is_alive():
            os.kill(holder.pid, signal.SIGCONT)
            holder.kill()


def published(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a reader polling for the file never
    sees it empty, as it could between write_text's open and its write)."""
    Path(path + ".part").write_text(text)
    os.replace(path + ".part", path)


def hold_with_writer(
    mutex: Mutex, key: str, report: str, write_until: Callable[[Lease, threading.Event], None]
) -> None:
    """A holder paused past its lease (the child of ``taken_from_paused``): holds ``key``
    (renewed) while ``write_until(lease, stop)`` writes under its fence from a thread of
    its own, as a worker pool's would: the lapse interrupt reaches the holder's thread,
    never that one. Writes the fence to ``report`` before that thread starts (so before any
    of its writes), and the outcome, "interrupted" or not, to ``report + ".done"``."""
    outcome, stop = "never interrupted", threading.Event()
    helper: threading.Thread | None = None
    faulthandler.register(STACKS_SIGNAL, all_threads=True)  # for a holder that hangs
    try:
        with mutex.acquire(key, renew=True) as lease:
            helper = threading.Thread(target=write_until, args=(lease, stop))
            published(report, str(lease.fence))
            helper.start()
            while True:
                time.sleep(0.01)
    except SimpleMutexLeaseExpiredError:
        outcome = "interrupted"
    finally:
        stop.set()
    if helper is not None and helper.is_alive():
        helper.join(10)
    published(report + ".done", outcome)


class Row(NamedTuple):
    """One critical section as a child logged it."""

    pid: int
    start: float
    end: float
    fence: int
    slot: int
    seen: int  # the counter read inside the section
    lost: int  # 1 if the lease was lost inside it


def read_rows(paths: list[Path]) -> list[Row]:
    """The critical sections the children logged, in the order they began."""
    rows = [
        Row(int(p), float(a), float(b), int(f), int(s), int(n), int(lost))
        for path in paths
        for p, a, b, f, s, n, lost in (line.split() for line in path.read_text().splitlines())
    ]
    return sorted(rows, key=lambda row: row.start)


def max_overlap(rows: list[Row]) -> int:
    """The largest number of sections open at one instant (an end sorts before a start
    at the same instant: touching sections do not overlap)."""
    events = sorted([(r.start, 1) for r in rows] + [(r.end, -1) for r in rows])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


# -- a. exclusion ---------------------------------------------------------------------


def contend(
    url: str,
    prefix: str,
    key: str,
    permits: int,
    iterations: int,
    hold: float,
    counter_path: str,
    log_path: str,
    barrier: Any,
) -> None:
    """``iterations`` critical sections on ``key``, each a read-modify-write of the shared
    counter file with a sleep in between (two holders at once would lose an increment);
    logs ``pid start end fence slot seen lost``. Between sections a worker pauses briefly,
    as real work does: the lock is not fair, and a releaser that re-acquired at once
    would keep it from waiters that poll."""
    cache = cache_from_url(url)
    space: Mutex | Semaphore
    if permits == 1:
        space = Mutex(cache, lease=30, interval=POLL, prefix=prefix)
    else:
        space = Semaphore(cache, permits=permits, lease=30, interval=POLL, prefix=prefix)
    lines = []
    barrier.wait(60)  # start together, so that every process contends
    for _ in range(iterations):
        # A broken lock must show up as overlaps and lost counts in the parent's checks,
        # not as a crash here: tolerate what a second holder would do to us.
        lost = 0
        try:
            with space.acquire(key, timeout=60) as lease:
                start = time.monotonic()
                text = Path(counter_path).read_text()  # empty if another holder is mid-write
                seen = int(text) if text else -1
                time.sleep(hold)
                Path(counter_path).write_text(str(seen + 1))
                end = time.monotonic()
        except SimpleMutexLeaseExpiredError:
            lost = 1
        lines.append(f"{os.getpid()} {start!r} {end!r} {lease.fence} {lease.slot} {seen} {lost}\n")
        time.sleep(random.uniform(0, 2 * POLL))
    Path(log_path).write_text("".join(lines))


# -- b. a holder killed with SIGKILL --------------------------------------------------


def hold_forever(url: str, prefix: str, key: str, lease: float, info_path: str) -> None:
    """Take ``key`` without renewal, report it (``asked``: before the acquire's request,
    ``granted``: after its reply), then hang until killed."""
    mutex = Mutex(cache_from_url(url), lease=lease, prefix=prefix)
    mutex.locked("warm-up")  # the first request's set-up is not part of the grant
    asked = time.monotonic()
    held = mutex.acquire(key, timeout=10)
    granted = time.monotonic()
    info = {"pid": os.getpid(), "fence": held.fence, "asked": asked, "granted": granted}
    write_json(info_path, info)
    while True:
        time.sleep(3600)


def take_when_free(url: str, prefix: str, key: str, ready_path: str, report_path: str) -> None:
    """Wait for ``key`` with the default settings (a 1 s poll), report when it was got."""
    mutex = Mutex(cache_from_url(url), prefix=prefix)
    Path(ready_path).touch()
    lease = mutex.acquire(key, timeout=30)
    write_json(report_path, {"got": time.monotonic()})
    lease.release()


def wait_and_report(
    url: str, prefix: str, key: str, timeout: float, ready_path: str, report_path: str
) -> None:
    """Wait for ``key`` up to ``timeout`` (polling every 0.2 s); report when it was got,
    or the error that ended the wait."""
    mutex = Mutex(cache_from_url(url), prefix=prefix, interval=0.2)
    mutex.locked("warm-up")
    Path(ready_path).touch()
    try:
        lease = mutex.acquire(key, timeout=timeout)
    except Exception as exc:  # the report is the test's evidence, whatever ended the wait
        write_json(report_path, {"error": f"{type(exc).__name__}: {exc}"})
        return
    write_json(report_path, {"got": time.monotonic(), "fence": lease.fence})
    lease.release()


def first_use(url: str, barrier: Any) -> None:
    """Use a store for the first time at the same instant as the other children."""
    cache = cache_from_url(url)
    barrier.wait(30)
    Mutex(cache, interval=POLL).acquire("k", timeout=10).release()


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


# -- c. grants through a fault of the server (etcd's leader SIGKILLed) ------------------------


def cycle_until_stopped(url: str, prefix: str, key: str, stop_path: str, log_path: str) -> None:
    """Take ``key`` again and again until ``stop_path`` exists, each time a
    read-modify-write of the file ``counter`` beside ``log_path`` with a short hold
    (the file ``holding`` beside it exists meanwhile); a
    MalfunctionError or a timeout (the cluster electing a leader) is logged and tried
    again. Logs ``pid start end fence seen`` per section
    and ``pid fault at`` per failure."""
    from simple_mutex import MalfunctionError, SimpleMutexAcquireTimeoutError

    mutex = Mutex(cache_from_url(url), lease=2, interval=0.5, prefix=prefix)
    counter = Path(log_path).parent / "counter"
    holding = Path(log_path).parent / "holding"  # exists while a section runs
    lines = []
    while not Path(stop_path).exists():
        try:
            with mutex.acquire(key, timeout=2) as lease:
                start = time.monotonic()
                holding.touch()
                text = counter.read_text()
                seen = int(text) if text else -1
                time.sleep(0.05)
                counter.write_text(str(seen + 1))
                holding.unlink()
                end = time.monotonic()
                # Logged inside: a release the election fails still ran its section.
                lines.append(f"{os.getpid()} {start!r} {end!r} {lease.fence} {seen}\n")
        except (MalfunctionError, SimpleMutexAcquireTimeoutError) as exc:
            lines.append(f"{os.getpid()} fault {time.monotonic()!r} {type(exc).__name__}\n")
        time.sleep(random.uniform(0, 0.02))
    Path(log_path).write_text("".join(lines))
