"""The busy policy Celery and RQ share (simple_mutex.busy), and that both go through it."""

from __future__ import annotations

import os
import time
import typing
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from celery import Celery
from workers import spin

from celery_mutex import MutexTask
from rq_mutex import mutex_job
from simple_mutex import (
    ConstraintError,
    ConstraintValueError,
    InMemoryCache,
    Mutex,
    SimpleMutexAcquireTimeoutError,
    SimpleMutexLeaseExpiredError,
)
from simple_mutex._runtime.interrupt import LeaseInterrupt
from simple_mutex.busy import (
    BusyPolicy,
    OnBusy,
    PerProcess,
    RunAgain,
    Skip,
    current_lease,
    is_skipped,
    running,
    shared_cache,
    skip_marker,
)
from simple_mutex.busy.policy import ON_BUSY, RetryPolicy, retry_policy

pytestmark = pytest.mark.fast

# -- the retry schedule -----------------------------------------------------------------


def test_retry_delays_grow_by_backoff_and_stop_at_the_cap():
    """countdown * backoff**n, capped; without jitter exactly that."""
    policy = retry_policy("t", {"countdown": 1, "backoff": 2, "cap": 5, "jitter": False})
    assert [policy.delay(n) for n in range(5)] == [1, 2, 4, 5, 5]


def test_jitter_keeps_each_delay_within_half_to_one_and_a_half():
    """With jitter a delay lies in [0.5, 1.5) of the unjittered one, drawn at random."""
    policy = retry_policy("t", {"countdown": 2, "backoff": 1})
    assert policy.delay(0, 0.0) == 1.0
    assert policy.delay(0, 0.999) == pytest.approx(2.998)
    drawn = {policy.delay(0) for _ in range(20)}
    assert len(drawn) > 1
    assert all(1.0 <= d < 3.0 for d in drawn)


def test_retry_budget_sums_the_delays_up_to_max():
    """The budget is what all retries would wait; a huge max is summed without a loop."""
    assert RetryPolicy().budget() == float("inf")
    assert RetryPolicy(max=0).budget() == 0
    assert RetryPolicy(countdown=1, backoff=2, cap=5, max=4).budget() == 1 + 2 + 4 + 5
    started = time.monotonic()
    assert RetryPolicy(countdown=1, backoff=2, cap=5, max=10**9).budget() == pytest.approx(5e9)
    assert time.monotonic() - started < 0.1


# -- what busy means, in a worker and synchronously ---------------------------------------


@pytest.mark.parametrize(
    ("options", "in_worker", "synchronously"),
    [
        ({"on_busy": "wait"}, None, None),
        ({"on_busy": "wait", "timeout": 5}, 5, 5),
        ({"on_busy": "skip"}, 0, 0),
        ({"on_busy": "raise", "timeout": 2}, 2, 2),
        ({"on_busy": "retry"}, 0, 60),  # synchronously: one lease, the retries are endless
        ({"on_busy": "retry", "lease": 9}, 0, 9),
        ({"on_busy": "retry", "retry": {"countdown": 0.1, "backoff": 1, "max": 3}}, 0, 0.3),
        ({"on_busy": "retry", "timeout": 2}, 2, 2),
    ],
)
def test_wait_before_busy_in_a_worker_and_synchronously(options, in_worker, synchronously):
    """Synchronous execution cannot re-queue: a retry waits as long as its retries would
    have, at most one lease, or exactly timeout; the other policies wait the same."""
    policy = BusyPolicy.from_options("t", options)
    assert policy.wait_for(synchronous=False) == in_worker
    assert policy.wait_for(synchronous=True) == pytest.approx(synchronously)


def test_the_busy_policies_are_one_closed_type():
    """The policies are these eight (what option checks accept, read from the OnBusy
    literal that mypy checks every match against); any other name is refused, and the
    line's three with more than one permit too (a line runs one call of a key at a time)."""
    names = ("skip", "retry", "wait", "raise", "queue", "latest", "debounce", "replace")
    assert typing.get_args(OnBusy) == names
    assert names == ON_BUSY
    with pytest.raises(ConstraintValueError, match="on_busy must be one of skip, retry"):
        BusyPolicy.from_options("t", {"on_busy": "line"})
    debounce = {"debounce": {"period": 1, "max_delay": 5}}
    for on_busy, more in [("queue", {}), ("latest", {}), ("debounce", debounce)]:
        with pytest.raises(ConstraintValueError, match="permits=2 would run several"):
            BusyPolicy.from_options("t", {"on_busy": on_busy, "permits": 2, **more})


def test_the_debounce_options_are_checked_and_name_the_fix():
    """on_busy='debounce' needs both period and max_delay, max_delay at least period and
    at most queue park_for (a parked call must not expire before its run); keep latest
    takes no options."""
    policy = BusyPolicy.from_options(
        "t", {"on_busy": "debounce", "debounce": {"period": 2, "max_delay": {"seconds": 30}}}
    )
    assert (policy.debounce.period, policy.debounce.max_delay) == (2.0, 30.0)
    assert policy.in_line
    assert (policy.wait_for(synchronous=False), policy.wait_for(synchronous=True)) == (0.0, None)
    latest = BusyPolicy.from_options("t", {"on_busy": "latest"})
    assert latest.in_line
    assert (latest.wait_for(synchronous=False), latest.wait_for(synchronous=True)) == (0.0, None)
    assert not BusyPolicy.from_options("t", {"on_busy": "wait"}).in_line
    for options, fix in [
        ({"on_busy": "debounce"}, r"needs debounce=\{'period': s, 'max_delay': s\}.*set both"),
        ({"on_busy": "debounce", "debounce": {"period": 1}}, "set both"),
        ({"on_busy": "debounce", "debounce": {"max_delay": 1}}, "set both"),
        (
            {"on_busy": "debounce", "debounce": {"period": 5, "max_delay": 2}},
            "max_delay .2 s. must be at least its period .5 s.: raise max_delay",
        ),
        (
            {"on_busy": "debounce", "debounce": {"period": 1, "max_delay": 600},
             "queue": {"park_for": 60}},
            "must not exceed queue park_for .60 s.*lower max_delay",
        ),
        ({"on_busy": "debounce", "debounce": {"period": 0, "max_delay": 2}}, "greater than 0"),
        ({"on_busy": "debounce", "debounce": {"period": -1, "max_delay": 2}}, "debounce period"),
        ({"on_busy": "debounce", "debounce": {"wait": 1}}, "unknown debounce field.*'wait'"),
        ({"on_busy": "debounce", "debounce": [1, 2]}, "expected a dict of debounce fields"),
    ]:  # fmt: skip
        with pytest.raises(ConstraintError, match=fix):
            BusyPolicy.from_options("t", options)


def test_replace_refuses_the_options_it_cannot_honour():
    """on_busy='replace' stops one holder and never waits for it: with permits > 1 or a
    timeout it raises ConstraintError naming the fix; a worker's call tries once (then
    takes the key), a synchronous one has no worker to stop through and waits; a busy
    key it could not take raises."""
    with pytest.raises(ConstraintValueError, match="permits=3 there is no single holder"):
        BusyPolicy.from_options("t", {"on_busy": "replace", "permits": 3})
    with pytest.raises(ConstraintValueError, match="drop timeout"):
        BusyPolicy.from_options("t", {"on_busy": "replace", "timeout": 5})
    with pytest.raises(ConstraintValueError, match="drop renew=False"):
        BusyPolicy.from_options("t", {"on_busy": "replace", "renew": False})
    policy = BusyPolicy.from_options("t", {"on_busy": "replace"})
    assert (policy.wait_for(synchronous=False), policy.wait_for(synchronous=True)) == (0.0, None)
    busy = SimpleMutexAcquireTimeoutError("busy", key="k")
    with pytest.raises(SimpleMutexAcquireTimeoutError):
        policy.after_busy(busy, synchronous=False, busy_retries=0)
    with pytest.raises(ConstraintValueError, match="drop timeout"):
        mutex_job(key="k", on_busy="replace", timeout=1)  # RQ's checks are the same


def test_the_queue_options_are_checked():
    """queue={...}: defaults merged in, unknown fields and bad values refused, naming
    the fix; a synchronous queue waits, a worker's call tries once (its line decides)."""
    policy = BusyPolicy.from_options("t", {"on_busy": "queue", "queue": {"max": 5}})
    assert (policy.queue.max, policy.queue.on_full, policy.queue.gap_for) == (5, "raise", 120.0)
    assert (policy.wait_for(synchronous=False), policy.wait_for(synchronous=True)) == (0.0, None)
    for bad, fix in [
        ({"maximum": 5}, "unknown queue field"),
        ({"max": 0}, "queue max must be None or an int >= 1"),
        ({"max": True}, "queue max must be None or an int >= 1"),
        ({"on_full": "drop"}, "queue on_full must be 'raise' or 'skip'"),
        ({"gap_for": -1}, "gap_for"),
    ]:
        with pytest.raises(ConstraintError, match=fix):  # a ValueError or a TypeError
            BusyPolicy.from_options("t", {"on_busy": "queue", "queue": bad})


def test_after_busy_skips_retries_or_raises():
    """skip: Skip (the marker); retry: RunAgain after a delay, until max; wait/raise, and
    a synchronous retry: the acquire timeout error, naming why."""
    busy = SimpleMutexAcquireTimeoutError("busy", key="k")

    def after(on_busy: str, synchronous: bool = False, retries: int = 0, **retry: Any) -> Any:
        policy = BusyPolicy.from_options("t", {"on_busy": on_busy, "retry": retry})
        return policy.after_busy(busy, synchronous=synchronous, busy_retries=retries)

    assert after("skip") == Skip()
    assert after("skip", synchronous=True) == Skip()
    assert after("retry", countdown=2, jitter=False, retries=1) == RunAgain(4.0)
    for on_busy in ("wait", "raise"):
        with pytest.raises(SimpleMutexAcquireTimeoutError) as caught:
            after(on_busy)
        assert caught.value is busy
    with pytest.raises(SimpleMutexAcquireTimeoutError, match=r"after 2 busy retries \(retry max=2"):
        after("retry", retries=2, max=2)
    with pytest.raises(SimpleMutexAcquireTimeoutError, match="synchronous call cannot be"):
        after("retry", synchronous=True)


# -- options: one check for both integrations ------------------------------------------


def work(order_id: int) -> None:
    """A task or job body (never run here)."""


def _define_celery_task(options: dict[str, Any]) -> None:
    app = Celery("busy", set_as_current=False, broker="memory://")
    app.task(shared=False, base=MutexTask, mutex=options)(work)
    app.finalize()


def _decorate_rq_job(options: dict[str, Any]) -> None:
    mutex_job(**{"key": "k", **options})(work)


@pytest.mark.parametrize("define", [_define_celery_task, _decorate_rq_job], ids=["celery", "rq"])
@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"on_busy": "later"}, "on_busy must be one of skip, retry, wait, raise"),
        ({"retry": {"delay": 1}}, "unknown retry field"),
        ({"retry": {"backoff": 0.5}}, "backoff must be a number >= 1"),
        ({"retry": {"jitter": "yes"}}, "jitter must be True or False"),
        ({"retry": {"max": -1}}, "max must be None or an int >= 0"),
        ({"retry": "often"}, "expected a dict of retry fields"),
        ({"lease": 0}, "lease must be greater than 0"),
        ({"timeout": -1}, "timeout must be None"),
        ({"renew": "yes"}, "renew must be True or False"),
        ({"permits": 0}, "permits must be an int >= 1"),
    ],
)
def test_bad_shared_options_fail_at_definition_with_one_message(define, options, fragment):
    """Celery tasks and RQ job functions refuse a bad shared option when defined, with
    the same message naming the fix."""
    with pytest.raises(ConstraintError, match=fragment):
        define(options)


# -- what the body sees, and what a skipped run returns ---------------------------------


def test_running_body_sees_its_lease_and_a_loss_leaves_as_the_public_error(key):
    """current_lease() is the lease inside running() only; a lapse interrupts the body and
    leaves as SimpleMutexLeaseExpiredError itself, chained to the interrupt."""
    lease = Mutex(InMemoryCache(), lease=0.2).acquire(key)
    seen = []

    def body() -> None:
        with running(lease), lease:
            seen.append(current_lease())
            spin()  # pure Python: interrupted at once

    started = time.monotonic()
    with pytest.raises(SimpleMutexLeaseExpiredError) as caught:
        body()
    assert time.monotonic() - started < 1.5
    assert seen == [lease]
    assert current_lease() is None
    assert type(caught.value) is SimpleMutexLeaseExpiredError
    assert caught.value.key == key
    assert isinstance(caught.value.__cause__, LeaseInterrupt)


@pytest.mark.parametrize("unwinding", [SystemExit, KeyboardInterrupt])
def test_a_loss_landing_while_a_systemexit_unwinds_lets_the_systemexit_leave(key, unwinding):
    """SIGTERM's SystemExit (or a Ctrl-C) runs the body's ``finally:``, and the lease lapses
    in there: the interrupt displaced the SystemExit, which leaves running() instead of the
    lock's error (Celery would record that as a failure and keep the child), noting the loss."""
    lease = Mutex(InMemoryCache(), lease=0.2).acquire(key)

    def body() -> None:
        with running(lease), lease:
            try:
                raise unwinding()
            finally:
                spin()  # the clean-up outlasts the lease: interrupted in here

    with pytest.raises(unwinding) as caught:
        body()
    assert any("lost" in note for note in getattr(caught.value, "__notes__", []))


def test_skip_markers_of_both_integrations_are_recognized():
    """is_skipped knows the markers Celery and RQ have always returned, and nothing else."""
    assert is_skipped({"celery_mutex": "skipped", "key": "k", "holder": None})
    assert is_skipped({"rq_mutex": "skipped", "key": "k"})
    assert skip_marker("rq_mutex", "k", reason="duplicate tick") == {
        "rq_mutex": "skipped",
        "key": "k",
        "reason": "duplicate tick",
    }
    for other in ("skipped", {"key": "k"}, {"celery_mutex": "ran"}, None, ["rq_mutex"]):
        assert not is_skipped(other)


# -- once per process --------------------------------------------------------------------


def test_per_process_builds_once_per_key_even_under_threads():
    """Eight threads asking at once get one value; another key gets its own."""
    built: list[object] = []

    def build(key: object) -> object:
        time.sleep(0.05)  # wide window for a second builder
        built.append(key)
        return object()

    memo: PerProcess[object] = PerProcess(build)
    with ThreadPoolExecutor(8) as pool:
        values = list(pool.map(lambda _: memo.get("a"), range(8)))
    assert built == ["a"]
    assert all(v is values[0] for v in values)
    assert memo.get("b") is not values[0]


@pytest.mark.backends
def test_a_forked_child_builds_its_own_values():
    """The parent's values (clients, sockets) stay behind in a forked child, even if a
    thread held the memo's lock at the fork."""
    memo: PerProcess[object] = PerProcess(lambda key: object())
    parent = memo.get("url")
    memo._lock.acquire()  # as if another thread were building right then
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        child = memo.get("url")
        os.write(write, b"fresh" if child is not parent and memo.get("url") is child else b"same")
        os._exit(0)
    memo._lock.release()
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 16) == b"fresh"
    assert memo.get("url") is parent


def test_shared_cache_builds_a_url_once_and_passes_caches_through():
    """One cache per URL in a process (tasks of one app share it); a cache stays itself."""
    assert shared_cache("memory://") is shared_cache("memory://")
    mine = InMemoryCache()
    assert shared_cache(mine) is mine
