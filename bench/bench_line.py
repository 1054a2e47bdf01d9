"""Per-entity order with real prefork workers: ``on_busy`` wait, retry and queue on the
same work, in one run (not a test).

    python bench/bench_line.py            # BENCH_ENTITIES=20 BENCH_TASKS=10 BENCH_SLOTS=4

20 entities x 10 tasks of 50 ms, sent in bursts (each entity's ten together: an
order's events arriving at once) and then interleaved (round by round), to one
``celery worker -P prefork -c 4`` on a Redis broker (``BL_BROKER`` for another). For each
policy it prints the makespan (first send to last result) against the ideal,
max(total work / slots, the longest entity's chain), the slot utilisation (work done /
(makespan x slots)), the deliveries per task (every message a worker took: busy
retries and parked calls re-published count), and the share of tasks that started
after a task of their entity sent later (out of send order). The target: queue within
1.2x the ideal with 0 out of order.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[1]
URL = os.environ.get("BL_REDIS", "redis://127.0.0.1:6379/12")
BROKER = os.environ.get("BL_BROKER", URL)
ENTITIES = int(os.environ.get("BENCH_ENTITIES", "20"))
TASKS = int(os.environ.get("BENCH_TASKS", "10"))
SLOTS = int(os.environ.get("BENCH_SLOTS", "4"))
SECTION = float(os.environ.get("BL_SECTION", "0.05"))


def out_of_order(starts: list[tuple[int, int]]) -> int:
    """Tasks that started after a task of their entity that was sent later."""
    latest: dict[int, int] = {}
    late = 0
    for entity, n in starts:
        if n < latest.get(entity, -1):
            late += 1
        latest[entity] = max(n, latest.get(entity, -1))
    return late


def ideal_makespan() -> float:
    """max(total work / slots, the longest entity's chain): no schedule does better."""
    return max(ENTITIES * TASKS * SECTION / SLOTS, TASKS * SECTION)


def sends(order: str) -> list[tuple[int, int]]:
    """(entity, n) in send order: ``burst``, each entity's tasks together (an order's
    events arriving at once), or ``interleaved``, round by round."""
    if order == "burst":
        return [(e, n) for e in range(ENTITIES) for n in range(TASKS)]
    return [(e, n) for n in range(TASKS) for e in range(ENTITIES)]


def one(policy: str, order: str, record: redis.Redis, tmp: Path) -> dict[str, float]:
    run = uuid.uuid4().hex[:8]
    queue_name = f"bench-line-{run}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "BL_QUEUE": queue_name,
        "BL_PREFIX": f"bl{run}.",
        "BL_REDIS": URL,
        "BL_BROKER": BROKER,
        "BL_SECTION": str(SECTION),
    }
    os.environ.update({k: env[k] for k in ("BL_QUEUE", "BL_PREFIX", "BL_REDIS", "BL_BROKER")})
    sys.path.insert(0, str(ROOT))
    sys.modules.pop("bench.line_app", None)  # the producer's copy, this run's queue and prefix
    line_app = importlib.import_module("bench.line_app")

    log = open(tmp / f"{policy}-{order}.log", "wb")  # noqa: SIM115  (the worker's, to the end)
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "bench.line_app", "worker", "-P", "prefork",
         "-c", str(SLOTS), "-Q", queue_name, "-n", f"{policy}-{run}@%h", "-l", "WARNING",
         "--without-gossip", "--without-mingle", "--without-heartbeat"],
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log,
    )  # fmt: skip
    try:
        task = getattr(line_app, policy)
        task.apply_async(("warm", -1, 0)).get(timeout=60)  # the worker is up
        record.delete(f"bl{run}.deliveries.warm")
        started = time.perf_counter()
        results = [task.apply_async((run, e, n)) for e, n in sends(order)]
        for result in results:
            result.get(timeout=600)
        makespan = time.perf_counter() - started
    except BaseException:
        log.flush()
        print((tmp / f"{policy}-{order}.log").read_text()[-3000:], file=sys.stderr)
        raise
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        log.close()
    starts = [
        (int(e), int(n))
        for e, n, _ in (s.decode().split() for s in record.lrange(f"bl{run}.starts.{run}", 0, -1))
    ]
    total = ENTITIES * TASKS
    deliveries = int(record.get(f"bl{run}.deliveries.{run}") or 0)
    return {
        "makespan": makespan,
        "utilisation": total * SECTION / (makespan * SLOTS),
        "deliveries": deliveries / total,
        "out_of_order": out_of_order(starts) / total,
        "runs": len(starts) / total,
    }


def main() -> None:
    record = redis.Redis.from_url(URL)
    record.ping()
    ideal = ideal_makespan()
    print(
        f"{ENTITIES} entities x {TASKS} tasks of {SECTION * 1000:.0f} ms, one prefork worker "
        f"of {SLOTS} processes, broker {BROKER}; ideal makespan {ideal:.2f} s"
    )
    print(f"{'sent':12} {'policy':8} {'makespan':>9} {'x ideal':>8} {'slots used':>10} "
          f"{'deliveries/task':>15} {'out of order':>12}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for order in ("burst", "interleaved"):
            for policy in ("wait", "retry", "queue"):
                got = one(policy, order, record, Path(tmp))
                print(
                    f"{order:12} {policy:8} {got['makespan']:8.2f}s "
                    f"{got['makespan'] / ideal:7.2f}x {got['utilisation']:9.0%} "
                    f"{got['deliveries']:15.2f} {got['out_of_order']:11.1%}"
                )


if __name__ == "__main__":
    main()
