"""Demo: two ``celery beat`` processes side by side, each tick still runs once.

    python examples/beat_demo.py          # Redis at REDIS_URL (default redis://127.0.0.1:6379/0)

It starts a ``celery worker -P prefork -c 2`` and two ``celery beat`` processes with
``beat_scheduler = "celery_mutex.beat:MutexScheduler"`` on this module, with one entry
every second, for about 8 s. Both beats stay active: for each tick they race for one
claim in Redis and only the winner sends. It prints, per tick, how many times it ran
(all 1) and which beat sent it, and exits 1 if a tick in the window ran twice or not at all.
"""

from __future__ import annotations

import collections
import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import redis
from celery import Celery

HERE = Path(__file__).resolve().parent
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
RUN = os.environ.setdefault("BEAT_DEMO_RUN", uuid.uuid4().hex[:8])
RUNS = f"beat-demo-{RUN}.runs"  # a Redis list: one JSON line per run

app = Celery("beat_demo", set_as_current=False)
app.conf.update(
    broker_url=REDIS_URL,
    result_backend=REDIS_URL,
    mutex_cache=REDIS_URL,  # where the beats claim their ticks
    mutex_prefix=f"beat-demo-{RUN}.",
    beat_scheduler="celery_mutex.beat:MutexScheduler",  # the one line that enables it
    beat_schedule={"tick": {"task": "beat_demo.tick", "schedule": dt.timedelta(seconds=1)}},
    task_default_queue=f"beat-demo-{RUN}",
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
)


@app.task(bind=True, name="beat_demo.tick")
def tick(self: Any) -> None:
    row = {"slot": getattr(self.request, "mutex_beat_slot", None), "origin": self.request.origin}
    redis.Redis.from_url(REDIS_URL).rpush(RUNS, json.dumps(row))


def _celery(*argv: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "beat_demo", *argv, "-l", "INFO"],
            cwd=HERE,
            stdout=subprocess.DEVNULL,
            stderr=out,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)])},
        )


def _slot(epoch: int) -> str:
    return "tick@" + dt.datetime.fromtimestamp(epoch, dt.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ"
    )


def _epoch(slot: str) -> int:
    moment = dt.datetime.strptime(slot.removeprefix("tick@"), "%Y-%m-%dT%H:%M:%SZ")
    return int(moment.replace(tzinfo=dt.timezone.utc).timestamp())


def _beat_of(origin: str | None, beats: dict[str, str]) -> str:
    """Which beat sent a tick: Celery names a sender "gen<pid>@<host>"."""
    for prefix, name in beats.items():
        if (origin or "").startswith(prefix):
            return name
    return origin or "-"


def main() -> int:
    print("Part 3: two celery beat processes side by side (MutexScheduler): each tick runs once")
    record = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    record.ping()  # no Redis: fail here, with redis-py's message
    tmp = Path(tempfile.mkdtemp(prefix="beat-demo-"))
    procs = [
        _celery(
            "worker", "-P", "prefork", "-c", "2", "--without-gossip", "--without-mingle",
            log=tmp / "worker.log",
        )
    ]  # fmt: skip
    started = time.time()
    try:
        for n in (1, 2):
            procs.append(
                _celery(
                    "beat", "-s", str(tmp / f"beat-{n}"), "--pidfile", str(tmp / f"beat-{n}.pid"),
                    log=tmp / f"beat-{n}.log",
                )
            )  # fmt: skip
        time.sleep(8)
        stopped = time.time()
    finally:
        for proc in reversed(procs):  # beats first, then the worker drains
            if proc is procs[0]:
                time.sleep(1.5)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    rows = [json.loads(line) for line in record.lrange(RUNS, 0, -1)]
    leftovers = [*record.scan_iter(match=f"{{beat-demo-{RUN}.*")]  # claims, fence counters
    leftovers += [*record.scan_iter(match=f"_kombu.binding*.beat-demo-{RUN}")]
    record.delete(RUNS, f"beat-demo-{RUN}", *leftovers)
    counts = collections.Counter(row["slot"] for row in rows)
    beats = {f"gen{proc.pid}@": f"beat-{n}" for n, proc in enumerate(procs[1:], start=1)}
    senders = {row["slot"]: _beat_of(row["origin"], beats) for row in rows}
    logs = {n: (tmp / f"beat-{n}.log").read_text() for n in (1, 2)}
    claims = {n: log.count(" claimed tick@") for n, log in logs.items()}
    # The window opens at the first tick a beat claimed: a loaded machine starts the beats
    # late, and a tick before either was up is not one the guard could run or miss.
    claimed = re.findall(r" claimed (tick@\S+)", logs[1] + logs[2])
    first = min((_epoch(slot) for slot in claimed), default=int(stopped))
    window = [_slot(s) for s in range(max(first, int(started)), int(stopped))]
    print(f"redis     : {REDIS_URL}")
    print(f"beats     : 2, both active; ticks claimed: beat-1 {claims[1]}, beat-2 {claims[2]}")
    print("tick (UTC)                runs  sent by")
    for slot in window:
        print(f"{slot:<26}{counts[slot]:>4}  {senders.get(slot, '-')}")
    doubled = sorted(s for s, n in counts.items() if n > 1)
    missed = [s for s in window if counts[s] == 0]
    print(f"doubled   : {doubled or 'none'}")
    print(f"missed    : {missed or 'none'}")
    return 0 if window and not doubled and not missed and None not in counts else 1


if __name__ == "__main__":
    sys.exit(main())
