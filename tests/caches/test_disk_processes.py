"""DiskCache across real OS processes: the behaviour suite, wake-ups, crashes, fork.

These are the per-machine tier's promises, checked the only way they can be: with several
interpreters (``spawn``, so no state is inherited by accident) on one SQLite file. Every
wait is bounded, so a broken lock fails the test instead of hanging it.
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import procs
import pytest
from behaviour import PREFIX, NotifyBehaviour, SharedBehaviour, new_key
from servers import TESTS

from simple_mutex import DiskCache, Mutex
from simple_mutex.caches.disk import FILENAME, GATE_FILENAME
from simple_mutex.errors import SimpleCacheConditionError

pytestmark = pytest.mark.backends

HERE = TESTS  # procs.py


class TestDiskBehaviour(NotifyBehaviour, SharedBehaviour):
    """The behaviour suite on DiskCache, with processes on one directory."""

    @pytest.fixture
    def url(self, tmp_path: Path) -> str:
        return (tmp_path / "locks").as_uri()

    def write_foreign(self, url: str, cache_key: str) -> str:
        """A row of other types, as another program writing into the SQLite file would."""
        path = Path(url.removeprefix("file://"))
        DiskCache(path).get("create the table")
        with closing(sqlite3.connect(path / FILENAME)) as conn, conn:
            conn.execute(
                "INSERT INTO entries (key, value, version, fence, expires_at) "
                "VALUES (?, ?, ?, ?, ?)",
                (cache_key, b"\x00binary", "v", "one", "tomorrow"),
            )
        return url

    def unreachable_url(self, tmp_path: Path) -> str:
        """A store file that is not a database."""
        (tmp_path / "broken").mkdir()
        (tmp_path / "broken" / FILENAME).write_bytes(b"not a database, " * 512)
        return (tmp_path / "broken").as_uri()


def test_a_release_wakes_a_waiter_in_another_process_with_default_settings(tmp_path: Path):
    """A process waiting with the default 1 s poll takes the lock within 0.1 s of the
    release in another process: the gate woke it (a poll would come 0.2 s late or more).
    The gate is one fixed-size file: waiting on many keys adds nothing to the directory."""
    url, key = (tmp_path / "locks").as_uri(), new_key()
    mutex = Mutex(DiskCache(tmp_path / "locks"), prefix=PREFIX)
    held = mutex.acquire(key, timeout=0)
    ready, report = tmp_path / "ready", tmp_path / "report.json"
    waiter = procs.start(procs.take_when_free, url, PREFIX, key, str(ready), str(report))
    try:
        assert procs.wait_for_file(ready, timeout=30)
        time.sleep(0.3)  # the waiter failed its first try and blocks
        released = time.monotonic()
        assert held.release() is True
        assert procs.wait_for_file(report, timeout=5)
        assert procs.read_json(report)["got"] - released < 0.1
    finally:
        waiter.join(5)
    for n in range(50):
        mutex.try_acquire(f"{key}.{n}")
    gate = tmp_path / "locks" / GATE_FILENAME
    assert sorted(p.name for p in gate.parent.iterdir() if not p.name.startswith(FILENAME)) == [
        GATE_FILENAME
    ]
    assert gate.stat().st_size == 4096


def test_processes_opening_a_new_store_at_once_all_succeed(tmp_path: Path, children):
    """Processes that open one fresh directory at the same instant race to set the store
    up (SQLite answers "locked" at once to all but one): each still gets its lock."""
    for attempt in range(5):  # one race lost in two, without the wait for "locked"
        url, barrier = (tmp_path / f"store-{attempt}").as_uri(), procs.CTX.Barrier(4)
        started = [procs.start(procs.first_use, url, barrier) for _ in range(4)]
        children.extend(started)
        procs.join_all(started, timeout=60)


def test_sigkill_at_random_moments_never_corrupts_the_store(tmp_path, children):
    """Processes hammering acquire/release are SIGKILLed at random moments (often mid
    SQLite write). Afterwards the file passes ``PRAGMA integrity_check``, no fence was
    granted twice, and the lock still works with a fence above every earlier grant."""
    cache_dir = str(tmp_path / "cache")
    rng = random.Random(os.getpid())
    logs: list[Path] = []

    def spawn_hammer() -> Any:
        log = tmp_path / f"fences-{len(logs)}"
        logs.append(log)
        proc = procs.start(procs.hammer, cache_dir, "crashy", 0.3, str(log))
        children.append(proc)
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


_THREADS_ON_ONE_CACHE = """
import sys, threading
from simple_mutex import DiskCache, Mutex
mutex = Mutex(DiskCache(sys.argv[1]), interval=0.005)
def cycles(n):
    for i in range(150):
        with mutex.acquire(f"k{(n + i) % 3}", timeout=20):
            pass
threads = [threading.Thread(target=cycles, args=(n,)) for n in range(8)]
for t in threads: t.start()
for t in threads: t.join()
print("done")
"""


def test_threads_sharing_one_disk_cache_never_deadlock(tmp_path: Path):
    """Eight threads cycle locks through one DiskCache (one SQLite connection) at once,
    busy keys and free ones, in a process of their own (a deadlock there holds the GIL:
    only a timeout from outside ends it). SQLite calls the clock function back under the
    connection's mutex; a thread that read its reply outside the cache's guard held the
    GIL waiting for that mutex: the process froze within a few hundred cycles."""
    argv = [sys.executable, "-c", _THREADS_ON_ONE_CACHE, str(tmp_path / "locks")]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("threads sharing one DiskCache froze (a deadlock on its connection)")
    assert done.stdout.strip() == "done", done.stderr


# -- a cache dropped before a fork ---------------------------------------------------------


def open_store_files(directory: Path) -> list[str]:
    """The files of the store under ``directory`` this process has open."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)) and FILENAME in target:
            found.append(target)
    return found


def test_a_dropped_cache_leaves_no_connection_open(tmp_path: Path):
    """From Python 3.11 a dropped sqlite3.Connection stays open until the cyclic collector
    runs (it is in a cycle with its statement cache): the cache closes its own."""
    gc.disable()
    try:
        cache = DiskCache(tmp_path / "locks")
        cache.put_if_absent("k", "v", ttl=60)
        assert open_store_files(tmp_path / "locks")
        del cache
        assert open_store_files(tmp_path / "locks") == []
    finally:
        gc.enable()


def hold_in_turn(directory: str, seconds: float, out: str) -> None:
    """Take one key again and again for ``seconds``, noting each hold that found another
    process inside (a flag file made with O_EXCL); and add one to a shared counter by
    compare-and-set each time, noting how many landed."""
    cache = DiskCache(directory)
    locks = Mutex(cache, lease=1)
    flag = os.path.join(directory, "inside")
    held = overlaps = landed = 0
    stop = time.monotonic() + seconds
    while time.monotonic() < stop:
        with locks.acquire("one.key", timeout=30):
            held += 1
            try:
                os.close(os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                overlaps += 1
            else:
                time.sleep(0.002)
                os.unlink(flag)
        entry = cache.get("counter")
        assert entry is not None
        try:
            cache.compare_and_set("counter", str(int(entry.value) + 1), ttl=600,
                                  version=entry.version)  # fmt: skip
            landed += 1
        except SimpleCacheConditionError:
            pass
        time.sleep(0.004)  # the key is free a good part of the time
    procs.write_json(out, {"held": held, "overlaps": overlaps, "landed": landed})


def test_processes_forked_around_a_dropped_cache_share_one_store(tmp_path: Path, children):
    """A cache the parent used and dropped, then processes forked before and after the
    parent's next collection: one key is never held twice and no compare-and-set is lost
    (its connection, carried open into the first children, once made the parent delete
    the -wal and -shm under them when the collector closed it: two stores on one path)."""
    directory = tmp_path / "locks"
    cache = DiskCache(directory)
    cache.put_if_absent("counter", "0", ttl=600)
    del cache
    outs = [str(tmp_path / f"out{n}.json") for n in range(4)]
    fork = multiprocessing.get_context("fork")
    for n, out in enumerate(outs):
        if n == 2:
            time.sleep(0.3)
            gc.collect()  # the parent's collector runs while the first two work
        child = fork.Process(target=hold_in_turn, args=(str(directory), 3.0, out))
        child.start()
        children.append(child)
    for child in children:
        child.join(60)
        assert child.exitcode == 0
    reports = [procs.read_json(out) for out in outs]
    assert all(report["held"] > 0 for report in reports)
    assert sum(report["overlaps"] for report in reports) == 0
    counter = DiskCache(directory).get("counter")
    assert counter is not None
    assert int(counter.value) == sum(report["landed"] for report in reports)
