"""MutexTask definition-time checks, key derivation and settings (no worker needed)."""

from __future__ import annotations

import datetime as dt
import decimal
import enum
import os
import threading
import time
import uuid
from typing import Any

import pytest
from celery import Celery, Task
from workers import ReleaseLater

# isort: split
from celery_mutex import MutexTask, call_state, current_lease, is_skipped
from celery_mutex.keys import stable_encoding
from rq_mutex import mutex_job
from simple_mutex import ConstraintError, InMemoryCache, Mutex, SimpleMutexAcquireTimeoutError

pytestmark = pytest.mark.fast


def _app(**conf: Any) -> Celery:
    app = Celery("opts", set_as_current=False, broker="memory://", backend="cache+memory://")
    app.conf.update(conf)
    app.finalize()
    return app


def _task(app: Celery | None = None, **mutex: Any) -> Any:
    """A MutexTask ``task(n)`` returning "ran", on ``app`` (default: a memory cache)."""

    @(app or _app(mutex_cache="memory://")).task(shared=False, base=MutexTask, mutex=mutex)
    def task(n: int) -> str:
        return "ran"

    return task


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"on_bussy": "skip"}, r"unknown mutex option.*'on_bussy'"),
        ({"key": "n.{order}"}, "names order"),
        ({"key": ["missing"]}, "are not arguments of the task"),
        ({"key": 42}, "mutex key must be a template"),
        ({"enqueue": "maybe"}, "enqueue must be None, 'return' or 'raise'"),
        ({"enqueue_ttl": 0}, "enqueue_ttl must be greater than 0"),
        ({"prefix": 3}, "prefix must be a str"),
        ({"prefix": "queued.jobs."}, "could meet the records celery_mutex keeps under queued."),
        ({"prefix": ""}, "could meet the records .* under queued., beat., ticks."),
        ({"prefix": "p" * 60}, "prefix must be at most 57 characters"),
    ],
)
def test_bad_options_fail_when_the_task_is_defined(options, fragment):
    """A typo in mutex={...}, a template naming a missing argument or a bad value of an
    option only Celery has raises at @app.task, naming the fix (the shared options:
    test_busy.py)."""
    with pytest.raises(ConstraintError, match=fragment) as info:
        _task(_app(), **options)
    assert isinstance(info.value, (ValueError, TypeError))  # what Python code expects


def test_lazy_app_fails_no_later_than_finalize():
    """With an app not finalized yet, Celery builds the task on first use: it fails there."""
    app = Celery("lazy", set_as_current=False, broker="memory://")

    @app.task(shared=False, base=MutexTask, mutex={"key": "order.{nope}"})
    def task(order_id: int) -> None: ...

    with pytest.raises(ConstraintError, match="names nope"):
        app.finalize()


def test_bound_task_template_skips_self_and_binds_defaults():
    """bind=True tasks: the template sees the task's own arguments, defaults applied."""
    app = _app()

    @app.task(shared=False, base=MutexTask, bind=True, mutex={"key": "o.{order_id}.{currency}"})
    def charge(self: Any, order_id: int, currency: str = "EUR") -> None: ...

    assert charge.mutex_key(7) == charge.mutex_key(order_id=7) == "o.7.EUR"
    assert charge.mutex_key(7, "USD") == "o.7.USD"


def test_key_from_argument_names_and_from_callable():
    """A list of names keys on those arguments only; a callable gets the call's arguments."""
    app = _app()

    @app.task(shared=False, base=MutexTask, mutex={"key": ["a", "b"]})
    def names(a: int, b: int, c: int = 0) -> None: ...

    @app.task(shared=False, base=MutexTask, mutex={"key": lambda a, **_: f"by-a.{a}"})
    def by_callable(a: int, b: int = 0) -> None: ...

    assert names.mutex_key(1, 2, 3) == names.mutex_key(b=2, a=1, c=9)
    assert names.mutex_key(1, 2) != names.mutex_key(2, 1)
    assert names.mutex_key(1, 2).startswith(names.name + ":")
    assert by_callable.mutex_key(5, b=1) == "by-a.5"


class Color(enum.Enum):
    RED = "red"


def test_omitted_key_is_name_plus_every_argument_stably_encoded():
    """Same values give the same key whatever their spelling; different values differ."""
    app = _app()

    @app.task(shared=False, base=MutexTask)
    def job(ref: Any, when: Any = None, meta: Any = None) -> None: ...

    u = uuid.uuid4()
    utc = dt.datetime(2026, 1, 1, 12, tzinfo=dt.timezone.utc)
    cet = utc.astimezone(dt.timezone(dt.timedelta(hours=1)))
    assert job.mutex_key(u) == job.mutex_key(ref=str(u), when=None)
    assert job.mutex_key(1, utc) == job.mutex_key(1, when=cet)
    assert job.mutex_key(1, meta={"a": 1, "b": [1, 2]}) == job.mutex_key(
        1, meta={"b": [1, 2], "a": 1}
    )
    assert job.mutex_key(decimal.Decimal("1.0")) == job.mutex_key(decimal.Decimal("1.00"))
    assert job.mutex_key(1) != job.mutex_key("1") != job.mutex_key(1.0)
    assert job.mutex_key(Color.RED) != job.mutex_key("red")
    assert job.mutex_key(1).startswith(job.name + ":")
    assert "0x" not in stable_encoding({"s": {3, 1, 2}})  # no reprs, no addresses
    with pytest.raises(ConstraintError, match="stable lock key"):
        job.mutex_key(object())


def test_settings_come_from_app_conf_or_django_and_task_options_win():
    """CELERY_MUTEX_* under config_from_object(namespace='CELERY') configure the tasks;
    mutex={...} wins over app.conf.mutex_* (retry field by field); a bad app setting is
    refused by name; no cache at all is an error, never a fallback to the broker."""
    django = Celery("dj", set_as_current=False)

    class Settings:
        CELERY_BROKER_URL = "memory://"
        CELERY_MUTEX_CACHE = "memory://"
        CELERY_MUTEX_LEASE = 5
        CELERY_MUTEX_ON_BUSY = "skip"

    django.config_from_object(Settings, namespace="CELERY")
    cfg = _task(django)._mutex_config()
    assert isinstance(cfg.locks.space.cache, InMemoryCache)
    assert (cfg.locks.space.lease, cfg.policy.on_busy) == (5, "skip")
    app = _app(
        mutex_cache="memory://", mutex_lease=5, mutex_on_busy="skip", mutex_retry={"countdown": 3}
    )
    cfg = _task(app, lease=9, retry={"cap": 10})._mutex_config()
    assert (cfg.locks.space.lease, cfg.policy.on_busy) == (9, "skip")
    retry = cfg.policy.retry
    assert (retry.countdown, retry.cap, retry.backoff) == (3, 10, 2)
    with pytest.raises(ConstraintError, match="mutex_on_busy"):
        _task(_app(mutex_cache="memory://", mutex_on_busy="later"))._mutex_config()
    with pytest.raises(ConstraintError, match="mutex_cache"):
        _task(_app(broker_url="redis://127.0.0.1:6379/11"))._mutex_config()


@pytest.mark.integrations
def test_cache_clients_are_rebuilt_after_fork():
    """A forked child (Celery prefork) builds its own cache client, not the parent's."""
    task = _task()
    parent = task._mutex_config()
    assert task._mutex_config() is parent  # cached within the process
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        child = task._mutex_config()
        same = child is parent or child.locks.space.cache is parent.locks.space.cache
        os.write(write, b"same" if same else b"fresh")
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 16) == b"fresh"


def test_eager_apply_and_direct_calls_lock_and_skip():
    """task.apply() (eager) and a direct call task(1) both run under the lock: busy skip
    returns the marker, and the body always has its lease (current_lease() is None only
    outside a body). A direct call nested in a body holding the same key runs inside that
    hold (re-entrant), instead of waiting for itself; a task calling itself on another key
    takes that key and leaves its own held."""
    cache = InMemoryCache()
    app = _app()

    @app.task(
        shared=False, base=MutexTask, mutex={"key": "e.{n}", "on_busy": "skip", "cache": cache}
    )
    def fenced(n: int) -> int:
        return current_lease().fence

    @app.task(
        shared=False, base=MutexTask, mutex={"key": "e.{n}", "on_busy": "wait", "cache": cache}
    )
    def outer(n: int, depth: int = 1) -> tuple[Any, ...]:
        held = current_lease().fence
        deeper = outer(n + 1, depth - 1) if depth else None  # itself, on another key
        return held, fenced(n), deeper, Mutex(cache).locked(f"e.{n}")

    assert fenced.apply(args=(1,)).get() < fenced(1) < fenced(n=1)
    with Mutex(cache).acquire("e.1"):
        assert is_skipped(fenced.apply(args=(1,)).get())
        assert is_skipped(fenced(1))
        assert fenced(2) >= 1  # another key
    held, inner, deeper, still_held = outer(1)
    assert inner == held
    assert deeper[0] > held  # its own lock on e.2
    assert still_held  # and e.1 still ours after it returned
    first, inner, deeper, still_held = outer.apply(args=(1,)).get()
    assert inner == first > held  # the same under the tracer
    assert deeper[0] > first
    assert still_held
    assert current_lease() is None
    assert not Mutex(cache).locked("e.1")


def test_always_eager_busy_retry_waits_then_fails_within_its_budget():
    """task_always_eager cannot re-queue: a busy retry waits for the holder, and fails
    with SimpleMutexAcquireTimeoutError once its retries' budget (0.3 s) is spent."""
    cache = InMemoryCache()
    retry = {"countdown": 0.1, "backoff": 1, "jitter": False, "max": 3}
    task = _task(_app(task_always_eager=True), key="e.{n}", cache=cache, retry=retry)
    started = time.monotonic()
    ReleaseLater(0.2, Mutex(cache).acquire("e.1").release)
    assert task.delay(1).get() == "ran"
    assert time.monotonic() - started >= 0.15
    with Mutex(cache).acquire("e.1"):
        started = time.monotonic()
        result = task.delay(1)
        assert 0.25 <= time.monotonic() - started < 3
    with pytest.raises(SimpleMutexAcquireTimeoutError, match="synchronous call cannot be"):
        result.get()


def test_apply_async_mutex_overrides_key_on_busy_and_timeout_for_one_call():
    """``apply_async(..., mutex={...})`` changes the key, on_busy and timeout of that call
    only (here under task_always_eager); an option that describes the task's locks as a
    whole, or a bad value, raises ConstraintError instead of being ignored."""
    cache = InMemoryCache()
    task = _task(_app(task_always_eager=True), key="e.{n}", cache=cache, on_busy="raise")
    with Mutex(cache).acquire("e.1"):
        assert task.apply_async((1,), mutex={"key": "own"}).get() == "ran"  # another key
        assert is_skipped(task.apply_async((1,), mutex={"on_busy": "skip"}).get())
        with pytest.raises(SimpleMutexAcquireTimeoutError):
            task.apply_async((1,)).get()  # the next call has the task's options again
        with Mutex(cache).acquire("own"), pytest.raises(SimpleMutexAcquireTimeoutError):
            task.apply_async((2,), mutex={"key": "own"}).get()
    holder = Mutex(cache).acquire("e.1")
    ReleaseLater(0.2, holder.release)
    started = time.monotonic()
    waited = task.apply_async((1,), mutex={"on_busy": "wait", "timeout": 5})
    assert waited.get() == "ran"
    assert time.monotonic() - started >= 0.15
    for given, fragment in [
        ({"lease": 5}, "'lease' cannot change per call"),
        ({"cache": "memory://", "prefix": "x."}, "'cache', 'prefix' cannot change per call"),
        ({"on_busy": "later"}, "on_busy must be one of"),
        ({"timeout": -1}, "timeout"),
        ({"key": ""}, "key must be a non-empty str"),
        ({"on_bussy": "skip"}, r"unknown mutex option\(s\) 'on_bussy'"),
        ("skip", "expected a dict of mutex options"),
    ]:
        with pytest.raises(ConstraintError, match=fragment):
            task.apply_async((1,), mutex=given)


def test_a_key_that_looks_like_a_marker_is_still_a_task_lock():
    """The enqueue markers live beside the prefix ("queued.mutex.<key>"), never under it:
    a task whose key is "queued.{n}" neither blocks nor is blocked by another task's
    marker for key "{n}"."""
    cache = InMemoryCache()
    app = _app(mutex_cache=cache, task_always_eager=False)

    @app.task(shared=False, base=MutexTask, mutex={"key": "{n}", "enqueue": "raise"})
    def plain(n: int) -> str:
        return "ran"

    @app.task(shared=False, base=MutexTask, mutex={"key": "queued.{n}", "on_busy": "raise"})
    def looks_alike(n: int) -> str:
        return "ran"

    plain.apply_async((5,), task_id="t-5")  # sent to the in-memory broker, marks "5"
    assert Mutex(cache, prefix="queued.mutex.").locked("5")
    assert not Mutex(cache, prefix="mutex.").locked("queued.5")
    assert looks_alike.apply((5,)).get() == "ran"  # not taken for the marker


def test_a_lost_childs_per_call_key_and_marker_are_freed_by_the_parent():
    """For a child killed mid-task (WorkerLostError) Celery pushes the call's context
    before task_failure: the parent frees the lock and enqueue marker of the call's own
    key (apply_async(mutex={"key": ...})), not of the template's."""
    from celery.app.task import Context
    from celery.exceptions import WorkerLostError

    from celery_mutex import safety_net
    from celery_mutex._owned import owner_of
    from celery_mutex.config import config_of

    cache = InMemoryCache()
    task = _task(_app(mutex_cache=cache), key="{n}", enqueue="raise")
    task_id, key = str(uuid.uuid4()), "own.1"
    cfg = config_of(task)
    for space in (cfg.locks, cfg.markers):
        assert space is not None
        space.acquire(key, owner=owner_of(task_id), attempt=0, timeout=0, renew=False, label="x")
    task.request_stack.push(Context({"id": task_id, "mutex_call": {"key": key}}))
    try:
        safety_net._release_after_child_died(
            sender=task, task_id=task_id, exception=WorkerLostError(), args=(1,), kwargs={}
        )
    finally:
        task.request_stack.pop()
    assert not Mutex(cache, prefix="mutex.").locked(key)
    assert not Mutex(cache, prefix="queued.mutex.").locked(key)


def test_a_producer_needs_a_lock_cache_only_to_queue():
    """Sending a MutexTask builds no lock cache (the worker takes the lock), unless the
    task queues: its ticket is taken at the send, in the lock cache."""
    plain = _task(_app(), key="k.{n}", on_busy="retry")
    assert plain.apply_async((1,)).id
    queued = _task(_app(), key="k.{n}", on_busy="queue")
    with pytest.raises(ConstraintError, match="no lock cache configured"):
        queued.apply_async((1,))


def test_queue_options_are_refused_where_they_cannot_hold():
    """Per call, queue needs the task's own on_busy='queue' (workers sweep only those
    lines); a queued call's arguments must be JSON (it may be parked as JSON)."""
    plain = _task(key="k.{n}", on_busy="retry")
    with pytest.raises(ConstraintError, match="needs the task's own on_busy='queue'"):
        plain.apply_async((1,), mutex={"on_busy": "queue"})
    queued = _task(key="k.{n}", on_busy="queue")
    with pytest.raises(ConstraintError, match="are not JSON"):
        queued.apply_async((object(),))
    assert queued.apply_async((2,)).id  # a JSON call is sent, its ticket taken


def test_an_end_with_nothing_to_publish_sweeps_a_call_that_parked_meanwhile():
    """The next call can arrive between an end's write and the lock's release, find the
    lock still held and park; the end then has nothing to publish. Once released, the end
    sweeps the key, so that call is published at once, not at the next periodic sweep."""
    from celery_mutex import line
    from celery_mutex.config import config_of
    from simple_mutex.busy.line import Park

    task = _task(key="k.{n}", on_busy="queue")
    cfg, key = config_of(task), "k.1"
    first, second = cfg.lines.take(key), cfg.lines.take(key)
    held = cfg.locks.acquire(key, owner="first", attempt=0, timeout=0, renew=False, label="t")
    cfg.lines.start(key, first)
    task.push_request(id="first", args=(1,), kwargs={})
    try:
        call_state.of(task.request).ticket = (key, first)
        then = line.ending(task, None)  # the end's write: 2 has not arrived, nothing to send
        assert isinstance(cfg.lines.arrive(key, second, {"task": task.name, "id": "second",
            "args": [1], "kwargs": {}, "options": {}, "headers": {}}), Park)  # fmt: skip
        held.release()
        sent: list[Any] = []
        task._get_app().send_task = lambda *a, **kw: sent.append((a, kw))
        then()
    finally:
        task.pop_request()
    assert [kw["task_id"] for _, kw in sent] == ["second"]
    line_now = cfg.lines.read(key)
    assert line_now is not None
    assert line_now.parked[second.number].promoted is not None


def test_latest_and_debounce_options_are_checked_where_the_task_is_made():
    """Bad debounce options fail at the first send (they may come from app.conf's
    mutex_debounce, so they are checked merged), naming the fix; a bad field fails at
    definition; per call, the line's disciplines need the task's own (a line keeps one);
    RQ refuses them until its parking is built."""
    with pytest.raises(ConstraintError, match=r"needs debounce=.*set both"):
        _task(key="k.{n}", on_busy="debounce").apply_async((1,))
    bad = _task(key="k.{n}", on_busy="debounce", debounce={"period": 3, "max_delay": 1})
    with pytest.raises(ConstraintError, match="must be at least its period"):
        bad.apply_async((1,))
    with pytest.raises(ConstraintError, match="unknown debounce field"):
        _task(key="k.{n}", on_busy="debounce", debounce={"quiet": 3})
    queued = _task(key="k.{n}", on_busy="queue")
    with pytest.raises(ConstraintError, match="needs the task's own on_busy='latest'"):
        queued.apply_async((1,), mutex={"on_busy": "latest"})
    latest = _task(key="k.{n}", on_busy="latest")
    with pytest.raises(ConstraintError, match="needs the task's own on_busy='queue'"):
        latest.apply_async((1,), mutex={"on_busy": "queue"})
    with pytest.raises(ConstraintError, match="debounce"):
        mutex_job(key="k", on_busy="debounce")  # RQ's mutex_job checks the same options


def test_a_line_with_permits_fails_when_the_task_class_is_made():
    """on_busy="queue" with permits=2 in the task's own options is refused as the task
    class is made (Celery's first use of the task, at the latest a worker's start), not
    at the first send; permits from the app's settings are checked merged."""
    app = Celery("lazy", set_as_current=False, broker="memory://")  # not finalized
    app.conf.mutex_cache = "memory://"

    @app.task(
        shared=False, base=MutexTask, mutex={"key": "k.{n}", "on_busy": "queue", "permits": 2}
    )
    def task(n: int) -> int:
        return n

    with pytest.raises(ConstraintError, match="permits=2 would run several") as info:
        _ = task.name  # the class is made here: nothing was sent
    assert isinstance(info.value, ValueError)
    merged = _task(_app(mutex_cache="memory://", mutex_permits=2), key="k.{n}", on_busy="queue")
    with pytest.raises(ConstraintError, match="permits=2 would run several"):
        merged.apply_async((1,))


def test_a_newer_send_takes_the_waiting_calls_place_and_resolves_it():
    """Keep latest at the producer: the first call goes to the broker (nobody ahead), the
    second waits in the line, the third takes its place and ticket: the second's
    AsyncResult resolves at once to the skip marker, superseded by the third's id."""
    from celery_mutex.config import config_of

    task = _task(key="k.{n}", on_busy="latest")
    first, second, third = (task.apply_async((1,)) for _ in range(3))
    marker = second.get(timeout=5)
    assert is_skipped(marker)
    assert (marker["reason"], marker["by"], marker["key"]) == ("superseded", third.id, "k.1")
    line = config_of(task).lines.read("k.1")
    assert line is not None
    assert [p.message["id"] for p in line.parked.values()] == [third.id]
    assert (line.next, line.turn) == (3, 1)  # the third took ticket 2: no ticket per call
    assert not first.ready()
    assert not third.ready()


def test_a_debounced_send_always_waits_and_a_newer_one_pushes_it_back():
    """Debounce at the producer: even the first call of a burst waits in the line, due a
    period later; a newer call takes its place, keeps the burst's start, and pushes the
    due time back, never past max_delay from the burst's first call."""
    from celery_mutex.config import config_of

    task = _task(key="k.{n}", on_busy="debounce", debounce={"period": 2, "max_delay": 3})
    lines = config_of(task).lines
    results = [task.apply_async((1,))]
    parked = next(iter(lines.read("k.1").parked.values()))  # type: ignore[union-attr]
    assert parked.due == pytest.approx(parked.at + 2, abs=0.01)
    time.sleep(0.3)
    results.append(task.apply_async((1,)))
    entry = next(iter(lines.read("k.1").parked.values()))  # type: ignore[union-attr]
    assert (entry.message["id"], entry.at) == (results[1].id, parked.at)
    assert entry.due == pytest.approx(parked.at + 2.3, abs=0.1)
    time.sleep(1.0)
    results.append(task.apply_async((1,)))
    entry = next(iter(lines.read("k.1").parked.values()))  # type: ignore[union-attr]
    assert entry.due == pytest.approx(parked.at + 3)  # max_delay caps it
    assert [r.get(timeout=5)["by"] for r in results[:2]] == [results[1].id, results[2].id]


def test_a_worker_names_each_task_it_could_not_guard():
    """``startup.check``: a task given mutex={...} without base=MutexTask (Celery keeps
    the option as a plain attribute: no lock at all) refuses the worker; a MutexTask with
    no lock cache refuses it when no guarded task could run, and is only named when one
    could."""
    from celery_mutex.startup import check

    def alone() -> Celery:
        """An app without the shared tasks other test modules of this process declared."""
        app = _app()
        for name in [name for name in app.tasks if not name.startswith(__name__)]:
            del app.tasks[name]
        return app

    app = alone()

    @app.task(shared=False, mutex={"key": "o.{n}", "on_busy": "skip"})
    def forgot_the_base(n: int) -> None: ...

    @app.task(shared=False, base=MutexTask, mutex={"key": "o.{n}"})
    def no_cache(n: int) -> None: ...

    found = check(app)
    assert found.refused()
    [unguarded] = found.unguarded
    assert "forgot_the_base: mutex={...} is set, but the task's base is not MutexTask" in unguarded
    assert "base=MutexTask" in unguarded
    [unconfigured] = found.unconfigured
    assert "no_cache: no lock cache configured; set app.conf.mutex_cache" in unconfigured
    assert found.guarded == 0

    class KeepsALock(Task):  # a base class's own attribute of that name: not options
        mutex = threading.Lock()

    app = alone()

    @app.task(shared=False, base=KeepsALock)
    def unrelated(n: int) -> None: ...

    assert check(app).unguarded == []

    @app.task(shared=False, base=MutexTask, mutex={"key": "o.{n}"})
    def lacks_a_cache(n: int) -> None: ...

    assert check(app).refused()  # no guarded task could run

    @app.task(shared=False, base=MutexTask, mutex={"key": "p.{n}", "cache": "memory://"})
    def has_a_cache(n: int) -> None: ...

    found = check(app)
    assert (found.refused(), len(found.unconfigured), found.guarded) == (False, 1, 1)


def test_a_call_that_expires_holds_its_line_until_its_expiry_at_most() -> None:
    """A call sent through the broker with ``expires`` (here with a countdown) takes its
    place with a gap clock that runs out at its expiry: a broker that drops it unseen
    then (RabbitMQ's message TTL) holds the calls behind it that long, not gap_for."""
    import time

    from celery_mutex import line
    from celery_mutex.config import config_of

    task = _task(key="o.{n}", on_busy="queue")
    lines = config_of(task).lines
    gap_for = config_of(task).policy.queue.gap_for
    sent = time.time()
    assert line.at_send(task, (1,), {}, {"countdown": 0.5, "expires": 2}) is None
    assert line.at_send(task, (1,), {}, {"countdown": 0.5}) is None
    record = lines.read("o.1")
    assert record is not None
    expiring, plain = record.issued[1], record.issued[2]
    assert expiring + gap_for == pytest.approx(sent + 2, abs=0.5)  # skippable at its expiry
    assert plain == pytest.approx(sent + 0.5, abs=0.5)  # gap_for after it is due, as before
