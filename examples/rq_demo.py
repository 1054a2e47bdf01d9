"""RQ demo: per-order jobs that never overlap, and a singleton report.

Needs Redis at ``REDIS_URL`` (default ``redis://127.0.0.1:6379/0``). Enqueues 12 charges
over 3 orders (``on_busy="retry"``: a busy charge returns ``rq.Retry`` and runs again
later under the same job id) and 4 copies of a nightly report (``on_busy="skip"``), then
runs two ``rq worker -w rq_mutex.Worker --burst --with-scheduler`` processes side by side,
in rounds until every job has ended (each round's scheduler pass re-enqueues the retries
that are due). ``rq_mutex.Worker`` is RQ's worker that also reaps a dead job's lock and,
with redis-py 8.2, exits at once (RQ's own may wait a minute for its pubsub thread).
Prints runs, skips, retries and overlaps; exits non-zero if a check fails.

    python examples/rq_demo.py
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

import redis
from rq import get_current_job
from rq.job import JobStatus

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (str(ROOT), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)

from rq_mutex import Queue, is_skipped, mutex_job  # noqa: E402
from rq_mutex.job import NO_SCHEDULER_FLAG  # noqa: E402

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
HOLD = 0.2  # seconds inside each critical section


def _log(what: str, **fields: object) -> None:
    job = get_current_job()
    assert job is not None
    start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process here
    time.sleep(HOLD)
    fields.update(start=start, end=time.monotonic(), job=job.id)
    job.connection.rpush(f"rqdemo:{job.origin}:{what}", json.dumps(fields))


@mutex_job(
    key="demo.order.{order_id}",
    on_busy="retry",
    retry={"countdown": 1, "backoff": 1, "jitter": False},
    lease=30,
)
def charge(order_id: int, amount: int = 0) -> int:
    """One order at a time: charges of the same order must never run side by side."""
    _log("charge", key=f"order.{order_id}", amount=amount)
    return amount


@mutex_job(key="demo.nightly-report", on_busy="skip", lease=30)
def nightly_report() -> str:
    """A singleton: a copy that finds another running is skipped."""
    _log("report", key="report")
    return "report written"


def overlaps(sections: list[dict[str, float]]) -> int:
    by_key: dict[object, list[dict[str, float]]] = defaultdict(list)
    for s in sections:
        by_key[s["key"]].append(s)
    found = 0
    for runs in by_key.values():
        runs.sort(key=lambda s: s["start"])
        found += sum(b["start"] < a["end"] for a, b in itertools.pairwise(runs))
    return found


def main() -> int:
    print("Part 4: RQ workers on the same kinds of jobs (charges retried, a report skipped)")
    import rq_demo  # this file, imported by name: RQ refuses functions from __main__

    conn = redis.Redis.from_url(REDIS_URL)
    conn.ping()
    queue = Queue(f"rqdemo-{uuid.uuid4().hex[:8]}", connection=conn)
    # This demo runs burst workers in rounds itself, so the retried jobs are not stranded:
    # mark rq_mutex's "no scheduler on this queue" warning as already given.
    conn.set(NO_SCHEDULER_FLAG + queue.name, 1, ex=600)
    jobs = [queue.enqueue(rq_demo.charge, order, amount=n) for n, order in enumerate(ORDERS)]
    reports = [queue.enqueue(rq_demo.nightly_report) for _ in range(4)]
    everything = jobs + reports
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}
    rq = str(Path(sys.executable).parent / "rq")
    command = [rq, "worker", "-w", "rq_mutex.Worker", "--burst", "--with-scheduler", "-q"]
    command += ["-u", REDIS_URL, queue.name]
    deadline = time.monotonic() + 60
    rounds = 0
    try:
        while time.monotonic() < deadline:
            rounds += 1
            workers = [subprocess.Popen(command, env=env) for _ in range(2)]
            for w in workers:
                w.wait(60)
            statuses = [j.get_status(refresh=True) for j in everything]
            if all(s in (JobStatus.FINISHED, JobStatus.FAILED) for s in statuses):
                break
            time.sleep(0.5)  # let the next retries fall due
        for job in everything:
            job.refresh()
        charges = [json.loads(r) for r in conn.lrange(f"rqdemo:{queue.name}:charge", 0, -1)]
        runs = [json.loads(r) for r in conn.lrange(f"rqdemo:{queue.name}:report", 0, -1)]
        skips = sum(is_skipped(j.return_value()) for j in reports)
        retries = sum(j.number_of_retries or 0 for j in everything)
        overlap = overlaps(charges + runs)
        finished = sum(j.get_status() == JobStatus.FINISHED for j in everything)
        print(
            f"rq demo: {len(charges)} charge runs over 3 orders, {len(runs)} report run(s), "
            f"{skips} report skip(s), {retries} busy retries, overlaps = {overlap}, "
            f"{finished}/{len(everything)} jobs finished in {rounds} burst round(s)"
        )
        ok = (
            overlap == 0
            and finished == len(everything)
            and len(charges) == len(jobs)
            and sorted(j.return_value() for j in jobs) == list(range(len(jobs)))
            and len(runs) + skips == len(reports)
            and len(runs) >= 1
        )
        if not ok:
            print("rq demo: FAILED", file=sys.stderr)
        return 0 if ok else 1
    finally:
        keys = list(conn.scan_iter(match=f"rqdemo:{queue.name}:*"))
        if keys:
            conn.delete(*keys)


ORDERS = [1, 1, 2, 2, 3, 3, 1, 1, 2, 2, 3, 3]  # neighbours share an order: they contend

if __name__ == "__main__":
    sys.exit(main())
