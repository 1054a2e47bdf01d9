"""A nemesis client: takes locks on shared keys and writes to the fenced store inside
them, recording every step (``history``), until its run ends.

Run as ``python -m nemesis.workload CONFIG.json`` (one OS process per history), or with
``"threads": N`` in the config for the memory tier (N histories in one process: the
first runs on the main thread, the only one a signal alarm reaches).

Each operation picks, from a generator seeded with the run's seed and the worker's name,
a key, a lease length, renew or not, a timeout, a number of body steps, and now and then
an in-process fault (the faults a signal from outside cannot deal):

fork
    ``os.fork()`` inside the held block; the child leaves the block (as a
    multiprocessing helper or a subprocess helper would) and exits. It must not free the
    parent's lock (issue 20, item 5).
concurrent-renew
    two threads renew the held lease at once with different lengths, beside the
    background renewal: the holder must never believe in more time than its record has
    (item 3).
alarm
    a ``signal.setitimer`` alarm raises an ordinary exception (as RQ's ``job_timeout`` and
    Celery's soft time limit do) while ``acquire`` may still wait: it must reach the
    caller, and the body must not run (item 7).
stall
    the body stops for longer than its lease (a GC pause, a swapped-out page): the steps
    after it are unprotected and the store must refuse them.

A worker catches ``Exception`` around each operation, as worker loops do; a SIGTERM
raises ``SystemExit`` (a graceful service), which must end the process (item 4).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nemesis  # noqa: F401  (sys.path)
from nemesis.body import Steps
from nemesis.history import Recorder
from simple_mutex import (
    DiskCache,
    InMemoryCache,
    Mutex,
    Semaphore,
    SimpleMutexAcquireTimeoutError,
    SimpleMutexLeaseExpiredError,
)


class JobTimeout(Exception):
    """What a job timeout raises from its signal handler: an ordinary exception."""


def make_cache(spec: dict[str, Any]) -> Any:
    kind = spec["kind"]
    if kind == "memory":
        return InMemoryCache()
    if kind == "disk":
        return DiskCache(spec["path"], gc_after=spec.get("gc_after", 60))
    if kind == "redis":
        import redis

        from simple_mutex.caches import RedisCache

        client = redis.Redis(port=spec["port"], socket_timeout=spec.get("socket_timeout", 1),
                             socket_connect_timeout=spec.get("socket_timeout", 1))  # fmt: skip
        return RedisCache(client)
    if kind == "postgres":
        from simple_mutex.caches.postgres import PostgresCache

        return PostgresCache(spec["url"], table=spec["table"])
    if kind == "url":  # as a user configures it: redis+sentinel://...?replicas=1
        from simple_mutex.caches.url import cache_from_url

        return cache_from_url(spec["url"])
    raise ValueError(f"unknown cache kind {kind!r}")


class Worker:
    """One history: a loop of operations until ``until`` (monotonic)."""

    def __init__(self, cfg: dict[str, Any], name: str, cache: Any, main_thread: bool) -> None:
        self.cfg, self.name = cfg, name
        self.rec = Recorder(cfg["history"], name)
        self.rng = random.Random(f"{cfg['seed']}:{name}")
        self.main_thread = main_thread
        self.spaces: dict[tuple[str, float], Mutex | Semaphore] = {}
        self.cache = cache
        self.current: str | None = None  # the op an alarm belongs to
        self.steps = Steps(self.rec, cfg["store"])

    def space(self, key: str, lease: float) -> Mutex | Semaphore:
        found = self.spaces.get((key, lease))
        if found is None:
            permits = self.cfg.get("permits", {}).get(key, 1)
            interval = self.cfg.get("interval", 0.02)
            if permits == 1:
                found = Mutex(self.cache, lease=lease, interval=interval, prefix="nem.")
            else:
                found = Semaphore(self.cache, permits=permits, lease=lease, interval=interval,
                                  prefix="nemsem.")  # fmt: skip
            self.spaces[(key, lease)] = found
        return found

    def pick_fault(self) -> str | None:
        roll = self.rng.random()
        for kind, p in self.cfg.get("in_process", {}).items():
            if kind == "alarm" and not self.main_thread:
                continue
            if roll < p:
                return str(kind)
            roll -= p
        return None

    def run(self) -> None:
        self.rec("start")
        n = 0
        stop = self.cfg.get("stop")  # a file whose existence ends the run early
        while time.monotonic() < self.cfg["until"] and not (stop and os.path.exists(stop)):
            n += 1
            try:
                self.operation(f"{self.name}:{n}")
            except Exception as exc:  # a worker loop goes on after a failed job
                self.rec("failed", id=f"{self.name}:{n}", error=repr(exc)[:300])
            time.sleep(self.rng.uniform(0, self.cfg.get("think", 0.02)))
        self.rec("exit")

    def operation(self, op: str) -> None:
        rng, cfg = self.rng, self.cfg
        key = rng.choice(cfg["keys"])
        lease = rng.choice(cfg.get("leases", [0.5, 1.0, 2.0]))
        renew = rng.random() < cfg.get("renew", 0.5)
        timeout = rng.choice(cfg.get("timeouts", [0, 0.3, 1.0, 3.0]))
        steps = rng.randint(*cfg.get("steps", [1, 6]))
        fault = self.pick_fault()
        fault_step = rng.randrange(steps)
        if fault == "concurrent-renew":
            renew, steps, fault_step = True, max(steps, 8), 0
        self.current = op
        self.rec("acquire", id=op, key=key, timeout=timeout, lease=lease, renew=renew)
        if fault == "alarm":
            delay = rng.uniform(0.05, max(0.1, timeout))
            self.rec("fault", kind="alarm", target=self.rec.pid, id=op, after=delay)
            signal.signal(signal.SIGALRM, self._alarm)
            signal.setitimer(signal.ITIMER_REAL, delay)
        try:
            held = self.space(key, lease).acquire(key, timeout=timeout, renew=renew)
        except SimpleMutexAcquireTimeoutError as exc:
            self._disarm(fault)
            self.rec("busy", id=op, key=key, error=type(exc).__name__)
            return
        except JobTimeout:
            self.rec("failed", id=op, key=key, error="JobTimeout while acquiring")
            return
        except Exception as exc:
            self._disarm(fault)
            self.rec("failed", id=op, key=key, error=repr(exc)[:300])
            return
        self.rec("granted", id=op, key=key, fence=held.fence, slot=held.slot,
                 deadline=held._deadline)  # fmt: skip
        try:
            self.body(op, key, held, steps, fault, fault_step)
        finally:
            self._disarm(fault)
            self.current = None

    def body(self, op: str, key: str, held: Any, steps: int, fault: str | None,
             fault_step: int) -> None:  # fmt: skip
        child = False
        left = time.monotonic()
        try:
            with held:
                try:
                    n, until = 0, 0.0
                    while n < steps or time.monotonic() < until:
                        self.step(op, key, held, n)
                        if n == fault_step and fault is not None:
                            child = self.in_body_fault(op, fault, held)
                            if child:
                                break
                            if fault == "concurrent-renew":  # work on past the shorter one
                                until = time.monotonic() + 1.5 * held.length
                        time.sleep(self.rng.uniform(0.005, self.cfg.get("step_sleep", 0.03)))
                        n += 1
                finally:
                    left = time.monotonic()  # the release starts here
        except SimpleMutexLeaseExpiredError as exc:
            if not child:
                self.rec("lost", id=op, key=key, error=str(exc)[:200])
        except JobTimeout:
            self.rec("failed", id=op, key=key, error="JobTimeout in the body")
        finally:
            if child:
                self.rec("exit")
                os._exit(0)
        # The deadline believed at release and the lease's loss, if any: a release or a
        # renewal that found the record gone in time is a grant the server forgot
        # (checker "vanished", failover runs).
        self.rec("released", id=op, key=key, ok=not held.lost, t0=left, deadline=held._deadline,
                 loss=held._state.loss)  # fmt: skip
        self.rec("done", id=op)

    def step(self, op: str, key: str, held: Any, n: int) -> None:
        self.steps.step(op, key, held, n)

    def in_body_fault(self, op: str, fault: str, held: Any) -> bool:
        """Deal ``fault`` inside the held block; True in a forked child."""
        if fault == "fork":
            pid = os.fork()
            if pid == 0:
                self.rec.after_fork("child")
                self.rec("start", forked=True)
                return True
            self.rec("fault", kind="fork", target=pid, id=op)
            threading.Thread(target=os.waitpid, args=(pid, 0), daemon=True).start()
        elif fault == "concurrent-renew":
            lengths = [held.length * 0.6, held.length * 6] * 3
            self.rec("fault", kind="concurrent-renew", target=self.rec.pid, id=op,
                     lengths=lengths)  # fmt: skip
            together = threading.Barrier(len(lengths))
            threads = [threading.Thread(target=_quietly(held.renew, length, together))
                       for length in lengths]  # fmt: skip
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(10)
        elif fault == "stall":
            pause = held.length * self.rng.uniform(1.2, 2.5)
            self.rec("fault", kind="stall", target=self.rec.pid, id=op, seconds=pause)
            time.sleep(pause)  # the interrupt is raised when it returns
        return False

    def _alarm(self, signum: int, frame: Any) -> None:
        self.rec("alarm", id=self.current)
        raise JobTimeout("job timeout")

    def _disarm(self, fault: str | None) -> None:
        if fault == "alarm":
            signal.setitimer(signal.ITIMER_REAL, 0)


def _quietly(renew: Callable[[float], None], length: float, together: threading.Barrier
             ) -> Callable[[], None]:  # fmt: skip
    def call() -> None:
        with contextlib.suppress(Exception):
            together.wait(5)
            renew(length)

    return call


def main(path: str) -> None:
    cfg = json.loads(Path(path).read_text())
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cache = make_cache(cfg["cache"])
    threads = cfg.get("threads", 0)
    if not threads:
        Worker(cfg, cfg["name"], cache, True).run()
        return
    workers = [Worker(cfg, f"{cfg['name']}.t{i}", cache, i == 0) for i in range(threads)]
    for i, worker in enumerate(workers):
        worker.rec.pid = os.getpid() * 100 + i  # one history per thread
    others = [threading.Thread(target=w.run, daemon=True) for w in workers[1:]]
    for thread in others:
        thread.start()
    workers[0].run()
    for thread in others:
        thread.join(60)


if __name__ == "__main__":
    main(sys.argv[1])
