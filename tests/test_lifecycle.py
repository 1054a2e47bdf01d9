"""A lease's lifecycle (simple_mutex._core.lifecycle): the moves it allows, and that every
other move leaves the state as it is (once ended, never live again; the first loss stands)."""

from __future__ import annotations

import pytest

from simple_mutex import InMemoryCache, MalfunctionError, Mutex
from simple_mutex._core import lifecycle
from simple_mutex._core.lifecycle import HELD, RELEASING, Lost, Released, State, step
from simple_mutex.testing import FaultyCache

pytestmark = pytest.mark.fast

ALL: list[State] = [
    HELD,
    RELEASING,
    Lost("it lapsed"),
    Lost("gone", record_gone=True),
    Released(in_time=True),
    Released(in_time=False, loss="taken over before release"),
]


@pytest.mark.parametrize("to", ALL[1:], ids=repr)
def test_a_held_lease_may_move_to_any_ending(to: State) -> None:
    """Held: released, being released, or lost, each by one step."""
    assert step(HELD, to) == to


@pytest.mark.parametrize("to", [HELD, lifecycle.Held()], ids=repr)
@pytest.mark.parametrize("state", ALL[1:], ids=repr)
def test_nothing_goes_back_to_held(state: State, to: State) -> None:
    """A lease never becomes held again, whatever it met."""
    assert step(state, to) == state


@pytest.mark.parametrize("to", ALL, ids=repr)
@pytest.mark.parametrize("state", ALL[4:], ids=repr)
def test_released_is_final(state: State, to: State) -> None:
    """A loss found after the release (a late renewal, a keeper's visit) changes nothing."""
    assert step(state, to) is state


def test_a_lost_lease_is_not_released_in_flight() -> None:
    """A lost lease being let go stays lost until the release lands (it is not renewed and
    not live again)."""
    lost = Lost("it lapsed")
    assert step(lost, RELEASING) is lost


def test_the_first_loss_stands_and_a_second_adds_only_that_the_record_is_gone() -> None:
    """Two losses: the first reason is reported; that the record is gone is kept, so a
    release then needs no cache call."""
    first = Lost("it lapsed")
    assert step(first, Lost("other")) is first
    assert step(first, Lost("other", record_gone=True)) == Lost("it lapsed", record_gone=True)
    gone = Lost("gone", record_gone=True)
    assert step(gone, Lost("other")) is gone


@pytest.mark.parametrize("in_time", [True, False])
def test_a_release_after_a_loss_carries_the_loss(in_time: bool) -> None:
    """Released from Lost keeps the loss's reason, not the release's own guess."""
    after = step(Lost("it lapsed"), Released(in_time=in_time, loss="taken over before release"))
    assert after == Released(in_time=in_time, loss="it lapsed")


def test_releasing_may_end_either_way() -> None:
    """A release in flight (or failed on a fault) ends released, or lost at its deadline."""
    assert step(RELEASING, Released(in_time=True)) == Released(in_time=True)
    assert step(RELEASING, Lost("it lapsed")) == Lost("it lapsed")
    assert isinstance(step(RELEASING, RELEASING), lifecycle.Releasing)


def test_live_and_loss_of_each_state() -> None:
    """``live``: held or being let go; ``loss``: the reason, once there is one."""
    assert [s.live for s in ALL] == [True, True, False, False, False, False]
    assert [s.loss for s in ALL] == [
        None,
        None,
        "it lapsed",
        "gone",
        None,
        "taken over before release",
    ]


def test_a_lease_whose_release_failed_is_releasing_and_no_longer_renewed() -> None:
    """A release that hit a fault in time leaves the lease Releasing: the keeper starts no
    renewal of it (we meant to let go), and a retry of release() reaches the record."""
    cache = FaultyCache(InMemoryCache())
    lease = Mutex(cache, lease=30).acquire("k", renew=True)
    assert lease._renews
    cache.fail("compare_and_delete", times=2)  # the read back finds it, the second fails too
    with pytest.raises(MalfunctionError):
        lease.release()
    assert lease._state is RELEASING
    assert not lease._renews
    assert not lease.lost
    assert "releasing" in repr(lease)
    assert lease.release() is True
    assert lease._state == Released(in_time=True)
