"""with_simple_mutex on plain functions: keys from templates (defaults applied) or
callables, both decorator forms, metadata, busy keys, and exclusion between threads. What
holds for an ``async def`` alike runs for both (the rest of async: test_async.py)."""

from __future__ import annotations

import asyncio
import functools
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from workers import spin

from simple_mutex import (
    ConstraintError,
    InMemoryCache,
    MalfunctionError,
    Mutex,
    SimpleMutexAcquireTimeoutError,
    SimpleMutexLeaseExpiredError,
    with_simple_mutex,
)

pytestmark = pytest.mark.fast


def held_keys(mutex: Mutex, candidates: list[str]) -> list[str]:
    return [k for k in candidates if mutex.locked(k)]


def decorated(kind: str, body: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """``body`` guarded by with_simple_mutex as a plain function ("sync"), or behind an
    ``async def`` of the same signature ("async") that each call runs to its end."""
    if kind == "sync":
        return with_simple_mutex(body, **options)

    @functools.wraps(body)
    async def coroutine(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0)
        return body(*args, **kwargs)

    guarded = with_simple_mutex(coroutine, **options)
    return lambda *args, **kwargs: asyncio.run(guarded(*args, **kwargs))


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_template_key_is_filled_from_bound_arguments_with_defaults(memory_cache, kind):
    """f(1), f(phone=1) and f(1, 'eu') all lock 'phone.1.eu'; f(1, 'us') locks another;
    for a plain function and an async def alike."""
    probe = Mutex(memory_cache)
    candidates = ["phone.1.eu", "phone.1.us", "phone.{phone}.{region}", "phone.1.{region}"]
    seen: list[list[str]] = []

    def body(phone, region="eu"):
        seen.append(held_keys(probe, candidates))
        return phone

    call = decorated(kind, body, key="phone.{phone}.{region}", cache=memory_cache, timeout=0)
    assert call(1) == 1
    call(phone=1)
    call(1, "eu")
    call(region="eu", phone=1)
    call(1, region="us")
    assert seen == [["phone.1.eu"]] * 4 + [["phone.1.us"]]
    assert held_keys(probe, candidates) == []  # all released


def test_templates_reach_into_attributes_of_arguments_and_self(memory_cache):
    """'{order.id}' formats an attribute of an argument; on a method, '{self.number}'
    keys each instance apart."""

    @dataclass
    class Order:
        id: int

    probe = Mutex(memory_cache)
    seen = []

    @with_simple_mutex(key="order.{order.id}", cache=memory_cache)
    def ship(order):
        seen.append(held_keys(probe, ["order.17"]))

    class Account:
        def __init__(self, number):
            self.number = number

        @with_simple_mutex(key="acct.{self.number}", cache=memory_cache)
        def settle(self):
            seen.append(held_keys(probe, ["acct.1", "acct.2"]))

    ship(Order(17))
    Account(1).settle()
    Account(2).settle()
    assert seen == [["order.17"], ["acct.1"], ["acct.2"]]


def test_callable_key_receives_the_call_arguments_and_must_return_a_str(memory_cache):
    """A callable key gets the same arguments as the function and names the lock; one
    returning a non-str raises ConstraintError before the body runs."""
    probe = Mutex(memory_cache)
    calls = []
    seen = []

    def key_of(a, b=2, **extra):
        calls.append((a, b, extra))
        return f"sum.{a + b}" if a else a

    @with_simple_mutex(key=key_of, cache=memory_cache)
    def add(a, b=2, **extra):
        seen.append(probe.locked(f"sum.{a + b}"))
        return a + b

    assert add(1, b=5, c=3) == 6
    assert calls == [(1, 5, {"c": 3})]
    assert seen == [True]
    with pytest.raises(ConstraintError, match="non-empty str"):
        add(0)
    assert seen == [True]


def test_template_naming_a_missing_argument_fails_at_decoration(memory_cache):
    """A template field the function does not take is a ConstraintError at decoration."""
    with pytest.raises(ConstraintError, match="phone"):

        @with_simple_mutex(key="phone.{phone}", cache=memory_cache)
        def call(number):
            pass  # pragma: no cover


def test_template_with_var_keyword_is_filled_from_kwargs(memory_cache):
    """With **kwargs, a template field may come from any keyword argument."""
    probe = Mutex(memory_cache)
    seen = []

    @with_simple_mutex(key="job.{name}.{n}", cache=memory_cache)
    def run(n=0, **kwargs):
        seen.append(probe.locked(f"job.{kwargs['name']}.{n}"))

    run(name="sync")
    run(n=3, name="sync")
    assert seen == [True, True]
    with pytest.raises(ConstraintError, match="name"):
        run(n=1)  # no 'name' given: the key cannot be built


def test_arguments_that_do_not_fit_raise_constraint_error(memory_cache):
    """Calling with arguments the signature rejects fails before locking anything."""

    @with_simple_mutex(key="x.{a}", cache=memory_cache)
    def f(a):
        pass  # pragma: no cover

    with pytest.raises(ConstraintError, match="do not fit"):
        f(1, 2)


def test_wrappers_keep_function_metadata(memory_cache):
    """The wrapper keeps name, qualname, doc, module and __wrapped__; an async def's
    wrapper is itself an async def."""

    def original(a: int, b: str = "x") -> str:
        """Original docstring."""
        return b * a

    async def coroutine(a):
        """Doc."""
        return a

    wrapped = with_simple_mutex(original, key="m.{a}", cache=memory_cache)
    wrapped_async = with_simple_mutex(coroutine, key="m.{a}", cache=memory_cache)
    for logic, wrapper in ((original, wrapped), (coroutine, wrapped_async)):
        for attribute in ("__name__", "__qualname__", "__doc__", "__module__"):
            assert getattr(wrapper, attribute) == getattr(logic, attribute)
        assert wrapper.__wrapped__ is logic  # type: ignore[attr-defined]
    assert wrapped(2, "ab") == "abab"
    assert asyncio.iscoroutinefunction(wrapped_async)
    assert asyncio.run(wrapped_async(3)) == 3


def test_timeout_zero_on_a_busy_key_raises_acquire_timeout(memory_cache):
    """A call with timeout=0 while another holder has the key raises at once."""
    ran = []

    @with_simple_mutex(key="busy.{n}", cache=memory_cache, timeout=0)
    def work(n):
        ran.append(n)

    holder = Mutex(memory_cache).acquire("busy.1")
    start = time.monotonic()
    with pytest.raises(SimpleMutexAcquireTimeoutError) as info:
        work(1)
    assert time.monotonic() - start < 0.5
    assert info.value.key == "busy.1"
    assert ran == []
    work(2)  # another key is free
    holder.release()
    work(1)
    assert ran == [2, 1]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_body_exception_propagates_and_releases(memory_cache, kind):
    """An exception from the function (or coroutine) comes out unchanged; the key is freed."""

    def fail():
        raise LookupError("nope")

    with pytest.raises(LookupError, match="nope"):
        decorated(kind, fail, key="err", cache=memory_cache)()
    assert not Mutex(memory_cache).locked("err")


class _ReleaseFails(InMemoryCache):
    """Every release (compare-and-delete) fails, as a reset connection would."""

    name = "flaky"

    def compare_and_delete(self, key: str, *, version: str) -> bool | None:
        raise MalfunctionError(f"flaky cache failed during compare_and_delete on {key!r}")


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_failed_release_after_work_that_finished_says_so(kind):
    """The work finished but the release failed: a plain function and an ``async def``
    alike raise MalfunctionError saying so (the seed's test), never the raw fault."""
    with pytest.raises(MalfunctionError, match="finished, but releasing the lock failed"):
        decorated(kind, lambda: 1, key="k", cache=_ReleaseFails())()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_failed_release_after_work_that_failed_reaches_the_caller_too(kind):
    """Work and release both failed: the work's error, carrying the release fault."""

    def fail() -> None:
        raise LookupError("nope")

    with pytest.raises(LookupError) as info:
        decorated(kind, fail, key="k", cache=_ReleaseFails())()
    assert any("releasing the lock" in note for note in info.value.__notes__)


def test_lease_lapse_interrupts_the_function(memory_cache):
    """A function running past its lease is interrupted with SimpleMutexLeaseExpiredError."""

    @with_simple_mutex(key="slow", cache=memory_cache, lease=0.2)
    def slow():
        spin()

    start = time.monotonic()
    with pytest.raises(SimpleMutexLeaseExpiredError) as info:
        slow()
    assert time.monotonic() - start < 1.5
    assert info.value.key == "slow"


def test_renew_true_lets_the_function_outlive_its_lease(memory_cache):
    """renew=True keeps a 0.2 s lease alive through a 0.6 s call."""

    @with_simple_mutex(key="long", cache=memory_cache, lease=0.2, renew=True)
    def long_call():
        time.sleep(0.6)
        return "done"

    assert long_call() == "done"


def test_threads_incrementing_a_counter_end_exact_with_zero_overlaps(memory_cache):
    """Read-modify-write under the decorator from many threads: exact count, no overlap."""
    state = {"count": 0}
    intervals: list[tuple[float, float]] = []

    @with_simple_mutex(key="counter", cache=memory_cache, interval=0.01, timeout=5)
    def increment():
        start = time.perf_counter()
        value = state["count"]
        time.sleep(0.0005)  # invite a race if the lock did not hold
        state["count"] = value + 1
        intervals.append((start, time.perf_counter()))

    def worker():
        for _ in range(25):
            increment()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert state["count"] == 100
    intervals.sort()
    overlaps = [(a, b) for a, b in itertools.pairwise(intervals) if b[0] < a[1]]
    assert overlaps == []


def test_partial_objects_can_be_wrapped(memory_cache):
    """Callables without __name__ quirks (functools.partial) still get guarded."""
    probe = Mutex(memory_cache)
    seen = []

    def body(a, b):
        seen.append(probe.locked(f"p.{a}"))
        return a + b

    guarded = with_simple_mutex(functools.partial(body, b=1), key="p.{a}", cache=memory_cache)
    assert guarded(4) == 5
    assert seen == [True]


def guard_generator(cache, kind: str) -> list[bool]:
    """Decorate a (sync or async) generator that reports whether its lock is held while
    its body runs, and run it to the end."""
    probe = Mutex(cache)
    if kind == "sync":

        @with_simple_mutex(key="gen", cache=cache, timeout=0)
        def gen():
            yield probe.locked("gen")

        return list(gen())

    @with_simple_mutex(key="gen", cache=cache, timeout=0)
    async def agen():
        yield probe.locked("gen")

    async def consume():
        return [x async for x in agen()]

    return asyncio.run(consume())


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_generator_bodies_never_run_unprotected(memory_cache, kind):
    """A decorated generator is refused, or its body runs under the lock; never unlocked."""
    refusal: ConstraintError | None = None
    try:
        seen = guard_generator(memory_cache, kind)
    except ConstraintError as exc:
        refusal = exc
    if refusal is not None:
        assert "generator" in str(refusal)
    else:
        assert seen == [True], "the generator body ran without the lock"
