"""simple-mutex demo: several OS processes share two locks through a DiskCache.

Run it with ``scripts/demo.sh`` (sets everything up), or ``python examples/demo.py`` once
``simple-mutex`` is installed. It takes about 5 seconds and touches only a temporary
directory.

Part 1a, contention. Four worker processes each run 30 critical sections. Each section
locks one of two bank accounts (``account.alice`` or ``account.bob``) with
``Mutex.acquire`` and does a read-modify-write of that account's ledger file: read it,
pause 2 ms, write it back one higher. Without the lock, two workers would read the same
value and one increment would be lost. Each write is *fenced*: it carries the lease's
fence number and the ledger refuses a fence not above the last one it accepted (that is how
a real database or API should use ``Lease.fence``).

Part 1b, a crash. A process takes ``account.alice`` with a 2 s lease and is killed with
SIGKILL while holding it: it never releases. Another process, already waiting, gets the
lock once the lease has lapsed, with a higher fence.

At the end the demo prints what it saw, with the metrics the workers gathered from the
lock event stream (``simple_mutex.events``: every grant, release and loss, and how long
each acquire waited), and exits non-zero if any check failed. Every process journals its
lock events (``SIMPLE_MUTEX_JOURNAL``, set here for the workers: no code of theirs
changes), and the demo draws them as ``timeline.html``, one page that any browser opens:
who held which key when, the waits, the takeover after the kill.

The decorator form does the same in one line when the work does not need the fence::

    @with_simple_mutex(key="account.{name}", cache=DiskCache("/var/lock/myapp"))
    def deposit(name: str, amount: int) -> None: ...
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from simple_mutex import (
    DiskCache,
    Mutex,
    SimpleMutexLeaseExpiredError,
    events,
    journal,
)
from simple_mutex.journal import timeline

WORKERS = 4
SECTIONS = 30  # per worker
KEYS = ("account.alice", "account.bob")
LEASE = 10.0  # seconds; far above a section's 2 ms, so only a crash lets one lapse
POLL = 0.005  # DiskCache cannot notify other processes: waiters poll this often
CRASH_LEASE = 2.0

CTX = multiprocessing.get_context("spawn")  # fresh interpreters: nothing shared by accident


# -- what runs inside the lock ------------------------------------------------------------


def ledger_path(workdir: Path, key: str) -> Path:
    return workdir / f"{key}.ledger.json"


def fenced_increment(workdir: Path, key: str, fence: int) -> bool:
    """Read-modify-write the key's ledger; refuse a write whose fence is not newer.

    The pause between read and write is where a second holder would sneak in."""
    path = ledger_path(workdir, key)
    ledger = json.loads(path.read_text())
    time.sleep(0.002)
    accepted = bool(fence > ledger["last_fence"])  # a stale holder's write is refused
    if accepted:
        ledger["count"] += 1
        ledger["last_fence"] = fence
    else:
        ledger["rejected"] += 1
    write_report(path, ledger)
    return accepted


def open_mutex(workdir: Path, lease: float, label: str) -> Mutex:
    return Mutex(DiskCache(workdir / "locks"), lease=lease, interval=POLL, label=label)


def write_report(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # readers never see half a report


# -- the processes ------------------------------------------------------------------------


def worker(workdir: Path, number: int, barrier: Any) -> None:
    """Part 1a: SECTIONS critical sections on random keys, each logged with its times."""
    mutex = open_mutex(workdir, LEASE, f"worker-{number}")
    rng = random.Random()
    log = []
    seen: list[events.LockEvent] = []
    events.subscribe(seen.append)  # this process's lock events, for the metrics below
    barrier.wait(60)  # everyone starts together, so they really contend
    for _ in range(SECTIONS):
        key = rng.choice(KEYS)
        lost = False
        try:
            with mutex.acquire(key, timeout=60) as lease:
                start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process
                fenced_increment(workdir, key, lease.fence)
                end = time.monotonic()
        except SimpleMutexLeaseExpiredError:  # cannot happen with a 10 s lease: report it
            lost = True
        log.append(
            {
                "pid": os.getpid(),
                "key": key,
                "start": start,
                "end": end,
                "fence": lease.fence,
                "lost": lost,
            }
        )
        time.sleep(rng.uniform(0, 0.01))  # some work outside the lock
    metrics = {kind: sum(e.kind == kind for e in seen) for kind in ("acquired", "released", "lost")}
    waits = [e.waited for e in seen if e.waited is not None]
    metrics.update(waited_total=sum(waits), waited_max=max(waits, default=0.0))
    write_report(workdir / f"worker-{number}.json", {"sections": log, "metrics": metrics})


def stuck_holder(workdir: Path) -> None:
    """Part 1b: take account.alice, do one fenced write, then hang until killed."""
    mutex = open_mutex(workdir, CRASH_LEASE, "stuck-holder")
    lease = mutex.acquire(KEYS[0], timeout=30)
    fenced_increment(workdir, KEYS[0], lease.fence)
    write_report(
        workdir / "stuck.json",
        {"pid": os.getpid(), "fence": lease.fence, "expires_at": lease.expires_at.timestamp()},
    )
    while True:  # a hung job: it will never release
        time.sleep(3600)


def rescuer(workdir: Path) -> None:
    """Part 1b: wait for account.alice (up to 15 s), then do a fenced write."""
    mutex = open_mutex(workdir, LEASE, "rescuer")
    while not (workdir / "stuck.json").exists():  # start waiting once it is taken
        time.sleep(0.005)
    with mutex.acquire(KEYS[0], timeout=15) as lease:
        got_at, got_wall = time.monotonic(), time.time()
        fenced_increment(workdir, KEYS[0], lease.fence)
    write_report(
        workdir / "rescuer.json",
        {"pid": os.getpid(), "fence": lease.fence, "got_at": got_at, "got_wall": got_wall},
    )


# -- the conductor ------------------------------------------------------------------------


@dataclass
class Check:
    ok: bool
    text: str


def run_processes(target: Any, args_list: list[tuple[Any, ...]], timeout: float) -> list[Any]:
    procs = [CTX.Process(target=target, args=args, daemon=True) for args in args_list]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    return procs


def overlapping_pairs(sections: list[dict[str, Any]]) -> int:
    """Pairs of sections whose [start, end] intervals intersect."""
    ordered = sorted(sections, key=lambda s: s["start"])
    count = 0
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if b["start"] >= a["end"]:
                break
            count += 1
    return count


def part_one(workdir: Path, checks: list[Check], summary: list[str]) -> None:
    print(f"Part 1a: {WORKERS} processes x {SECTIONS} critical sections on {len(KEYS)} keys")
    print("  each section: lock the key, read its ledger file, wait 2 ms, write it back +1")
    began = time.monotonic()
    barrier = CTX.Barrier(WORKERS)
    procs = run_processes(worker, [(workdir, n, barrier) for n in range(WORKERS)], 60)
    print(
        f"  worker pids: {', '.join(str(p.pid) for p in procs)}; "
        f"finished in {time.monotonic() - began:.1f} s"
    )
    failed = [p.pid for p in procs if p.exitcode != 0]
    checks.append(
        Check(
            not failed,
            "all worker processes exited cleanly" + (f" (failed: {failed})" if failed else ""),
        )
    )

    sections: list[dict[str, Any]] = []
    metrics: dict[str, float] = {}
    for n in range(WORKERS):
        report = workdir / f"worker-{n}.json"
        if report.exists():
            found = json.loads(report.read_text())
            sections += found["sections"]
            for name, value in found["metrics"].items():
                merge = max if name == "waited_max" else sum
                metrics[name] = merge((metrics.get(name, 0), value))
    expected = WORKERS * SECTIONS
    print()
    print(
        f"  {'key':<15} {'sections':>8} {'ledger':>7} {'overlaps':>8}  {'fences':<12} "
        "strictly increasing"
    )
    total_overlaps = 0
    for key in KEYS:
        mine = sorted((s for s in sections if s["key"] == key), key=lambda s: s["start"])
        fences = [s["fence"] for s in mine]
        increasing = all(a < b for a, b in itertools.pairwise(fences))
        overlaps = overlapping_pairs(mine)
        total_overlaps += overlaps
        ledger = json.loads(ledger_path(workdir, key).read_text())
        span = f"{fences[0]}..{fences[-1]}" if fences else "-"
        print(
            f"  {key:<15} {len(mine):>8} {ledger['count']:>7} {overlaps:>8}  {span:<12} "
            f"{'yes' if increasing else 'NO'}"
        )
        checks.append(Check(overlaps == 0, f"{key}: {overlaps} overlapping critical sections"))
        checks.append(
            Check(
                ledger["count"] == len(mine) and ledger["rejected"] == 0,
                f"{key}: ledger counted {ledger['count']} of {len(mine)} sections "
                f"({ledger['rejected']} stale writes refused)",
            )
        )
        checks.append(Check(increasing, f"{key}: fences strictly increase ({span})"))
        summary.append(
            f"fences on {key}: {span}, strictly increasing: {'yes' if increasing else 'NO'}"
        )
    parallel = overlapping_pairs(sections) - total_overlaps
    print(f"  {'total':<15} {len(sections):>8} {'':>7} {total_overlaps:>8}")
    print(
        f"  (sections on different keys ran at the same time {parallel} times: different "
        "keys are different locks)"
    )
    checks.append(
        Check(len(sections) == expected, f"{len(sections)} of {expected} critical sections ran")
    )
    lost = sum(1 for s in sections if s["lost"])
    checks.append(Check(lost == 0, f"{lost} leases lost inside a critical section"))
    print(
        f"  lock events seen by the workers: acquired {metrics.get('acquired', 0):.0f}, "
        f"released {metrics.get('released', 0):.0f}, lost {metrics.get('lost', 0):.0f}; "
        f"waited {metrics.get('waited_total', 0):.2f} s in all, at most "
        f"{metrics.get('waited_max', 0) * 1000:.0f} ms"
    )
    checks.append(
        Check(
            metrics.get("acquired") == metrics.get("released") == len(sections),
            "the event stream reported every grant and release "
            f"({metrics.get('acquired', 0):.0f} / {metrics.get('released', 0):.0f})",
        )
    )
    summary.insert(0, f"critical sections run: {len(sections)} (by {WORKERS} processes)")
    summary.insert(1, f"overlapping sections on the same key: {total_overlaps} (must be 0)")


def part_two(workdir: Path, checks: list[Check], summary: list[str]) -> None:
    print()
    print(f"Part 1b: a holder is killed with SIGKILL while it holds {KEYS[0]!r}")
    mutex = open_mutex(workdir, LEASE, "observer")
    stuck = CTX.Process(target=stuck_holder, args=(workdir,), daemon=True)
    helper = CTX.Process(target=rescuer, args=(workdir,), daemon=True)
    stuck.start()
    helper.start()
    deadline = time.monotonic() + 30
    while not (workdir / "stuck.json").exists() and time.monotonic() < deadline:
        time.sleep(0.005)
    if not (workdir / "stuck.json").exists():
        stuck.kill()
        helper.kill()
        checks.append(Check(False, "the holder process never reported its lease"))
        return
    held = json.loads((workdir / "stuck.json").read_text())
    expires = datetime.fromtimestamp(held["expires_at"]).strftime("%H:%M:%S.%f")[:-3]
    print(
        f"  pid {held['pid']} holds it: fence {held['fence']}, {CRASH_LEASE:g} s lease "
        f"(until {expires}); pid {helper.pid} is waiting for it"
    )
    time.sleep(0.3)  # let it hold for a moment, as a real job would
    os.kill(held["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    left = held["expires_at"] - time.time()  # of the lease, at the kill
    stuck.join(5)
    seen = mutex.holder(KEYS[0])
    still_locked = mutex.locked(KEYS[0])
    print(
        f"  SIGKILL -> pid {held['pid']} (exit status {stuck.exitcode}), {left:.2f} s before "
        "its lease ends; a killed process cannot release"
    )
    if seen is not None:
        print(
            f"  right after the kill: locked = {still_locked}, holder = pid {seen.pid} "
            f"({seen.label}), fence {seen.fence}"
        )
    checks.append(
        Check(
            still_locked and seen is not None and seen.pid == held["pid"],
            "the dead holder's lock stays held until its lease lapses",
        )
    )

    helper.join(20)
    report = workdir / "rescuer.json"
    if helper.exitcode != 0 or not report.exists():
        checks.append(Check(False, f"the waiting process failed (exit {helper.exitcode})"))
        return
    got = json.loads(report.read_text())
    after_kill = got["got_at"] - killed_at
    after_lease = got["got_wall"] - held["expires_at"]
    print(
        f"  pid {got['pid']} took it over {after_kill:.2f} s after the kill, "
        f"{after_lease * 1000:.0f} ms after the lease ended; fence {held['fence']} -> "
        f"{got['fence']}"
    )
    checks.append(
        Check(
            after_lease >= -0.01,
            f"takeover came after the lease ended ({after_lease * 1000:+.0f} ms)",
        )
    )
    checks.append(
        Check(
            after_kill <= CRASH_LEASE + 1.0,
            f"takeover came within lease + 1 s of the kill ({after_kill:.2f} s)",
        )
    )
    checks.append(
        Check(
            got["fence"] > held["fence"],
            f"the new holder's fence is higher ({held['fence']} -> {got['fence']})",
        )
    )
    summary.append(
        f"takeover: holder pid {held['pid']} killed with {left:.2f} s of its lease left; "
        f"pid {got['pid']} got {KEYS[0]} {after_kill:.2f} s after the kill; fence "
        f"{held['fence']} -> {got['fence']}"
    )


def main() -> int:
    began = time.monotonic()
    checks: list[Check] = []
    summary: list[str] = []
    # Kept after the run (the lock directory is not): the journal and its picture.
    journal_dir = Path(tempfile.mkdtemp(prefix="simple-mutex-journal-"))
    os.environ[journal.ENV] = str(journal_dir)  # the spawned workers inherit it
    with tempfile.TemporaryDirectory(prefix="simple-mutex-demo-") as tmp:
        workdir = Path(tmp)
        for key in KEYS:
            ledger_path(workdir, key).write_text(
                json.dumps({"count": 0, "last_fence": 0, "rejected": 0})
            )
        print(f"simple-mutex demo: locks in a DiskCache (SQLite) under {workdir}")
        print()
        part_one(workdir, checks, summary)
        part_two(workdir, checks, summary)
    print()
    drawn = timeline.cli_main([str(journal_dir)], str(journal_dir / "timeline.html"))
    checks.append(Check(drawn == 0, "the journal was drawn as timeline.html"))
    print()
    print("Summary:")
    for line in summary:
        print(f"  {line}")
    print()
    print("Checks:")
    for check in checks:
        print(f"  [{'ok' if check.ok else 'FAILED'}] {check.text}")
    passed = all(check.ok for check in checks)
    print()
    print(f"{'PASS' if passed else 'FAIL'} in {time.monotonic() - began:.1f} s")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
