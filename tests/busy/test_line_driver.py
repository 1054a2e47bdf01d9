"""The line's per-call driver (``simple_mutex.busy.line.driver``) through a port made
here, on an in-memory cache: each outcome an arrival can settle on, the sweep that hands
a parking call its own turn, and a publish that steps over a call its queue lost. Celery
and RQ run the same driver through their own ports (tests/celery_mutex, tests/rq_mutex)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import pytest

from simple_mutex import InMemoryCache, MalfunctionError, Mutex, SimpleMutexAcquireTimeoutError
from simple_mutex.busy.line import Latest, Lines, Publish, Superseded, Ticket, driver
from simple_mutex.busy.policy import QueuePolicy
from simple_mutex.busy.port import Published

pytestmark = pytest.mark.fast

log = logging.getLogger("test.driver")


@dataclass
class Queue:
    """A task queue in a list: what was published, and the calls it says are gone."""

    sent: list[tuple[str, int, str]] = field(default_factory=list)
    gone: set[str] = field(default_factory=set)
    name: str = "job"
    log: logging.Logger = log

    def publish(self, key: str, what: Publish, *, by: str) -> Published:
        call_id = what.message["id"]
        if call_id in self.gone:
            return "gone"
        self.sent.append((call_id, what.ticket, by))
        return "sent"


@dataclass
class Delivery(Queue):
    """One delivery of call ``id`` through the port; records what the driver told it."""

    id: str = "c1"
    carried: Ticket | None = None
    keeps_parked: bool = False
    failed_before: bool = False
    bounds: QueuePolicy = field(default_factory=lambda: QueuePolicy(gap_for=60.0))
    told: list[str] = field(default_factory=list)
    resolved: list[Superseded] = field(default_factory=list)

    @property
    def who(self) -> str:
        return f"call {self.id}"

    def ticket(self) -> Ticket | None:
        return self.carried

    def take(self, lines: Lines, key: str) -> Ticket:
        self.carried = lines.take(key)
        self.told.append(f"took {self.carried.number}")
        return self.carried

    def message(self, ticket: Ticket) -> dict[str, Any]:
        return {"id": self.id}

    def attempt(self) -> int | None:
        return None

    def redelivers(self) -> bool:
        return False

    def ran_and_failed(self) -> bool:
        return self.failed_before

    def resolve(self, key: str, gone: tuple[Superseded, ...]) -> None:
        self.resolved.extend(gone)

    def parked(self, key: str, ticket: Ticket) -> None:
        self.told.append(f"parked {ticket.number}")

    def started(self, key: str, ticket: Ticket) -> None:
        self.told.append(f"started {ticket.number}")


@pytest.fixture
def setup() -> tuple[Lines, Mutex]:
    cache = InMemoryCache()
    return Lines(cache, lease=30), Mutex(cache, lease=30)


def test_a_call_whose_turn_it_is_runs_and_its_end_publishes_the_next(setup):
    lines, locks = setup
    first = Delivery(id="a", carried=lines.take("k"))
    second = Delivery(id="b", carried=lines.take("k"))
    # The second arrives first: not its turn, it parks (its sweep finds nothing to do).
    assert driver.arrive(second, lines, "k", None, lambda: locks.acquire("k")) == (
        driver.Parking(second.carried)
    )
    assert second.told == ["parked 2"]
    turn = driver.arrive(first, lines, "k", None, lambda: locks.acquire("k", timeout=0))
    assert isinstance(turn, driver.Turn)
    assert (turn.ticket, turn.late) == (first.carried, None)
    assert first.told == ["started 1"]
    then = driver.end(first, lines, "k", turn.ticket, first.bounds, again_after=None, who="a")
    assert first.sent == []  # nothing is published before the lock is released
    turn.lease.release()
    then()
    assert first.sent == [("b", 2, "end")]


def test_a_copy_of_a_ticket_that_ran_is_dropped_unless_its_run_failed(setup):
    lines, locks = setup
    call = Delivery(id="a")
    turn = driver.arrive(call, lines, "k", None, lambda: locks.acquire("k", timeout=0))
    assert isinstance(turn, driver.Turn)
    driver.end(call, lines, "k", turn.ticket, call.bounds, again_after=None, who="a")
    turn.lease.release()
    copy = Delivery(id="a", carried=turn.ticket)
    assert driver.arrive(copy, lines, "k", None, locks.acquire) == driver.Dropped("duplicate")
    again = Delivery(id="a", carried=turn.ticket, failed_before=True)
    rerun = driver.arrive(again, lines, "k", None, lambda: locks.acquire("k", timeout=0))
    assert isinstance(rerun, driver.Turn)
    assert rerun.ticket.number == 2  # a new place
    assert again.told == ["took 2", "started 2"]


def test_keep_latest_drops_the_call_a_newer_one_replaced(setup):
    lines, locks = setup
    holder = Delivery(id="h")
    held = driver.arrive(holder, lines, "k", Latest(), lambda: locks.acquire("k", timeout=0))
    assert isinstance(held, driver.Turn)
    older, newer = Delivery(id="old"), Delivery(id="new")
    assert isinstance(driver.arrive(older, lines, "k", Latest(), locks.acquire), driver.Parking)
    assert isinstance(driver.arrive(newer, lines, "k", Latest(), locks.acquire), driver.Parking)
    assert [gone.message["id"] for gone in newer.resolved] == ["old"]
    # A newer send takes the waiting call's place and ticket: the older call's delivery
    # carrying that ticket finds another call there, and never runs.
    ticket, parked, gone = lines.send_collapsed("k", lambda _: {"id": "newest"}, Latest())
    assert parked
    assert [g.message["id"] for g in gone] == ["new"]
    copy = Delivery(id="new", carried=ticket)
    assert driver.arrive(copy, lines, "k", Latest(), locks.acquire) == (
        driver.Dropped("superseded", "newest")
    )


@dataclass
class Racing(Delivery):
    """A delivery during whose park the holder ``then`` does something (the race)."""

    then: Any = None

    def parked(self, key: str, ticket: Ticket) -> None:
        super().parked(key, ticket)
        self.then()


def test_a_parking_call_handed_its_turn_by_a_sweep_runs_in_this_delivery(setup):
    lines, locks = setup
    holder = Delivery(id="h")
    held = driver.arrive(holder, lines, "k", None, lambda: locks.acquire("k", timeout=0))
    assert isinstance(held, driver.Turn)
    # The holder dies as the next call parks: its lock lapses with its turn still marked.
    waiting = Racing(id="w", carried=lines.take("k"), then=held.lease.release)
    turn = driver.arrive(waiting, lines, "k", None, lambda: locks.acquire("k", timeout=0))
    assert isinstance(turn, driver.Turn)
    assert turn.ticket == waiting.carried
    assert waiting.sent == []  # its own turn was not published to the queue: it runs here


@pytest.mark.parametrize("keeps_parked", [True, False])
def test_a_call_promoted_while_it_parks_runs_here_if_its_queue_keeps_it(setup, keeps_parked):
    lines, locks = setup
    holder = Delivery(id="h")
    held = driver.arrive(holder, lines, "k", None, lambda: locks.acquire("k", timeout=0))
    assert isinstance(held, driver.Turn)

    def holder_ends() -> None:  # its end's publish waits for the parking to finish
        lines.over("k", held.ticket, again_after=None)
        held.lease.release()

    waiting = Racing(id="w", carried=lines.take("k"), keeps_parked=keeps_parked, then=holder_ends)
    got = driver.arrive(waiting, lines, "k", None, lambda: locks.acquire("k", timeout=0))
    # RQ's parked job is that very job: it runs now. Celery's line keeps the call, and the
    # holder's publish sends it: this delivery ends.
    assert isinstance(got, driver.Turn if keeps_parked else driver.Parking)


def test_a_publish_steps_over_a_call_its_queue_lost(setup):
    lines, locks = setup
    holder = Delivery(id="h")
    held = driver.arrive(holder, lines, "k", None, lambda: locks.acquire("k", timeout=0))
    assert isinstance(held, driver.Turn)
    for name in ("lost", "next"):
        parked = Delivery(id=name, carried=lines.take("k"))
        assert isinstance(driver.arrive(parked, lines, "k", None, locks.acquire), driver.Parking)
    holder.gone.add("lost")
    then = driver.end(holder, lines, "k", held.ticket, holder.bounds, again_after=None, who="h")
    held.lease.release()
    then()
    assert holder.sent == [("next", 3, "end")]  # ticket 2 was stepped over


def test_an_arrival_the_line_keeps_changing_under_gives_up_loudly(setup):
    lines, _ = setup
    call = Delivery(id="a")

    def taken_meanwhile() -> Any:
        raise SimpleMutexAcquireTimeoutError("busy", key="k")

    # Every decision says "run", and every take finds the lock taken: bounded, then loud.
    with pytest.raises(MalfunctionError, match="changed under each of 8 arrivals"):
        driver.arrive(call, lines, "k", None, taken_meanwhile)


def test_a_sweep_of_every_line_publishes_each_head_nobody_ran(setup):
    lines, locks = setup
    queue = Queue()
    for key in ("a", "b"):
        first, second = Delivery(id=f"{key}1"), Delivery(id=f"{key}2")
        held = driver.arrive(first, lines, key, None, lambda k=key: locks.acquire(k, timeout=0))
        assert isinstance(held, driver.Turn)
        second.carried = lines.take(key)
        assert isinstance(driver.arrive(second, lines, key, None, locks.acquire), driver.Parking)
        lines.over(key, held.ticket, again_after=None)  # ended; its publish was lost
        held.lease.release()
    bounds = QueuePolicy(gap_for=0.0)  # promote_grace 0: a promoted head is published again
    assert driver.sweep_lines(lines, lambda key: (queue, bounds), queue.log) == 2
    assert sorted(queue.sent) == [("a2", 2, "sweep"), ("b2", 2, "sweep")]
