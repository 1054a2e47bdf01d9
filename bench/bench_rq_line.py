"""Per-entity order with real ``rq worker`` processes: ``on_busy`` wait, retry and queue,
RQ's own ``RateLimit(key, 1)`` and no lock at all, on the same work, in one run (not a
test).

    python bench/bench_rq_line.py         # BENCH_ENTITIES=20 BENCH_TASKS=10 BENCH_SLOTS=4

20 entities x 10 jobs of 50 ms, enqueued in bursts (each entity's ten together) and
then interleaved (round by round), to four ``rq worker
-w rq_mutex.Worker`` processes (one runs the scheduler, which busy retries and RateLimit
need). For each it prints the makespan (first enqueue to last end) against the ideal,
max(total work / slots, the longest entity's chain), the slot utilisation, the
executions per job (every time a horse got the job: RQ's results per job, so busy
retries and parked arrivals count), and the share of jobs that started after a job of
their entity enqueued later (out of order). ``none`` runs without a lock: the floor of
RQ itself (a fork per job), not a policy. The target: queue within 1.2x the ideal with 0
out of order.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis
from rq.job import Job, JobStatus

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import rq_line_jobs  # noqa: E402
from bench.bench_line import ideal_makespan, out_of_order, sends  # noqa: E402
from rq_mutex import Queue  # noqa: E402

URL = os.environ.get("BL_REDIS", "redis://127.0.0.1:6379/12")
ENTITIES = int(os.environ.get("BENCH_ENTITIES", "20"))
TASKS = int(os.environ.get("BENCH_TASKS", "10"))
SLOTS = int(os.environ.get("BENCH_SLOTS", "4"))
SECTION = rq_line_jobs.SECTION
DONE = (JobStatus.FINISHED, JobStatus.FAILED)


def enqueue(queue: Queue, policy: str, run: str, e: int, n: int) -> Job:
    if policy == "rate_limit":
        from rq import RateLimit  # rq >= 3.0

        return queue.enqueue(
            rq_line_jobs.plain, run, e, n, rate_limit=RateLimit(f"bl.{run}.{e}", 1)
        )
    function = rq_line_jobs.plain if policy == "none" else getattr(rq_line_jobs, policy)
    return queue.enqueue(function, run, e, n)


def one(policy: str, order: str, conn: redis.Redis) -> dict[str, float]:
    run = uuid.uuid4().hex[:8]
    queue = Queue(f"bench-rq-line-{run}", connection=conn)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    rq = str(Path(sys.executable).with_name("rq"))
    workers = []
    for i in range(SLOTS):
        scheduler = ["--with-scheduler"] if i == 0 else []
        argv = [rq, "worker", "-u", URL, "-w", "rq_mutex.Worker", "-q", *scheduler, queue.name]
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        workers.append(subprocess.Popen(argv, env=env, cwd=ROOT, **quiet))  # type: ignore[call-overload]
    try:
        warm = queue.enqueue(rq_line_jobs.plain, "warm", -1, 0)
        while warm.get_status(refresh=True) not in DONE:
            time.sleep(0.05)
        time.sleep(1.0)  # every worker listening
        started = time.perf_counter()
        sent = [enqueue(queue, policy, run, e, n) for e, n in sends(order)]
        pending = list(sent)
        while pending:
            pending = [j for j in pending if j.get_status(refresh=True) not in DONE]
            time.sleep(0.02)
        makespan = time.perf_counter() - started
        executions = sum(len(j.results()) for j in sent)
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.wait(timeout=30)
    starts = [
        (int(e), int(n))
        for e, n, _ in (s.decode().split() for s in conn.lrange(f"bl.starts.{run}", 0, -1))
    ]
    conn.delete(f"bl.starts.{run}")
    total = ENTITIES * TASKS
    return {
        "makespan": makespan,
        "utilisation": total * SECTION / (makespan * SLOTS),
        "executions": executions / total,
        "out_of_order": out_of_order(starts) / total,
    }


def main() -> None:
    conn = redis.Redis.from_url(URL, socket_connect_timeout=2)
    conn.ping()
    ideal = ideal_makespan()
    print(
        f"{ENTITIES} entities x {TASKS} jobs of {SECTION * 1000:.0f} ms, "
        f"{SLOTS} rq workers; ideal makespan {ideal:.2f} s; load {os.getloadavg()[0]:.1f}"
    )
    print(f"{'sent':12} {'policy':10} {'makespan':>9} {'x ideal':>8} {'x none':>7} "
          f"{'slots used':>10} {'executions/job':>14} {'out of order':>12}")  # fmt: skip
    policies = ["none", "wait", "retry", "queue"]
    try:
        import rq

        if int(rq.__version__.split(".")[0]) >= 3:
            policies.insert(3, "rate_limit")
    except (ImportError, ValueError):
        pass
    for order in ("burst", "interleaved"):
        floor = None
        for policy in policies:
            got = one(policy, order, conn)
            floor = floor or got["makespan"]
            print(
                f"{order:12} {policy:10} {got['makespan']:8.2f}s {got['makespan'] / ideal:7.2f}x "
                f"{got['makespan'] / floor:6.2f}x {got['utilisation']:9.0%} "
                f"{got['executions']:14.2f} {got['out_of_order']:11.1%}"
            )


if __name__ == "__main__":
    main()
