"""MutexTask definition-time checks, key derivation and settings (no worker needed)."""

from __future__ import annotations

import datetime as dt
import decimal
import enum
import os
import uuid
from typing import Any

import celery_support  # noqa: F401  (puts celery_mutex on sys.path)
import pytest
from celery import Celery

# isort: split
from celery_mutex import MutexTask, current_lease, is_skipped
from celery_mutex.keys import stable_encoding
from simple_mutex import ConstraintError, InMemoryCache, Mutex


def _app(**conf: Any) -> Celery:
    app = Celery("opts", set_as_current=False, broker="memory://", backend="cache+memory://")
    app.conf.update(conf)
    app.finalize()
    return app


def test_unknown_option_fails_when_the_task_is_defined():
    """A typo in mutex={...} raises at @app.task, naming the known options."""
    app = _app()
    with pytest.raises(ConstraintError, match=r"unknown mutex option.*'on_bussy'"):

        @app.task(shared=False, base=MutexTask, mutex={"on_bussy": "skip"})
        def task(order_id: int) -> None: ...


def test_template_naming_a_missing_argument_fails_when_defined():
    """key='order.{order}' on a task taking order_id fails at definition."""
    app = _app()
    with pytest.raises(ConstraintError, match="names order"):

        @app.task(shared=False, base=MutexTask, mutex={"key": "order.{order}"})
        def task(order_id: int) -> None: ...


@pytest.mark.parametrize(
    "options",
    [
        {"on_busy": "queue"},
        {"lease": -1},
        {"permits": 0},
        {"renew": "yes"},
        {"retry": {"countdown": 1, "every": 2}},
        {"key": ["missing"]},
        {"key": 42},
        {"enqueue": "maybe"},
    ],
)
def test_bad_option_values_fail_when_defined(options):
    """Each bad value is refused at definition with a ConstraintError."""
    app = _app()
    with pytest.raises(ConstraintError):

        @app.task(shared=False, base=MutexTask, mutex=options)
        def task(order_id: int) -> None: ...


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


def test_django_namespace_settings_are_read():
    """CELERY_MUTEX_* under config_from_object(namespace='CELERY') configure the tasks."""
    app = Celery("dj", set_as_current=False)

    class Settings:
        CELERY_BROKER_URL = "memory://"
        CELERY_MUTEX_CACHE = "memory://"
        CELERY_MUTEX_LEASE = 5
        CELERY_MUTEX_ON_BUSY = "skip"

    app.config_from_object(Settings, namespace="CELERY")

    @app.task(shared=False, base=MutexTask, mutex={"key": "k.{n}"})
    def task(n: int) -> None: ...

    cfg = task._mutex_config()
    assert isinstance(cfg.locks.space.cache, InMemoryCache)
    assert cfg.locks.space.lease == 5
    assert cfg.policy.on_busy == "skip"


def test_task_options_override_app_settings_and_bad_settings_fail():
    """mutex={...} wins over app.conf.mutex_*; a bad app setting is refused by name."""
    app = _app(
        mutex_cache="memory://", mutex_lease=5, mutex_on_busy="skip", mutex_retry={"countdown": 3}
    )

    @app.task(shared=False, base=MutexTask, mutex={"lease": 9, "retry": {"cap": 10}})
    def task(n: int) -> None: ...

    cfg = task._mutex_config()
    assert (cfg.locks.space.lease, cfg.policy.on_busy) == (9, "skip")
    assert (cfg.policy.retry.countdown, cfg.policy.retry.cap, cfg.policy.retry.backoff) == (3, 10, 2)  # merged
    bad = _app(mutex_cache="memory://", mutex_on_busy="later")

    @bad.task(shared=False, base=MutexTask)
    def other(n: int) -> None: ...

    with pytest.raises(ConstraintError, match="mutex_on_busy"):
        other._mutex_config()


def test_missing_cache_is_an_error_not_a_broker_fallback():
    """No mutex_cache and no cache option: ConstraintError naming the setting."""
    app = _app(broker_url="redis://127.0.0.1:6379/11")

    @app.task(shared=False, base=MutexTask)
    def task(n: int) -> None: ...

    with pytest.raises(ConstraintError, match="mutex_cache"):
        task._mutex_config()


def test_cache_clients_are_rebuilt_after_fork():
    """A forked child (Celery prefork) builds its own cache client, not the parent's."""
    app = _app(mutex_cache="memory://")

    @app.task(shared=False, base=MutexTask)
    def task(n: int) -> None: ...

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


def test_eager_apply_locks_and_skips():
    """task.apply() (eager) runs under the lock too: busy skip returns the marker."""
    cache = InMemoryCache()
    app = _app()

    @app.task(
        shared=False, base=MutexTask, mutex={"key": "e.{n}", "on_busy": "skip", "cache": cache}
    )
    def task(n: int) -> str:
        return "ran"

    assert task.apply(args=(1,)).get() == "ran"
    with Mutex(cache).acquire("e.1"):
        assert is_skipped(task.apply(args=(1,)).get())
    assert task(1) == "ran"  # a direct call is a plain function call: no lock


def test_current_lease_is_none_outside_a_task():
    """current_lease() outside a running MutexTask returns None, it does not raise."""
    assert current_lease() is None
