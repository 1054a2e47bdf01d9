"""Per-task overhead of MutexTask against the same task without it (one run, not a test).

    REDIS_URL=redis://127.0.0.1:6379/11 python bench/bench_celery.py

Same in-process worker (solo pool), same Redis broker, backend and lock cache; N tasks of
each kind are sent and awaited, twice, and the better round is kept. Prints milliseconds
per task and the ratio. The target is under 1 ms added per task on loopback Redis.
"""

from __future__ import annotations

import os
import time

from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_mutex import MutexTask

URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/11")
N = int(os.environ.get("BENCH_TASKS", "1000"))

app = Celery("celery_bench", broker=URL, backend=URL, set_as_current=False)
app.conf.update(task_default_queue="celery-bench", mutex_cache=URL, mutex_prefix="bench.")


@app.task(shared=False)
def plain(n: int) -> int:
    return n


@app.task(shared=False, base=MutexTask, mutex={"key": "bench.{n}"})
def locked(n: int) -> int:
    return n


def per_task_ms(task: object) -> float:
    start = time.perf_counter()
    results = [task.delay(i) for i in range(N)]  # type: ignore[attr-defined]
    for result in results:
        result.get(timeout=60)
    return (time.perf_counter() - start) / N * 1000


def main() -> None:
    with start_worker(app, pool="solo", perform_ping_check=False, loglevel="WARNING"):
        plain.delay(-1).get(timeout=10)
        locked.delay(-1).get(timeout=10)
        rounds = [(per_task_ms(plain), per_task_ms(locked)) for _ in range(2)]
    base = min(r[0] for r in rounds)
    guarded = min(r[1] for r in rounds)
    print(f"{N} tasks, solo worker, Redis {URL}")
    print(f"plain task : {base:.3f} ms/task")
    print(f"MutexTask  : {guarded:.3f} ms/task")
    print(f"added      : {guarded - base:.3f} ms/task (ratio {guarded / base:.2f})")


if __name__ == "__main__":
    main()
