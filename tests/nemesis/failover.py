"""Failover runs: a replicated tier's primary is SIGKILLed while client processes stream
grants, its standby is promoted, the clients carry on; the history checker then counts
what the failover did to the locks (issue 26, item 3).

Tiers (each started on free loopback ports by ``failover_run`` and stopped after it):

``redis-sentinel``
    a primary, one replica and three Sentinels (quorum 2); clients reach the primary
    through ``redis+sentinel://`` (``replicas=`` in the URL). The Sentinels promote the
    replica; the killed primary comes back empty as the new primary's replica, so the
    next trial can fail over the other way.
``postgres-standby``
    a primary and a streaming standby (``pg_basebackup -R``); clients hold one libpq
    multi-host conninfo (``target_session_attrs=read-write``). The nemesis promotes the
    standby (``pg_ctl promote``, as an operator or Patroni would) and rebuilds the killed
    node as the new primary's standby. ``sync``: ``synchronous_commit=on`` with
    ``synchronous_standby_names='*'``.
``etcd``
    three members (tests/servers.py ``EtcdCluster``); clients hold an ``etcd://`` URL
    naming all three. The leader is SIGKILLed, the other two elect one of themselves on
    their own (raft: the nemesis only waits for it), and the killed member restarts on
    its data directory as a follower. No lagging link: a raft write is acknowledged only
    once a majority has it, so there is no replication backlog for the kill to drop.

The clients are the nemesis's own (``workload``), writing their fences to a SQLite
fenced store no fault touches. Each failover is recorded as ``fault`` (kind
``primary-kill``), ``promoted`` and ``rejoined`` events in the same history.

Two clients of their own take turns on one more key (``WAITED``): the primary dies just
after a grant of it, while the other polls it, and ``twice`` says per failover whether
that waiter was granted the key inside the live lease (``_held_twice``).

Figures: grants, failed acquires, held twice, the checker's anomalies by kind (``overlap``: two
holders inside their leases at once; ``refused-while-protected``: a later grant's fence
written while a holder still believed it held the key; ``fence-order`` /
``fence-repeat`` / ``stale-write``: fences going backwards; ``vanished``: a record gone
under a holder inside its lease), and the grant pause (the kill to the next grant).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import redis

import nemesis
from nemesis import checker, history
from nemesis.runner import ENV
from nemesis.store import open_store

KEYS = ["a", "b", "c"]
SERVICE = "failover"
LAG = 0.05  # seconds each replication chunk is delayed: the standby trails by about that
# Leases longer than a failover (detection, election, reconnection: seconds), so that a
# hold granted before the kill is still believed in after the promotion; bodies long
# enough that holds straddle the kill.
WORKLOAD = {
    "keys": KEYS, "permits": {}, "threads": 0, "in_process": {},
    "leases": [6.0, 10.0], "renew": 0.5, "timeouts": [0.5, 2.0, 4.0], "steps": [10, 40],
    "step_sleep": 0.15, "think": 0.05, "interval": 0.05,
}  # fmt: skip
# The waited key: two clients of their own take turns on it, so that whenever one holds it
# the other waits, polling every 20 ms, through the failover. The primary is killed just
# after a grant of this key: if the grant is lost, the waiter is the second holder. No
# renewal (the holder believes in its whole lease, as a body without renew= does), and a
# body of 7 to 8 s: longer than a Sentinel's promotion (~2.4 s) and the clients'
# reconnection after it, shorter than the lease.
WAITED = "w"
WAITERS = 2
WAITER = {
    **WORKLOAD, "keys": [WAITED], "leases": [10.0], "renew": 0.0, "timeouts": [30.0],
    "steps": [70, 80], "step_sleep": 0.2, "think": 0.02, "interval": 0.02,
}  # fmt: skip


class Pair(Protocol):
    """A replicated tier: the URL clients use, and the nemesis's handles on it."""

    def client_cache(self) -> dict[str, Any]: ...
    def wait_in_sync(self, timeout: float = 30) -> None: ...
    def kill_primary(self) -> int: ...
    def promote(self, timeout: float = 30) -> int: ...
    def rejoin(self) -> None: ...
    def close(self) -> None: ...


# -- Redis with Sentinel ----------------------------------------------------------------


class SentinelPair:
    """A primary, a replica and three Sentinels of this run's own."""

    def __init__(self, workdir: Path, replicas: int, link: Any) -> None:
        from servers import RedisServer, free_port

        self._server_class, self.replicas = RedisServer, replicas
        self.workdir = workdir
        self.nodes: dict[int, Any] = {}
        self.sentinels: list[Any] = []
        self.primary, self.replica = free_port(), free_port()
        self._node(self.primary)
        self.link = link(self.primary)  # the replication link, delayed by LAG
        self._node(self.replica, self.link.port)
        # Each Sentinel is told of the others and of the replica up front (ids of our
        # own), instead of finding them by hello messages over several seconds.
        ports = [free_port() for _ in range(3)]
        ids = [f"{i + 1:040x}" for i in range(3)]
        for i, port in enumerate(ports):
            home = workdir / f"sentinel{i}"
            home.mkdir()
            others = "".join(
                f"sentinel known-sentinel {SERVICE} 127.0.0.1 {ports[j]} {ids[j]}\n"
                for j in range(3) if j != i
            )  # fmt: skip
            conf = home / "sentinel.conf"  # Sentinel rewrites its file: one each
            conf.write_text(
                f"sentinel myid {ids[i]}\n"
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} 1000\n"
                # Longer than the run: Sentinel "fixes" a replica whose master address
                # is not the master's (ours is the lagging link) after failover-timeout.
                f"sentinel failover-timeout {SERVICE} 120000\n"
                f"sentinel known-replica {SERVICE} 127.0.0.1 {self.replica}\n{others}"
            )
            sentinel = RedisServer(port, home, config=conf)
            self.sentinels.append(sentinel.start())
        deadline = time.monotonic() + 30
        while not all(self._sees_everyone(s.port) for s in self.sentinels):
            if time.monotonic() > deadline:
                raise RuntimeError("the Sentinels did not find each other and the replica")
            time.sleep(0.05)

    def _node(self, port: int, primary: int | None = None) -> None:
        home = self.workdir / f"redis{port}"
        home.mkdir(exist_ok=True)
        # No diskless-sync delay (5 s by default): a replica's full sync starts at once.
        extra = ["--repl-diskless-sync-delay", "0"]
        extra += ["--replicaof", "127.0.0.1", str(primary)] if primary else []
        node = self._server_class(port, home, *extra)
        self.nodes[port] = node.start()

    def _sees_everyone(self, port: int) -> bool:
        with contextlib.suppress(redis.RedisError):
            master = redis.Redis(port=port, socket_timeout=1).sentinel_master(SERVICE)
            return bool(master["num-other-sentinels"] == 2 and master["num-slaves"] >= 1)
        return False

    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        query = "socket_timeout=0.5&socket_connect_timeout=0.5"
        query += f"&replicas={self.replicas}"  # 0 by name: a Sentinel URL's default is 1
        return f"redis+sentinel://{hosts}/{SERVICE}/0?{query}"

    def client_cache(self) -> dict[str, Any]:
        return {"kind": "url", "url": self.url()}

    def wait_in_sync(self, timeout: float = 30) -> None:
        """The replica is linked and the primary counts it."""
        deadline = time.monotonic() + timeout
        primary = redis.Redis(port=self.primary, socket_timeout=1)
        replica = redis.Redis(port=self.replica, socket_timeout=1)
        while True:
            with contextlib.suppress(redis.RedisError):
                up = replica.info("replication").get("master_link_status") == "up"
                counted = primary.info("replication").get("connected_slaves", 0) >= 1
                if up and counted:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"replica {self.replica} did not catch up")
            time.sleep(0.05)

    def kill_primary(self) -> int:
        """The primary's machine dies: the replication bytes still on their way go with it
        (the lagging link drops them), then the server is SIGKILLed."""
        self.link.set("reset")
        node = self.nodes[self.primary]
        node.proc.kill()
        node.proc.wait(10)
        return self.primary

    def promote(self, timeout: float = 30) -> int:
        """The Sentinels promote the replica on their own: wait until they name it."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(redis.RedisError):
                probe = redis.Redis(port=self.sentinels[0].port, socket_timeout=1)
                addr = probe.sentinel_get_master_addr_by_name(SERVICE)
                role = redis.Redis(port=self.replica, socket_timeout=1).info("replication")
                if addr and int(addr[1]) == self.replica and role["role"] == "master":
                    self.primary, self.replica = self.replica, self.primary
                    return self.primary
            if time.monotonic() > deadline:
                raise RuntimeError("the Sentinels did not promote the replica")
            time.sleep(0.05)

    def rejoin(self) -> None:
        """The killed node comes back empty, as the new primary's replica (Sentinel would
        make it one; started so, it is never a second primary meanwhile), linked
        directly: the trial's one failover is over."""
        self._node(self.replica, self.primary)

    def close(self) -> None:
        for server in [*self.sentinels, *self.nodes.values()]:
            server.stop()
        self.link.__exit__(None, None, None)


# -- PostgreSQL with a streaming standby ------------------------------------------------


class StandbyPair:
    """A primary and a streaming standby; ``sync``: every commit waits for the standby."""

    def __init__(self, workdir: Path, sync: bool, link: Any) -> None:
        from servers import free_port

        self.sync = sync
        self.bin = sorted(Path("/usr/lib/postgresql").glob("*/bin"))[-1]
        self.root = Path(tempfile.mkdtemp(prefix="simple-mutex-pg-failover-"))
        self.user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.user:
            shutil.chown(self.root, "postgres")
        self.workdir = workdir
        self.primary, self.replica = free_port(), free_port()
        self._run("initdb", "-D", self._data(self.primary), "-A", "trust", "-U", "postgres",
                  "--no-sync")  # fmt: skip
        conf = ["wal_level = replica", "max_wal_senders = 10", "wal_keep_size = 64MB"]
        if sync:
            conf += ["synchronous_commit = on", "synchronous_standby_names = '*'"]
        else:
            conf += ["synchronous_commit = on", "synchronous_standby_names = ''"]
        with open(Path(self._data(self.primary)) / "postgresql.conf", "a") as f:
            f.write("\n".join(conf) + "\n")
        self._start(self.primary)
        self.link = link(self.primary)  # the replication link, delayed by LAG
        self._standby(self.replica, via=self.link.port)

    def _data(self, port: int) -> str:
        return str(self.root / f"data{port}")

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run([*self.user, str(self.bin / tool), *args], check=True,
                       capture_output=True, timeout=120, cwd=self.root)  # fmt: skip

    def _start(self, port: int) -> None:
        # fsync=off: a SIGKILLed server loses nothing the kernel has (this is not a power
        # cut); what a failover loses is what the standby never received.
        options = f"-p {port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        log = self.root / f"log{port}"
        try:
            self._run("pg_ctl", "-D", self._data(port), "-l", str(log), "-w", "-o", options,
                      "start")  # fmt: skip
        except subprocess.CalledProcessError:
            tail = log.read_text()[-2000:]
            raise RuntimeError(f"postgres on {port} did not start:\n{tail}") from None

    def _standby(self, port: int, via: int | None = None) -> None:
        """A base backup of the primary (direct), then streaming from it through ``via``
        (a later primary_conninfo in postgresql.auto.conf wins)."""
        shutil.rmtree(self._data(port), ignore_errors=True)
        self._run("pg_basebackup", "-h", "127.0.0.1", "-p", str(self.primary), "-U",
                  "postgres", "-D", self._data(port), "-R", "-X", "stream", "-c", "fast",
                  "--no-sync")  # fmt: skip
        if via is not None:
            with open(Path(self._data(port)) / "postgresql.auto.conf", "a") as f:
                f.write(f"primary_conninfo = 'host=127.0.0.1 port={via} user=postgres'\n")
        self._start(port)

    def conninfo(self) -> str:
        return (
            f"host=127.0.0.1,127.0.0.1 port={self.primary},{self.replica} user=postgres "
            "dbname=postgres target_session_attrs=read-write connect_timeout=2 "
            "tcp_user_timeout=2000"
        )

    def client_cache(self) -> dict[str, Any]:
        return {"kind": "postgres", "url": self.conninfo(), "table": "failover_locks"}

    def _query(self, port: int, sql: str) -> list[tuple[Any, ...]]:
        import psycopg

        url = f"postgresql://postgres@127.0.0.1:{port}/postgres?connect_timeout=2"
        with psycopg.connect(url, autocommit=True) as conn:
            return conn.execute(sql).fetchall()

    def wait_in_sync(self, timeout: float = 30) -> None:
        """The standby streams (as the synchronous one, with ``sync``)."""
        deadline = time.monotonic() + timeout
        want = "sync" if self.sync else "async"
        while True:
            with contextlib.suppress(Exception):
                rows = self._query(self.primary,
                                   "SELECT state, sync_state FROM pg_stat_replication")  # fmt: skip
                if rows and rows[0][0] == "streaming" and rows[0][1] == want:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"standby {self.replica} did not catch up")
            time.sleep(0.05)

    def _postmaster(self, port: int) -> int:
        return int((Path(self._data(port)) / "postmaster.pid").read_text().split()[0])

    def kill_primary(self) -> int:
        """The primary's machine dies: the WAL still on its way to the standby goes with it
        (the lagging link drops it), and the postmaster and every backend are SIGKILLed at
        once (a backend left alone would go on answering its client)."""
        self.link.set("reset")
        pid = self._postmaster(self.primary)
        children = _children(pid)
        os.kill(pid, 9)
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, 9)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in [pid, *children]) and time.monotonic() < deadline:
            time.sleep(0.02)
        for leftover in self.root.glob(f".s.PGSQL.{self.primary}*"):  # the dead one's socket
            leftover.unlink()
        return self.primary

    def promote(self, timeout: float = 30) -> int:
        self._run("pg_ctl", "-D", self._data(self.replica), "-w", "-t", str(int(timeout)),
                  "promote")  # fmt: skip
        self.primary, self.replica = self.replica, self.primary
        return self.primary

    def rejoin(self) -> None:
        """The killed node, rebuilt from the new primary as its standby."""
        self._standby(self.replica)

    def close(self) -> None:
        for port in (self.primary, self.replica):
            with contextlib.suppress(Exception):
                self._run("pg_ctl", "-D", self._data(port), "-m", "immediate", "-w", "stop")
        self.link.__exit__(None, None, None)
        shutil.rmtree(self.root, ignore_errors=True)


# -- etcd: three members, raft -------------------------------------------------------------


class EtcdTrio:
    """Three etcd members; the "primary" is the raft leader, the "promotion" the election
    the two others hold by themselves."""

    def __init__(self) -> None:
        from servers import EtcdCluster

        self.cluster = EtcdCluster().start()
        self.killed: Any = None

    def client_cache(self) -> dict[str, Any]:
        # 2 s per request: one in flight to a follower when the leader dies waits for
        # the election (or times out and is retried by the engine), never for long.
        members = ",".join(self.cluster.endpoints)
        return {"kind": "url", "url": f"etcd://{members}/{SERVICE}?timeout=2"}

    def wait_in_sync(self, timeout: float = 30) -> None:
        """Every member answers and follows the same leader."""
        deadline = time.monotonic() + timeout
        while True:
            statuses = [m.status() for m in self.cluster.members]
            leaders = {s["leader"] for s in statuses if s is not None}
            if None not in statuses and len(leaders) == 1 and leaders != {"0"}:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the etcd members did not agree on a leader: {statuses}")
            time.sleep(0.05)

    def kill_primary(self) -> int:
        self.killed = self.cluster.leader()
        self.killed.kill()
        return int(self.killed.client_port)

    def promote(self, timeout: float = 30) -> int:
        """Nothing to do but wait: the two members left elect a leader."""
        return int(self.cluster.leader(timeout=timeout).client_port)

    def rejoin(self) -> None:
        """The killed member restarts on its data: it catches up as a follower."""
        self.killed.start()

    def close(self) -> None:
        self.cluster.stop()


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:  # the field after the state: the parent's pid
                found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"


# -- one run ----------------------------------------------------------------------------


@dataclass
class Outcome:
    tier: str
    setup: str  # the configuration, as the table prints it
    failovers: int
    figures: dict[str, Any]
    anomalies: list[checker.Anomaly]
    pauses: list[float]  # per failover: the kill to the next grant, seconds
    switches: list[float]  # per failover: the kill to the promotion the nemesis saw
    workdir: Path
    counts: Counter[str] = field(default_factory=Counter)
    # Per failover: how long before the end of the live lease of the grant the primary
    # was killed after (its holder's release or believed deadline, the earlier) the
    # waiter was granted the key; None: not inside it.
    twice: list[float | None] = field(default_factory=list)
    kills: list[str | None] = field(default_factory=list)  # the grant each kill came after

    @property
    def held_twice(self) -> int:
        return sum(t is not None for t in self.twice)

    def count(self, *kinds: str) -> int:
        return sum(self.counts[k] for k in kinds)

    def row(self) -> str:
        c = self.counts
        pause = max(self.pauses, default=float("nan"))
        switch = max(self.switches, default=float("nan"))
        early = max((t for t in self.twice if t is not None), default=0.0)
        return (
            f"{self.tier:<17} {self.setup:<21} {self.failovers:>3} {self.figures['grants']:>6} "
            f"{self.figures['failed']:>6} {self.held_twice:>5} {early:>6.2f} "
            f"{c['overlap']:>7} {c['refused-while-protected']:>7} "
            f"{c['vanished']:>8} {self.count('fence-order', 'fence-repeat', 'stale-write'):>5} "
            f"{switch:>8.2f} {pause:>7.2f} {self.others()}"
        )

    def others(self) -> str:
        """The anomalies of other kinds (hang, crash...), by kind: printed, not counted."""
        rest = {k: n for k, n in self.counts.items() if k not in COUNTED}
        return ",".join(f"{k}:{n}" for k, n in sorted(rest.items())) or "-"


HEADER = (
    f"{'tier':<17} {'setup':<21} {'k':>3} {'grants':>6} {'failed':>6} {'twice':>5} "
    f"{'before':>6} {'overlap':>7} "
    f"{'refused':>7} {'vanished':>8} {'fence':>5} {'switch s':>8} {'grant s':>7} other"
)
COUNTED = {"overlap", "refused-while-protected", "vanished", "fence-order", "fence-repeat",
           "stale-write"}  # fmt: skip
LEGEND = (
    "k failovers; failed: acquires that raised (the primary down, or too few replicas); "
    "twice: failovers after which the waiter was granted the key inside the live lease of "
    "the grant the primary died after (before: the most seconds before that lease's end); "
    "overlap / refused: two holders inside their leases (checker); vanished: a record gone "
    "under a holder in its lease; fence: fences backwards or repeated; switch s / grant s: "
    "the longest kill-to-promotion / kill-to-next-grant"
)


def lagging(delay: float) -> Any:
    """A replication link: a loopback proxy to the primary whose every chunk arrives
    ``delay`` seconds late (tests/faults.py), so that the standby trails the primary by
    about that long, as one across a network does."""
    from faults import FaultProxy

    def open_link(port: int) -> Any:
        proxy = FaultProxy(port).__enter__()
        if delay:
            proxy.set("delay", delay=delay)
        return proxy

    return open_link


@contextlib.contextmanager
def _pair(tier: str, workdir: Path, option: int, lag: float) -> Iterator[Pair]:
    pair: Pair
    if tier == "redis-sentinel":
        pair = SentinelPair(workdir, replicas=option, link=lagging(lag))
    elif tier == "postgres-standby":
        pair = StandbyPair(workdir, sync=bool(option), link=lagging(lag))
    else:
        raise ValueError(f"unknown failover tier {tier!r}")
    try:
        yield pair
    finally:
        pair.close()


PairFor = Callable[[Path], contextlib.AbstractContextManager[Pair]]  # a trial's home -> its pair


@contextlib.contextmanager
def _pairs(tier: str, option: int, lag: float) -> Iterator[PairFor]:
    """Per trial, the pair to fail over: a fresh one (Redis, PostgreSQL: each is floored by
    the same clock), or for etcd the same cluster throughout: its fences are its
    revisions, which grow within one cluster only; the killed member has rejoined, so the
    next trial kills whichever member leads then."""
    if tier != "etcd":
        yield lambda home: _pair(tier, home, option, lag)
        return
    trio = EtcdTrio()
    try:
        yield lambda home: contextlib.nullcontext(trio)
    finally:
        trio.close()


def failover_run(tier: str, option: int, trials: int = 4, clients: int = 5, seed: int = 1,
                 lag: float = LAG, lead: float = 1.0, settle: float = 2.0) -> Outcome:  # fmt: skip
    """``trials`` failovers, each on a fresh pair (etcd: on one cluster): ``clients``
    processes stream grants for ``lead`` seconds, the primary is killed just after the
    next grant (``Grants``), the standby promoted (etcd: a leader elected), the killed node
    rejoins as the new standby, and the clients go on for ``settle`` seconds. ``option``
    is ``replicas=`` (Redis) or synchronous (1) / asynchronous (0) commit (PostgreSQL).
    One history and one fenced store for every trial: the trials do not overlap in time,
    and their fences only grow (``_pairs``)."""
    workdir = Path(tempfile.mkdtemp(prefix=f"failover-{tier}-{option}-"))
    hist = workdir / "history"
    hist.mkdir()
    store = f"sqlite://{workdir / 'store.sqlite'}"
    rec = history.Recorder(hist, "nemesis")
    rec("start")
    with _pairs(tier, option, lag) as pair_for:
        for trial in range(trials):
            _trial(pair_for, workdir / f"trial{trial}", trial, rec, hist, store, clients,
                   seed, lead, settle)  # fmt: skip
    rec("exit")
    fenced = open_store(store)
    log = fenced.log()
    fenced.close()
    events = history.load(hist)
    spec = checker.Spec(records_kept=True, acquire_slack=3.0, release_slack=4.0)
    anomalies = checker.check(events, log, spec)
    figures = checker.figures(events, anomalies)
    figures["failed"] = sum(e["op"] == "failed" for e in events)
    return Outcome(tier, _setup(tier, option), trials, figures, anomalies,
                   _after(events, "granted"), _after(events, "promoted"), workdir,
                   Counter(a.kind for a in anomalies), _held_twice(events),
                   [e.get("after") for e in events if e["op"] == "fault"
                    and e["kind"] == "primary-kill"])  # fmt: skip


def _held_twice(events: list[history.Event]) -> list[float | None]:
    """Per kill of a primary: was the next grant of the waited key made inside the live
    lease of the grant the primary died after, and how long before that lease's end
    (its holder's release, or its believed deadline, whichever came first)?"""
    grants = [e for e in events if e["op"] == "granted" and e["key"] == WAITED]
    by_id = {e["id"]: e for e in grants}
    released = {e["id"]: e for e in events if e["op"] == "released"}
    found: list[float | None] = []
    for kill in (e for e in events if e["op"] == "fault" and e["kind"] == "primary-kill"):
        first = by_id.get(kill.get("after"))
        if first is None:
            found.append(None)
            continue
        end = first["deadline"]
        if first["id"] in released:
            end = min(end, released[first["id"]]["t0"])
        later = [e["t"] for e in grants if e["t"] > first["t"] and e["id"] != first["id"]]
        second = min(later, default=float("inf"))
        found.append(end - second if second < end else None)
    return found


def _trial(pair_for: PairFor, home: Path, trial: int, rec: history.Recorder, hist: Path,
           store: str, clients: int, seed: int, lead: float, settle: float) -> None:  # fmt: skip
    """One failover: clients stream, the primary dies just after a grant, the standby is
    promoted, the killed node rejoins, the clients go on until a grant came after it."""
    home.mkdir()
    with pair_for(home) as pair:
        pair.wait_in_sync()
        stop = home / "stop"
        procs = _clients(pair, home, hist, store, stop, clients, seed + trial)
        try:
            watch = Grants(hist, home.name)
            watch.wait_started(clients + WAITERS)
            time.sleep(lead)
            granted = watch.next_grant(key=WAITED, timeout=15)
            port = pair.kill_primary()
            rec("fault", kind="primary-kill", target="server", port=port, trial=trial,
                after=granted)  # fmt: skip
            new = pair.promote()
            rec("promoted", target="server", port=new)
            pair.rejoin()
            pair.wait_in_sync()
            rec("rejoined", target="server", port=port)
            time.sleep(settle)
            # Go on until a grant came after the kill, so the trial's pause is
            # measured, not cut off (keys whose release failed in the outage stay
            # held for their lease; with replicas=1 that outlasted the 2 s settle).
            watch.next_grant(timeout=30)
        finally:
            stop.touch()
            for proc in procs:
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    rec("unended", target=proc.pid, name=str(proc.args[-1]))
                    proc.kill()
                    proc.wait(10)


class Grants:
    """Reads a trial's client histories as they are written: the kill is timed to land
    just after a grant (the worst moment: the grant's write is still on its way to the
    standby), not at a random one, where loopback replication would almost never lag."""

    def __init__(self, hist: Path, prefix: str) -> None:
        self.hist, self.prefix = hist, prefix
        self.read: dict[Path, int] = {}

    def _new(self) -> Iterator[history.Event]:
        for path in sorted(self.hist.glob(f"{self.prefix}.*.jsonl")):
            with open(path, "rb") as f:
                f.seek(self.read.get(path, 0))
                chunk = f.read()
            whole = chunk[: chunk.rfind(b"\n") + 1]
            self.read[path] = self.read.get(path, 0) + len(whole)
            for line in whole.splitlines():
                yield json.loads(line)

    def wait_started(self, clients: int, timeout: float = 60) -> None:
        started, deadline = 0, time.monotonic() + timeout
        while started < clients and time.monotonic() < deadline:
            started += sum(e["op"] == "start" for e in self._new())
            time.sleep(0.02)

    def next_grant(self, key: str | None = None, timeout: float = 10) -> str | None:
        """Wait for a grant (of ``key``, if given) recorded from now on; its op id (None:
        none came)."""
        list(self._new())  # what is there already is not "next"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for e in self._new():
                if e["op"] == "granted" and key in (None, e["key"]):
                    return str(e["id"])
            time.sleep(0.002)
        return None


def _setup(tier: str, option: int) -> str:
    if tier == "redis-sentinel":
        return f"replicas={option}" if option else "no replicas="
    if tier == "etcd":
        return "3 members, leader kill"
    return "synchronous standby" if option else "asynchronous standby"


def _clients(pair: Pair, home: Path, hist: Path, store: str, stop: Path, clients: int,
             seed: int) -> list[subprocess.Popen[bytes]]:  # fmt: skip
    base = {**WORKLOAD, "seed": seed, "history": str(hist), "cache": pair.client_cache(),
            "store": store, "stop": str(stop), "until": time.monotonic() + 600}  # fmt: skip
    waiter = {**base, **WAITER, "seed": seed}
    procs = []
    names = [(f"{home.name}.w{i}", base) for i in range(clients)]
    names += [(f"{home.name}.waiter{i}", waiter) for i in range(WAITERS)]
    for name, cfg in names:
        path = home / f"{name}.json"
        path.write_text(json.dumps({**cfg, "name": name}))
        with open(home / f"{name}.log", "wb") as log:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "nemesis.workload", str(path)], env=ENV,
                cwd=nemesis.ROOT, stdout=log, stderr=subprocess.STDOUT,
            ))  # fmt: skip
    return procs


def _after(events: list[history.Event], op: str) -> list[float]:
    """Per kill of a primary, the seconds until the next ``op`` event."""
    times = [e["t"] for e in events if e["op"] == op]
    kills = [e["t"] for e in events if e["op"] == "fault" and e["kind"] == "primary-kill"]
    return [min((t for t in times if t > k), default=float("inf")) - k for k in kills]


def cleanup(outcome: Outcome) -> None:
    shutil.rmtree(outcome.workdir, ignore_errors=True)


if __name__ == "__main__":
    tier, option = sys.argv[1], int(sys.argv[2])
    runs = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    lag = float(sys.argv[4]) if len(sys.argv) > 4 else LAG
    outcome = failover_run(tier, option, runs, lag=lag)
    print(HEADER)
    print(outcome.row())
    print(LEGEND)
    for a in outcome.anomalies[:20]:
        print("  ", a)
    print(outcome.workdir)
