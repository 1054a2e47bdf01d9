"""Demo: a Celery prefork worker running MutexTask tasks, with no server at all.

    python examples/celery_demo.py            # filesystem broker, file results, DiskCache
    REDIS_URL=redis://127.0.0.1:6379/0 python examples/celery_demo.py   # all on Redis

It starts ``celery worker -P prefork -c 4`` on this module, sends 24 charges over 3 orders
(``on_busy="retry"``: per-order serialization) and 6 copies of a singleton report
(``on_busy="skip"``), then prints runs, skips, busy retries and overlapping runs per key,
which must be 0. Exits 1 if anything overlapped or went missing.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from celery import Celery

from celery_mutex import MutexTask, is_skipped, signals

HERE = Path(__file__).resolve().parent

DIR = Path(os.environ.setdefault("CELERY_DEMO_DIR", tempfile.mkdtemp(prefix="celery-demo-")))
REDIS_URL = os.environ.get("REDIS_URL")
RUNS = DIR / "runs.jsonl"  # one line per body run: appends of < 4 KiB are atomic

app = Celery("celery_demo", set_as_current=False)
if REDIS_URL:
    app.conf.update(broker_url=REDIS_URL, result_backend=REDIS_URL, mutex_cache=REDIS_URL)
else:
    (DIR / "queue").mkdir(exist_ok=True)
    (DIR / "control").mkdir(exist_ok=True)
    (DIR / "results").mkdir(exist_ok=True)
    app.conf.update(
        broker_url="filesystem://localhost//",
        broker_transport_options={
            "data_folder_in": str(DIR / "queue"),
            "data_folder_out": str(DIR / "queue"),
            "control_folder": str(DIR / "control"),  # kombu's default is ./control
            "polling_interval": 0.05,
        },
        result_backend=f"file://{DIR / 'results'}",
        mutex_cache=f"file://{DIR / 'locks'}",
    )
app.conf.update(
    task_default_queue=f"demo-{DIR.name}",
    mutex_prefix=f"demo-{DIR.name[-8:]}.",
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)


def _record(event: str, **fields: Any) -> None:
    with RUNS.open("a") as out:
        out.write(json.dumps({"event": event, "pid": os.getpid(), **fields}) + "\n")


@app.task(
    base=MutexTask,
    mutex={"key": "order.{order_id}", "on_busy": "retry", "retry": {"countdown": 0.05, "cap": 0.5}},
)
def charge(order_id: int, n: int) -> int:
    """Per-entity serialization: two charges of one order never run at once."""
    start = time.time()
    time.sleep(0.05)
    _record("run", key=f"order.{order_id}", n=n, start=start, end=time.time())
    return n


@app.task(base=MutexTask, mutex={"key": [], "on_busy": "skip"})  # one lock: the task name
def nightly_report(copy: int) -> str:
    """A singleton: copies sent while one runs are skipped, not queued behind it."""
    start = time.time()
    time.sleep(1.0)
    _record("run", key="nightly-report", n=copy, start=start, end=time.time())
    return "report done"


def _count_busy(sender: Any = None, policy: str = "", **_: Any) -> None:
    _record("busy", policy=policy)


signals.mutex_busy.connect(_count_busy, weak=False)  # runs in the worker processes


def quiet_as_root() -> dict[str, str]:
    """Run as root (a container, CI), Celery's worker prints an eight-line warning that
    says nothing about locks: keep it out of the demo's story, and say so in one line."""
    if os.geteuid() != 0:
        return {}
    print("  (running as root: Celery's warning about that is left out)")
    return {"PYTHONWARNINGS": "ignore:You're running the worker with superuser privileges"}


def main() -> int:
    print(
        "Part 2: a Celery prefork worker: 24 charges over 3 orders "
        '(on_busy="retry") and 6 copies of a nightly report (on_busy="skip")'
    )
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "celery_demo",
            "worker",
            "-P",
            "prefork",
            "-c",
            "4",
            "-l",
            "WARNING",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
        ],
        cwd=HERE,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)]),
             **quiet_as_root()},
    )  # fmt: skip
    try:
        started = time.monotonic()
        charges = [charge.delay(n % 3, n) for n in range(24)]
        reports = [nightly_report.delay(copy) for copy in range(6)]
        done = [r.get(timeout=120, interval=0.05) for r in charges + reports]
        elapsed = time.monotonic() - started
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    rows = [json.loads(line) for line in RUNS.read_text().splitlines()]
    runs = [row for row in rows if row["event"] == "run"]
    by_key: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for row in runs:
        by_key[row["key"]].append((row["start"], row["end"]))
    overlaps = sum(
        b[0] < a[1] for spans in by_key.values() for a, b in itertools.pairwise(sorted(spans))
    )
    skips = sum(is_skipped(value) for value in done)
    retries = sum(row["event"] == "busy" and row["policy"] == "retry" for row in rows)
    missing = sorted(set(range(24)) - {r["n"] for r in runs if r["key"] != "nightly-report"})
    print(
        f"backend   : {'redis ' + REDIS_URL if REDIS_URL else 'no server (filesystem + DiskCache)'}"
    )
    print(f"worker    : prefork, 4 processes, pids {sorted({r['pid'] for r in runs})}")
    reports = len(by_key["nightly-report"])
    print(f"runs      : {len(runs)} (24 charges over 3 orders, {reports} report)")
    print(f"skips     : {skips} (report copies sent while one ran)")
    print(f"retries   : {retries} (busy orders re-queued; not counted against max_retries)")
    print(f"overlaps  : {overlaps} (runs of one key at the same time)")
    print(f"missing   : {missing or 'none'}")
    print(f"elapsed   : {elapsed:.1f} s")
    return 0 if overlaps == 0 and not missing and skips + reports == 6 else 1


if __name__ == "__main__":
    sys.exit(main())
