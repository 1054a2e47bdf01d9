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
        False, f"refused: 'report' slot 0 with fence {first.fence + 1} is not on the page"
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


def test_the_board_refuses_a_holder_that_changed_while_keeping_its_fence() -> None:
    """A take-over that keeps the fence (a Celery retry's) writes another record: the
    page showed the first holder, so the release is refused and nothing is freed."""
    cache = InMemoryCache()
    Mutex(cache, lease=30).acquire("report")
    board = Board(cache, "mutex.", actions=True)
    board.refresh()
    [(cache_key, entry)] = list(cache.scan("mutex."))
    other = json.loads(entry.value) | {"pid": 4242, "token": "another-owner"}
    cache.compare_and_set(cache_key, json.dumps(other), ttl=30, version=entry.version)
    now_held = cache.get(cache_key)
    assert now_held is not None
    assert now_held.fence == entry.fence
    freed, text = board.release("report", 0, entry.fence)
    assert not freed
    assert "changed hands" in text
    assert cache.get(cache_key) is not None  # the new holder keeps it


def test_an_action_request_is_checked_before_anything_is_read() -> None:
    import io
    import types

    from simple_mutex.admin.serve import MAX_BODY, _body, _named

    def request(body: bytes, length: int | None = None) -> object:
        size = str(len(body) if length is None else length)
        return types.SimpleNamespace(headers={"Content-Length": size}, rfile=io.BytesIO(body))

    def release(body: bytes, length: int | None = None) -> tuple[object, ...]:
        fields = (("key", str), ("slot", int), ("fence", int))
        return _named(_body(request(body, length)), *fields)  # type: ignore[arg-type]

    assert release(b'{"key": "k", "slot": 0, "fence": 3}') == ("k", 0, 3)
    step = _named(_body(request(b'{"key": "k", "ticket": 4}')), ("key", str), ("ticket", int))  # type: ignore[arg-type]
    assert step == ("k", 4)
    for body, length in (
        (b"[" * 4000, None),  # nested past the recursion limit
        (b"\xff\xfe", None),
        (b'{"key": "k", "slot": 0, "fence": 1.5}', None),
        (b'{"key": "k", "slot": true, "fence": 1}', None),  # a bool is no int
        (b'["k", 0, 3]', None),
        (b"{}", MAX_BODY + 1),
        (b"{}", -1),
    ):
        with pytest.raises(ValueError, match="action"):
            release(body, length)


def test_the_board_steps_over_only_a_call_it_showed_waiting() -> None:
    """From the page: a parked call of a line is stepped over (an event says so, the
    line moves on without it); the running call, a ticket the page never showed, and the
    same call twice are refused."""
    cache = InMemoryCache()
    _line_with_three(cache, "order.7")  # ticket 1 on its way, 2..4 parked
    board = Board(cache, "mutex.", actions=True)
    board.refresh()
    assert board.step_over("order.7", 9) == (
        False, "refused: ticket 9 of 'order.7' is not waiting on the page"
    )  # fmt: skip
    done, text = board.step_over("order.7", 3)
    assert done, text
    assert text == "stepped over ticket 3 (shop.charge[c1]) of 'order.7': it will not run"
    state = json.loads(board.json())
    [line] = state["lines"]
    assert [c["ticket"] for c in line["calls"]] == [1, 2, 4]
    assert state["events"][-1]["kind"] == "stepped over"
    again, text = board.step_over("order.7", 3)
    assert not again
    lines = Lines(cache, lease=30)
    for n in range(boards.CALLS_SHOWN):  # a long line: the page shows its first calls
        lines.send("order.7", lambda ticket, n=n: {"task": "shop.charge", "id": f"d{n}"})
    board.refresh()
    last = lines.read("order.7").next - 1  # type: ignore[union-attr]
    assert board.step_over("order.7", last)[0] is False  # waiting, but never on the page
    ticket = lines.read("order.7").ticket(1)  # type: ignore[union-attr]
    assert type(lines.start("order.7", ticket)).__name__ == "Run"
    board.refresh()
    assert board.step_over("order.7", 1)[0] is False  # running: it ends itself


def test_the_host_check_takes_addresses_and_the_served_name_not_other_names() -> None:
    from simple_mutex.admin.serve import _host_ok

    port = 41765  # any port: no server listens here, the rule is only read

    def ok(host: str, bound: str, at: int = port) -> bool:
        return _host_ok(f"{host}:{at}" if host else "", bound, port)

    assert ok("127.0.0.1", "127.0.0.1")
    assert ok("localhost", "127.0.0.1")
    assert ok("192.0.2.7", "0.0.0.0")  # a wildcard bind, reached by address
    assert ok("[::1]", "::1")
    assert ok("locks.internal", "locks.internal")
    assert not ok("evil.example", "0.0.0.0")  # DNS rebinding
    assert not ok("127.0.0.1", "127.0.0.1", at=port + 1)
    assert not _host_ok("127.0.0.1", "127.0.0.1", port)  # no port at all
    assert not ok("", "127.0.0.1")


def test_serve_refuses_a_port_out_of_range_before_it_reads_or_binds() -> None:
    import io

    from simple_mutex import ConstraintValueError
    from simple_mutex.admin.serve import serve

    for port in (-1, 65536, 99999):
        with pytest.raises(ConstraintValueError, match=r"port must be in 0\.\.65535"):
            serve(InMemoryCache(), "mutex.", io.StringIO(), port=port)


def test_a_line_with_far_away_numbers_costs_only_its_entries() -> None:
    """A record's ``next`` far ahead of its entries (its writers' word) is not walked
    number by number; a long line shows its first CALLS_SHOWN calls and how many more."""
    now = T0.timestamp()
    far = _line(next=100_000_000, parked={2: Parked({"id": "j2"}, now)}, issued={1: now})
    said = boards.line_state("k", far, held=True, now_s=now)  # type: ignore[arg-type]
    assert [c["ticket"] for c in said["calls"]] == [1, 2]
    long = _line(next=1002, parked={n: Parked({"id": f"j{n}"}, now) for n in range(2, 1002)},
                 issued={1: now})  # fmt: skip
    said = boards.line_state("k", long, held=True, now_s=now)  # type: ignore[arg-type]
    assert len(said["calls"]) == boards.CALLS_SHOWN
    assert said["more"] == 1001 - boards.CALLS_SHOWN
