"""One run of one tier: set up its servers, proxy and fenced store, start the clients,
deal the seeded schedule of faults for ``duration`` seconds, let the run settle, then
check the history. ``run(tier, seed, duration)`` returns a ``Result``.

Tiers: ``memory`` (threads of one process, one InMemoryCache), ``disk`` (processes on one
DiskCache), ``redis`` and ``postgres`` (processes through a FaultProxy to a server of the
run's own, which the nemesis restarts), and the task-queue tiers (``celery``, ``rq``,
``beat``, ``cron``: modules of their own, run through the same ``Result``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nemesis
from nemesis import checker, history
from nemesis.faults import Nemesis, schedule
from nemesis.store import open_store

SHARED_REDIS = "redis://127.0.0.1:6379/13"
SHARED_POSTGRES = os.environ.get("POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        p for p in [os.environ.get("PYTHONPATH"), str(nemesis.TESTS), str(nemesis.ROOT)] if p
    ),
}
LIB_TIERS = ("memory", "disk", "redis", "postgres")
PROCESS_FAULTS = {"sigkill": 2.0, "sigstop": 3.0, "sigterm": 1.0, "stop-then-term": 1.0}
LINK_FAULTS = {
    "delay": 0.7,
    "blackhole": 0.7,
    "reset": 0.7,
    "refuse": 0.7,
    "cut": 0.7,
    "restart": 0.5,
}
IN_PROCESS = {"fork": 0.03, "concurrent-renew": 0.05, "alarm": 0.04, "stall": 0.02}


@dataclass
class Result:
    tier: str
    seed: int
    duration: float
    figures: dict[str, Any]
    anomalies: list[checker.Anomaly]
    workdir: Path
    notes: list[str] = field(default_factory=list)
    clues: dict[int, list[str]] = field(default_factory=dict)  # anomaly index -> faults

    def report(self) -> str:
        f = self.figures
        lines = [
            f"tier {self.tier} seed {self.seed} duration {self.duration:g} s "
            f"(history in {self.workdir})",
            f"  histories {f['histories']}, operations {f['operations']}, grants "
            f"{f['grants']}, body steps {f['steps']} ({f['unprotected_steps']} unprotected, "
            f"{f['unprotected_refused']} of them refused by the store), events {f['events']}"
            + (f", queued {f['queued']} (parked {f['parked']})" if f.get("queued") else ""),
            f"  faults: {json.dumps(f['faults'], sort_keys=True)}",
            f"  anomalies: {len(self.anomalies)} {json.dumps(f['anomalies'], sort_keys=True)}",
            *(f"  note: {n}" for n in self.notes),
        ]
        shown: dict[str, int] = {}
        for i, a in enumerate(self.anomalies):
            shown[a.kind] = shown.get(a.kind, 0) + 1
            if shown[a.kind] <= 3:
                lines.append(f"    - {a}")
                lines.append(
                    f"      faults dealt to it: {', '.join(self.clues.get(i, [])) or 'none'}"
                )
        return "\n".join(lines)


def only(weights: dict[str, float], kinds: set[str] | None) -> dict[str, float]:
    """``weights`` restricted to ``kinds`` (all of them when None): to replay one fault."""
    return dict(weights) if kinds is None else {k: w for k, w in weights.items() if k in kinds}


def run(tier: str, seed: int, duration: float, workdir: Path | None = None,
        clients: int = 5, kinds: set[str] | None = None) -> Result:  # fmt: skip
    """One run; ``kinds`` limits the faults dealt (outside and in-process) to those."""
    if tier not in LIB_TIERS:
        from nemesis import queue_tiers

        return queue_tiers.run(tier, seed, duration, workdir, kinds)
    workdir = workdir or Path(tempfile.mkdtemp(prefix=f"nemesis-{tier}-{seed}-"))
    (workdir / "history").mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        setup = stack.enter_context(_tier(tier, workdir))
        setup.faults, setup.in_process = only(setup.faults, kinds), only(setup.in_process, kinds)
        return _run_clients(tier, seed, duration, workdir, clients, setup)


@dataclass
class Setup:
    cache: dict[str, Any]
    store: str
    faults: dict[str, float]
    spec: checker.Spec
    proxy: Any = None
    restart: Callable[[], None] | None = None
    threads: int = 0
    in_process: dict[str, float] = field(default_factory=lambda: dict(IN_PROCESS))
    drop_store: Callable[[], None] | None = None
    stall: Callable[[float], None] | None = None


KEYS = ["a", "b", "c", "s"]
PERMITS = {"s": 2}


@contextlib.contextmanager
def _tier(tier: str, workdir: Path) -> Iterator[Setup]:
    run_id = uuid.uuid4().hex[:8]
    sqlite = f"sqlite://{workdir / 'store.sqlite'}"
    if tier == "memory":
        no_fork = {k: v for k, v in IN_PROCESS.items() if k != "fork"}
        yield Setup({"kind": "memory"}, sqlite, {"sigstop": 1.0}, checker.Spec(PERMITS),
                    threads=6, in_process=no_fork)  # fmt: skip
        return
    if tier == "disk":
        # gc_after=0: freed rows are collected by the next collecting grant, so the fence
        # floor is what keeps fences growing (issue 20, item 6).
        cache = {"kind": "disk", "path": str(workdir / "locks"), "gc_after": 0}
        yield Setup(cache, sqlite, {**PROCESS_FAULTS, "disk-stall": 2.0},
                    checker.Spec(PERMITS, per_slot_fences=True),
                    stall=lambda seconds: _hold_sqlite(workdir / "locks", seconds))  # fmt: skip
        return
    from faults import FaultProxy

    if tier == "redis":
        from servers import RedisServer, free_port

        server = RedisServer(free_port(), workdir, "--appendonly", "yes",
                             "--appendfsync", "always")  # fmt: skip
        server.start()
        store = f"{SHARED_REDIS}?prefix=nem:{run_id}:"

        def restart() -> None:
            assert server.proc is not None
            server.proc.kill()
            server.proc.wait(10)
            server.start()

        try:
            with FaultProxy(server.port) as proxy:
                cache = {"kind": "redis", "port": proxy.port, "socket_timeout": 1}
                yield Setup(cache, store, {**PROCESS_FAULTS, **LINK_FAULTS},
                            checker.Spec(PERMITS), proxy, restart,
                            drop_store=lambda: open_store(store).drop())  # type: ignore[attr-defined]  # fmt: skip
        finally:
            server.stop()
        return
    if tier == "postgres":
        from servers import PostgresServer

        pg = PostgresServer()
        pg.pg_ctl("start")
        store = f"{SHARED_POSTGRES}?table=nem_{run_id}"

        def restart_pg() -> None:
            pg._run("pg_ctl", "-D", "data", "-m", "immediate", "-w", "stop")
            pg.pg_ctl("start")

        try:
            with FaultProxy(pg.port) as proxy:
                # libpq's "socket timeout": connect_timeout (2 s is its least) for a new
                # connection, tcp_user_timeout for unanswered bytes on an open one. An
                # acquire is bounded by its timeout plus that one (DESIGN §4 rule 9).
                url = (
                    f"postgresql://postgres@127.0.0.1:{proxy.port}/postgres"
                    "?connect_timeout=2&tcp_user_timeout=2000"
                )
                cache = {"kind": "postgres", "url": url, "table": "nemlocks"}
                # Under the proxy's delay (1.5 s each way at most) one statement takes a
                # 3 s round trip, which libpq's tcp_user_timeout does not cut (the proxy
                # acknowledges every byte): an acquire's last try, sent just before its
                # timeout, and a release (no timeout of its own) each get one round trip
                # and scheduling on top.
                spec = checker.Spec(PERMITS, per_slot_fences=True, acquire_slack=3.5,
                                    release_slack=4.0)  # fmt: skip
                yield Setup(cache, store, {**PROCESS_FAULTS, **LINK_FAULTS},
                            spec, proxy, restart_pg,
                            drop_store=lambda: open_store(store).drop())  # type: ignore[attr-defined]  # fmt: skip
        finally:
            pg.remove()
        return
    raise ValueError(f"unknown tier {tier!r}; one of {LIB_TIERS} or celery, rq, beat, cron")


def _hold_sqlite(directory: Path, seconds: float) -> None:
    """Hold the DiskCache's write lock for ``seconds`` from a thread of the nemesis."""
    import sqlite3
    import threading

    from simple_mutex.caches.disk import FILENAME

    def hold() -> None:
        db = sqlite3.connect(directory / FILENAME, timeout=30, isolation_level=None)
        db.execute("BEGIN IMMEDIATE")
        time.sleep(min(seconds, 5.0))  # below the cache's own 10 s wait for the lock
        db.execute("COMMIT")
        db.close()

    threading.Thread(target=hold, daemon=True).start()


def _run_clients(tier: str, seed: int, duration: float, workdir: Path, clients: int,
                 setup: Setup) -> Result:  # fmt: skip
    hist = workdir / "history"
    rec = history.Recorder(hist, "nemesis")
    rec("start")
    start = time.monotonic()
    until = start + duration
    base = {
        "seed": seed, "history": str(hist), "cache": setup.cache, "store": setup.store,
        "keys": KEYS, "permits": PERMITS, "until": until, "threads": setup.threads,
        "in_process": setup.in_process,
    }  # fmt: skip
    procs: dict[str, subprocess.Popen[bytes]] = {}
    generation: dict[str, int] = {}

    def launch(slot: str) -> None:
        generation[slot] = generation.get(slot, -1) + 1
        name = f"{slot}.{generation[slot]}" if generation[slot] else slot
        path = workdir / f"{name}.json"
        path.write_text(json.dumps({**base, "name": name}))
        with open(workdir / f"{name}.log", "wb") as log:
            procs[slot] = subprocess.Popen(
                [sys.executable, "-m", "nemesis.workload", str(path)], env=ENV,
                cwd=nemesis.ROOT, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip

    for i in range(1 if setup.threads else clients):
        launch(f"w{i}")
    nem = Nemesis(rec, lambda: [p.pid for p in procs.values() if p.poll() is None],
                  setup.proxy, setup.restart, setup.stall)  # fmt: skip
    plan = schedule(seed, duration, setup.faults)
    pending = list(plan)
    while (now := time.monotonic()) < until:
        while pending and start + pending[0].at <= now:
            nem.deal(pending.pop(0))
        nem.tick(now)
        for slot, proc in list(procs.items()):
            if proc.poll() is not None and now < until - 2:
                launch(slot)  # a killed client is replaced: the load goes on
        time.sleep(0.02)
    nem.heal()
    deadline = time.monotonic() + 40
    for proc in procs.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.1, deadline - time.monotonic()))
        if proc.poll() is None:
            rec("unended", target=proc.pid, name=str(proc.args[-1]))
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
    rec("exit")
    store = open_store(setup.store)
    log = store.log()
    store.close()
    if setup.drop_store is not None:
        setup.drop_store()
    events = history.load(hist)
    anomalies = checker.check(events, log, setup.spec)
    notes = [f"{len(plan)} faults planned; store log {len(log)} accepted writes"]
    return finish(tier, seed, duration, events, anomalies, workdir, notes)


def finish(
    tier: str,
    seed: int,
    duration: float,
    events: list[history.Event],
    anomalies: list[checker.Anomaly],
    workdir: Path,
    notes: list[str],
) -> Result:
    clues = {i: checker.dealt_to(events, a) for i, a in enumerate(anomalies)}
    return Result(tier, seed, duration, checker.figures(events, anomalies), anomalies, workdir,
                  notes, clues)  # fmt: skip


def cleanup(result: Result) -> None:
    shutil.rmtree(result.workdir, ignore_errors=True)
