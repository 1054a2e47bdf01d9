"""``on_busy="queue"`` under real ``celery worker -P prefork`` subprocesses: tasks of one
key run one at a time, in send order, each once, and a task whose turn has not come is
parked (its slot free) and published again in its turn. Also when a task raises, retries
itself, is revoked, when its pool child is SIGKILLed and when its whole worker is.

Needs Redis at 127.0.0.1:6379 (lock cache, result backend, records) and, for the AMQP
cases, RabbitMQ at 127.0.0.1:5672. A missing server fails the tests; it never skips them.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celery_support.line_app  # noqa: F401  (its shared tasks join the producer)
import psycopg
import pytest
from caches.test_postgres import POSTGRES_URL, with_query
from celery import Celery
from celery.exceptions import TaskRevokedError
from celery_support import line_app
from celery_support.line_app import LINE, MAX_DELAY, PERIOD, SECTION
from celery_support.processes import REDIS_URL, Processes
from servers import PostgresServer, RedisServer, free_port
from workers import wait_until

# isort: split
from celery_mutex import is_skipped

AMQP_URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
GET = 60

pytestmark = pytest.mark.integrations

MODULE = "celery_support.line_app"


class Line(Processes):
    """Prefork workers of ``celery_support.line_app`` and a producer of its tasks (the
    sending side takes each call's ticket: it sends through the MutexTask itself)."""

    def __init__(self, tmp: Path, broker: str, cache: str = REDIS_URL) -> None:
        super().__init__(MODULE, tmp, broker)
        self.env["CM_CACHE"] = cache  # the locks and the lines; runs are recorded in Redis
        self.producer = Celery("producer", set_as_current=False)
        self.producer.conf.update(
            broker_url=broker,
            result_backend=REDIS_URL,
            task_default_queue=self.queue,
            mutex_cache=cache,
            mutex_prefix=self.prefix,
        )
        # line_app's tasks are shared: the producer has them too, under its own conf.
        self.producer.loader.import_default_modules()

    def task(self, name: str) -> Any:
        return self.producer.tasks[f"{MODULE}.{name}"]

    def runs(self, run: str) -> list[tuple[int, int, str, float, int]]:
        """(entity, n, "start" | "end", wall time, pid) of every run, in record order."""
        raw = self.record.lrange(f"{self.prefix}runs.{run}", 0, -1)
        return [tuple(json.loads(entry)) for entry in raw]  # type: ignore[misc]

    def starts(self, run: str) -> dict[int, list[int]]:
        """Per entity, the n of each start, in the order they started."""
        found: dict[int, list[int]] = defaultdict(list)
        for entity, n, what, _, _ in self.runs(run):
            if what == "start":
                found[entity].append(n)
        return found

    def overlaps(self, run: str, killed: int | None = None) -> list[str]:
        """Runs of one entity that overlapped in time (a start before the last end);
        ``killed``: a run that died with no end (its key was freed for it)."""
        open_: dict[int, int | None] = {}
        found = []
        for entity, n, what, _, _ in self.runs(run):
            if n == killed:
                continue
            if what == "start":
                if open_.get(entity) not in (None, n):  # n again: a killed run's copy
                    found.append(f"entity {entity}: {n} started while {open_[entity]} ran")
                open_[entity] = n
            elif open_.get(entity) == n:
                open_[entity] = None
        return found


def _line(
    broker: str, workers: int = 2, concurrency: int = 2, cache: str | None = None
) -> Iterator[Line]:
    with tempfile.TemporaryDirectory() as tmp:
        line = Line(Path(tmp), broker, cache or REDIS_URL)
        for i in range(workers):
            line.start_worker(f"w{i}", concurrency)
        try:
            yield line
        finally:
            line.stop()


@pytest.fixture(scope="module", params=["redis", "amqp"])
def line(request: pytest.FixtureRequest) -> Iterator[Line]:
    """Two prefork workers of two processes each (four slots), on Redis or RabbitMQ."""
    yield from _line(REDIS_URL if request.param == "redis" else AMQP_URL)


@pytest.fixture
def run() -> str:
    return uuid.uuid4().hex[:10]


def test_twenty_keys_of_ten_tasks_run_in_send_order_each_once(line: Line, run: str) -> None:
    """200 tasks over 20 keys, sent interleaved to four slots: every key's tasks start in
    send order, each exactly once, never two of one key at once; every result arrives."""
    _twenty_keys_of_ten(line, run, [(e, n) for n in range(10) for e in range(20)])


def _twenty_keys_of_ten(line: Line, run: str, sends: list[tuple[int, int]]) -> None:
    """Send ``step`` for each (entity, n) in this order; assert every key's calls started
    in send order, each once, none overlapping, every result back."""
    step = line.task("step")
    results = [step.apply_async((run, e, n)) for e, n in sends]
    assert [r.get(timeout=GET) for r in results] == [n for _, n in sends]
    starts = line.starts(run)
    assert {e: starts[e] for e in range(20)} == {e: list(range(10)) for e in range(20)}
    assert line.overlaps(run) == []


def test_a_busy_key_holds_no_slot(line: Line, run: str) -> None:
    """One key held for 3 s with six of its calls behind it (more than the four slots):
    the other keys' twelve calls all finish while it is still held, since the six wait
    parked, not in slots (with on_busy="wait" they would fill every slot)."""
    step = line.task("step")
    head = step.apply_async((run, 0, 0, 3.0))
    wait_until(lambda: line.starts(run).get(0), 20, "the long head to start")
    followers = [step.apply_async((run, 0, n)) for n in range(1, 7)]
    others = [step.apply_async((run, e, 0)) for e in range(1, 13)]
    for other in others:
        other.get(timeout=GET)
    assert not head.ready(), "the others should finish while the head still runs"
    head.get(timeout=GET)
    assert [f.get(timeout=GET) for f in followers] == list(range(1, 7))
    assert line.starts(run)[0] == list(range(7))
    assert line.overlaps(run) == []


def test_a_task_that_raises_passes_the_turn_on(line: Line, run: str) -> None:
    failing = line.task("step_or_fail")
    results = [failing.apply_async((run, 0, n, 3)) for n in range(8)]
    for n, result in enumerate(results):
        if n == 3:
            with pytest.raises(ValueError, match="task 3 fails"):
                result.get(timeout=GET)
        else:
            assert result.get(timeout=GET) == n
    assert line.starts(run)[0] == list(range(8))
    assert line.overlaps(run) == []


@pytest.mark.parametrize("name", ["step_or_retry", "step_or_reject"])
def test_a_call_that_comes_again_keeps_its_turn(line: Line, run: str, name: str) -> None:
    """Call 2's first attempt comes again, by Task.retry (a 0.5 s countdown) or by
    Reject(requeue=True) under acks_late (its message goes back to the queue): neither
    ends its turn, so it runs again before the calls sent after it, already waiting."""
    again = line.task(name)
    results = [again.apply_async((run, 0, n, 2)) for n in range(5)]
    assert [r.get(timeout=GET) for r in results] == list(range(5))
    assert line.starts(run)[0] == [0, 1, 2, 2, 3, 4]
    assert line.overlaps(run) == []


def test_a_revoked_task_is_stepped_over(line: Line, run: str) -> None:
    """A call revoked while it waits in the line is stepped over when its turn comes; the
    others run in order. The head holds until both workers have the revoke (a loaded
    machine once delivered call 3 before its revoke reached the worker)."""
    step = line.task("step")
    held = line_app.held(line.prefix, run)
    line.record.set(held, 1, ex=120)
    try:
        head = step.apply_async((run, 0, 0))
        wait_until(lambda: line.starts(run).get(0), 20, "the head to start")
        rest = {n: step.apply_async((run, 0, n)) for n in range(1, 6)}
        # Until both of this line's workers answered (a reply can be lost: a revoke again
        # is the same revoke; other tests' workers on the same broker answer too).
        mine = {f"w{i}-{line.run}@" for i in range(2)}
        answered: set[str] = set()
        deadline = time.monotonic() + 60
        while answered != mine and time.monotonic() < deadline:
            replies = line.producer.control.revoke(rest[3].id, reply=True, timeout=3)
            names = [name for reply in replies for name in reply]
            answered |= {prefix for prefix in mine for name in names if name.startswith(prefix)}
        assert answered == mine, answered
    finally:
        line.record.delete(held)
    head.get(timeout=GET)
    for n in (1, 2, 4, 5):
        assert rest[n].get(timeout=GET) == n
    assert line.starts(run)[0] == [0, 1, 2, 4, 5]


@pytest.mark.parametrize("parks", ["at the send", "at a worker", "behind a quiet task"])
def test_a_call_that_expires_while_parked_ends_revoked_and_never_runs(
    line: Line, run: str, parks: str
) -> None:
    """Call 1, sent with ``expires=1`` behind a 3 s head, expires while it waits: when
    its turn comes it ends REVOKED ("expired") without running, and call 2 runs next. A
    relative expires counts from the send: parked at the send, it once counted again
    from the publish and the call ran 3 s after it expired. "At a worker": a countdown
    sends it through the broker, and it parks as it arrives. "Behind a quiet task": the
    head is another task of the key that stores no result (the expiry is the parked
    call's own to store)."""
    step = line.task("step")
    first = line.task("step_quietly") if parks == "behind a quiet task" else step
    head = first.apply_async((run, 0, 0, 3.0))
    wait_until(lambda: line.starts(run).get(0), 20, "the head to start")
    through_broker = {"countdown": 0.1} if parks == "at a worker" else {}
    expiring = step.apply_async((run, 0, 1), expires=1, **through_broker)
    after = step.apply_async((run, 0, 2))
    assert after.get(timeout=GET) == 2
    if first is step:
        assert head.get(timeout=GET) == 0
    with pytest.raises(TaskRevokedError, match="expired"):
        expiring.get(timeout=GET)
    assert line.starts(run)[0] == [0, 2]


def test_a_pool_child_killed_mid_line_passes_the_turn_on(line: Line, run: str) -> None:
    """Call 2's pool child SIGKILLs itself mid-run: the worker's parent frees its key and
    ends its turn; the rest run in order, once each, and call 2 does not run again
    (early ack: at most once)."""
    dying = line.task("step_or_die")
    results = [dying.apply_async((run, 0, n, 2)) for n in range(6)]
    for n, result in enumerate(results):
        if n == 2:
            with pytest.raises(Exception, match=r"WorkerLost|exited prematurely|signal 9"):
                result.get(timeout=GET)
        else:
            assert result.get(timeout=GET) == n
    assert line.starts(run)[0] == list(range(6))
    assert line.overlaps(run, killed=2) == []


# -- the other tiers ------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["postgres", "disk"])
def tier_line(request: pytest.FixtureRequest) -> Iterator[Line]:
    """Four slots on a Redis broker, the locks and lines in PostgreSQL or a DiskCache."""
    with tempfile.TemporaryDirectory() as locks:
        if request.param == "postgres":
            table = f"t{uuid.uuid4().hex[:8]}_locks"
            cache = with_query(POSTGRES_URL, table=table)
        else:
            cache = f"file://{locks}"
        yield from _line(REDIS_URL, cache=cache)
        if request.param == "postgres":
            with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
                conn.execute(f'DROP TABLE IF EXISTS "{table}"')


def test_every_tier_keeps_the_line(tier_line: Line, run: str) -> None:
    """The same 20 keys x 10 tasks, sent in bursts (each key's ten together), with the
    locks and lines in PostgreSQL and DiskCache: send order, each once, no overlap."""
    _twenty_keys_of_ten(tier_line, run, [(e, n) for e in range(20) for n in range(10)])


# -- a whole worker SIGKILLed ----------------------------------------------------------------


def _kill_tree(main: int) -> None:
    """SIGKILL a worker's main process and its pool children at once (a lost machine)."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    ppid = int(stat.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == main:
                children.append(int(entry))
    for pid in [main, *children]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def amqp_line() -> Iterator[Line]:
    """Workers on RabbitMQ, started by the test (none yet): a killed worker's unacked
    messages go back to the queue as its connection drops."""
    yield from _line(AMQP_URL, workers=0)


def _running_on_w0(line: Line, task: Any, run: str, what: str) -> Any:
    """w0 starts and runs ``what``, the first call of ``task`` (6 s); once it started, w1
    starts too. The first call's result."""
    line.start_worker("w0", 2)
    first = task.apply_async((run, 0, 0, 6.0))
    wait_until(lambda: line.starts(run).get(0), 30, f"{what} to start on w0")
    line.start_worker("w1", 2)
    return first


def test_a_whole_worker_killed_while_holding_keeps_the_line(amqp_line: Line, run: str) -> None:
    """acks_late + reject_on_worker_lost: the head's worker is SIGKILLed (main process and
    children) mid-run. Its message comes back to the other worker, waits parked until the
    dead holder's lease lapses, and runs again before anything sent after it; each
    follower runs once, in order, and no two runs of the key overlap."""
    line = amqp_line
    redelivered = line.task("step_redelivered")
    head = _running_on_w0(line, redelivered, run, "the head")
    followers = [redelivered.apply_async((run, 0, n)) for n in range(1, 5)]
    time.sleep(1.0)  # the followers arrive and park behind the running head
    killed_at = time.time()
    _kill_tree(line.procs[0].pid)
    # The head's copy runs again on w1 (for 6 s): its start, after the lease lapsed.
    wait_until(lambda: len(line.starts(run).get(0, [])) >= 2, 60, "the head to run again")
    restarted = [at for e, n, what, at, _ in line.runs(run) if (n, what) == (0, "start")][1]
    # The dead holder's record had at least half a lease left (it renews before that).
    assert restarted - killed_at >= LINE["lease"] / 2, "ran before the dead lease lapsed"
    assert head.get(timeout=GET) == 0
    assert [f.get(timeout=GET) for f in followers] == list(range(1, 5))
    assert line.starts(run)[0] == [0, 0, 1, 2, 3, 4]
    assert line.overlaps(run) == []


def test_a_whole_worker_killed_with_early_ack_passes_the_turn_on(amqp_line: Line, run: str) -> None:
    """Celery's default early ack: the head's whole worker is SIGKILLed mid-run, so its
    call ran at most once and is not delivered again. The other worker's sweep finds the
    dead holder's lock lapsed and passes the turn on: the next call starts within a lease
    plus a sweep of the kill, and every follower runs once, in order."""
    line = amqp_line
    step = line.task("step")
    _running_on_w0(line, step, run, "the head")
    followers = [step.apply_async((run, 0, n)) for n in range(1, 5)]
    time.sleep(1.0)  # w1 is up and sweeping; the followers wait in the line
    killed_at = time.time()
    _kill_tree(line.procs[0].pid)
    assert [f.get(timeout=GET) for f in followers] == list(range(1, 5))
    first = next(at for e, n, what, at, _ in line.runs(run) if (n, what) == (1, "start"))
    delay = first - killed_at
    print(f"turn passed on {delay:.2f} s after the kill (lease {LINE['lease']} s)")
    lease, sweep = LINE["lease"], LINE["queue"]["sweep_every"]
    # At least the half lease the dead record had left; at most a lease plus a sweep
    # (5 s of slack for this loaded machine).
    assert lease / 2 <= delay <= lease + sweep + 5.0
    assert line.starts(run)[0] == [0, 1, 2, 3, 4]  # the head ran once (early ack)
    assert line.overlaps(run, killed=0) == []


# -- the lock cache restarts ------------------------------------------------------------------


@contextlib.contextmanager
def _restartable(kind: str) -> Iterator[tuple[str, Any]]:
    """A lock cache of this test's own that keeps what it acknowledged: a Redis with
    `appendonly yes` (each write fsynced) or a PostgreSQL. (Its URL, a restart.)"""
    if kind == "postgres":
        pg = PostgresServer()
        pg.pg_ctl("start")
        try:
            yield with_query(pg.url, table="celery_locks"), lambda: pg.pg_ctl("restart")
        finally:
            pg.remove()
        return
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(free_port(), Path(tmp), "--appendonly", "yes",
                             "--appendfsync", "always")  # fmt: skip
        server.start()

        def restart() -> None:
            server.shutdown()  # nosave: only the append-only file keeps the lines
            server.start()

        try:
            yield f"redis://127.0.0.1:{server.port}/0", restart
        finally:
            server.stop()


@pytest.mark.parametrize("kind", ["redis-aof", "postgres"])
def test_parked_calls_outlive_a_restart_of_a_persistent_lock_cache(run: str, kind: str) -> None:
    """The locks and lines in a cache of their own that keeps what it acknowledged: five
    calls park behind a running head, and the cache is restarted while the head runs.
    Every parked call still runs, once, in send order. (On a Redis that keeps nothing the
    same restart loses them all, and a worker warns of it at its start:
    tests/busy/test_line_unkept.py.)"""
    with _restartable(kind) as (cache, restart):
        lines = _line(REDIS_URL, workers=1, cache=cache)
        line = next(lines)
        try:
            step = line.task("step")
            head = step.apply_async((run, 0, 0, 6.0))
            wait_until(lambda: line.starts(run).get(0), 30, "the head to start")
            parked = [step.apply_async((run, 0, n)) for n in range(1, 6)]
            time.sleep(0.5)
            restart()
            assert [p.get(timeout=GET) for p in parked] == [1, 2, 3, 4, 5]
            assert line.starts(run)[0] == [0, 1, 2, 3, 4, 5]
            assert line.overlaps(run) == []
            # It ran once; its lease may have been lost in the restart (a renewal met a
            # refused connection), which fails it: either way it is over.
            head.get(timeout=GET, propagate=False)
        finally:
            with contextlib.suppress(StopIteration):
                next(lines)


# -- a head whose message is slow or lost: the line's own copy ------------------------------


def test_a_head_whose_message_is_lost_runs_in_its_place_and_its_late_copy_never(
    redis_line: Line, run: str
) -> None:
    """The broker loses the head's message (taken off its queue before any worker saw
    it); the two calls behind it wait parked. gap_for after the send, a sweep sends the
    line's own copy of the head in its place: the three run in send order, each once.
    The lost message then turns up after all (put back on the queue): it is a duplicate,
    and runs nothing. (Before the line kept copies, the head was stepped over: 1 and 2
    ran, and 0 never did, or ran last when its message came.)"""
    line = redis_line
    step = line.task("step")
    results = [step.apply_async((run, 0, n)) for n in range(3)]
    broker = line.record  # the broker is this Redis too (REDIS_URL)
    assert broker.llen(line.queue) == 1  # only the head went to the broker: 1, 2 parked
    lost = broker.lpop(line.queue)
    assert lost is not None
    line.start_worker("w0", 2)
    assert [r.get(timeout=GET) for r in results] == [0, 1, 2]
    assert line.starts(run)[0] == [0, 1, 2]
    broker.rpush(line.queue, lost)  # the slow copy arrives at last
    wait_until(lambda: broker.llen(line.queue) == 0, 30, "the late copy to be taken")
    time.sleep(2.0)  # time for it to have run, had it run
    assert line.starts(run)[0] == [0, 1, 2]
    assert line.app.AsyncResult(results[0].id).get(timeout=GET) == 0
    assert "did not come; the line sent its own copy" in line.log_text("w0")


def test_a_countdown_head_whose_message_is_lost_runs_in_its_place_with_its_link(
    redis_line: Line, run: str
) -> None:
    """The head is sent with a countdown and a link, so it goes through the broker (it
    cannot park at its send), and its message is lost. gap_for after it was due, the
    line sends its own copy, link included: the three calls run in send order, each
    once, and the link runs after the head. (Before, such a head kept no copy and was
    stepped over: 1 and 2 ran, and 0 and its link never did.)"""
    line = redis_line
    step = line.task("step")
    head = step.apply_async((run, 0, 0), countdown=1, link=step.si(run, 2, 0))
    behind = [step.apply_async((run, 0, n)) for n in (1, 2)]
    broker = line.record  # the broker is this Redis too (REDIS_URL)
    assert broker.llen(line.queue) == 1  # only the head went to the broker: 1, 2 parked
    assert broker.lpop(line.queue) is not None
    line.start_worker("w0", 2)
    assert [r.get(timeout=GET) for r in (head, *behind)] == [0, 1, 2]
    assert line.starts(run)[0] == [0, 1, 2]
    wait_until(lambda: line.starts(run).get(2) == [0], 30, "the head's link to run")
    assert "did not come; the line sent its own copy" in line.log_text("w0")


def test_a_head_slow_behind_a_backlog_is_not_sent_again_every_few_seconds(
    redis_line: Line, run: str
) -> None:
    """One worker slot, busy for 24 s with another key's call right after the head of
    this key ends: the next call, published for its turn, waits behind it. The sweep
    sends it again after promote_grace (3 s here), then twice as long each time: it is
    delivered 4 times (the publish and 3 sends, at about 3, 9 and 21 s), not every 3 s
    (9 times), and runs once, after the head."""
    line = redis_line
    step = line.task("step")
    line.start_worker("w0", 1)
    head = step.apply_async((run, 0, 0, 1.0))
    behind = step.apply_async((run, 0, 1))  # parked at the send, behind the head
    blocker = step.apply_async((run, 1, 0, 24.0))  # another key: takes the only slot
    assert [head.get(timeout=GET), behind.get(timeout=GET)] == [0, 1]
    assert blocker.get(timeout=GET) == 0
    # The copies wait in the broker's queue while the slot is busy; then each is taken
    # (and dropped as a duplicate).
    wait_until(lambda: line.record.llen(line.queue) == 0, 30, "the copies to be taken")
    time.sleep(1.0)
    delivered = line.log_text("w0").count(f"[{behind.id}] received")
    print(f"the call behind the head was delivered {delivered} times in its 24 s wait")
    assert 3 <= delivered <= 5, delivered
    assert line.starts(run)[0] == [0, 1]


def test_a_copy_sent_before_a_retry_never_runs_that_attempt_again(
    redis_line: Line, run: str
) -> None:
    """The only slot is busy 8 s with another key's call; a call that retries once waits
    behind it past gap_for, so the line sends its copy (and again later). When the slot
    frees, attempt 0 runs and retries; the copies of attempt 0 that come after are
    duplicates (the line knows the ticket's retry is attempt 1), and the retry runs once:
    two runs in all, not one per copy."""
    line = redis_line
    line.start_worker("w0", 1)
    blocker = line.task("step").apply_async((run, 1, 0, 8.0))  # another key: the slot
    wait_until(lambda: line.starts(run).get(1), 30, "the blocker to start")
    flaky = line.task("step_or_retry").apply_async((run, 0, 0, 0))  # retries at n=0
    assert flaky.get(timeout=GET) == 0
    assert blocker.get(timeout=GET) == 0
    wait_until(lambda: line.record.llen(line.queue) == 0, 30, "the copies to be taken")
    time.sleep(1.5)  # time for a copy taken last to have run, had it run
    log = line.log_text("w0")
    assert log.count(f"[{flaky.id}] received") >= 2, "no copy was sent: nothing tested"
    assert line.starts(run)[0] == [0, 0]  # attempt 0 and its retry, once each
    assert "is a duplicate" in log


@pytest.mark.parametrize("deaths", [1, 2], ids=["killed-once", "killed-twice"])
def test_acks_late_on_a_redis_broker_keeps_a_killed_holders_call(
    redis_line: Line, run: str, deaths: int
) -> None:
    """acks_late + reject_on_worker_lost on a Redis broker: the head's whole worker is
    SIGKILLed mid-run. Kombu delivers its message again only after visibility_timeout (an
    hour by default); the line does not wait for it nor give up on the call: gap_for
    after the dead holder's lease lapsed, the other worker's sweep sends the line's copy,
    and the head runs again before anything sent after it. Killed twice: the worker
    running it again from the line's copy dies too; that run's message is still the
    line's copy, so a third worker's sweep sends it once more. (Before, its turn passed
    on and the call stayed PENDING until the broker's copy came, then was dropped; the
    second death did the same to the rerun.)"""
    line = redis_line
    redelivered = line.task("step_redelivered")
    head = _running_on_w0(line, redelivered, run, "the head")
    followers = [redelivered.apply_async((run, 0, n)) for n in range(1, 4)]
    time.sleep(1.0)  # the followers park behind the running head
    _kill_tree(line.procs[0].pid)
    if deaths == 2:
        wait_until(lambda: len(line.starts(run).get(0, [])) >= 2, 60, "the head to run again")
        line.start_worker("w2", 2)
        _kill_tree(line.procs[1].pid)  # w1, running the head's second run
    assert head.get(timeout=GET) == 0
    assert [f.get(timeout=GET) for f in followers] == [1, 2, 3]
    assert line.starts(run)[0] == [0] * (deaths + 1) + [1, 2, 3]  # the head first, again
    assert line.overlaps(run) == []


# -- keep latest and debounce (issue 25) -----------------------------------------------------


def _superseded_in_a_chain(results: list[Any]) -> None:
    """Each of ``results`` resolved to the skip marker, superseded by the next one."""
    for result, newer in itertools.pairwise(results):
        marker = result.get(timeout=GET)
        assert is_skipped(marker), marker
        assert (marker["reason"], marker["by"]) == ("superseded", newer.id)


def _fifty_behind_a_holder_on_w0(line: Line, task: Any, run: str) -> list[Any]:
    """The first call of keep-latest ``task`` runs (6 s) on w0, then 49 more are sent (w1
    up): the 48 between resolve superseded, each by the next, and the last waits in the
    line. The 50 results."""
    first = _running_on_w0(line, task, run, "the first call")
    results = [first, *(task.apply_async((run, 0, n)) for n in range(1, 50))]
    _superseded_in_a_chain(results[1:49])
    return results


def _burst_behind_the_first(line: Line, task: Any, run: str, die_at: int = -1) -> list[Any]:
    """50 calls of keep-latest ``task``, sent at once; the first runs (0.5 s once the
    other 49 were sent, however long that took). Their results."""
    held = line_app.held(line.prefix, run)
    line.record.set(held, 1, ex=120)
    try:
        return [task.apply_async((run, 0, n, 0.5, die_at)) for n in range(50)]
    finally:
        line.record.delete(held)


@pytest.mark.parametrize("die", [False, True], ids=["finishes", "killed"])
def test_keep_latest_runs_the_running_call_and_the_last_of_a_burst_of_fifty(
    line: Line, run: str, die: bool
) -> None:
    """50 calls of one key sent at once: the first runs (until all were sent), the other
    49 wait in the line one at a time, each newer taking the waiting one's place: the last
    (49) runs next, once, and the 48 between resolve at once to the skip marker, each superseded
    by the next. Also with the first's pool child SIGKILLed mid-run: its parent passes
    the turn on, and the last still runs once (the first, early-acked, never again)."""
    latest = line.task("latest")
    results = _burst_behind_the_first(line, latest, run, 0 if die else -1)
    _superseded_in_a_chain(results[1:49])
    assert results[49].get(timeout=GET) == 49
    if die:
        with pytest.raises(Exception, match=r"WorkerLost|exited prematurely|signal 9"):
            results[0].get(timeout=GET)
    else:
        assert results[0].get(timeout=GET) == 0
    assert line.starts(run)[0] == [0, 49]
    assert line.overlaps(run, killed=0 if die else None) == []


def _debounce_burst(
    debounced: Any, run: str, ns: range, every: float, die_at: int = -1, during: Any = None
) -> tuple[list[Any], float, float]:
    """Send ``debounced`` for each n of ``ns``, ``every`` seconds apart (``during(i)``
    after the i-th send); returns the results, the first send's and the last send's
    wall times (each read before its send: the line's clock reads it after)."""
    results, first, last = [], time.time(), 0.0
    for i, n in enumerate(ns):
        last = time.time()
        results.append(debounced.apply_async((run, 0, n, SECTION, die_at)))
        if during is not None:
            during(i)
        time.sleep(every)
    return results, first, last


def _start_of(line: Line, run: str, n: int) -> float:
    return next(at for _, m, what, at, _ in line.runs(run) if (m, what) == (n, "start"))


def test_debounce_runs_each_burst_once_after_it_ends_with_its_last_arguments(
    line: Line, run: str
) -> None:
    """Three bursts of ten calls 50 ms apart (shorter than the 1 s period), each sent
    once the one before ran: each burst runs exactly once, its last call, no earlier
    than a period after that call and at most max_delay after the burst's first; every
    other call resolves at once to the skip marker, superseded by the next."""
    debounced = line.task("debounced")
    late = []
    for b in range(3):
        ns = range(b * 10, b * 10 + 10)
        results, first, last = _debounce_burst(debounced, run, ns, 0.05)
        assert results[-1].get(timeout=GET) == ns[-1]
        _superseded_in_a_chain(results)
        began = _start_of(line, run, ns[-1])
        assert began - last >= PERIOD - 0.01, "ran before the quiet period passed"
        assert began - first <= MAX_DELAY + LINE["queue"]["sweep_every"] + 2.0
        late.append(began - (last + PERIOD))
    print(f"debounce: each run started {', '.join(f'{s:.2f}' for s in late)} s after due")
    assert line.starts(run)[0] == [9, 19, 29]
    assert line.overlaps(run) == []


def test_debounce_runs_a_steady_stream_by_its_max_delay(line: Line, run: str) -> None:
    """Calls every 0.25 s for 4.5 s, never a quiet period: the burst's max_delay (3 s)
    runs the call waiting then, no earlier, while the stream goes on; the rest form a
    second burst, whose last call runs a period after the stream stops. Every call runs
    once or is superseded, never both."""
    debounced = line.task("debounced")
    results, first, _ = _debounce_burst(debounced, run, range(18), 0.25)
    assert results[-1].get(timeout=GET) == 17
    starts = line.starts(run)[0]
    assert len(starts) == 2, starts
    assert starts[1] == 17
    capped = _start_of(line, run, starts[0])
    print(f"debounce: a steady stream's first run {capped - first:.2f} s after its first call")
    assert MAX_DELAY - 0.01 <= capped - first <= MAX_DELAY + LINE["queue"]["sweep_every"] + 2.0
    for n, result in enumerate(results):
        outcome = result.get(timeout=GET)
        assert outcome == n if n in starts else is_skipped(outcome), (n, outcome)
    assert line.overlaps(run) == []


@pytest.fixture
def redis_line() -> Iterator[Line]:
    """Workers on Redis, started by the test (none yet), so it may kill one."""
    yield from _line(REDIS_URL, workers=0)


def test_debounce_loses_nothing_to_a_killed_holder_or_a_killed_worker(
    redis_line: Line, run: str
) -> None:
    """Three bursts on two workers. Burst 1's run SIGKILLs its pool child mid-run: its
    parent ends the turn (early ack: it ran once, and not again). Midway through burst 2
    one whole worker is SIGKILLed (main process and children): the burst's call waits in
    the line, in the lock cache, and the other worker's sweep publishes it when due. Each
    burst's last call starts exactly once; the others are superseded."""
    line = redis_line
    line.start_worker("w0", 2)
    line.start_worker("w1", 2)
    debounced = line.task("debounced")
    results, _, _ = _debounce_burst(debounced, run, range(10), 0.05, die_at=9)
    with pytest.raises(Exception, match=r"WorkerLost|exited prematurely|signal 9"):
        results[-1].get(timeout=GET)
    _superseded_in_a_chain(results)

    def kill_w0(i: int) -> None:
        if i == 4:
            _kill_tree(line.procs[0].pid)

    for ns, during in [(range(10, 20), kill_w0), (range(20, 30), None)]:
        results, _, last = _debounce_burst(debounced, run, ns, 0.05, during=during)
        assert results[-1].get(timeout=GET) == ns[-1]
        _superseded_in_a_chain(results)
        assert _start_of(line, run, ns[-1]) - last >= PERIOD - 0.01
    assert line.starts(run)[0] == [9, 19, 29]
    assert line.overlaps(run, killed=9) == []


def test_keep_latest_loses_nothing_to_a_whole_worker_killed_while_holding(
    redis_line: Line, run: str
) -> None:
    """The first call runs (6 s) on w0; 49 more are sent, 48 superseded, the last
    waiting in the line; then w0 is SIGKILLed (main process and children: early ack, so
    the first ran at most once). The waiting call is in the lock cache, not in w0: w1's
    sweep finds the dead holder's lock lapsed and publishes it; it runs once."""
    line = redis_line
    results = _fifty_behind_a_holder_on_w0(line, line.task("latest"), run)
    killed_at = time.time()
    _kill_tree(line.procs[0].pid)
    assert results[49].get(timeout=GET) == 49
    delay = _start_of(line, run, 49) - killed_at
    print(f"keep latest: the waiting call ran {delay:.2f} s after its holder's worker died")
    assert line.starts(run)[0] == [0, 49]
    assert line.overlaps(run, killed=0) == []


def test_every_tier_keeps_the_latest_and_debounces(tier_line: Line, run: str) -> None:
    """Keep latest and debounce with the locks and lines in PostgreSQL and DiskCache: 50
    calls sent at once (the first running until all were sent) run the first and the last
    only; a debounce burst of ten runs its
    last call once, no earlier than a period after it."""
    line = tier_line
    latest = line.task("latest")
    results = _burst_behind_the_first(line, latest, run)
    _superseded_in_a_chain(results[1:49])
    assert [results[0].get(timeout=GET), results[49].get(timeout=GET)] == [0, 49]
    assert line.starts(run)[0] == [0, 49]
    debounced = line.task("debounced")
    burst, _, last = _debounce_burst(debounced, run, range(100, 110), 0.05)
    assert burst[-1].get(timeout=GET) == 109
    _superseded_in_a_chain(burst)
    assert _start_of(line, run, 109) - last >= PERIOD - 0.01
    assert line.starts(run)[0] == [0, 49, 109]
    assert line.overlaps(run) == []


def test_keep_latest_reruns_a_redelivered_holder_before_the_waiting_call(
    amqp_line: Line, run: str
) -> None:
    """acks_late + reject_on_worker_lost: the first call's whole worker is SIGKILLed
    mid-run while the 50th waits (48 superseded). The first's message comes back to the
    other worker and runs again once its dead lease lapsed, in its own turn; then the
    50th runs, once. Nothing lost, no two runs of the key at once."""
    line = amqp_line
    held = line_app.held(line.prefix, run)
    line.record.set(held, 1, ex=120)  # the first runs until the kill, however slow the sends
    try:
        results = _fifty_behind_a_holder_on_w0(line, line.task("latest_redelivered"), run)
        time.sleep(1.0)  # w1 is up and sweeping
        _kill_tree(line.procs[0].pid)
    finally:
        line.record.delete(held)
    assert results[0].get(timeout=GET) == 0
    assert results[49].get(timeout=GET) == 49
    assert line.starts(run)[0] == [0, 0, 49]
    assert line.overlaps(run) == []
