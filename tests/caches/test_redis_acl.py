"""Least privilege on Redis: ``RedisCache.acl_rules()`` against the real server at REDIS_URL.

The contract, behaviour, asyncio and CLI suites also run as a user made from the rules
(``AsLockUser`` classes in test_redis.py / test_redis_async.py, the ``redis-lock-user``
CLI parameter). Here: the words themselves, the scripts' keys, a user for another prefix
refused both ways, a missing command named, and Celery's records (enqueue markers, beat
claims, beat-run ticks) under ``celery_mutex.acl_prefixes()``.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery
from celery.beat import ScheduleEntry, Scheduler, SchedulingError
from celery.schedules import schedule
from redis_acl import lock_user, url_as
from servers import ROOT
from shared_redis import REDIS_URL, shared_client

import celery_mutex
from celery_mutex.beat import MutexSchedulerMixin, drop_duplicate_tick
from simple_mutex import (
    ConstraintTypeError,
    ConstraintValueError,
    MalfunctionError,
    Mutex,
    Semaphore,
    cache_from_url,
)
from simple_mutex.caches import AsyncRedisCache, RedisCache
from simple_mutex.caches.redis.protocol import CAS, DELETE, PUT

pytestmark = pytest.mark.backends

RUN = uuid.uuid4().hex[:8]


@pytest.fixture(scope="module")
def admin() -> Iterator[redis.Redis]:
    """The server's default user, to make users and look behind the cache's back."""
    with shared_client(REDIS_URL, f"*acl{RUN}*") as conn:
        yield conn


@contextlib.contextmanager
def as_user(admin: redis.Redis, *rules: list[str]) -> Iterator[str]:
    """A URL of a fresh user made from ``rules``, deleted after the block."""
    with lock_user(admin, *rules) as (user, password):
        yield url_as(REDIS_URL, user, password)


def test_the_default_words_are_one_key_pattern_and_the_exact_commands() -> None:
    """The words the guides print: the default prefix's hash-tagged head, the eighteen
    commands the library sends (Lua scripts' own included, the index's too), no channel,
    no CONFIG."""
    assert RedisCache.acl_rules() == [
        "~{mutex.*", "+evalsha", "+script|load", "+get", "+set", "+del", "+exists",
        "+pexpire", "+lpush", "+blpop", "+time", "+scan", "+select", "+zadd", "+zrem",
        "+zremrangebyscore", "+zrange", "+pttl", "+mget",
    ]  # fmt: skip
    assert AsyncRedisCache.acl_rules is RedisCache.acl_rules  # one list for both
    words = RedisCache.acl_rules(("mutex.", "semaphore."), cache_prefix="app:", replicas=True)
    assert words[:2] == ["~app:{mutex.*", "~app:{semaphore.*"]
    assert words[-1] == "+wait"
    assert not any(w.startswith(("&", "+config", "+@", "+keys", "+flush")) for w in words)


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda: RedisCache.acl_rules("mutex."), ConstraintTypeError),  # a str, not a tuple
        (lambda: RedisCache.acl_rules(()), ConstraintTypeError),
        (lambda: RedisCache.acl_rules(("bad prefix*",)), ConstraintValueError),
        (lambda: RedisCache.acl_rules(cache_prefix="a b"), ConstraintValueError),
    ],
)
def test_bad_prefixes_are_refused_naming_the_fix(call: Any, error: type[Exception]) -> None:
    """A bare string, an empty tuple or a prefix with glob or space characters."""
    with pytest.raises(error, match="prefix"):
        call()


def test_every_script_call_names_only_keys_it_received() -> None:
    """Each redis.call / redis.pcall in the Lua scripts takes its key from KEYS[n] (or
    is TIME, which has none): no script builds a key name, so the key pattern of the
    rules covers all a script touches (Cluster and ACL both rely on it)."""
    for script in (PUT, CAS, DELETE):
        calls = re.findall(r"redis\.p?call\(([^)]*)\)", script)
        assert calls
        for call in calls:
            command, *args = [a.strip() for a in call.split(",")]
            if command == "'TIME'":
                assert not args
                continue
            assert re.fullmatch(r"KEYS\[(\d|i)\]", args[0]), call  # i: over the indexes
            if command == "'DEL'":
                assert all(re.fullmatch(r"KEYS\[\d\]", a) for a in args), call


def test_a_user_for_another_prefix_can_neither_take_nor_free_these_locks(admin) -> None:
    """A lock taken by the user for ``own.``; a user whose rules cover ``other.`` only
    gets a MalfunctionError naming the Redis key it may not touch when it tries to take,
    read or free it, and the lock stays with its holder."""
    own, other = f"acl{RUN}own.", f"acl{RUN}other."
    with (
        as_user(admin, RedisCache.acl_rules((own,))) as own_url,
        as_user(admin, RedisCache.acl_rules((other,))) as other_url,
    ):
        lease = Mutex(cache_from_url(own_url), prefix=own, lease=30).acquire("k")
        intruder = Mutex(cache_from_url(other_url), prefix=own, lease=30)
        with pytest.raises(MalfunctionError, match=r"lacks access to the key '\{" + own) as e:
            intruder.acquire("k", timeout=0)
        assert e.value.key == "k"
        with pytest.raises(MalfunctionError, match="NoPermissionError"):
            intruder.holder("k")
        with pytest.raises(MalfunctionError, match="lacks access to the key"):
            intruder.cache.compare_and_delete(own + "k", version=lease.token)  # type: ignore[attr-defined]
        with pytest.raises(MalfunctionError, match="lacks access to the key"):
            cache_from_url(other_url).compare_and_delete(own + "k", version="1.1")
        assert admin.exists(f"{{{own}k}}")
        assert lease.release()


def test_a_missing_command_is_named_as_the_word_to_grant(admin) -> None:
    """Without +evalsha a grant fails naming ``+evalsha``; without +del (called inside
    the release script, where Redis names only the script's line) the release fails
    naming ``+del``, and the lock is left to its lease, not half-freed."""
    prefix = f"acl{RUN}cmd."
    rules = RedisCache.acl_rules((prefix,))
    with (
        as_user(admin, [w for w in rules if w != "+evalsha"]) as url,
        pytest.raises(MalfunctionError, match=r"lacks the command \+evalsha"),
    ):
        Mutex(cache_from_url(url), prefix=prefix).acquire("k", timeout=0)
    with as_user(admin, [w for w in rules if w != "+del"]) as url:
        lease = Mutex(cache_from_url(url), prefix=prefix, lease=30).acquire("k")
        with pytest.raises(
            MalfunctionError, match=r"lacks the command \+del \(called by the compare_and_delete"
        ):
            lease.release()
        assert admin.exists(f"{{{prefix}k}}")
        admin.delete(f"{{{prefix}k}}", f"{{{prefix}k}}:h")


def test_a_semaphore_under_its_own_prefix_needs_that_prefix_in_the_rules(admin) -> None:
    """The default rules cover ``mutex.`` only: a Semaphore (``semaphore.``) is refused
    until its prefix is in the list; then every permit works."""
    prefix = f"acl{RUN}sem."
    with (
        as_user(admin, RedisCache.acl_rules((f"acl{RUN}mutex.",))) as url,
        pytest.raises(MalfunctionError, match="lacks access"),
    ):
        Semaphore(cache_from_url(url), permits=2, prefix=prefix).acquire("k", timeout=0)
    with as_user(admin, RedisCache.acl_rules((prefix,))) as url:
        sem = Semaphore(cache_from_url(url), permits=2, prefix=prefix, lease=30)
        held = [sem.acquire("k", timeout=0), sem.acquire("k", timeout=0)]
        assert sorted(lease.slot for lease in held) == [0, 1]
        assert sem.try_acquire("k") is None
        assert all(lease.release() for lease in held)


class _Recording(MutexSchedulerMixin, Scheduler):  # type: ignore[misc]
    """A plain Scheduler with the guard; send_task records instead of publishing."""

    def __init__(self, app: Celery, sent: list[str]) -> None:
        super().__init__(app, lazy=True)
        self.sent = sent

    def send_task(self, name: str, *args: Any, **options: Any) -> Any:
        self.sent.append(name)
        return SimpleNamespace(id="x")


def test_celery_records_work_under_acl_prefixes(admin) -> None:
    """As a user made from ``acl_rules(celery_mutex.acl_prefixes(prefix))``: two guarded
    beats send a slot once (beat claims), a tick's second message is dropped (beat-run
    ticks), an enqueue marker and a task lock are taken and freed. Without the ``beat.``
    prefix in the rules the beat guard fails closed (nothing sent), naming the key."""
    prefix = f"acl{RUN}c."
    with as_user(admin, RedisCache.acl_rules(celery_mutex.acl_prefixes(prefix))) as url:
        app = Celery(set_as_current=False)
        app.conf.update(mutex_cache=url, mutex_prefix=prefix)
        sent: list[str] = []
        # Hourly: both beats send in one slot (a 1 s slot ended between them once, under load).
        entry = ScheduleEntry(name="r", task="not.imported.r", schedule=schedule(3600.0), app=app)
        for beat in (_Recording(app, sent), _Recording(app, sent)):
            beat.apply_async(entry, producer=object(), advance=False)
        assert sent == ["not.imported.r"]
        cache = cache_from_url(url)
        request = SimpleNamespace(retries=0, mutex_busy_retries=0, mutex_beat_slot="r@1")
        task = SimpleNamespace(name="r", request=request, _get_app=lambda: app)
        assert drop_duplicate_tick(task, cache, prefix, "a") is None
        assert drop_duplicate_tick(task, cache, prefix, "b") is not None
        for kind in ("", "queued."):
            lease = Mutex(cache, prefix=kind + prefix, lease=30).acquire("task.1")
            assert lease.release()
    no_beat = [p for p in celery_mutex.acl_prefixes(prefix) if not p.startswith("beat.")]
    with as_user(admin, RedisCache.acl_rules(no_beat)) as url:
        app = Celery(set_as_current=False)
        app.conf.update(mutex_cache=url, mutex_prefix=prefix)
        entry = ScheduleEntry(name="s", task="not.imported.s", schedule=schedule(1.0), app=app)
        with pytest.raises(SchedulingError, match=r"lacks access to the key '\{beat\."):
            _Recording(app, []).apply_async(entry, producer=object(), advance=False)


def test_the_guides_print_the_words_acl_rules_returns() -> None:
    """The ACL SETUSER lines of the Redis and Celery guides are the rules of today's code
    (for the defaults; the Redis guide's second, of a functions user, for the locks and
    their lines), so a new command cannot leave the guides behind."""
    docs = os.path.join(ROOT, "docs", "guides")
    function_user = RedisCache.acl_rules(("mutex.", "line.mutex."), functions=True)
    for page, expected in (
        ("redis.md", [RedisCache.acl_rules(("mutex.",)), function_user]),
        ("celery.md", [RedisCache.acl_rules(celery_mutex.acl_prefixes())]),
    ):
        with open(os.path.join(docs, page)) as f:
            lines = [line for line in f if line.startswith("ACL SETUSER")]
        assert [line.split("-@all ", 1)[1].split() for line in lines] == expected, page


def test_celery_enqueue_markers_under_acl_prefixes(admin) -> None:
    """A real ``apply_async`` (kombu's in-memory broker) with ``enqueue="raise"``, the
    lock cache reached as a user made from ``acl_rules(celery_mutex.acl_prefixes())``:
    the first call writes its "queued" marker and is sent, an equal one is refused; a
    user without the ``queued.`` pattern fails closed, naming the key."""
    prefix = f"acl{RUN}e."
    with as_user(admin, RedisCache.acl_rules(celery_mutex.acl_prefixes(prefix))) as url:
        app = Celery(set_as_current=False, broker="memory://")
        app.conf.update(mutex_cache=url, mutex_prefix=prefix, task_default_queue=f"q{RUN}")

        @app.task(
            base=celery_mutex.MutexTask, shared=False, mutex={"key": "o.{n}", "enqueue": "raise"}
        )
        def order(n: int) -> None: ...

        order.delay(1)
        with pytest.raises(celery_mutex.AlreadyQueuedError):
            order.delay(1)
        assert admin.exists(f"{{queued.{prefix}o.1}}")
    no_queued = [p for p in celery_mutex.acl_prefixes(prefix) if not p.startswith("queued.")]
    with as_user(admin, RedisCache.acl_rules(no_queued)) as url:
        app = Celery(set_as_current=False, broker="memory://")
        app.conf.update(mutex_cache=url, mutex_prefix=prefix, task_default_queue=f"q{RUN}")

        @app.task(
            base=celery_mutex.MutexTask, shared=False, mutex={"key": "o.{n}", "enqueue": "raise"}
        )
        def refused(n: int) -> None: ...

        with pytest.raises(MalfunctionError, match=r"lacks access to the key '\{queued\."):
            refused.delay(2)  # fails closed: nothing sent unmarked
