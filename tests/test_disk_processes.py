"""DiskCache across real OS processes: exclusion, SIGKILLed holders, crashes, fork.

These are the per-machine tier's promises, checked the only way they can be: with several
interpreters (``spawn``, so no state is inherited by accident) contending on one SQLite
file. Every wait is bounded, so a broken lock fails the test instead of hanging it.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import procs
import pytest

from simple_mutex import DiskCache, Mutex
from simple_mutex.caches.disk import FILENAME

pytestmark = pytest.mark.slow

CTX = multiprocessing.get_context("spawn")
HERE = Path(__file__).resolve().parent


@pytest.fixture
def children() -> Iterator[list[multiprocessing.process.BaseProcess]]:
    """Processes started by a test; any still alive at teardown are killed."""
    started: list[multiprocessing.process.BaseProcess] = []
    yield started
    for proc in started:
        if proc.is_alive():
            proc.kill()
        proc.join(5)


def start(children: list, target, *args) -> multiprocessing.process.BaseProcess:
    proc = CTX.Process(target=target, args=args, daemon=True)
    proc.start()
    children.append(proc)
    return proc


def join_all(procs_: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs_:
        proc.join(max(0.0, deadline - time.monotonic()))
    stuck = [p.pid for p in procs_ if p.is_alive()]
    assert not stuck, f"processes {stuck} still running after {timeout} s: lock wedged?"
    failed = {p.pid: p.exitcode for p in procs_ if p.exitcode != 0}
    assert not failed, f"child processes failed (pid: exit code): {failed}"


# pid, start, end, fence, slot, count seen, lease lost inside the section (0 or 1)
Row = tuple[int, float, float, int, int, int, int]


def read_intervals(paths: list[Path]) -> list[Row]:
    """The critical sections the workers logged, in the order they began."""
    rows = []
    for path in paths:
        for line in path.read_text().splitlines():
            pid, start_, end, fence, slot, seen, lost = line.split()
            rows.append(
                (int(pid), float(start_), float(end), int(fence), int(slot), int(seen), int(lost))
            )
    return sorted(rows, key=lambda row: row[1])


def max_overlap(rows: list[Row]) -> int:
    """The largest number of intervals open at one instant (an end sorts before a start
    at the same instant: touching intervals do not overlap)."""
    events = sorted([(r[1], 1) for r in rows] + [(r[2], -1) for r in rows])
    level = peak = 0
    for _, step in events:
        level += step
        peak = max(peak, level)
    return peak


PROCESSES = 4
ITERATIONS = 40


def test_processes_never_overlap_and_no_increment_is_lost(tmp_path, children):
    """4 processes x 40 read-modify-writes of one counter file under one DiskCache mutex:
    no increment is lost, no two critical sections overlap in time, and fences strictly
    increase in the order the sections ran."""
    counter = tmp_path / "counter"
    counter.write_text("0")
    logs = [tmp_path / f"log-{i}" for i in range(PROCESSES)]
    barrier = CTX.Barrier(PROCESSES)
    workers = [
        start(
            children,
            procs.contend,
            str(tmp_path / "cache"),
            "counter",
            1,
            ITERATIONS,
            0.001,
            str(counter),
            str(log),
            barrier,
        )
        for log in logs
    ]
    join_all(workers, timeout=60)

    rows = read_intervals(logs)
    total = PROCESSES * ITERATIONS
    assert len(rows) == total
    overlaps = [(a, b) for a, b in itertools.pairwise(rows) if b[1] < a[2]]
    assert overlaps == []
    assert int(counter.read_text()) == total
    # A 30 s lease cannot lapse here: a loss means another holder took the record.
    assert [row for row in rows if row[6]] == []
    assert len({row[0] for row in rows}) == PROCESSES
    # They really contended: the lock changed hands between processes many times.
    handoffs = sum(a[0] != b[0] for a, b in itertools.pairwise(rows))
    assert handoffs >= PROCESSES * 3, f"only {handoffs} hand-offs: processes ran in turn"
    fences = [row[3] for row in rows]
    assert all(a < b for a, b in itertools.pairwise(fences)), fences
    # Each section read the count the previous one wrote: the order is the lock's order.
    assert [row[5] for row in rows] == list(range(total))


def test_semaphore_of_two_admits_two_processes_at_most(tmp_path, children):
    """4 processes under Semaphore(permits=2): never more than two sections at once, two
    did run at once (the semaphore is not a mutex in disguise), and each permit's fences
    strictly increase."""
    logs = [tmp_path / f"log-{i}" for i in range(PROCESSES)]
    barrier = CTX.Barrier(PROCESSES)
    workers = [
        start(
            children,
            procs.contend,
            str(tmp_path / "cache"),
            "pool",
            2,
            15,
            0.01,
            None,
            str(log),
            barrier,
        )
        for log in logs
    ]
    join_all(workers, timeout=60)

    rows = read_intervals(logs)
    assert len(rows) == PROCESSES * 15
    assert max_overlap(rows) == 2
    assert [row for row in rows if row[6]] == []
    assert {row[4] for row in rows} == {0, 1}
    for slot in (0, 1):
        fences = [row[3] for row in rows if row[4] == slot]
        assert all(a < b for a, b in itertools.pairwise(fences)), (slot, fences)


def test_lock_of_a_sigkilled_holder_frees_when_its_lease_lapses(tmp_path, children):
    """A holder killed with SIGKILL never releases: its lock stays held (holder() names the
    dead pid) until the 1 s lease lapses, then another process takes it with a higher
    fence, no earlier than the lease end."""
    cache_dir = str(tmp_path / "cache")
    info = tmp_path / "holder.json"
    lease = 1.0
    holder_proc = start(children, procs.hold_forever, cache_dir, "job", lease, str(info))
    assert procs.wait_for_file(info, timeout=30), "holder never reported its lease"
    held = procs.read_json(info)

    os.kill(holder_proc.pid, signal.SIGKILL)
    holder_proc.join(5)
    killed_at = time.monotonic()
    assert holder_proc.exitcode == -signal.SIGKILL

    mutex = Mutex(DiskCache(cache_dir), lease=5, interval=0.01)
    assert mutex.locked("job")
    seen = mutex.holder("job")
    assert seen is not None
    assert (seen.pid, seen.fence) == (held["pid"], held["fence"])
    assert mutex.try_acquire("job") is None

    taken = mutex.acquire("job", timeout=5)
    waited = time.monotonic() - killed_at
    try:
        # The cache frees the record at (its clock at the write) + lease, which is no
        # earlier than the holder's own expires_at (taken just before the write).
        assert time.time() >= held["expires_at"] - 0.01
        assert waited <= lease + 1.0, f"took {waited:.2f} s to take over a {lease} s lease"
        assert taken.fence > held["fence"]
    finally:
        assert taken.release()
    assert not mutex.locked("job")


def test_sigkill_at_random_moments_never_corrupts_the_store(tmp_path, children):
    """Processes hammering acquire/release are SIGKILLed at random moments (often mid
    SQLite write). Afterwards the file passes ``PRAGMA integrity_check``, no fence was
    granted twice, and the lock still works with a fence above every earlier grant."""
    cache_dir = str(tmp_path / "cache")
    rng = random.Random(os.getpid())
    logs: list[Path] = []

    def spawn_hammer() -> multiprocessing.process.BaseProcess:
        log = tmp_path / f"fences-{len(logs)}"
        logs.append(log)
        proc = start(children, procs.hammer, cache_dir, "crashy", 0.3, str(log))
        # Kill it only once it hammers (it opens its log just before its first acquire).
        assert procs.wait_for_file(log, timeout=30), "a hammer never started"
        return proc

    DiskCache(cache_dir)  # create the store before the children race to
    live = [spawn_hammer() for _ in range(3)]
    time.sleep(1.0)  # let them start and hammer
    kills = 0
    for _ in range(8):
        time.sleep(rng.uniform(0.05, 0.3))
        victim = live.pop(rng.randrange(len(live)))
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(5)
        assert victim.exitcode == -signal.SIGKILL, "a hammer died on its own (an error?)"
        kills += 1
        live.append(spawn_hammer())
    time.sleep(0.5)
    for proc in live:
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)
        assert proc.exitcode == -signal.SIGKILL, "a hammer died on its own (an error?)"

    with closing(sqlite3.connect(Path(cache_dir) / FILENAME)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]

    fences = []
    for log in logs:
        # A kill may cut the last line short.
        mine = [int(line) for line in log.read_text().splitlines() if line.isdigit()]
        assert all(a < b for a, b in itertools.pairwise(mine)), mine
        fences += mine
    assert kills == 8
    assert len(fences) > 50, "the hammers barely ran: the test proves little"
    assert len(fences) == len(set(fences)), "a fence was granted twice"

    mutex = Mutex(DiskCache(cache_dir), lease=5, interval=0.01)
    first = mutex.acquire("crashy", timeout=5)  # may wait out a killed holder's lease
    assert first.fence > max(fences)
    assert first.release()
    second = mutex.acquire("crashy", timeout=0)
    assert second.fence > first.fence
    assert second.release()


def run_script(*args: str, timeout: float) -> None:
    result = subprocess.run(
        [sys.executable, str(HERE / "procs.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_forked_child_keeps_its_renewed_lease(tmp_path):
    """After a process used simple_mutex (its keeper thread running) and forked, like a
    Celery prefork child or an RQ work horse, a lease the child takes with renew=True and
    a 0.3 s lease stays held for the 1.2 s the child works: the child gets its own
    keeper. The parent sees the key held by the child throughout."""
    result_path = tmp_path / "result.json"
    run_script("fork", str(tmp_path / "cache"), str(result_path), timeout=60)
    result = procs.read_json(result_path)
    assert "error" not in result, result["error"]
    child = result["child"]
    assert child is not None
    assert "error" not in child, child
    assert result["child_exit"] == 0
    assert child["lost"] is False
    assert child["released"] - child["acquired"] >= 1.2
    assert child["keeper_threads"] == ["simple-mutex-keeper"]
    # Watched from the parent: held by the child from its acquire to its release, well
    # past the 0.3 s lease it never let lapse.
    inside = [
        pid
        for t, pid in result["observations"]
        if child["acquired"] + 0.05 < t < child["released"] - 0.05
    ]
    assert len(inside) >= 10
    assert set(inside) == {child["pid"]}
    assert result["parent_still_held"] is True
    assert result["parent_released"] is True


def test_fork_while_another_thread_uses_the_cache(tmp_path):
    """fork() while another thread of the parent is inside a DiskCache call (as when a
    keeper thread renews at the instant Celery or RQ forks): each child, using the same
    DiskCache object, acquires and releases within 3 s instead of hanging on a lock the
    fork copied in its held state."""
    result_path = tmp_path / "result.json"
    run_script("fork-busy", str(tmp_path / "cache"), str(result_path), "50", timeout=120)
    result = procs.read_json(result_path)
    assert result == {"forks": 50, "hung": 0, "failed": 0}
