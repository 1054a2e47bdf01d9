"""The nemesis: a seeded schedule of faults, and what each one does.

``schedule(seed, duration, weights)`` draws the whole plan up front from one generator:
when each fault comes, which kind, how long it lasts and a number in [0, 1) that picks its
target among the processes alive at that moment. The same seed gives the same plan (the
processes' own choices are seeded too; only the machine's timing differs between replays,
as in Jepsen).

Kinds dealt from outside (``Nemesis.deal``):

=================  =====================================================================
sigkill            SIGKILL a client (it is replaced by a fresh one)
sigstop            SIGSTOP a client for ``length`` (up to several leases), then SIGCONT
sigterm            SIGTERM a client: its SystemExit must end it (it is replaced)
stop-then-term     SIGSTOP a client past its lease, then SIGTERM and SIGCONT: its
                   SystemExit lands in a block whose lease is lost (issue 20, item 4)
delay, blackhole,  the loopback proxy between the clients and the lock's server
reset, refuse      (tests/faults.py FaultProxy) for ``length``, then "pass" again
cut                the proxy drops the next reply (the server applied the request) and
                   resets that connection: a lost reply
restart            the lock's own server killed (SIGKILL) and started again
disk-stall         the DiskCache's SQLite write lock held from outside for ``length`` (a
                   paused writer, a stalled disk): every grant waits behind it
=================  =====================================================================

In-process kinds (fork, concurrent-renew, alarm, stall) are drawn by the clients
themselves (``workload``); the task-queue tiers add theirs (``celery_tier``, ``rq_tier``).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nemesis.history import Recorder

PROXY_MODES = ("delay", "blackhole", "reset", "refuse", "cut")


@dataclass(frozen=True)
class Fault:
    at: float  # seconds from the start of the run
    kind: str
    length: float
    pick: float  # chooses the target among those alive


def schedule(seed: int, duration: float, weights: dict[str, float], gap: float = 1.0,
             max_length: float = 2.5) -> list[Fault]:  # fmt: skip
    """Faults at exponential intervals of mean ``gap`` seconds, from 1 s in to 3 s before
    the end (the run then settles before it is checked). Kinds are dealt from a shuffled
    deck holding each kind about ``weight`` times (at least once), so that even a short
    run deals every kind before it repeats one."""
    rng = random.Random(seed)
    deck: list[str] = []
    plan, at = [], 1.0
    while True:
        at += rng.expovariate(1 / gap)
        if at > duration - 3 or not weights:
            return plan
        if not deck:
            deck = [k for k in sorted(weights) for _ in range(max(1, round(weights[k])))]
            rng.shuffle(deck)
        plan.append(Fault(at, deck.pop(), rng.uniform(0.2, max_length), rng.random()))


class Nemesis:
    """Deals a schedule's faults to a run's processes, proxy and server, recording each."""

    def __init__(self, rec: Recorder, targets: Callable[[], list[int]],
                 proxy: Any = None, restart: Callable[[], None] | None = None,
                 stall: Callable[[float], None] | None = None) -> None:  # fmt: skip
        self.rec = rec
        self.stall = stall
        self.targets = targets  # pids of the live clients
        self.proxy = proxy
        self.restart_server = restart
        self.stopped: dict[int, float] = {}  # pid -> when to SIGCONT
        self.term_on_resume: set[int] = set()
        self.proxy_heals_at: float | None = None

    def deal(self, fault: Fault) -> None:
        kind = fault.kind
        if kind in PROXY_MODES:
            if self.proxy is None or self.proxy_heals_at is not None:
                return
            delay = min(fault.length, 1.5)
            self.rec("fault", kind=kind, target="proxy", length=fault.length, delay=delay)
            self.proxy.set(kind, delay=delay)
            self.proxy_heals_at = time.monotonic() + fault.length
            return
        if kind == "disk-stall":
            if self.stall is not None:
                self.rec("fault", kind=kind, target="server", length=fault.length)
                self.stall(fault.length)
            return
        if kind == "restart":
            if self.restart_server is None:
                return
            self.rec("fault", kind="restart", target="server")
            self.restart_server()
            self.rec("fault-end", kind="restart", target="server")
            return
        pids = [p for p in self.targets() if p not in self.stopped]
        if not pids:
            return
        pid = pids[int(fault.pick * len(pids))]
        if kind in ("sigstop", "stop-then-term"):
            length = fault.length + (2.0 if kind == "stop-then-term" else 0.0)  # past a lease
            self.rec("fault", kind="sigstop", target=pid, length=length)
            _signal(pid, signal.SIGSTOP)
            self.stopped[pid] = time.monotonic() + length
            if kind == "stop-then-term":
                self.term_on_resume.add(pid)
        elif kind in ("sigkill", "sigterm"):
            self.rec("fault", kind=kind, target=pid)
            _signal(pid, signal.SIGKILL if kind == "sigkill" else signal.SIGTERM)
        else:
            raise ValueError(f"unknown fault kind {kind!r}")

    def tick(self, now: float) -> None:
        """End the faults whose time is up."""
        for pid, when in list(self.stopped.items()):
            if now >= when:
                self.resume(pid)
        if self.proxy_heals_at is not None and now >= self.proxy_heals_at:
            self.proxy.set("pass")
            self.rec("fault-end", kind="proxy", target="proxy")
            self.proxy_heals_at = None

    def resume(self, pid: int) -> None:
        if pid in self.term_on_resume:
            self.term_on_resume.discard(pid)
            self.rec("fault", kind="sigterm", target=pid, after_stop=True)
            _signal(pid, signal.SIGTERM)  # delivered as it resumes
        _signal(pid, signal.SIGCONT)
        self.rec("resumed", target=pid)
        self.stopped.pop(pid, None)

    def heal(self) -> None:
        """End every fault still in force (the run is over)."""
        for pid in list(self.stopped):
            self.resume(pid)
        self.tick(float("inf"))


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it ended on its own meanwhile
        os.kill(pid, sig)
