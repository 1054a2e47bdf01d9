"""Job functions for ``tests/rq_mutex/test_rq.py``, importable by worker processes.

Every job records what it saw in Redis (db 12) under ``rqt:<run>:...`` so the test process
can check it: intervals as ``time.monotonic()`` (one clock for every process on Linux),
the pid that ran, the fence of its lease.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import redis
from rq import Retry, get_current_job
from rq.decorators import job

from rq_mutex import current_lease, mutex_job

REDIS_URL = "redis://127.0.0.1:6379/12"
_connection = redis.Redis.from_url(REDIS_URL)


def _redis() -> redis.Redis:
    current = get_current_job()
    return current.connection if current is not None else _connection


def _record(run: str, what: str, **fields: Any) -> None:
    lease = current_lease()
    fields.update(
        pid=os.getpid(),
        key=lease.key if lease else None,
        fence=lease.fence if lease else None,
    )
    _redis().rpush(f"rqt:{run}:{what}", json.dumps(fields))


def held(run: str) -> str:
    """While this key exists, a critical section that began waits (up to 60 s) before its
    ``hold``: a test enqueueing a burst behind a first job sets it first and deletes it
    once every job was enqueued, so the burst is behind that job however slow the sends."""
    return f"rqt:{run}:held"


def _section(run: str, name: str, hold: float, **fields: Any) -> None:
    """A critical section: counts holders inside it, to catch an overlap directly too."""
    conn = _redis()
    inside = conn.incr(f"rqt:{run}:inside:{name}")
    start = time.monotonic()
    deadline = start + 60
    while conn.exists(held(run)) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(hold)
    end = time.monotonic()
    conn.decr(f"rqt:{run}:inside:{name}")
    _record(run, "log", name=name, start=start, end=end, inside=inside, **fields)


FAST_RETRY = {"countdown": 1, "backoff": 1, "jitter": False}


@mutex_job(key="ser.{run}.{entity}", on_busy="retry", retry=FAST_RETRY, lease=10)
def serialized(run: str, entity: str, item: int, hold: float = 0.1) -> int:
    _section(run, entity, hold, item=item)
    return item


@mutex_job(key="ser.{run}.{entity}", on_busy="retry", retry=FAST_RETRY, lease=10)
async def serialized_async(run: str, entity: str, item: int, hold: float = 0.1) -> int:
    """``serialized`` as an ``async def`` job (RQ runs its coroutine)."""
    conn = _redis()
    inside = conn.incr(f"rqt:{run}:inside:{entity}")
    start = time.monotonic()
    await asyncio.sleep(hold)
    end = time.monotonic()
    conn.decr(f"rqt:{run}:inside:{entity}")
    _record(run, "log", name=entity, start=start, end=end, inside=inside, item=item)
    return item


@mutex_job(key="lose.{run}", lease=1, renew=True)
async def lose_lease_async(run: str) -> str:
    """Delete our own lock record, then wait: the next renewal finds it gone, and the
    coroutine must be cancelled long before its sleep ends."""
    conn = _redis()
    # Recorded first: the renewal may find the record gone before a line after the delete.
    _record(run, "log", stage="deleting")
    for name in conn.scan_iter(match=f"*lose.{run}*"):
        conn.delete(name)
    await asyncio.sleep(8)
    _record(run, "log", stage="finished")  # must never be reached
    return "ran"


@mutex_job(key="ser.{run}.{entity}", on_busy="retry", retry={"max": 0})
def serialized_no_retry(run: str, entity: str, item: int) -> int:
    _section(run, entity, 0.0, item=item)
    return item


@mutex_job(key="skip.{run}", on_busy="skip")
def skipper(run: str, hold: float = 0.0) -> str:
    _section(run, "skip", hold)
    return "ran"


@mutex_job(key="raise.{run}", on_busy="raise")
def raiser(run: str) -> str:
    _record(run, "log")
    return "ran"


@mutex_job(key="wait.{run}", on_busy="wait", timeout=5)
def waiter(run: str) -> str:
    _record(run, "log")
    return "ran"


@mutex_job(key="retry.{run}", on_busy="retry", retry=FAST_RETRY)
def retrier(run: str) -> str:
    _record(run, "log")
    return "ran"


@mutex_job(
    key="retry.{run}",
    on_busy="retry",
    retry={"countdown": 0.1, "backoff": 1, "jitter": False, "max": 3},
)
def retry_briefly(run: str) -> str:
    """Three busy retries of 0.1 s: synchronously, a 0.3 s wait."""
    _record(run, "log")
    return "ran"


@mutex_job(key="lose.{run}", lease=1, renew=True)
def lose_lease(run: str) -> str:
    """Delete our own lock record from Redis, then busy-loop: the next renewal finds it
    gone, and the body must be interrupted long before the loop ends."""
    conn = _redis()
    # Recorded first: under load the renewal found the record gone, and interrupted the
    # body, before it could record anything after the delete.
    _record(run, "log", stage="deleting")
    for name in conn.scan_iter(match=f"*lose.{run}*"):
        if not name.endswith(b":meta"):
            conn.delete(name)
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        sum(range(1000))  # Python bytecode: where the interrupt lands
    _record(run, "log", stage="finished")  # must never be reached
    return "ran"


@mutex_job(key="hold.{run}", lease=2, renew=True)
def hold_forever(run: str) -> str:
    """Report our pid and fence, then hold the lock (renewed) until killed."""
    _record(run, "held")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(0.05)
    return "held"


@mutex_job(key="kw.{run}.{a}.{b}", on_busy="skip")
def keyed(run: str, a: int, b: int = 2) -> int:
    _record(run, "log", a=a, b=b)
    return a + b


@mutex_job(key="fixed.{run}", lease=5, renew=False)
def fixed_lease(run: str) -> str:
    _record(run, "log")
    return "ran"


@job("rqt-stacked", connection=_connection)
@mutex_job(key="st1.{run}", on_busy="skip")
def stacked_job_outer(run: str) -> str:
    _record(run, "log", which="job-outer")
    return "ran"


@mutex_job(key="st2.{run}", on_busy="skip")
@job("rqt-stacked", connection=_connection)
def stacked_mutex_outer(run: str) -> str:
    _record(run, "log", which="mutex-outer")
    return "ran"


@mutex_job(key="tick.{run}", on_busy="skip")
def ticked(run: str) -> str:
    """The cron job: records which tick it ran for."""
    current = get_current_job()
    _record(run, "ticks", tick=current.meta.get("rq_mutex_tick") if current else None)
    return "ran"


@mutex_job(key="cleanup.{run}.{table}", on_busy="skip")
def cleanup(run: str, table: str) -> str:
    """A cron job registered several times under one name, once per table."""
    current = get_current_job()
    tick = current.meta.get("rq_mutex_tick") if current else None
    _record(run, "cleanups", table=table, tick=tick)
    return table


@mutex_job(key="sleep.{run}")
def sleeper(run: str, seconds: float) -> str:
    _record(run, "log", stage="started")
    time.sleep(seconds)
    _record(run, "log", stage="finished")
    return "slept"


@mutex_job(key="sem.{run}", on_busy="skip", permits=2)
def two_at_a_time(run: str) -> str:
    _record(run, "log")
    return "ran"


def _start_attempt(run: str) -> tuple[redis.Redis, int]:
    """Count and record an attempt (a run of the body) with its lease."""
    conn = _redis()
    attempt = int(conn.incr(f"rqt:{run}:count"))
    lease = current_lease()
    expires = lease.expires_at.timestamp() if lease else None
    _record(run, "attempts", attempt=attempt, at=time.time(), expires=expires)
    return conn, attempt


def _still_holding(conn: redis.Redis, run: str, deadline: float) -> bool:
    if conn.exists(f"rqt:{run}:go"):
        return False
    if time.monotonic() > deadline:
        raise TimeoutError("nobody killed or released this attempt")
    return True


@mutex_job(key="again.{run}", on_busy="skip", lease=30)
def hold_on_attempts(run: str, holds: tuple[int, ...] = (1,)) -> str:
    """Counts its attempts in Redis and records each with its lease; an attempt whose
    number is in ``holds`` keeps the lock until killed or until the test sets
    ``rqt:<run>:go``; the others return at once with the real result."""
    conn, attempt = _start_attempt(run)
    deadline = time.monotonic() + 60
    while attempt in holds and _still_holding(conn, run, deadline):
        time.sleep(0.05)
    _record(run, "done", attempt=attempt)
    return f"attempt {attempt}"


@mutex_job(key="again.{run}", on_busy="wait", lease=30)
def hold_on_attempts_waiting(run: str, holds: tuple[int, ...] = (1,)) -> str:
    """``hold_on_attempts`` with on_busy="wait" (no timeout)."""
    return hold_on_attempts.__wrapped__(run, holds)  # type: ignore[attr-defined, no-any-return]


@mutex_job(key="again.{run}", on_busy="skip", lease=30)
async def hold_on_attempts_async(run: str, holds: tuple[int, ...] = (1,)) -> str:
    """``hold_on_attempts`` as an ``async def`` job."""
    conn, attempt = _start_attempt(run)
    deadline = time.monotonic() + 60
    while attempt in holds and _still_holding(conn, run, deadline):
        await asyncio.sleep(0.05)
    _record(run, "done", attempt=attempt)
    return f"attempt {attempt}"


# -- on_busy="queue" (tests/rq_mutex/test_rq_line.py) -------------------------------------

LINE = {"sweep_every": 1, "gap_for": 4}


@mutex_job(key="line.{run}.{entity}", on_busy="queue", lease=6, queue=LINE)
def in_line(run: str, entity: str, item: int, hold: float = 0.05, fail: bool = False) -> int:
    """One call of an entity's line: its section is recorded, so order, overlap and
    exactly-once can be checked; ``fail`` raises after it. Its start is recorded too (the
    horse's pid, to kill it mid-run)."""
    _record(run, "started", name=entity, item=item, at=time.monotonic())
    _section(run, entity, hold, item=item)
    if fail:
        raise RuntimeError(f"item {item} fails, as told")
    return item


@mutex_job(key="line.{run}.{entity}", on_busy="queue", lease=6, queue={**LINE, "max": 3})
def in_short_line(run: str, entity: str, item: int, hold: float = 0.05) -> int:
    _section(run, entity, hold, item=item)
    return item


@mutex_job(
    key="line.{run}.{entity}", on_busy="queue", lease=6, queue={**LINE, "max": 2, "on_full": "skip"}
)
def in_line_or_skip(run: str, entity: str, item: int, hold: float = 0.05) -> int:
    _section(run, entity, hold, item=item)
    return item


@mutex_job(key="line.{run}.{entity}", on_busy="queue", lease=6, queue=LINE)
def in_line_flaky(run: str, entity: str, item: int, hold: float = 0.05) -> int:
    """Fails its first attempt (RQ retries it, under ``retry=Retry(...)``), then returns."""
    attempt = _redis().incr(f"rqt:{run}:attempt:{entity}:{item}")
    _section(run, entity, hold, item=item, attempt=attempt)
    if attempt == 1:
        raise RuntimeError("first attempt fails")
    return item


# The same line with the locks and lines in PostgreSQL and in a DiskCache (the lock cache
# is opened when a job first runs, so importing this module connects to nothing).
PG_LINE = os.environ.get("POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
PG_LINE += ("&" if "?" in PG_LINE else "?") + "table=rqt_line_locks"
DISK_LINE = "file:///tmp/rqt-line-disk"


@mutex_job(key="line.{run}.{entity}", on_busy="queue", lease=6, queue=LINE, cache=PG_LINE)
def in_pg_line(run: str, entity: str, item: int, hold: float = 0.05) -> int:
    _redis().set(f"rqt:{run}:pid:{entity}:{item}", os.getpid(), ex=300)
    _section(run, entity, hold, item=item)
    return item


@mutex_job(key="line.{run}.{entity}", on_busy="queue", lease=6, queue=LINE, cache=DISK_LINE)
def in_disk_line(run: str, entity: str, item: int, hold: float = 0.05) -> int:
    _section(run, entity, hold, item=item)
    return item


# -- keep latest and debounce (tests/rq_mutex/test_rq_line.py) ----------------------------


@mutex_job(key="latest.{run}.{entity}", on_busy="latest", lease=6, queue=LINE)
def latest_of(run: str, entity: str, item: int, hold: float = 0.05) -> int:
    """Keep latest: one runs, one waits; the newest enqueue takes the waiting place."""
    _record(run, "started", name=entity, item=item, at=time.monotonic())
    _section(run, entity, hold, item=item)
    return item


DEBOUNCE = {"period": 1.0, "max_delay": 3.0}


@mutex_job(key="deb.{run}.{entity}", on_busy="debounce", debounce=DEBOUNCE, lease=6, queue=LINE)
def debounced(run: str, entity: str, item: int, hold: float = 0.05) -> int:
    """Debounce: one run per burst, a period after its last enqueue, at most max_delay
    after its first; its start is recorded on the wall clock (the test's enqueue times)."""
    _record(run, "started", name=entity, item=item, at=time.monotonic(), wall=time.time())
    _section(run, entity, hold, item=item)
    return item


@mutex_job(key="line.{run}.{entity}", on_busy="queue", lease=6, queue=LINE)
def in_line_asks_again(run: str, entity: str, item: int, hold: float = 0.05) -> Any:
    """Returns ``rq.Retry(max=1)`` from its first attempt (RQ runs it once more), then
    its item."""
    attempt = _redis().incr(f"rqt:{run}:attempt:{entity}:{item}")
    _section(run, entity, hold, item=item, attempt=attempt)
    return Retry(max=1, interval=1) if attempt == 1 else item


# -- rq cron's overlap choice (tests/rq_mutex/test_rq_line.py) ----------------------------


def _tick_section(run: str) -> str:
    _record(run, "started", name="tick", item=0, at=time.monotonic())
    _section(run, "tick", 2.5, item=0)
    return "ran"


@mutex_job(key="overlap.{run}", on_busy="skip", lease=10)
def tick_or_skip(run: str) -> str:
    """A periodic job longer than its period: a tick while it runs is skipped."""
    return _tick_section(run)


@mutex_job(key="overlap.{run}", on_busy="latest", lease=10, queue=LINE)
def tick_or_buffer(run: str) -> str:
    """The same, buffering one tick (keep latest): it runs as soon as the last ends."""
    return _tick_section(run)
