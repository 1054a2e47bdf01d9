"""simple_mutex.admin.commands in-process: the watch loop's takeovers and its handling of a
server that fails, frame by frame, without a subprocess or a real clock."""

from __future__ import annotations

import io
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
    """A permit seen under a new fence at the next refresh is a takeover, named with the
    old and the new holder; the count shows in the key's row."""
    cache = InMemoryCache()
    mutex = Mutex(cache, label="first")
    first = mutex.acquire("k")
    out = io.StringIO()

    def between_frames(_: float) -> None:
        if first.release():  # freed and taken at once: never seen free
            Mutex(cache, label="second").acquire("k")

    assert watch_locks(cache, "mutex.", out, refreshes=2, sleep=between_frames) == 0
    text = out.getvalue()
    assert "takeover of 'k' slot 0" in text
    assert "(first) -> " in text
    assert "(second)" in text
    last_row = [line for line in text.splitlines() if line.startswith("k ")][-1]
    assert last_row.split()[-2:] == ["1", "?"]  # one takeover; memory cannot tell waiters


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
