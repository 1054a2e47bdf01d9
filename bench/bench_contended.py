"""Benchmark: contended throughput on Redis, simple-mutex against the Python Redis locks.

Run against the redis-server at REDIS_URL (default redis://127.0.0.1:6379/0)::

    .venv/bin/python bench/bench_contended.py           # 2 scenarios x 4 locks x 5 s, ~1 min
    .venv/bin/python bench/bench_contended.py --quick   # 2 s each, a smoke test

``--processes`` OS processes (default 8), started together on a barrier, each loop
acquire -> hold ``--hold`` s (default 0.2 ms, ``time.sleep``) -> release for ``--seconds``,
every acquire blocking (with a timeout far past the run, so a lost wake-up shows as a
failure line, never as a hang). Two scenarios, one table each:

* one hot key that every process wants;
* ``--keys`` keys (default 64), each process picking one at random per iteration (one
  seeded ``random.Random`` per process, ``--seed``).

Each lock is built by bench_redis.py's contenders (the same objects as its hand-off and
fairness tables: simple-mutex is ``Mutex(RedisCache)`` with a 5 s poll, so a waiter is
woken by the release's notification or not at all; redis-py's ``Lock`` polls every 0.1 s;
python-redis-lock waits in ``BLPOP``; pottery's ``Redlock`` on one master sleeps a random
0-0.2 s). Every pair is warmed up (one acquire + release, connections open, scripts
loaded) before the barrier. Per lock and scenario:

* sections/s: critical sections completed by all processes, over the time from the first
  process's start to the last one's final release;
* x best peer: that throughput over the best of the other three locks' in the same run;
* wait p50 / p99 / max: from calling acquire to holding, over every acquisition;
* fairness: the least served process's count over the mean count (1.00: all equal);
* overlaps: each section writes its process's mark into a shared array slot for its key
  on entry (after finding it empty) and checks the mark is still its own on exit; any
  other finding is two holders at once, printed as a FAIL line (exit status 1).

Keys are ``bench.<lock>.contended.<run>.*`` (python-redis-lock adds its ``lock:`` and
``lock-signal:`` prefixes) and are deleted at the end; nothing else is touched.
Figures and their reading: bench/README-redis.md, "Contended throughput".
"""

from __future__ import annotations

import argparse
import array
import math
import multiprocessing as mp
import os
import random
import secrets
import statistics
import sys
import time
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

from bench_redis import CONTENDERS, URL, client

TIMEOUT = 25.0  # per acquire; python-redis-lock refuses one longer than its 30 s lease
OURS = "simple-mutex"
TARGET = {"fairness": 0.9, "p99_ms": 10.0}  # issue 22, hot key; throughput >= best peer


@dataclass
class Result:
    name: str
    counts: list[int]
    waits: list[float]  # seconds, every acquisition of every process
    elapsed: float
    overlaps: int
    timeouts: int

    @property
    def rate(self) -> float:
        return sum(self.counts) / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def fairness(self) -> float:
        mean = statistics.mean(self.counts)
        return min(self.counts) / mean if mean else 0.0

    def wait_ms(self, q: float) -> float:
        """The q-quantile of the waits (nearest rank), in ms."""
        if not self.waits:
            return math.nan
        ordered = sorted(self.waits)
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)] * 1e3


def _worker(
    name: str,
    index: int,
    keys: list[str],
    hold: float,
    seconds: float,
    seed: int,
    ready: Any,
    marks: Any,
    out: Any,
) -> None:
    pairs = [CONTENDERS[name](key, timeout=TIMEOUT) for key in keys]
    for acquire, release in pairs:  # connections open, scripts loaded, imports done
        acquire()
        release()
    rng = random.Random(seed * 1000 + index)
    mark = index + 1
    waits = array.array("d")
    overlaps = timeouts = 0
    perf, now, sleep = time.perf_counter, time.monotonic, time.sleep
    spread = len(pairs) > 1
    ready.wait()
    start = now()
    end = start + seconds
    while now() < end:
        slot = rng.randrange(len(pairs)) if spread else 0
        acquire, release = pairs[slot]
        asked = perf()
        try:
            acquire()
        except TimeoutError:
            timeouts += 1
            continue
        waits.append(perf() - asked)
        if marks[slot] != 0:
            overlaps += 1
        marks[slot] = mark
        sleep(hold)
        if marks[slot] != mark:
            overlaps += 1
        marks[slot] = 0
        release()
    out.put((index, len(waits), waits.tobytes(), overlaps, timeouts, start, now()))


def run_one(
    name: str, keys: list[str], processes: int, hold: float, seconds: float, seed: int
) -> Result:
    ready = mp.Barrier(processes + 1)
    marks = mp.RawArray("q", len(keys))  # unlocked on purpose: the lock under test guards it
    out: Any = mp.Queue()
    workers = [
        mp.Process(target=_worker, args=(name, i, keys, hold, seconds, seed, ready, marks, out))
        for i in range(processes)
    ]
    for worker in workers:
        worker.start()
    try:
        ready.wait(timeout=120)  # every process connected and warmed up: go
        replies = [out.get(timeout=seconds + TIMEOUT + 60) for _ in workers]
    finally:
        for worker in workers:
            worker.join(10)
            if worker.is_alive():
                worker.kill()
    counts = [0] * processes
    waits: list[float] = []
    overlaps = timeouts = 0
    for index, count, raw, overlapped, timed_out, _, _ in replies:
        counts[index] = count
        waits.extend(array.array("d", raw))
        overlaps += overlapped
        timeouts += timed_out
    elapsed = max(r[6] for r in replies) - min(r[5] for r in replies)
    return Result(name, counts, waits, elapsed, overlaps, timeouts)


def print_table(title: str, results: list[Result]) -> None:
    peers = [r.rate for r in results if r.name != OURS]
    best = max(peers) if peers else math.nan
    print(f"\n{title}")
    print(
        f"| {'lock':17s} | sections/s | x best peer | wait p50 ms | wait p99 ms "
        f"| wait max ms | fairness | min / max per process | overlaps |"
    )
    print(f"|{'-' * 19}|{'-' * 12}|{'-' * 13}|{'-' * 13}|{'-' * 13}|{'-' * 13}|{'-' * 10}|"
          f"{'-' * 24}|{'-' * 10}|")  # fmt: skip
    for r in results:
        spread = f"{min(r.counts)} / {max(r.counts)}"
        print(
            f"| {r.name:17s} | {r.rate:10,.0f} | {r.rate / best:11.2f} | {r.wait_ms(0.5):11.2f} "
            f"| {r.wait_ms(0.99):11.2f} | {r.wait_ms(1.0):11.1f} | {r.fairness:8.2f} "
            f"| {spread:>22s} | {r.overlaps:8d} |"
        )


def verdict(results: list[Result]) -> str:
    ours = next((r for r in results if r.name == OURS), None)
    peers = [r for r in results if r.name != OURS]
    if ours is None or not peers:
        return "target: needs simple-mutex and its peers in the same run"
    best = max(peers, key=lambda r: r.rate)
    checks = [
        (f"throughput {ours.rate:,.0f} >= {best.name}'s {best.rate:,.0f}/s",
         ours.rate >= best.rate),
        (f"fairness {ours.fairness:.2f} >= {TARGET['fairness']}",
         ours.fairness >= TARGET["fairness"]),
        (f"p99 wait {ours.wait_ms(0.99):.2f} <= {TARGET['p99_ms']:g} ms",
         ours.wait_ms(0.99) <= TARGET["p99_ms"]),
    ]  # fmt: skip
    met = all(ok for _, ok in checks)
    detail = "; ".join(f"{text}: {'yes' if ok else 'NO'}" for text, ok in checks)
    return f"target (issue 22, hot key): {'MET' if met else 'not met'} ({detail})"


def cleanup(run: str) -> int:
    """Delete this run's keys; return how many there were."""
    r = client()
    found = list(r.scan_iter(match=f"*bench.*.contended.{run}.*", count=1000))
    if found:
        r.delete(*found)
    return len(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--keys", type=int, default=64, help="keys of the spread scenario")
    parser.add_argument("--hold", type=float, default=0.0002, help="critical section, s")
    parser.add_argument("--seconds", type=float, default=5.0, help="per lock and scenario")
    parser.add_argument("--seed", type=int, default=22)
    parser.add_argument("--quick", action="store_true", help="2 s per lock and scenario")
    parser.add_argument("--only", choices=("hot", "spread"), action="append", default=None)
    parser.add_argument(
        "--peers", action=argparse.BooleanOptionalAction, default=True,
        help="also run the other libraries",
    )  # fmt: skip
    args = parser.parse_args()
    seconds = 2.0 if args.quick else args.seconds
    names = list(CONTENDERS) if args.peers else [OURS]
    scenarios = {"hot": 1, "spread": args.keys}
    run = secrets.token_hex(4)
    info = client().info("server")
    print(
        f"redis {info['redis_version']} at {URL}; redis-py {version('redis')}, "
        f"python-redis-lock {version('python-redis-lock')}, pottery {version('pottery')}; "
        f"Python {sys.version.split()[0]}; {os.cpu_count()} CPUs; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    failures: list[str] = []
    try:
        for scenario in args.only or ["hot", "spread"]:
            nkeys = scenarios[scenario]
            results = []
            for name in names:
                keys = [f"contended.{run}.{scenario}.{k}" for k in range(nkeys)]
                result = run_one(name, keys, args.processes, args.hold, seconds, args.seed)
                results.append(result)
                if result.overlaps:
                    failures.append(
                        f"FAIL: {name} on {nkeys} key(s): {result.overlaps} overlapping "
                        f"sections detected (two holders at once)"
                    )
                if result.timeouts:
                    failures.append(
                        f"FAIL: {name} on {nkeys} key(s): {result.timeouts} acquires timed "
                        f"out after {TIMEOUT:g} s"
                    )
            where = "1 hot key" if nkeys == 1 else f"{nkeys} keys, a random one per section"
            print_table(
                f"contended: {args.processes} processes on {where}, hold {args.hold * 1e3:g} ms, "
                f"{seconds:g} s each",
                results,
            )
            if nkeys == 1:
                print(verdict(results))
    finally:
        left = cleanup(run)
    print(f"load average {os.getloadavg()[0]:.2f}; {left} keys of this run deleted")
    for line in failures:
        print(line)
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main()
