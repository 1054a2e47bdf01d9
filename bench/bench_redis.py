"""Benchmark: simple-mutex on Redis against the bare floor and the Python Redis locks.

Run against the redis-server at REDIS_URL (default redis://127.0.0.1:6379/0)::

    .venv/bin/python bench/bench_redis.py                  # everything, about 90 s
    .venv/bin/python bench/bench_redis.py --fair-seconds 3 # shorter fairness runs

Three tables:

* cycle: one uncontended acquire + release, mean µs over ``--cycles`` in each of
  ``--repeats`` rounds, the locks taking turns round by round so that load from other
  programs falls on all of them alike; the median round and the fastest round (the least
  disturbed), each with its ratio to the floor's. The
  floor is what a lock cannot do in fewer round trips: ``SET key token NX PX`` then a
  compare-and-delete script by ``EVALSHA``, through redis-py's own methods. The "raw"
  floor line sends the same two commands through ``execute_command`` (no argument
  handling); the InMemoryCache line is simple-mutex with no I/O at all (the core's own
  cost per cycle), and "RedisCache ops" is the backend alone: put_if_absent +
  compare_and_delete with a lock record of the usual size, no Mutex around them.
* hand-off: a waiter blocked in acquire (poll interval 5 s, so only a notification can
  be fast) and the time from the holder's ``release()`` call to the waiter holding the
  lock, in another process, p50 / p90 over ``--handoffs`` rounds.
* fairness: ``--clients`` processes each loop acquire, hold ``--hold`` s, release for
  ``--fair-seconds``; acquisitions per client (min / max / mean); every client should get
  at least half the mean.

Keys live under ``bench.*`` and are deleted at the end; nothing else is touched.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import redis
from rounds import interleaved_rounds, our_contenders, print_ratio_table

from simple_mutex import Mutex
from simple_mutex.caches.redis import RedisCache

URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
LEASE = 30.0
RELEASE = (
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) "
    "else return 0 end"
)
Pair = tuple[Callable[[], None], Callable[[], None]]


def client() -> redis.Redis:
    return redis.Redis.from_url(URL)


# -- contenders: each builds (acquire, release) for one key in the current process ------
# acquire blocks; with ``timeout`` (seconds) it raises TimeoutError once that runs out.


def _timed_out(name: str, timeout: float | None) -> TimeoutError:
    return TimeoutError(f"{name}: not acquired within {timeout} s")


def simple_mutex_pair(key: str, interval: float = 5.0, timeout: float | None = None) -> Pair:
    mutex = Mutex(RedisCache(client()), lease=LEASE, prefix="bench.sm.", interval=interval)
    held: list[Any] = []
    # SimpleMutexAcquireTimeoutError is a TimeoutError
    return (lambda: held.append(mutex.acquire(key, timeout=timeout)), lambda: held.pop().release())


def redis_py_pair(key: str, timeout: float | None = None) -> Pair:
    lock = client().lock(f"bench.rp.{key}", timeout=LEASE, blocking_timeout=timeout)

    def acquire() -> None:
        if not lock.acquire():
            raise _timed_out(lock.name, timeout)

    return acquire, lock.release


def python_redis_lock_pair(key: str, timeout: float | None = None) -> Pair:
    import redis_lock  # type: ignore[import-untyped]

    conn = client()
    held: list[Any] = []

    def acquire() -> None:
        lock = redis_lock.Lock(conn, f"bench.prl.{key}", expire=int(LEASE))
        if not lock.acquire(timeout=timeout):  # at most expire, whole seconds
            raise _timed_out(f"bench.prl.{key}", timeout)
        held.append(lock)

    return acquire, lambda: held.pop().release()


def pottery_pair(key: str, timeout: float | None = None) -> Pair:
    from pottery import Redlock  # type: ignore[import-untyped]

    lock = Redlock(key=f"bench.pot.{key}", masters={client()}, auto_release_time=LEASE)

    def acquire() -> None:
        if not lock.acquire(timeout=-1 if timeout is None else timeout):
            raise _timed_out(lock.key, timeout)

    return acquire, lock.release


CONTENDERS: dict[str, Callable[..., Pair]] = {
    "simple-mutex": simple_mutex_pair,
    "redis-py Lock": redis_py_pair,
    "python-redis-lock": python_redis_lock_pair,
    "pottery Redlock": pottery_pair,
}


# -- cycle ------------------------------------------------------------------------------


def cycle_functions() -> dict[str, Callable[[], None]]:
    """Each function does one full uncontended acquire + release, the way its users write
    it: a context manager around the protected block, a new lock object where the library
    makes one per use."""
    import redis_lock
    from pottery import Redlock

    r = client()
    sha = r.script_load(RELEASE)
    execute = r.execute_command

    def floor() -> None:
        token = secrets.token_hex(16)
        r.set("bench.floor", token, nx=True, px=int(LEASE * 1000))
        r.evalsha(sha, 1, "bench.floor", token)

    def floor_raw() -> None:
        token = secrets.token_hex(16)
        execute("SET", "bench.floor", token, "NX", "PX", int(LEASE * 1000))
        execute("EVALSHA", sha, 1, "bench.floor", token)

    def redis_py() -> None:
        with r.lock("bench.rp.cycle", timeout=LEASE):
            pass

    def python_redis_lock() -> None:
        with redis_lock.Lock(r, "bench.prl.cycle", expire=int(LEASE)):
            pass

    def pottery() -> None:
        with Redlock(key="bench.pot.cycle", masters={r}, auto_release_time=LEASE):
            pass

    return {
        "floor: SET NX PX + EVALSHA": floor,
        "floor, raw execute_command": floor_raw,
        **our_contenders(RedisCache(r), "RedisCache", lease=LEASE),
        "redis-py Lock": redis_py,
        "python-redis-lock": python_redis_lock,
        "pottery Redlock (1 master)": pottery,
    }


def bench_cycle(cycles: int, repeats: int) -> None:
    rounds = interleaved_rounds(cycle_functions(), cycles=cycles, repeats=repeats, warmup=200)
    print_ratio_table(
        f"uncontended acquire+release cycle, µs ({repeats} interleaved rounds of {cycles})",
        rounds,
        floor="floor: SET NX PX + EVALSHA",
    )


# -- hand-off ---------------------------------------------------------------------------


def _handoff_waiter(name: str, key: str, rounds: int, go: Any, out: Any) -> None:
    acquire, release = CONTENDERS[name](key)
    for _ in range(rounds):
        go.wait()
        go.clear()
        acquire()
        out.send(time.monotonic())  # CLOCK_MONOTONIC is one clock for every process
        release()


def bench_handoff(name: str, rounds: int) -> tuple[float, float, float]:
    key = f"handoff.{secrets.token_hex(4)}"
    acquire, release = CONTENDERS[name](key)
    go = mp.Event()
    receive, send = mp.Pipe(duplex=False)
    waiter = mp.Process(target=_handoff_waiter, args=(name, key, rounds, go, send))
    waiter.start()
    latencies = []
    try:
        for _ in range(rounds):
            acquire()
            go.set()
            time.sleep(0.02)  # the waiter tries, fails and blocks
            start = time.monotonic()
            release()
            latencies.append(receive.recv() - start)
            time.sleep(0.002)  # the waiter releases
    finally:
        waiter.join(10)
        waiter.kill()
    latencies.sort()
    return (
        statistics.median(latencies) * 1e3,
        latencies[int(len(latencies) * 0.9)] * 1e3,
        latencies[-1] * 1e3,
    )


# -- fairness ---------------------------------------------------------------------------


def _fair_client(name: str, key: str, hold: float, seconds: float, start: Any, out: Any) -> None:
    acquire, release = CONTENDERS[name](key)
    count = 0
    start.wait()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        acquire()
        time.sleep(hold)
        release()
        count += 1
    out.put(count)


def bench_fairness(name: str, clients: int, hold: float, seconds: float) -> list[int]:
    key = f"fair.{secrets.token_hex(4)}"
    start = mp.Event()
    out: Any = mp.Queue()
    workers = [
        mp.Process(target=_fair_client, args=(name, key, hold, seconds, start, out))
        for _ in range(clients)
    ]
    for worker in workers:
        worker.start()
    time.sleep(0.5)  # every client connected and imported
    start.set()
    counts = [out.get(timeout=seconds + 30) for _ in workers]
    for worker in workers:
        worker.join(5)
    return sorted(counts)


def cleanup() -> None:
    r = client()
    for pattern in ("bench.*", "lock:bench.*", "lock-signal:bench.*", "*{bench.*"):
        for key in r.scan_iter(match=pattern, count=1000):
            r.delete(key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=500, help="cycles per round")
    parser.add_argument("--repeats", type=int, default=31, help="rounds per lock")
    parser.add_argument("--handoffs", type=int, default=200, help="rounds for simple-mutex")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--hold", type=float, default=0.01)
    parser.add_argument("--fair-seconds", type=float, default=10.0)
    parser.add_argument(
        "--only", choices=("cycle", "handoff", "fairness"), action="append", default=None
    )
    parser.add_argument(
        "--peers", action=argparse.BooleanOptionalAction, default=True,
        help="also run hand-off and fairness for the other libraries",
    )  # fmt: skip
    args = parser.parse_args()
    parts = args.only or ["cycle", "handoff", "fairness"]
    names = list(CONTENDERS) if args.peers else ["simple-mutex"]
    r = client()
    info = r.info("server")
    print(
        f"redis {info['redis_version']} at {URL}; redis-py {redis.__version__}; "
        f"Python {sys.version.split()[0]}; {os.cpu_count()} CPUs"
    )
    try:
        if "cycle" in parts:
            bench_cycle(args.cycles, args.repeats)
        if "handoff" in parts:
            print("\nhand-off: release() call -> waiter in another process holds the lock")
            print(f"| {'lock':20s} | rounds |  p50 ms |  p90 ms |  max ms |")
            print(f"|{'-' * 22}|{'-' * 8}|{'-' * 9}|{'-' * 9}|{'-' * 9}|")
            for name in names:
                rounds = args.handoffs if name == "simple-mutex" else max(20, args.handoffs // 5)
                p50, p90, worst = bench_handoff(name, rounds)
                print(f"| {name:20s} | {rounds:6d} | {p50:7.2f} | {p90:7.2f} | {worst:7.2f} |")
        if "fairness" in parts:
            print(
                f"\nfairness: {args.clients} processes, hold {args.hold * 1e3:g} ms, "
                f"{args.fair_seconds:g} s"
            )
            print(f"| {'lock':20s} |  total |   min |   max |   mean | min/mean |")
            print(f"|{'-' * 22}|{'-' * 8}|{'-' * 7}|{'-' * 7}|{'-' * 8}|{'-' * 10}|")
            for name in names:
                counts = bench_fairness(name, args.clients, args.hold, args.fair_seconds)
                mean = statistics.mean(counts)
                print(
                    f"| {name:20s} | {sum(counts):6d} | {counts[0]:5d} | {counts[-1]:5d} | "
                    f"{mean:6.1f} | {counts[0] / mean if mean else 0:8.2f} |"
                )
    finally:
        cleanup()


if __name__ == "__main__":
    main()
