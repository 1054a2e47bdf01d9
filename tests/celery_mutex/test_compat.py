"""Migrating from celery-once and celery-singleton: each behaviour of theirs that the Celery
guide's migration table maps is one test, run against the drop-in class
(``celery_mutex.compat``: ``once`` = ``QueueOnce``, ``singleton`` = ``Singleton``) and
against the ``MutexTask`` options the table gives (``mutex``), with a real in-process
worker (thread pool) on Redis. The behaviours are the ones the peers document in their
READMEs and pin in their own test suites, written here from that description.

The settings, the definition-time checks and direct calls need no worker (memory caches).
Redis must run at 127.0.0.1:6379: a missing server fails these tests, it never skips them.
"""

from __future__ import annotations

import pickle
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery_support.compat_app import REDIS_URL, RUNS, STARTED, TASKS, app
from celery_support.worker import threaded_worker
from workers import wait_until

# isort: split
from celery_mutex import AlreadyQueuedError, ConstantKeyWarning, MutexTask, is_skipped
from celery_mutex.compat import (
    AlreadyQueued,
    DuplicateTaskError,
    QueueOnce,
    Singleton,
    clear_locks,
)
from simple_mutex import ConstraintError, DiskCache, InMemoryCache, Mutex

GET = 10  # seconds any single result may take

# The worker's app is configured by the peers' settings on purpose; their deprecation is
# asserted by the settings tests below.
pytestmark = [
    pytest.mark.integrations,
    pytest.mark.filterwarnings("ignore:app.conf.*celery_mutex.compat:DeprecationWarning"),
]


@pytest.fixture(scope="module")
def compat_worker() -> Iterator[None]:
    """One in-process worker (8 threads) for the module; Redis must be up."""
    with threaded_worker(app, REDIS_URL):
        yield


@pytest.fixture
def run() -> str:
    """An id no other test uses: the first argument of every call, so part of its key."""
    return uuid.uuid4().hex[:12]


def ran(run: str) -> list[dict[str, Any]]:
    return [r for r in RUNS if r["run"] == run]


def accepted(task: Any, *args: Any, not_ids: set[str | None], **kwargs: Any) -> Any:
    """Send a call: its AsyncResult if it was sent as a new call, None if it was refused
    as a duplicate (raised, or answered with a queued call's or a REJECTED result)."""
    try:
        result = task.delay(*args, **kwargs)
    except AlreadyQueuedError:
        return None
    return None if result.id is None or result.id in not_ids else result


def accepted_soon(task: Any, *args: Any, not_ids: set[str | None]) -> Any:
    """A call that ended clears its record just after its result is stored: retry the
    send for up to 3 s."""
    deadline = time.monotonic() + 3
    while (result := accepted(task, *args, not_ids=not_ids)) is None:
        assert time.monotonic() < deadline, "the ended call still blocks equal ones"
        time.sleep(0.05)
    return result


def started(run: str, n: object) -> None:
    wait_until(lambda: (run, n) in STARTED, GET, "the first call to start")


# -- duplicates while queued or running ----------------------------------------------------

REFUSED_AS = {"once": AlreadyQueued, "singleton": DuplicateTaskError, "mutex": AlreadyQueuedError}


@pytest.mark.parametrize("variant", ["once", "singleton", "mutex"])
def test_a_duplicate_raises_naming_the_queued_call(compat_worker, run, variant):
    """celery-once's AlreadyQueued, celery-singleton's raise_on_duplicate
    (DuplicateTaskError with the queued id), MutexTask's enqueue="raise": an equal call
    (positional or keyword) raises an AlreadyQueuedError carrying the queued call's id
    and the seconds its record may still block; it pickles; other arguments are sent."""
    task = TASKS["raises"][variant]
    first = task.delay(run, 1)
    for duplicate in ((run, 1), (run, 1, 0.4)):
        with pytest.raises(REFUSED_AS[variant]) as caught:
            task.delay(*duplicate)
    with pytest.raises(AlreadyQueuedError):
        task.apply_async(kwargs={"run": run, "n": 1})
    error = caught.value
    assert isinstance(error, ConstraintError)
    assert error.task_id == first.id
    assert 0 < error.countdown <= 3600
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), copy.task_id, copy.key) == (type(error), first.id, error.key)
    other = task.delay(run, 2)
    assert other.id != first.id
    assert (first.get(timeout=GET), other.get(timeout=GET)) == (1, 2)
    assert sorted(r["n"] for r in ran(run)) == [1, 2]


@pytest.mark.parametrize("variant", ["singleton", "mutex"])
def test_a_duplicate_returns_the_queued_calls_result(compat_worker, run, variant):
    """celery-singleton's default, MutexTask's enqueue="return": an equal call gets the
    queued call's AsyncResult and sends nothing."""
    task = TASKS["returns"][variant]
    first = task.delay(run, 1)
    duplicate = task.delay(run, n=1)
    assert duplicate.id == first.id
    assert duplicate.get(timeout=GET) == 1
    assert len(ran(run)) == 1


@pytest.mark.parametrize("variant", ["once", "mutex"])
def test_graceful_sends_nothing_and_raises_nothing(compat_worker, run, variant):
    """celery-once's graceful: a duplicate returns a result of None (REJECTED) instead of
    raising; the table maps it to enqueue="return", whose duplicate is the queued call's
    result. Either way nothing more is sent and the body runs once."""
    task = TASKS["graceful"][variant]
    first = task.delay(run, 1)
    duplicate = task.delay(run, 1)
    if variant == "once":
        assert duplicate.id is None
        assert duplicate.state == "REJECTED"
        assert duplicate.get() is None
    else:
        assert duplicate.id == first.id
    assert first.get(timeout=GET) == 1
    assert len(ran(run)) == 1


def test_once_options_per_call(compat_worker, run):
    """celery-once's apply_async(once={"graceful", "timeout"}) overrides the task's for one
    call; a per-call option it does not take is refused."""
    task = TASKS["raises"]["once"]
    first = task.apply_async((run, 1, 1.0), once={"timeout": 0.3})
    assert task.apply_async((run, 1, 1.0), once={"graceful": True}).get() is None
    with pytest.raises(AlreadyQueued):
        task.delay(run, 1, 1.0)
    time.sleep(0.4)  # past this call's own 0.3 s record, while it still runs
    late = accepted(task, run, 1, 1.0, not_ids={first.id})
    assert late is not None
    assert is_skipped(late.get(timeout=GET))  # never beside the first (the worker's lock)
    with pytest.raises(ConstraintError, match=r"unknown once option.*'keys'"):
        task.apply_async((run, 2), once={"keys": []})
    assert first.get(timeout=GET) == 1


@pytest.mark.parametrize("variant", ["once", "singleton", "mutex"])
def test_a_per_call_mutex_key_holds_for_the_drop_ins_too(compat_worker, run, variant):
    """apply_async(mutex={"key": ...}) reaches the drop-ins' own apply_async: the call
    is de-duplicated (and locked) on that key, not on its arguments; an option that
    cannot change per call is refused, not ignored."""
    task = TASKS["raises"][variant]
    first = task.apply_async((run, 7, 1.0), mutex={"key": f"own.{run}"})
    with pytest.raises(AlreadyQueuedError):
        task.apply_async((run, 8), mutex={"key": f"own.{run}"})  # other arguments, same key
    with pytest.raises(ConstraintError, match="'lease' cannot change per call"):
        task.apply_async((run, 9), mutex={"lease": 5})
    assert first.get(timeout=GET) == 7


# -- keys ------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["once", "singleton", "mutex"])
def test_empty_keys_lock_on_the_task_name(compat_worker, run, variant):
    """celery-once's keys=[], celery-singleton's unique_on=[], MutexTask's key=[]: any
    two calls are duplicates, whatever their arguments, until the first ends."""
    task = TASKS["by_name"][variant]
    first = task.delay(run, 1)
    assert accepted(task, run, 2, not_ids={first.id}) is None
    assert accepted(task, "another run", 3, not_ids={first.id}) is None
    assert first.get(timeout=GET) == 1
    assert accepted_soon(task, run, 2, not_ids={first.id}).get(timeout=GET) == 2


@pytest.mark.parametrize("variant", ["once", "singleton", "mutex"])
def test_named_arguments_alone_key_the_call(compat_worker, run, variant):
    """keys=["c"], celery-singleton's unique_on="c" (one name as a str), MutexTask's
    key=["c"]: calls that differ in other arguments are duplicates, in c they are not."""
    task = TASKS["on_c"][variant]
    c = uuid.uuid4().int % 10**9
    first = task.delay(run, 1, c)
    assert accepted(task, run, 2, c, not_ids={first.id}) is None
    assert accepted(task, "another run", 3, c=c, not_ids={first.id}) is None
    other = accepted(task, run, 1, c + 1, not_ids={first.id})
    assert other is not None
    assert (first.get(timeout=GET), other.get(timeout=GET)) == (1, 1)
    assert sorted(r["n"] for r in ran(run)) == [(1, c), (1, c + 1)]


def test_a_constant_key_template_warns_when_the_task_takes_arguments():
    """The table: unique_on="c" is key=["c"] (or "{c}"); key="c" is a constant, one lock
    for every call. It warns at definition, naming both fixes; a list, a template with a
    field, a callable, a semaphore or a task without arguments do not warn."""

    def define(key: Any, **mutex: Any) -> None:
        app = _memory_app()

        @app.task(shared=False, base=MutexTask, mutex={"key": key, **mutex})
        def task(a: int, c: int = 0) -> None: ...

        @app.task(shared=False, base=MutexTask, mutex={"key": "nightly"})
        def nightly() -> None: ...

    with pytest.warns(ConstantKeyWarning, match=r"key='\{c\}' or key=\['c'\].*key=\[\]"):
        define("c")
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConstantKeyWarning)
        for quiet in (["c"], [], "{c}", lambda a, c=0: "one"):
            define(quiet)
        define("pool", permits=3)


# -- how long the record lives -----------------------------------------------------------


@pytest.mark.parametrize("variant", ["once", "singleton", "mutex"])
def test_expiry_lets_a_duplicate_in_but_never_beside_the_first(compat_worker, run, variant):
    """celery-once's timeout, celery-singleton's lock_expiry, MutexTask's enqueue_ttl: past
    it (0.5 s) an equal call is sent again, even while the first still runs. Then the
    worker's lock (which the peers lacked) keeps the two apart: the later one is skipped."""
    task = TASKS["expiry"][variant]
    first = task.delay(run, 1, 1.5)
    assert accepted(task, run, 1, 1.5, not_ids={first.id}) is None
    started(run, 1)
    time.sleep(0.6)
    second = accepted(task, run, 1, 1.5, not_ids={first.id})
    assert second is not None
    outcomes = [first.get(timeout=GET), second.get(timeout=GET)]
    assert sorted(outcomes, key=is_skipped) == [1, outcomes[1]]
    assert is_skipped(outcomes[1])
    assert len(ran(run)) == 1


@pytest.mark.parametrize("variant", ["once", "mutex"])
def test_unlock_before_run_queues_the_next_call_once_this_one_runs(compat_worker, run, variant):
    """celery-once's unlock_before_run, MutexTask's enqueue_until="start" with
    on_busy="retry": once the first call starts, an equal one may be queued (a third is a
    duplicate of it); it runs after the first ended, not beside it."""
    task = TASKS["unlock"][variant]
    first = task.delay(run, 1)
    started(run, 1)
    second = accepted_soon(task, run, 1, not_ids={first.id})
    assert accepted(task, run, 1, not_ids={first.id, second.id}) is None
    assert (first.get(timeout=GET), second.get(timeout=GET)) == (1, 1)
    one, two = sorted(ran(run), key=lambda r: r["start"])
    assert two["start"] >= one["end"]


# -- retries and endings ---------------------------------------------------------------


@pytest.mark.parametrize("variant", ["once", "singleton", "mutex"])
def test_retries_keep_the_call_queued_and_get_through(compat_worker, run, variant):
    """A task's own retry (same task id, 0.6 s later) keeps its key taken: a duplicate in
    between is refused (or answered with the retrying call), and the retry itself is
    sent and runs (celery-singleton swallowed it: its issue #20)."""
    task = TASKS["retry"][variant]
    first = task.delay(run, 1)
    wait_until(lambda: len(ran(run)) == 1, GET, "the first attempt")
    assert accepted(task, run, 1, not_ids={first.id}) is None
    assert first.get(timeout=GET) == 1
    assert [r["retries"] for r in ran(run)] == [0, 1]
    assert accepted_soon(task, run, 1, not_ids={first.id}).get(timeout=GET) == 1


@pytest.mark.parametrize("how", ["return", "fail", "ignore"])
@pytest.mark.parametrize("variant", ["once", "singleton", "mutex"])
def test_an_ended_call_frees_its_key_however_it_ended(compat_worker, run, variant, how):
    """Success, failure and Ignore each free the key, so an equal call is sent again
    (celery-once kept it on Ignore until its timeout: after_return does not run then)."""
    task = TASKS["endings"][variant]
    first = task.delay(run, how)
    wait_until(lambda: len(ran(run)) == 1, GET, "the call to run")
    if how == "fail":
        with pytest.raises(KeyError):
            first.get(timeout=GET)
    elif how == "return":
        assert first.get(timeout=GET) == "return"
    again = accepted_soon(task, run, how, not_ids={first.id})
    wait_until(lambda: len(ran(run)) == 2, GET, "the call sent again to run")
    assert again.id != first.id


@pytest.mark.parametrize("variant", ["once", "singleton", "mutex"])
def test_a_copy_that_skips_the_check_never_runs_beside_the_first(compat_worker, run, variant):
    """send_task (and a beat that did not import the task) bypass apply_async, so the
    peers ran such a copy beside the first; the worker's lock skips it."""
    task = TASKS["raises"][variant]
    first = task.delay(run, 1, 0.8)
    started(run, 1)
    copy = app.send_task(task.name, args=(run, 1, 0.8))
    assert is_skipped(copy.get(timeout=GET))
    assert first.get(timeout=GET) == 1
    assert len(ran(run)) == 1


# -- settings, checks and direct calls (no worker) ----------------------------------------


def _memory_app(**conf: Any) -> Celery:
    app = Celery("compat", set_as_current=False, broker="memory://", backend="cache+memory://")
    app.conf.update(conf)
    app.finalize()  # tasks are made (and checked) as they are defined
    return app


def _queue_once(app: Celery, **once: Any) -> Any:
    @app.task(name=f"once.{uuid.uuid4().hex[:8]}", shared=False, base=QueueOnce, once=once)
    def job(n: int) -> int:
        return n

    return job


def _singleton(app: Celery, **options: Any) -> Any:
    @app.task(name=f"singleton.{uuid.uuid4().hex[:8]}", shared=False, base=Singleton, **options)
    def job(n: int, other: int = 0) -> int:
        return n

    return job


def test_celery_once_settings_are_read_and_deprecated(tmp_path: Path):
    """app.conf.ONCE (Django: CELERY_ONCE) gives the cache (Redis url; the File backend's
    location becomes a DiskCache) and default_timeout the queued record's lifetime, with a
    DeprecationWarning naming mutex_cache (and one saying blocking is not supported);
    mutex_* settings and the task's timeout win; a bad timeout or an unknown backend is
    refused, naming the setting and the fix."""
    redis_once = {"backend": "celery_once.backends.Redis", "settings": {"url": "memory://"}}
    settings = {"url": "memory://", "default_timeout": 42, "blocking": True}
    app = _memory_app(ONCE={**redis_once, "settings": settings})
    with pytest.warns(DeprecationWarning, match="app.conf.mutex_cache") as seen:
        cfg = _queue_once(app)._mutex_config()
    assert any("blocking is not supported" in str(w.message) for w in seen)
    assert isinstance(cfg.locks.space.cache, InMemoryCache)
    assert cfg.markers.space.lease == 42
    assert _queue_once(app, timeout=7)._mutex_config().markers.space.lease == 7

    django = Celery("dj", set_as_current=False)

    file_once = {"backend": "celery_once.backends.File", "settings": {"location": tmp_path / "o"}}
    django.config_from_object({"CELERY_ONCE": file_once}, namespace="CELERY")
    with pytest.warns(DeprecationWarning, match="ONCE"):
        cfg = _queue_once(django)._mutex_config()
    assert isinstance(cfg.locks.space.cache, DiskCache)
    assert (tmp_path / "o").is_dir()

    both = _memory_app(ONCE=redis_once, mutex_cache=InMemoryCache(), mutex_enqueue_ttl=5)
    with pytest.warns(DeprecationWarning, match="ONCE"):
        cfg = _queue_once(both)._mutex_config()
    assert cfg.locks.space.cache is both.conf.mutex_cache
    assert cfg.markers.space.lease == 5
    bad = _memory_app(ONCE={"settings": {"url": "memory://", "default_timeout": -1}})
    with (
        pytest.warns(DeprecationWarning, match="ONCE"),
        pytest.raises(ConstraintError, match="ONCE default_timeout must be greater than 0"),
    ):
        _queue_once(bad)._mutex_config()
    odd = _memory_app(ONCE={"backend": "myapp.locks.Memcached", "settings": {}})
    with (
        pytest.warns(DeprecationWarning, match="ONCE"),
        pytest.raises(ConstraintError, match=r"Memcached.*mutex_cache"),
    ):
        _queue_once(odd)._mutex_config()


def test_celery_singleton_settings_are_read_and_deprecated():
    """singleton_backend_url, singleton_key_prefix, singleton_lock_expiry and
    singleton_raise_on_duplicate configure Singleton tasks, each with a DeprecationWarning
    naming its mutex_* replacement; the task's raise_on_duplicate and lock_expiry win;
    a custom backend class is reported as unused."""
    app = _memory_app(
        singleton_backend_url="memory://",
        singleton_key_prefix="SINGLETONLOCK_",
        singleton_lock_expiry=9,
        singleton_raise_on_duplicate=True,
        singleton_backend_class="myapp.Backend",
    )
    task = _singleton(app)
    with pytest.warns(DeprecationWarning, match="singleton_") as seen:
        cfg = task._mutex_config()
    said = " ".join(str(w.message) for w in seen)
    for replacement in ("mutex_cache", "mutex_prefix", "mutex_enqueue_ttl", "not used"):
        assert replacement in said
    assert isinstance(cfg.locks.space.cache, InMemoryCache)
    assert cfg.locks.space.prefix == "SINGLETONLOCK_"
    assert cfg.markers.space.lease == 9
    first = task.delay(1)
    with (
        pytest.warns(DeprecationWarning, match="raise_on_duplicate"),
        pytest.raises(DuplicateTaskError) as caught,
    ):
        task.delay(n=1)
    assert caught.value.task_id == first.id
    patient = _singleton(app, raise_on_duplicate=False, lock_expiry=3)
    first = patient.delay(1)
    assert patient.delay(1).id == first.id
    assert patient._mutex_config().markers.space.lease == 3


def test_drop_in_options_are_checked_when_the_task_is_defined():
    """A typo in once={...}, a non-bool graceful or a unique_on naming no argument fail at
    definition, as MutexTask options do."""
    app = _memory_app(mutex_cache="memory://")
    with pytest.raises(ConstraintError, match=r"unknown once option.*'key'"):
        _queue_once(app, key=["n"])
    with pytest.raises(ConstraintError, match="graceful must be True or False"):
        _queue_once(app, graceful="yes")
    with pytest.raises(ConstraintError, match="not arguments of the task"):
        _singleton(app, unique_on=["user_id"])


def test_direct_calls_of_the_drop_ins_stay_plain_function_calls():
    """The peers: "It does not affect calling the tasks directly". A drop-in task called
    directly runs even while its key is held, and touches no cache (none configured);
    clear_locks() is kept as a no-op that says so."""
    bare = _memory_app()
    assert _queue_once(bare)(3) == 3
    assert _singleton(bare)(4) == 4
    cache = InMemoryCache()
    held = _memory_app(mutex_cache=cache)
    once = _queue_once(held)
    with Mutex(cache, prefix="mutex.").acquire(once.mutex_key(5)):
        assert once(5) == 5
    with pytest.warns(DeprecationWarning, match="does nothing"):
        clear_locks(held)
