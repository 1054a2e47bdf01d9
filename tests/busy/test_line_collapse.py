"""Keep latest and debounce on the line (simple_mutex.busy.line.collapse, issue 25).

* The pure decisions, case by case: a newer send takes the waiting call's place and its
  ticket, the superseded call is reported with the one that replaced it, a promoted or
  running call is never replaced, an arrival that finds a newer call waiting is the one
  superseded, a replaced call's broker copy never runs, a debounced call waits for its due
  time (pushed back by each newer call, never past max_delay from the burst's first),
  the record's JSON keeps ``due``.
* A property run: thousands of random interleavings (seeded) of sends at the producer and
  through the broker, deliveries (doubled), ends, crashed holders and sweeps, checked
  for: no call runs twice, every call runs or is reported superseded exactly once (by a
  newer call), the newest call of the key always runs, at most one call waits besides
  the running one, and a debounced call is never published before it is due.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from simple_mutex import MalfunctionError
from simple_mutex.busy import line as ln
from simple_mutex.busy.line import (
    Debounce,
    Duplicate,
    Latest,
    Line,
    Park,
    Publish,
    Run,
    Superseded,
    Ticket,
    arrival,
    arrive,
    end,
    new_line,
    send_collapsed,
    start,
    sweep,
    take,
)

pytestmark = pytest.mark.fast

E = "0123456789abcdef"
K = "doc.7"
KNOBS = {"promote_grace": 5.0, "gap_for": 60.0, "park_for": 3600.0}
LATEST = Latest()
DEBOUNCE = Debounce(period=2.0, max_delay=5.0)


def T(n: int) -> Ticket:
    return Ticket(E, n)


def msg(call: str, ticket: Ticket | None = None) -> dict[str, Any]:
    return {"id": call, "ticket": None if ticket is None else ticket.number}


def sent(line: Line, call: str, now: float, collapse: ln.Collapse = LATEST) -> tuple[Line, Any]:
    return send_collapsed(line, now, lambda ticket: msg(call, ticket), collapse)


def roundtrip(line: Line) -> Line:
    copy = ln.decode(ln.encode(line), line.key)
    assert copy == line
    return copy


def running(line: Line, n: int, call: str, now: float = 0.0, collapse: Any = LATEST) -> Line:
    line, decided = start(line, T(n), now, redelivers=False, collapse=collapse, message=msg(call))
    assert isinstance(decided, Run | ln.RunLate), decided
    return line


# -- keep latest -------------------------------------------------------------------------------


def test_the_first_send_goes_to_the_broker_and_the_next_waits():
    line, (ticket, parked, gone) = sent(new_line(K, E), "a", 1.0)
    assert (ticket, parked, gone) == (T(1), False, ())
    line, (ticket, parked, gone) = sent(line, "b", 2.0)
    assert (ticket, parked, gone) == (T(2), True, ())
    assert line.parked[2].message == msg("b", T(2))
    roundtrip(line)


def test_a_newer_send_takes_the_waiting_calls_place_and_ticket():
    """A burst of 50 behind a running call: one entry, one ticket, each newer call
    reporting the one it replaced; the end publishes the newest, and nothing else runs."""
    line, _ = sent(new_line(K, E), "c0", 0.0)
    line = running(line, 1, "c0")
    reported: list[tuple[str, str]] = []
    for i in range(1, 50):
        line, (ticket, parked, gone) = sent(line, f"c{i}", float(i))
        assert (ticket, parked) == (T(2), True)
        reported += [(s.message["id"], s.by_message["id"]) for s in gone]
        assert all(s.ticket == s.by == 2 for s in gone)
    assert reported == [(f"c{i}", f"c{i + 1}") for i in range(1, 49)]
    assert (line.next, len(line.parked), line.ended) == (3, 1, frozenset())
    assert line.parked[2].at == 49.0  # park_for counts from the newest call
    line, published = end(line, T(1), 60.0)
    assert published == Publish(2, msg("c49", T(2)))
    roundtrip(line)


def test_a_promoted_or_running_call_is_never_replaced():
    """Once published for its turn, a call is on its way to run: a newer one waits behind
    it, in a place of its own, and replaces only waiting calls."""
    line, _ = sent(new_line(K, E), "a", 0.0)
    line = running(line, 1, "a")
    line, _ = sent(line, "b", 1.0)
    line, published = end(line, T(1), 2.0)
    assert published is not None
    assert published.message["id"] == "b"
    line, (ticket, parked, gone) = sent(line, "c", 3.0)
    assert (ticket, parked, gone) == (T(3), True, ())  # b is promoted: not replaced
    line = running(line, 2, "b", 4.0)
    line, (ticket, _, gone) = sent(line, "d", 5.0)
    assert ticket == T(3)
    assert [(s.message["id"], s.by_message["id"]) for s in gone] == [("c", "d")]
    roundtrip(line)


def test_an_arrival_through_the_broker_replaces_older_waiting_calls_or_is_replaced():
    """Calls sent with a countdown take a ticket and park when they arrive: the arrival
    of a newer ticket supersedes an older waiting one (which leaves the line: ended),
    and an older ticket that arrives after a newer one waits is itself superseded."""
    line = new_line(K, E)
    for _ in range(4):
        line, _ = take(line, 0.0)
    line = running(line, 1, "t1")
    line, decided = arrival(line, T(2), msg("t2"), 1.0, lock_free=False, collapse=LATEST)
    assert decided == Park(2)
    line, decided = arrival(line, T(4), msg("t4"), 2.0, lock_free=False, collapse=LATEST)
    assert decided == Park(4, (Superseded(2, msg("t2"), 4, msg("t4")),))
    assert line.ended == {2}
    line, decided = arrival(line, T(3), msg("t3"), 3.0, lock_free=False, collapse=LATEST)
    assert decided == Superseded(3, msg("t3"), 4, msg("t4"))
    assert (line.ended, set(line.parked)) == ({2, 3}, {4})
    line, published = end(line, T(1), 4.0)  # the turn steps over 2 and 3
    assert (line.turn, published) == (4, Publish(4, msg("t4")))
    roundtrip(line)


def test_the_broker_copy_of_a_replaced_call_never_runs():
    """A call parked at its arrival, then replaced in place by a newer send, whose
    message comes again (a crash between the park's write and its ack): its ticket is
    the newer call's now, so it is told apart by its id: superseded, before and after
    the newer call is promoted. The newer call's own copy runs."""
    line = new_line(K, E)
    line, _ = take(line, 0.0)
    line, _ = take(line, 0.0)
    line = running(line, 1, "t1")
    line, _ = arrival(line, T(2), msg("old"), 1.0, lock_free=False, collapse=LATEST)
    line, (ticket, _, gone) = sent(line, "new", 2.0)
    assert ticket == T(2)
    assert [s.message["id"] for s in gone] == ["old"]
    stale = arrive(line, T(2), lock_free=True, collapse=LATEST, message=msg("old"))
    assert stale == Superseded(2, msg("old"), 2, msg("new", T(2)))
    line, _ = end(line, T(1), 3.0)
    assert isinstance(arrive(line, T(2), lock_free=True, collapse=LATEST, message=msg("old")),
                      Superseded)  # fmt: skip
    assert arrive(line, T(2), lock_free=True, collapse=LATEST, message=msg("new")) == Run(2)
    line, decided = start(line, T(2), 4.0, redelivers=False, collapse=LATEST, message=msg("old"))
    assert isinstance(decided, Superseded)


def test_the_redelivered_copy_of_the_running_call_is_never_superseded():
    """acks_late with reject_on_worker_lost: the running call's worker died and its
    message comes back while a newer call waits. The copy is the running call itself: it
    parks for the dead lease (no newer call takes its turn), runs once the lease lapsed,
    and then the waiting call runs."""
    line, _ = sent(new_line(K, E), "a", 0.0)
    line, _ = start(line, T(1), 0.0, redelivers=True, collapse=LATEST, message=msg("a"))
    line, _ = sent(line, "b", 1.0)
    line, decided = arrival(line, T(1), msg("a"), 2.0, lock_free=False, collapse=LATEST)
    assert decided == Park(1)
    assert {t: p.message["id"] for t, p in line.parked.items()} == {1: "a", 2: "b"}
    line, swept = sweep(line, 9.0, lock_free=True, **KNOBS)  # the dead lease lapsed
    assert swept.publish == (Publish(1, msg("a")),)
    assert arrive(line, T(1), lock_free=True, collapse=LATEST, message=msg("a")) == Run(1)
    line = running(line, 1, "a", 9.5)
    line, published = end(line, T(1), 10.0)
    assert published == Publish(2, msg("b", T(2)))


def test_a_retry_keeps_its_turn_under_latest_and_waits_again_under_debounce():
    """Task.retry keeps the ticket's turn: under keep latest the retry runs before the
    waiting call; under debounce it parks for a new quiet period, where the newer waiting
    call takes its place (the newer arguments win)."""
    from simple_mutex.busy.line import retry

    line, _ = sent(new_line(K, E), "a", 0.0)
    line = running(line, 1, "a")
    line, _ = sent(line, "b", 1.0)
    line = retry(line, T(1), 2.0, after=0.5)
    assert arrive(line, T(1), lock_free=True, collapse=LATEST, message=msg("a")) == Run(1)
    line, _ = sent(new_line(K, E), "a", 0.0, DEBOUNCE)
    line, _ = sweep(line, 2.0, lock_free=True, **KNOBS)
    line = running(line, 1, "a", 2.0, DEBOUNCE)
    line, _ = sent(line, "b", 3.0, DEBOUNCE)
    line = retry(line, T(1), 4.0, after=0.5)
    line, decided = arrival(line, T(1), msg("a"), 4.5, lock_free=True, collapse=DEBOUNCE)
    assert decided == Superseded(1, msg("a"), 2, msg("b", T(2)))


def test_the_queue_is_unchanged_without_collapse():
    """collapse=None is issue 24's queue: sends queue behind each other, nothing replaced."""
    line = new_line(K, E)
    for i in range(4):
        line, (ticket, _, gone) = send_collapsed(line, 0.0, lambda t, i=i: msg(f"q{i}", t), None)
        assert (ticket, gone) == (T(i + 1), ())
    assert set(line.parked) == {2, 3, 4}


# -- debounce ----------------------------------------------------------------------------------


def test_a_debounced_call_waits_for_its_quiet_time_and_each_newer_one_pushes_it_back():
    line, (ticket, parked, gone) = sent(new_line(K, E), "a", 10.0, DEBOUNCE)
    assert (ticket, parked, gone) == (T(1), True, ())  # even the first call waits
    assert (line.parked[1].at, line.parked[1].due) == (10.0, 12.0)
    line, s = sweep(line, 11.9, lock_free=True, **KNOBS)
    assert s.publish == ()  # not due yet
    line, (_, _, gone) = sent(line, "b", 11.0, DEBOUNCE)
    assert [(g.message["id"], g.by_message["id"]) for g in gone] == [("a", "b")]
    assert (line.parked[1].at, line.parked[1].due) == (10.0, 13.0)  # the burst began at 10
    line, (_, _, _) = sent(line, "c", 12.9, DEBOUNCE)
    assert line.parked[1].due == 14.9
    line, (_, _, _) = sent(line, "d", 14.0, DEBOUNCE)
    assert line.parked[1].due == 15.0  # max_delay: 10 + 5, not 14 + 2
    line = roundtrip(line)
    line, s = sweep(line, 14.9, lock_free=True, **KNOBS)
    assert s.publish == ()
    line, s = sweep(line, 15.0, lock_free=True, **KNOBS)
    assert s.publish == (Publish(1, msg("d", T(1))),)
    assert arrive(line, T(1), lock_free=True, collapse=DEBOUNCE, message=msg("d")) == Run(1)


def test_a_debounced_call_past_due_is_not_taken_by_a_new_burst():
    """Its quiet time passed, so it runs, however late the sweep (or RQ's scheduler) is
    to publish it; a call after that begins a burst of its own behind it."""
    line, _ = sent(new_line(K, E), "a", 10.0, DEBOUNCE)
    assert line.parked[1].due == 12.0
    line, (ticket, parked, gone) = sent(line, "b", 12.5, DEBOUNCE)  # nothing swept yet
    assert (ticket, parked, gone) == (T(2), True, ())
    assert (line.parked[1].message["id"], line.parked[2].due) == ("a", 14.5)
    line, s = sweep(line, 12.5, lock_free=True, **KNOBS)
    assert s.publish == (Publish(1, msg("a", T(1))),)


def test_an_older_arrival_is_superseded_by_a_newer_debounced_call_even_past_due():
    """A call that went through the broker arrives after a newer call, sent later and
    parked at its send, came due: the newer one holds the newer arguments and runs; the
    older one does not run after it."""
    line, ticket = take(new_line(K, E), 0.0)
    line, _ = sent(line, "new", 1.0, DEBOUNCE)  # due at 3
    line, decided = arrival(line, ticket, msg("old"), 4.0, lock_free=True, collapse=DEBOUNCE)
    assert decided == Superseded(1, msg("old"), 2, msg("new", T(2)))
    assert set(line.parked) == {2}


def test_the_end_of_a_run_publishes_a_debounced_call_only_when_it_is_due():
    line, _ = sent(new_line(K, E), "a", 0.0, DEBOUNCE)
    line, s = sweep(line, 2.0, lock_free=True, **KNOBS)
    line = running(line, 1, "a", 2.0, DEBOUNCE)
    line, _ = sent(line, "b", 3.0, DEBOUNCE)  # a new burst while a runs: due at 5
    assert line.parked[2].due == 5.0
    line, published = end(line, T(1), 4.0)
    assert published is None  # the sweep publishes it at 5
    line, s = sweep(line, 5.0, lock_free=True, **KNOBS)
    assert s.publish == (Publish(2, msg("b", T(2))),)
    line = running(line, 2, "b", 5.0, DEBOUNCE)
    line, _ = sent(line, "c", 6.0, DEBOUNCE)
    line, published = end(line, T(2), 9.0)  # c was due at 8: the end publishes it
    assert published == Publish(3, msg("c", T(3)))


def test_a_debounced_call_through_the_broker_parks_before_it_runs():
    """A call that reached a worker without parking (sent with a countdown, or by
    send_task) waits its quiet time too, even with its turn and the lock free."""
    line, ticket = take(new_line(K, E), 0.0)
    line, decided = arrival(line, ticket, msg("x"), 1.0, lock_free=True, collapse=DEBOUNCE)
    assert decided == Park(1)
    assert line.parked[1].due == 3.0
    assert arrive(line, ticket, lock_free=True, collapse=DEBOUNCE, message=msg("x")) == Duplicate(1)


def test_a_due_time_in_the_record_is_checked():
    line, _ = sent(new_line(K, E), "a", 0.0, DEBOUNCE)
    value = ln.encode(line)
    assert '"due":2.0' in value
    with pytest.raises(MalfunctionError, match="malformed line record"):
        ln.decode(value.replace('"due":2.0', '"due":"soon"'), K)
    queue_line, _ = take(new_line(K, E), 0.0)
    assert '"due"' not in ln.encode(queue_line)  # a queue's records are as before


# -- the property: random interleavings --------------------------------------------------------


class World:
    """One key's line under ``collapse``, a producer sending calls (at the producer, and
    some through the broker as a countdown would), a broker that doubles messages, one
    lock, holders that finish or crash (their parent ends the turn), and sweeps."""

    def __init__(self, seed: int, collapse: ln.Collapse) -> None:
        self.rng = random.Random(seed)
        self.collapse = collapse
        self.line = new_line(K, E)
        self.now = 0.0
        self.flight: list[tuple[int, dict[str, Any]]] = []
        self.holder: tuple[int, str, dict[str, Any]] | None = None
        # Odd seeds: a broker that redelivers a dead holder's call (acks_late with
        # reject_on_worker_lost); such a call may run again, once per death.
        self.redelivers = seed % 2 == 1
        self.again: list[str] = []
        self.calls: list[str] = []
        self.ran: list[str] = []
        self.superseded: dict[str, str] = {}
        self.crashed: set[str] = set()
        self.due: dict[str, float] = {}  # a debounced call's due time when published
        self.seen: set[str] = set()

    def step(self, sending: bool) -> None:
        actions = ["deliver"] * 5 + ["finish"] * 2 + ["sweep", "tick", "crash"]
        if sending:
            actions += ["send"] * 4 + ["send_broker"]
        getattr(self, self.rng.choice(actions))()
        roundtrip(self.line)

    def _gone(self, gone: tuple[Superseded, ...]) -> None:
        for s in gone:
            call = s.message["id"]
            assert call not in self.superseded, f"{call} superseded twice"
            assert call not in self.ran, f"{call} ran, then was superseded"
            self.superseded[call] = s.by_message["id"]
            self.seen.add("superseded")

    def send(self) -> None:
        call = f"c{len(self.calls)}"
        self.calls.append(call)
        self.line, (ticket, parked, gone) = send_collapsed(
            self.line, self.now, lambda t: msg(call, t), self.collapse
        )
        self._gone(gone)
        if not parked:
            self.flight.append((ticket.number, msg(call, ticket)))
        if self.rng.random() < 0.1 and not parked:
            self.flight.append((ticket.number, msg(call, ticket)))  # a doubled delivery
        waiting = ln.decisions._waiting(self.line, None, self.now)  # a due one aside
        assert len(waiting) <= 1, f"{len(waiting)} calls wait besides the running one"

    def send_broker(self) -> None:
        call = f"c{len(self.calls)}"
        self.calls.append(call)
        self.line, ticket = take(self.line, self.now)
        self.flight.append((ticket.number, msg(call, ticket)))

    def deliver(self) -> None:
        if not self.flight:
            return
        n, message = self.flight.pop(self.rng.randrange(len(self.flight)))
        call = message["id"]
        free = self.holder is None
        self.line, decided = arrival(
            self.line, T(n), message, self.now, lock_free=free, collapse=self.collapse
        )
        match decided:
            case Park(superseded=gone):
                self._gone(gone)
                self.seen.add("park")
            case Superseded():
                self._gone((decided,))
                self.seen.add("arrival superseded")
            case Duplicate():
                self.seen.add("duplicate")
            case Run() | ln.RunLate():
                assert free, "ran while the lock was held"
                self.line, again = start(
                    self.line, T(n), self.now, redelivers=self.redelivers,
                    collapse=self.collapse, message=message,
                )  # fmt: skip
                if not isinstance(again, Run | ln.RunLate):
                    return
                if call in self.again:
                    self.again.remove(call)  # its broker's copy, after its holder died
                    self.seen.add("redelivered ran")
                else:
                    assert call not in self.ran, f"{call} ran twice"
                    self.ran.append(call)
                assert call not in self.superseded, f"{call} ran after it was superseded"
                if call in self.due:
                    assert self.now >= self.due[call], f"{call} ran before it was due"
                self.holder = (n, call, message)

    def _publish(self, what: Publish | None) -> None:
        if what is not None:
            self.flight.append((what.ticket, what.message))
            entry = self.line.parked.get(what.ticket)
            if entry is not None and entry.due is not None:
                assert self.now >= entry.due, "published before it was due"
                self.due[what.message["id"]] = entry.due

    def finish(self) -> None:
        if self.holder is not None:
            self.line, published = end(self.line, T(self.holder[0]), self.now)
            self.holder = None
            self._publish(published)

    def crash(self) -> None:
        """The holder dies. Early ack: its parent ends the turn, no copy comes. A broker
        that redelivers: its lock lapses, nobody ends the turn, and its copy comes back."""
        if self.holder is None or self.rng.random() >= 0.3:
            return
        n, call, message = self.holder
        self.crashed.add(call)
        self.seen.add("crash")
        if not self.redelivers:
            self.finish()
            return
        self.holder = None
        self.again.append(call)
        self.flight.append((n, message))

    def sweep(self) -> None:
        self.now += self.rng.random() * 2
        self.line, swept = sweep(self.line, self.now, lock_free=self.holder is None, **KNOBS)
        assert swept.expired == swept.skipped == ()
        for what in swept.publish:
            self._publish(what)

    def tick(self) -> None:
        self.now += self.rng.random()

    def drain(self) -> None:
        for _ in range(20_000):
            line = self.line
            idle = self.holder is None and line.running is None
            if idle and not self.flight and not line.parked and not line.issued:
                return
            self.step(sending=False)
        raise AssertionError(f"the line never drained: {self.line}")


SEEDS = range(40)
MODES = {"latest": LATEST, "debounce": DEBOUNCE}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("seed", SEEDS)
def test_random_interleavings_run_each_call_once_or_supersede_it_and_the_newest_runs(seed, mode):
    world = World(seed, MODES[mode])
    for _ in range(300):
        world.step(sending=True)
    world.drain()
    ran = set(world.ran)
    assert len(ran) == len(world.ran), "a call ran twice"
    assert ran & set(world.superseded) == set(), "a call ran and was superseded"
    assert ran | set(world.superseded) == set(world.calls), "a call neither ran nor resolved"
    assert world.calls[-1] in ran, "the newest call did not run"
    for old, by in world.superseded.items():
        assert world.calls.index(by) > world.calls.index(old), f"{old} replaced by older {by}"
    assert len(ran) < len(world.calls), "nothing was superseded: the run told nothing"


def test_the_property_run_sees_every_outcome():
    seen: set[str] = set()
    for mode in MODES.values():
        for seed in SEEDS:
            world = World(seed, mode)
            for _ in range(300):
                world.step(sending=True)
            world.drain()
            seen |= world.seen
    assert seen >= {"superseded", "park", "arrival superseded", "duplicate", "crash",
                    "redelivered ran"}  # fmt: skip
