"""A job's own timeout lands while ``acquire`` waits, or while it writes (issue 20.7).

RQ's ``job_timeout``, Celery's ``soft_time_limit`` and a plain ``signal.alarm`` raise an
ordinary exception from a signal handler. Only a cache's driver errors are backend
faults; this one must reach the caller at once (never be waited out, after which the
body ran anyway), and a record the interrupted call may have written must not stay
behind. Real servers: the Redis at REDIS_URL, the PostgreSQL at POSTGRES_URL, and a
DiskCache (a missing server fails the test). The RQ and Celery cases, with real
workers, are in test_rq.py and test_celery_timeouts.py."""

from __future__ import annotations

import ast
import gc
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alarms import Alarm

from simple_mutex import DiskCache, InMemoryCache, Mutex, cache_from_url
from simple_mutex.caches._base import fault

pytestmark = pytest.mark.backends

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES_URL = os.environ.get("POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


@pytest.fixture(params=["disk", "redis", "postgres"])
def mutex(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Mutex]:
    url = {
        "disk": f"file://{tmp_path / 'locks'}",
        "redis": REDIS_URL,
        "postgres": POSTGRES_URL,
    }[request.param]
    return Mutex(cache_from_url(url), lease=30, prefix=f"alarm-{uuid.uuid4().hex[:8]}.")


def test_an_alarm_while_waiting_reaches_the_caller_at_once(mutex, alarm):
    """The key is held; the acquire waits (timeout 10 s); the alarm at 0.3 s leaves the
    acquire as itself within a second, and the cache works on afterwards."""
    holder = Mutex(mutex.cache, prefix=mutex.prefix).acquire("k")
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    started = time.monotonic()
    with pytest.raises(Alarm):
        mutex.acquire("k", timeout=10, interval=0.05)
    waited = time.monotonic() - started
    assert waited < 2.0, f"the alarm was waited out ({waited:.2f} s)"
    assert holder.release() is True
    lease = mutex.acquire("k", timeout=5)  # the cache (its connection) still works
    lease.release()


def test_an_alarm_at_any_moment_of_a_cycle_leaves_no_record(mutex, alarm, request):
    """Alarms at random moments of acquire/release cycles, wherever they land inside the
    library (before, inside or after a write, in the lease's construction, in a release):
    the key is never left held by the interrupted caller. (A caller that got its lease
    releases it: the lease is in hand as soon as acquire returns.)"""
    rng = random.Random(20)
    interrupted = 0
    # Python ignores an exception raised in a finalizer ("Exception ignored in ..."): an
    # alarm landing in the __del__ of another test's discarded client is lost by Python
    # itself, whatever a library does. No collection runs during the loop.
    gc.collect()
    gc.disable()
    request.addfinalizer(gc.enable)
    for _ in range(40):
        lease = None
        # Bounded: an alarm the library swallowed would loop here for ever (a CI run once
        # hung here on Redis: see test_a_first_grant_runs_no_scan_that_swallows_a_signal).
        give_up = time.monotonic() + 20
        try:
            # Set inside the try: on a loaded machine the alarm may ring before the next
            # line (it once rang in the statement that used to stand between the two).
            signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.0002, 0.004))
            while time.monotonic() < give_up:
                lease = mutex.acquire("k", timeout=5)
                lease.release()
                lease = None
        except Alarm:
            interrupted += 1
        signal.setitimer(signal.ITIMER_REAL, 0)
        if lease is not None:
            lease.release()  # acquire had returned: the lease was the caller's to free
        assert not mutex.locked("k"), "an interrupted acquire or release left its record"
    assert interrupted == 40


class SwallowingDriver(InMemoryCache):
    """A cache whose driver catches what a signal handler raises inside it and raises its
    own error instead (psycopg does so around parsing a connection string: a CI run once
    saw an alarm come back as "bad value for connect_timeout"), which the backend maps to
    a fault as every backend does."""

    def put_if_absent(self, key: str, value: str, ttl: float) -> Any:
        try:
            try:
                signal.raise_signal(signal.SIGALRM)  # the job timeout lands in the driver
            except Exception:
                raise OSError("bad value for connect_timeout: '5'") from None
        except OSError as exc:
            raise fault("memory", "put_if_absent", key, exc) from exc
        return super().put_if_absent(key, value, ttl)


@pytest.mark.fast
def test_a_job_timeout_a_driver_turned_into_its_own_error_still_reaches_the_caller(alarm):
    """The driver's error stands for the caller's job timeout: the acquire raises the
    timeout itself, at once, not a backend fault (which a waiting acquire would retry
    until its own timeout, and then report as the backend's)."""
    mutex = Mutex(SwallowingDriver())
    started = time.monotonic()
    with pytest.raises(Alarm):
        mutex.acquire("k", timeout=30)
    assert time.monotonic() - started < 10  # at once; a retried fault would take 30 s
    assert not mutex.locked("k")


def test_a_disk_wait_is_cut_short_by_the_alarm_too(tmp_path, alarm):
    """DiskCache blocks on its futex gate: the alarm still ends the wait promptly."""
    cache = DiskCache(tmp_path / "gate")
    Mutex(cache).acquire("k")
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    started = time.monotonic()
    with pytest.raises(Alarm):
        Mutex(cache).acquire("k", timeout=10)
    assert time.monotonic() - started < 2.0


@pytest.mark.parametrize("where", ["_sync", "_book_next"])
def test_an_interrupt_at_the_blocks_door_leaves_no_record(mutex, monkeypatch, where):
    """A signal handler's exception landing in ``Lease.__enter__`` (at its first line,
    ``_sync``, where no ``__exit__`` follows; or inside it, ``_book_next``, where the
    reviewer's alarms landed): ``with_simple_mutex`` frees the record before the
    exception leaves. Before, the key stayed held for the whole lease."""
    from simple_mutex import Lease, with_simple_mutex

    original = getattr(Lease, where)
    fired = []

    def ring_once(self, *args):  # type: ignore[no-untyped-def]
        if not fired:
            fired.append(1)
            raise Alarm("time is up")
        return original(self, *args)

    monkeypatch.setattr(Lease, where, ring_once)
    guarded = with_simple_mutex(lambda: "ran", key="k", cache=mutex.cache, lease=30)
    with pytest.raises(Alarm):
        guarded()
    assert fired == [1]
    assert not Mutex(mutex.cache).locked("k"), "the interrupted call left its record"


def test_an_interrupt_as_postgres_enters_a_session_leaves_the_cache_usable():
    """A signal handler's exception can land as a ``@contextmanager``'s ``__enter__``
    returns (CPython runs pending signal handlers when a call returns). Raised there, at
    each such point of the library an acquire and release pass through, its traceback
    kept alive (a log record, a stored failure, as RQ and Celery keep them): the next call
    on the cache still answers. Before, PostgresCache took its session guard inside the
    generator, which then sat suspended holding it, and every later call hung (so the
    probe runs in a process of its own, which a hang cannot take the suite down with)."""
    probe = Path(__file__).with_name("enter_probe.py")
    try:
        done = subprocess.run(
            [sys.executable, str(probe), POSTGRES_URL], capture_output=True, text=True, timeout=90
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the probe hung: an interrupted call left the cache's guard held")
    assert done.returncode == 0, done.stdout + done.stderr
    points = int(done.stdout.split()[-1])
    assert points >= 1, "no interrupt landed: the probe no longer reaches the session"


# Where a broad catch is allowed, and why: no signal handler runs there (signals reach the
# main thread only), or it re-raises. By file (under the repository) and function.
BROAD_CATCH_ALLOWED = {
    ("simple_mutex/_runtime/keeper.py", "_logged"),  # the keeper's own thread
    ("celery_mutex/exits.py", "_run"),  # the exit watch's own thread
    # Celery beat's own populate_heap, kept as Celery writes it: the beat process has no
    # job timeout, and its stop signals raise SystemExit, which this does not catch.
    ("celery_mutex/beat.py", "populate_heap"),
    ("simple_mutex/admin/cli.py", "main"),  # the operator's command: no job timeout there
    # Celery's and RQ's own hooks after a body ended, where raising breaks the framework:
    # a time limit landing there has no body left to stop.
    ("celery_mutex/acquire.py", "_skip"),  # the skip's monitoring event; the task returns
    ("celery_mutex/enqueue.py", "unmark"),
    ("celery_mutex/enqueue.py", "unmark_refused"),
    ("celery_mutex/run.py", "release_owner"),
    ("celery_mutex/safety_net.py", "_release_leftover"),  # the parent, its child dead
    ("rq_mutex/horses.py", "_record_ended"),  # the RQ worker, its horse dead
    # on_busy="queue": the next call's publish after the body ended and the lock was
    # released (a failure leaves it to a sweep), the parent's end of a dead child's turn,
    # and the sweeper's own thread.
    ("celery_mutex/line.py", "_from_the_parent"),
    ("celery_mutex/sweeper.py", "_run"),
    # The periodic sweep of every line, in Celery's sweeper thread and in RQ's worker's
    # main process (no job timeout in either).
    ("simple_mutex/busy/line/driver.py", "sweep_lines"),
    ("rq_mutex/worker.py", "sweep_lines"),
}
BROAD = {"Exception", "BaseException"}


def _broad_catches(path: Path) -> set[str]:
    """The functions of ``path`` holding an ``except Exception`` (or BaseException) that
    does not re-raise, or a ``suppress(Exception)``."""
    found: set[str] = set()

    def names(node: ast.expr | None) -> set[str]:
        if node is None:
            return {"BaseException"}  # a bare except
        items = node.elts if isinstance(node, ast.Tuple) else [node]
        return {ast.unparse(item).rsplit(".", 1)[-1] for item in items}

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            here = function
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                here = child.name
            elif isinstance(child, ast.ExceptHandler) and names(child.type) & BROAD:
                if not any(isinstance(n, ast.Raise) for n in ast.walk(child)):
                    found.add(function)
            elif (
                isinstance(child, ast.Call)
                and ast.unparse(child.func).rsplit(".", 1)[-1] == "suppress"
                and {ast.unparse(arg).rsplit(".", 1)[-1] for arg in child.args} & BROAD
            ):
                found.add(function)
            visit(child, here)

    visit(ast.parse(path.read_text()), "<module>")
    return found


def test_no_broad_catch_can_swallow_a_job_timeout():
    """RQ's JobTimeoutException and Celery's SoftTimeLimitExceeded are ordinary
    exceptions raised by a signal handler wherever the main thread is: an
    ``except Exception`` that does not re-raise, or a ``suppress(Exception)``, on a
    caller's path loses the timeout and the job runs on. (One in the standard library's
    importlib.metadata lost an alarm at a Redis cache's first grant: see
    tests/caches/test_redis.py.) Library code catches what it means to."""
    root = Path(__file__).resolve().parent.parent
    found = {
        (str(path.relative_to(root)), function)
        for package in ("simple_mutex", "celery_mutex", "rq_mutex")
        for path in sorted((root / package).rglob("*.py"))
        for function in _broad_catches(path)
    }
    assert found - BROAD_CATCH_ALLOWED == set(), "broad catches on a caller's path"
    assert found >= BROAD_CATCH_ALLOWED, "an allowance no longer needed: drop it"


def test_the_broad_catch_check_sees_each_spelling(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import contextlib\n"
        "def a():\n    try: f()\n    except Exception: pass\n"
        "def b():\n    with contextlib.suppress(OSError, Exception): f()\n"
        "def c():\n    try: f()\n    except (ValueError, BaseException): return 1\n"
        "def d():\n    try: f()\n    except: pass\n"
        "def fine():\n    try: f()\n    except Exception:\n        log()\n        raise\n"
        "def narrow():\n    try: f()\n    except OSError: pass\n"
    )
    assert _broad_catches(probe) == {"a", "b", "c", "d"}
