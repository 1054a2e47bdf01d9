"""What the live page shows (``simple_mutex.admin.board``), in-process: the state of held
keys and lines, what is flagged stuck and why, the events between two snapshots, and
the page's server answering, refusing and releasing (``simple_mutex.admin.serve``'s board
without its socket)."""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime, timedelta, timezone

import pytest

from simple_mutex import InMemoryCache, Mutex
from simple_mutex.admin import LiveLock
from simple_mutex.admin import board as boards
from simple_mutex.admin.serve import Board
from simple_mutex.busy.line import Lines, Running
from simple_mutex.busy.line.record import Parked

pytestmark = pytest.mark.fast

T0 = datetime(2026, 12, 7, 12, 0, tzinfo=timezone.utc)


def _line_with_three(cache: InMemoryCache, key: str) -> None:
    """A line whose first ticket is on its way and three calls parked behind it."""
    lines = Lines(cache, lease=30)
    lines.take(key)
    for n in range(3):
        lines.send(key, lambda ticket, n=n: {"task": "shop.charge", "id": f"c{n}", "args": [n]})


def test_the_state_shows_held_keys_and_each_lines_calls_in_order_without_tokens() -> None:
    cache = InMemoryCache()
    lease = Mutex(cache, lease=30, label="shop.charge[c-head]").acquire("order.7")
    _line_with_three(cache, "order.7")
    Lines(cache, lease=30).take("order.sent")  # a ticket on its way, nothing held: shown
    state = boards.state(boards.read(cache, "mutex."), [], actions=False)
    assert [line["key"] for line in state["lines"]] == ["order.7", "order.sent"]
    [lock] = state["locks"]
    assert lock["key"] == "order.7"
    assert lock["label"] == "shop.charge[c-head]"
    assert lock["fence"] == lease.fence
    assert lock["in_line"] is True
    assert 29 < lock["lease_left"] <= 30
    line = next(line for line in state["lines"] if line["key"] == "order.7")
    assert line["held"] is True
    assert line["waiting"] == 3
    assert [(c["ticket"], c["state"], c["call"]) for c in line["calls"]] == [
        (1, "sent", None),
        (2, "parked", "shop.charge[c0]"),
        (3, "parked", "shop.charge[c1]"),
        (4, "parked", "shop.charge[c2]"),
    ]
    text = json.dumps(state)
    [(_, entry)] = [(k, e) for k, e in cache.scan("mutex.")]
    token = json.loads(entry.value)["token"]
    assert token not in text  # the owner's token never leaves the cache
    assert '"args"' not in text  # nor a call's arguments
    lease.release()


def test_an_idle_line_is_left_out() -> None:
    """A line whose every call ended (its record lives on a while) is not shown: a busy
    day's hundreds of idle lines would bury the ones that wait."""
    cache = InMemoryCache()
    lines = Lines(cache, lease=30)
    ticket = lines.take("order.done")
    assert set(boards.read(cache, "mutex.").lines) == {"order.done"}  # one on its way
    lines.revoke("order.done", ticket)
    assert lines.read("order.done") is not None  # the record is still there
    assert boards.read(cache, "mutex.").lines == {}


def _line(**fields: object) -> object:
    from simple_mutex.busy.line import new_line

    return dataclasses.replace(new_line("k"), **fields)  # type: ignore[arg-type]


def test_stuck_calls_are_named_with_the_reason() -> None:
    now = T0.timestamp()
    dead = _line(next=3, running=Running(1, now - 50, redelivers=False),
                 parked={2: Parked({"id": "j2", "queue": "q"}, now - 40)})  # fmt: skip
    said = boards.line_state("k", dead, held=False, now_s=now)  # type: ignore[arg-type]
    assert said["stuck"] == ["ticket 1's holder is gone (its lock is free): a worker's sweep "
                             "ends its turn"]  # fmt: skip
    assert boards.line_state("k", dead, held=True, now_s=now)["stuck"] == []  # type: ignore[arg-type]
    published = _line(next=2, parked={1: Parked({"id": "j1"}, now - 90, promoted=now - 45)})
    said = boards.line_state("k", published, held=False, now_s=now)  # type: ignore[arg-type]
    assert said["stuck"]
    assert "sent for its turn 45 s ago" in said["stuck"][0]
    unswept = _line(next=2, parked={1: Parked({"id": "j1"}, now - 400)})
    said = boards.line_state("k", unswept, held=False, now_s=now)  # type: ignore[arg-type]
    assert said["stuck"]
    assert "nobody sent it: no worker sweeps" in said["stuck"][0]
    young = _line(next=2, parked={1: Parked({"id": "j1"}, now - 5)})
    assert boards.line_state("k", young, held=False, now_s=now)["stuck"] == []  # type: ignore[arg-type]
    fresh = _line(next=2, parked={1: Parked({"id": "j1"}, now - 90, promoted=now - 5)})
    assert boards.line_state("k", fresh, held=False, now_s=now)["stuck"] == []  # type: ignore[arg-type]
    lost = _line(next=3, issued={1: now - 200}, parked={2: Parked({"id": "j2"}, now - 150)})
    said = boards.line_state("k", lost, held=False, now_s=now)  # type: ignore[arg-type]
    assert said["stuck"]
    assert "never arrived" in said["stuck"][0]
    assert [c["call"] for c in said["calls"]] == [None, "job j2"]


def _lock(key: str, fence: int, expires: datetime, pid: int = 1) -> LiveLock:
    from simple_mutex._core.records import Holder

    holder = Holder("h", pid, None, T0, expires, fence)
    return LiveLock(key, 0, holder, "mutex." + key, "v")


def _snap(
    at: datetime, *locks: LiveLock, lines: dict[str, object] | None = None
) -> boards.Snapshot:
    return boards.Snapshot(at, locks, lines or {}, {})  # type: ignore[arg-type]


def test_events_between_two_snapshots() -> None:
    """A grant; a hand-over while the old lease had time; a takeover once it had run out;
    a free with time left; a lapse; a call parked and one started."""
    t1, t2 = T0 + timedelta(seconds=1), T0 + timedelta(seconds=2)
    later = T0 + timedelta(seconds=30)
    before = _snap(t1, _lock("handed", 1, later), _lock("taken", 2, t1), _lock("freed", 3, later),
                   _lock("lapsed", 4, t1))  # fmt: skip
    parked = _line(next=3, running=Running(1, 0.0, redelivers=False),
                   parked={2: Parked({"task": "t", "id": "c2"}, 0.0)})  # fmt: skip
    after = _snap(t2, _lock("new", 5, later), _lock("handed", 6, later, pid=2),
                  _lock("taken", 7, later, pid=3), lines={"q": parked})  # fmt: skip
    found = [(e["kind"], e["key"]) for e in boards.changes(before, after)]
    assert sorted(found) == sorted([
        ("granted", "new"), ("handed over", "handed"), ("takeover", "taken"),
        ("freed", "freed"), ("lapsed", "lapsed"), ("parked", "q"), ("started", "q"),
    ])  # fmt: skip
    assert boards.changes(None, after) == []
    assert boards.changes(after, after) == []


def test_the_board_releases_only_the_holder_the_operator_saw() -> None:
    cache = InMemoryCache()
    mutex = Mutex(cache, lease=30)
    first = mutex.acquire("report")
    board = Board(cache, "mutex.", actions=True)
    board.refresh()
    assert board.release("report", 0, first.fence + 1) == (
        False, f"refused: 'report' slot 0 is no longer held with fence {first.fence + 1}"
    )  # fmt: skip
    freed, text = board.release("report", 0, first.fence)
    assert freed
    assert text.startswith("freed 'report' slot 0")
    assert mutex.holder("report") is None
    state = json.loads(board.json())
    assert state["locks"] == []
    assert state["error"] is None
    assert [e["kind"] for e in state["events"]][-2:] == ["released", "freed"]


def test_a_refresh_that_fails_keeps_the_last_state_and_says_why() -> None:
    class Failing(InMemoryCache):
        fail = False

        def scan(self, prefix: str):  # type: ignore[no-untyped-def]
            if self.fail:
                from simple_mutex import MalfunctionError

                raise MalfunctionError("the server went away", key=prefix)
            return super().scan(prefix)

    cache = Failing()
    Mutex(cache, lease=30).acquire("report")
    board = Board(cache, "mutex.", actions=False)
    board.refresh()
    cache.fail = True
    board.refresh()
    state = json.loads(board.json())
    assert [lock["key"] for lock in state["locks"]] == ["report"]
    assert "refresh failed" in state["error"]
    assert "the server went away" in state["error"]
