"""simple_mutex.admin.commands in-process: the watch loop's takeovers and its handling of a
server that fails, frame by frame, without a subprocess or a real clock."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator

import pytest

from simple_mutex import InMemoryCache, MalfunctionError, Mutex
from simple_mutex.admin.commands import release_lock, watch_locks
from simple_mutex.contract import Entry

pytestmark = pytest.mark.fast


class Flaky(InMemoryCache):
    """An InMemoryCache whose scans fail on the calls listed in ``failing`` (1-based)."""

    def __init__(self, failing: set[int]) -> None:
        super().__init__()
        self.failing = failing
        self.scans = 0

    def scan(self, prefix: str) -> Iterator[tuple[str, Entry]]:
        if prefix.startswith("line."):  # the lines' scan (parked counts): never fails
            return super().scan(prefix)
        self.scans += 1
        if self.scans in self.failing:
            raise MalfunctionError(f"flaky cache failed during scan on {prefix!r}", key=prefix)
        return super().scan(prefix)


def test_watch_counts_a_takeover_between_two_refreshes() -> None:
    """A permit seen under a new fence at the next refresh, granted once the old lease had
    run out, is a takeover, named with the old and the new holder; the count shows in the
    key's row."""
    cache = InMemoryCache()
    _first = Mutex(cache, label="first", lease=0.2).acquire("k")  # not renewed: it lapses
    out = io.StringIO()

    def between_frames(_: float) -> None:
        time.sleep(0.3)
        Mutex(cache, label="second").acquire("k", timeout=0)

    assert watch_locks(cache, "mutex.", out, refreshes=2, sleep=between_frames) == 0
    text = out.getvalue()
    assert "takeover of 'k' slot 0" in text
    assert "(first) -> " in text
    assert "(second)" in text
    last_row = [line for line in text.splitlines() if line.startswith("k ")][-1]
    assert last_row.split()[-2:] == ["1", "?"]  # one takeover; memory cannot tell waiters


def test_watch_does_not_call_a_hand_off_a_takeover() -> None:
    """Freed and taken at once between two refreshes (consecutive calls of a line, or an
    operator's release and a waiter): a new fence, but no takeover."""
    cache = InMemoryCache()
    first = Mutex(cache, label="first").acquire("k")
    out = io.StringIO()

    def between_frames(_: float) -> None:
        if first.release():  # never seen free
            Mutex(cache, label="second").acquire("k", timeout=0)

    assert watch_locks(cache, "mutex.", out, refreshes=2, sleep=between_frames) == 0
    text = out.getvalue()
    assert "(second)" in text  # the second frame saw the new holder
    assert "takeover" not in text.replace("TAKEOVERS", "")
    last_row = [line for line in text.splitlines() if line.startswith("k ")][-1]
    assert last_row.split()[-2:] == ["0", "?"]


@pytest.mark.parametrize("lapses", [True, False])
def test_watch_remembers_a_lapsed_lease_across_a_free_refresh(lapses: bool) -> None:
    """Seen free at a refresh and taken at the next: a takeover when the old lease ran
    out (a waiter slow to wake), a hand-off when it was freed in time."""
    cache = InMemoryCache()
    first = Mutex(cache, label="first", lease=0.2 if lapses else 30).acquire("k")
    frames = iter(range(3))
    out = io.StringIO()

    def between_frames(_: float) -> None:
        if next(frames) == 0:  # the next refresh sees the key free
            time.sleep(0.3) if lapses else first.release()
        else:
            Mutex(cache, label="second").acquire("k", timeout=0)

    assert watch_locks(cache, "mutex.", out, refreshes=3, sleep=between_frames) == 0
    text = out.getvalue()
    assert "(no live locks)" in text
    assert ("takeover of 'k' slot 0: " in text) == lapses
    last_row = [line for line in text.splitlines() if line.startswith("k ")][-1]
    assert last_row.split()[-2] == ("1" if lapses else "0")


def test_watch_reports_a_failed_refresh_and_goes_on() -> None:
    """After a first good frame, a failing scan is one line and the next frame comes."""
    cache = Flaky({2})
    Mutex(cache).acquire("k")
    out = io.StringIO()
    assert watch_locks(cache, "mutex.", out, refreshes=3, sleep=lambda _: None) == 0
    text = out.getvalue()
    assert text.count("refresh failed: simple-mutex: flaky cache failed during scan") == 1
    assert text.count("1 held") == 2
    assert cache.scans == 3


def test_watch_raises_when_the_first_refresh_fails() -> None:
    """A cache that fails from the start (a wrong URL, a server down) is the caller's
    fault to report (status 2), not a loop of errors."""
    with pytest.raises(MalfunctionError):
        watch_locks(Flaky({1}), "mutex.", io.StringIO(), refreshes=3, sleep=lambda _: None)


def test_release_on_eof_at_the_prompt_frees_nothing() -> None:
    """No answer (end of input) is a no."""
    cache = InMemoryCache()
    mutex = Mutex(cache)
    lease = mutex.acquire("k")

    def no_answer(_: str) -> str:
        raise EOFError

    out = io.StringIO()
    assert release_lock(cache, "k", "mutex.", out, ask=no_answer) == 1
    assert "not freed" in out.getvalue()
    assert mutex.holder("k") is not None
    lease.release()
