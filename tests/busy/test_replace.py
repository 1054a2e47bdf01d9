"""``simple_mutex.busy.replace``: the take-over round and the holder's watch, in one
process on an in-memory cache (the integrations' suites run them across real workers:
``tests/celery_mutex/test_celery_replace.py``, ``tests/rq_mutex/test_rq_replace.py``)."""

from __future__ import annotations

import logging
import time

import pytest

from simple_mutex import InMemoryCache, Mutex, SimpleMutexAcquireTimeoutError
from simple_mutex.busy import replace
from simple_mutex.busy.replace import Takeover, call_in_brackets

pytestmark = pytest.mark.fast


def _over(locks: Mutex, key: str, stopped: list[str], **changes: object) -> Takeover:
    fields: dict[str, object] = {
        "key": key,
        "call": "new[n]",
        "take_once": lambda: locks.acquire(key, timeout=0, token="n.0", label="new[n]"),
        "holder": lambda: locks.holder(key),
        "victim_of": lambda held: call_in_brackets(held.label),
        "free": lambda victim: locks.evict(key, lambda t: t.startswith(victim + "."), by="new[n]"),
        "stop": stopped.append,
        "log": logging.getLogger("test"),
        **changes,
    }
    return Takeover(**fields)  # type: ignore[arg-type]


def test_the_round_frees_the_holder_asks_it_to_stop_and_takes_a_larger_fence():
    locks = Mutex(InMemoryCache(), lease=30)
    old = locks.acquire("k", token="o.0", label="old[o]")
    stopped: list[str] = []
    new = replace.take(_over(locks, "k", stopped))
    assert stopped == ["o"]
    assert new.fence > old.fence
    assert locks.holder("k").label == "new[n]"  # type: ignore[union-attr]
    new.release()


def test_a_holder_it_cannot_stop_makes_it_fail_after_its_rounds():
    """A record with no call in its label (or an earlier attempt of this call) is never
    freed: ROUNDS tries, then SimpleMutexAcquireTimeoutError naming that holder (not
    "other replacing calls", which there were none of)."""
    locks = Mutex(InMemoryCache(), lease=30)
    held = locks.acquire("k", token="x.0", label="someone")
    stopped: list[str] = []
    with pytest.raises(SimpleMutexAcquireTimeoutError, match="held by 'someone', which on_busy"):
        replace.take(_over(locks, "k", stopped))
    assert stopped == []
    assert locks.holder("k").label == "someone"  # type: ignore[union-attr]
    held.release()


def test_replacing_calls_that_keep_taking_the_key_exhaust_the_rounds():
    """Each round's holder is stopped, and another call takes the key before ours: after
    ROUNDS rounds, the error says other replacing calls hold it."""
    locks = Mutex(InMemoryCache(), lease=30)
    stopped: list[str] = []

    def rival_takes(victim: str) -> None:
        stopped.append(victim)
        locks.acquire("k", token=f"r{len(stopped)}.0", label=f"rival[r{len(stopped)}]")

    locks.acquire("k", token="r0.0", label="rival[r0]")
    with pytest.raises(SimpleMutexAcquireTimeoutError, match=f"each of {replace.ROUNDS} rounds"):
        replace.take(_over(locks, "k", [], stop=rival_takes))
    assert stopped == [f"r{n}" for n in range(replace.ROUNDS)]


def test_a_newer_holder_makes_this_call_give_way():
    """victim_of raising NewerCall (the holder was sent after us): it leaves take as it
    is, nothing freed, nothing stopped."""
    locks = Mutex(InMemoryCache(), lease=30)
    locks.acquire("k", token="o.0", label="newer[o]")
    stopped: list[str] = []

    def newer(held: object) -> str:
        raise replace.NewerCall("newer[o]")

    with pytest.raises(replace.NewerCall, match="superseded by newer"):
        replace.take(_over(locks, "k", stopped, victim_of=newer))
    assert stopped == []
    assert locks.holder("k").label == "newer[o]"  # type: ignore[union-attr]


def test_a_free_key_is_taken_with_no_stop():
    locks = Mutex(InMemoryCache(), lease=30)
    stopped: list[str] = []
    replace.take(_over(locks, "k", stopped)).release()
    assert stopped == []


def test_a_watched_lease_whose_record_was_taken_is_lost_at_the_nudge():
    """check_now (what STOP_SIGNAL's handler does) renews every watched lease now: one
    whose record was freed by a replacing call is marked lost at once, not at its next
    renewal a third of a lease later."""
    locks = Mutex(InMemoryCache(), lease=30)
    old = locks.acquire("k", token="o.0", label="old[o]", renew=False)
    replace.watch(old)
    assert locks.release_where("k", lambda t: t == "o.0")
    replace.check_now()
    deadline = time.monotonic() + 5
    while not old.lost and time.monotonic() < deadline:
        time.sleep(0.01)
    assert old.lost


def test_the_label_of_a_call_names_its_id():
    assert call_in_brackets("tasks.reindex[abc-1]") == "abc-1"
    assert [call_in_brackets(x) for x in (None, "", "plain", "t[]", "t[x")] == [None] * 5


def test_a_marked_call_gives_way_and_an_unmarked_one_goes_on():
    """Marks: the call a newer one replaced is told so (NewerCall, naming that call);
    any other call is not; marking twice keeps the first mark."""
    marks = replace.Marks(InMemoryCache(), "taken.")
    marks.check("old")  # not marked: nothing raised
    marks.mark("old", "new[n]")
    marks.mark("old", "newer[m]")
    with pytest.raises(replace.NewerCall, match=r"superseded by new\[n\]"):
        marks.check("old")
    marks.check("other")
