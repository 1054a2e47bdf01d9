"""The error tree: hierarchy, ``.key`` carried verbatim, and pickling (Celery and RQ
serialize exceptions), including the per-lease interrupt raised inside a block."""

from __future__ import annotations

import pickle

import pytest
from workers import spin

import simple_mutex
from simple_mutex import (
    ConstraintError,
    InMemoryCache,
    LineFullError,
    MalfunctionError,
    Mutex,
    SimpleCacheConditionError,
    SimpleMutexAcquireTimeoutError,
    SimpleMutexError,
    SimpleMutexLeaseExpiredError,
)
from simple_mutex._runtime.interrupt import LeaseInterrupt

pytestmark = pytest.mark.fast

ERRORS = [
    SimpleMutexError,
    ConstraintError,
    MalfunctionError,
    SimpleCacheConditionError,
    SimpleMutexAcquireTimeoutError,
    SimpleMutexLeaseExpiredError,
    LineFullError,
]
WEIRD_KEY = "order/ü {42}*#%"


@pytest.mark.parametrize("cls", ERRORS)
@pytest.mark.parametrize("key", [WEIRD_KEY, None])
@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_every_error_pickles_round_trip(cls, key, protocol):
    """Each error class survives pickling with its type, message and key."""
    error = cls("something broke; do this instead", key=key)
    copy = pickle.loads(pickle.dumps(error, protocol=protocol))
    assert type(copy) is cls
    assert str(copy) == "something broke; do this instead"
    assert copy.message == error.message
    assert copy.key == key


@pytest.mark.parametrize("flags", [{"unsent": True}, {"withheld": True}, {}])
@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_a_malfunction_keeps_its_flags_through_pickle(flags, protocol):
    """``unsent`` and ``withheld`` say whether a write can have landed: a copy rebuilt by
    Celery or RQ (they pickle errors) says the same."""
    error = MalfunctionError("redis cache failed", key=WEIRD_KEY, **flags)
    copy = pickle.loads(pickle.dumps(error, protocol=protocol))
    assert (copy.unsent, copy.withheld) == (error.unsent, error.withheld)
    assert (copy.message, copy.key) == (error.message, error.key)


@pytest.mark.parametrize("cls", ERRORS)
def test_every_error_is_exported_and_rooted(cls):
    """Every error is importable from simple_mutex and derives from SimpleMutexError; one
    about an option (no key involved) has key None."""
    assert getattr(simple_mutex, cls.__name__) is cls
    assert cls("bad option").key is None
    assert issubclass(cls, SimpleMutexError)
    assert issubclass(cls, Exception)


@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_a_full_line_keeps_its_limit_through_pickle(protocol):
    """``LineFullError.limit`` (the ``queue_max`` that refused the send) survives the
    pickling Celery and RQ do to report it."""
    error = LineFullError("line full", key=WEIRD_KEY, limit=7)
    copy = pickle.loads(pickle.dumps(error, protocol=protocol))
    assert type(copy) is LineFullError
    assert (copy.limit, copy.key, copy.message) == (7, WEIRD_KEY, "line full")


def test_hierarchy_matches_the_design():
    """Timeout and lease loss are ConstraintErrors (timeout also TimeoutError); faults not."""
    assert issubclass(SimpleMutexAcquireTimeoutError, ConstraintError)
    assert issubclass(SimpleMutexAcquireTimeoutError, TimeoutError)
    assert issubclass(SimpleMutexLeaseExpiredError, ConstraintError)
    assert not issubclass(SimpleMutexLeaseExpiredError, TimeoutError)
    assert not issubclass(ConstraintError, ValueError)  # "busy" never hides in ValueError
    assert not issubclass(MalfunctionError, ConstraintError)
    assert not issubclass(SimpleCacheConditionError, ConstraintError)
    assert not issubclass(SimpleCacheConditionError, MalfunctionError)
    # A full line is the user's queue_max speaking: not bad input, not a fault.
    assert not issubclass(LineFullError, (ConstraintError, MalfunctionError, ValueError))


def capture_interrupt() -> BaseException:
    """Let a 0.2 s lease lapse inside a busy loop and return what was raised in it."""
    mutex = Mutex(InMemoryCache(), lease=0.2)
    caught: list[BaseException] = []

    def spin_and_record() -> None:
        try:
            spin()
        except BaseException as exc:
            caught.append(exc)
            raise

    with pytest.raises(SimpleMutexLeaseExpiredError), mutex.acquire(WEIRD_KEY):
        spin_and_record()
    assert caught, "the busy loop was never interrupted"
    return caught[0]


def test_interrupt_inside_a_block_is_a_lease_expired_error_that_pickles_to_one():
    """The in-block interrupt is a LeaseExpired error with the key and pickles to one."""
    interrupt = capture_interrupt()
    assert isinstance(interrupt, SimpleMutexLeaseExpiredError)
    assert isinstance(interrupt, LeaseInterrupt)
    assert interrupt.key == WEIRD_KEY
    assert WEIRD_KEY in str(interrupt)
    copy = pickle.loads(pickle.dumps(interrupt))
    assert type(copy) is SimpleMutexLeaseExpiredError
    assert copy.key == WEIRD_KEY
    assert str(copy) == str(interrupt)


def test_errors_from_the_api_carry_the_users_key_verbatim(memory_cache):
    """A timeout on a key with unsafe characters reports the key as given, not encoded."""
    mutex = Mutex(memory_cache)
    mutex.acquire(WEIRD_KEY)
    with pytest.raises(SimpleMutexAcquireTimeoutError) as info:
        mutex.acquire(WEIRD_KEY, timeout=0)
    assert info.value.key == WEIRD_KEY
    copy = pickle.loads(pickle.dumps(info.value))
    assert copy.key == WEIRD_KEY
    assert isinstance(copy, TimeoutError)


def test_malfunction_names_cache_and_operation_and_carries_the_key():
    """A backend fault is a MalfunctionError naming cache and operation, with the key."""

    class Down(InMemoryCache):
        name = "downcache"

        def get(self, key):
            raise ConnectionError("refused")

    mutex = Mutex(Down())
    with pytest.raises(MalfunctionError) as info:
        mutex.holder(WEIRD_KEY)
    assert info.value.key == WEIRD_KEY
    assert "downcache" in str(info.value)
    assert "Get" in str(info.value)
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is MalfunctionError
    assert copy.key == WEIRD_KEY


def test_a_corrupt_record_is_a_malfunction_not_a_crash(memory_cache):
    """A non-record value under the lock prefix makes holder() raise MalfunctionError."""
    memory_cache.put_if_absent("mutex.k", "not json", ttl=30)
    with pytest.raises(MalfunctionError, match="not a lock record") as info:
        Mutex(memory_cache).holder("k")
    assert info.value.key == "k"
