"""The body the ``on_busy="replace"`` suites run under a lock, in Celery's pool children
(``celery_support.replace_app``) and RQ's work horses (``rq_support.replace_jobs``).

``Writer.loop`` writes ``<name>.<i>`` through the fence guard (``fenced_set`` into Redis
DB 9) every 20 ms, logging each write's outcome; a newer call of the same key replaces
it. Rows are JSON on ``<prefix><what>.<doc>`` in the record connection; times are
``time.monotonic()`` (system-wide on Linux, so comparable across processes).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from workers import wait_until

from simple_mutex import FencedOutError
from simple_mutex.fenced import fenced_get, fenced_set

STORE_URL = "redis://127.0.0.1:6379/9"  # the fenced store the bodies write to


def off_thread(call: Callable[[], object]) -> None:
    """Run ``call`` in a thread of its own and wait for it: the loss interrupt lands in
    the body's thread, never inside a Redis command (one cut between its send and its
    reply would leave the reply for the next command on that connection). The wait polls
    a flag with sleeps and takes no lock: an exception landing inside ``Thread.join``
    (Python 3.11) can leave the thread's lock held, and the next join then hangs."""
    done = threading.Event()

    def run() -> None:
        try:
            call()
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    try:
        while not done.is_set():
            time.sleep(0.002)
    except BaseException:
        while not done.is_set():  # the row or the write completes, then the body unwinds
            time.sleep(0.002)
        raise


class Writer:
    """Fenced writes of one holder, and the rows that tell the test what happened."""

    def __init__(self, record: redis.Redis, prefix: str) -> None:
        self.record = record
        self.prefix = prefix
        self.store = redis.Redis.from_url(STORE_URL)

    def log(self, doc: str, what: str, **row: object) -> None:
        """One JSON row on ``<prefix><what>.<doc>``."""
        key = f"{self.prefix}{what}.{doc}"
        value = json.dumps({**row, "t": time.monotonic()})
        off_thread(lambda: self.record.pipeline().rpush(key, value).expire(key, 600).execute())

    def _write(self, doc: str, name: str, fence: int, i: int) -> None:
        """One fenced write, and its row: ``sent`` when the write was sent, ``t`` when its
        outcome was known."""

        def write() -> None:
            sent = time.monotonic()
            try:
                fenced_set(self.store, f"{self.prefix}doc.{doc}", f"{name}.{i}", fence=fence)
                outcome = "accepted"
            except FencedOutError:
                outcome = "refused"
            row = {"name": name, "fence": fence, "i": i, "outcome": outcome, "sent": sent}
            key = f"{self.prefix}writes.{doc}"
            value = json.dumps({**row, "t": time.monotonic()})
            self.record.pipeline().rpush(key, value).expire(key, 600).execute()

        off_thread(write)

    def loop(self, doc: str, name: str, writes: int, fence: int, deaf: bool = False) -> str:
        """``writes`` fenced writes, 20 ms apart. ``deaf``: the loss interrupt is caught
        and the loop goes on (a body that cannot be stopped); its later writes carry its
        fence."""
        self.log(doc, "started", name=name, fence=fence, pid=os.getpid())
        i = 0
        try:
            while i < writes:
                try:
                    self._write(doc, name, fence, i)
                    i += 1
                    time.sleep(0.02)
                except BaseException as exc:  # the loss interrupt, or SIGTERM's SystemExit
                    if not deaf:
                        raise
                    self.log(doc, "ignored", name=name, error=type(exc).__name__)
        finally:
            self.log(doc, "ended", name=name, writes=i)
        self.log(doc, "done", name=name)
        return name


class Rows:
    """The test's side: the rows the writers logged (a mixin: ``record`` is the Redis
    they log to, ``prefix`` the one they log under)."""

    record: redis.Redis
    prefix: str

    def rows(self, what: str, doc: str) -> list[dict[str, Any]]:
        return [json.loads(r) for r in self.record.lrange(f"{self.prefix}{what}.{doc}", 0, -1)]

    def started(self, doc: str, name: str) -> dict[str, Any]:
        wait_until(
            lambda: any(r["name"] == name for r in self.rows("started", doc)), 30, f"{name} to run"
        )
        return next(r for r in self.rows("started", doc) if r["name"] == name)

    def writes_of(self, doc: str, name: str) -> list[dict[str, Any]]:
        return [r for r in self.rows("writes", doc) if r["name"] == name]

    def first_write(self, doc: str, name: str) -> dict[str, Any]:
        wait_until(lambda: self.writes_of(doc, name), 30, f"{name}'s first write")
        return self.writes_of(doc, name)[0]


def after(rows: list[dict[str, Any]], t: float, outcome: str) -> list[dict[str, Any]]:
    """The rows of writes sent after ``t`` with ``outcome``. ``t`` is when a newer
    holder's write was known to have landed: a write sent later reached the store after
    it, so it must be refused. (By the time its outcome was known, a write of a process
    the scheduler held back can look later while it landed first: CI saw one.)"""
    return [r for r in rows if r["sent"] > t and r["outcome"] == outcome]


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rpartition(")")[2].split()[1])


class Checks(Rows):
    """What every replace suite asserts once its calls ended (``store``: the fenced
    store's client; the doc's value is at ``<prefix>doc.<doc>``)."""

    store: redis.Redis

    def write(self, doc: str, name: str, writes: int, deaf: bool = False) -> Any:
        """Send one ``Writer.loop`` call of ``doc`` (the suite's own task or job)."""
        raise NotImplementedError

    def replacing(
        self, doc: str, old_writes: int, new_writes: int, deaf: bool = False
    ) -> tuple[Any, Any, float]:
        """``old`` (``old_writes`` writes; ``deaf``: it ignores the stop) runs; once it has
        written, ``new`` (``new_writes``) is sent to replace it. The two calls, and when
        new was sent."""
        old = self.write(doc, "old", old_writes, deaf=deaf)
        self.first_write(doc, "old")
        sent = time.monotonic()
        return old, self.write(doc, "new", new_writes), sent

    def killed_between(self, doc: str, names: tuple[str, str, str]) -> tuple[Any, Any, Any]:
        """The first of ``names`` writes (300); the second replaces it and, once it has
        written, its body's process is SIGKILLed; the third (10 writes) replaces what is
        left. The three calls."""
        first, second, third = names
        calls = [self.write(doc, first, 300)]
        self.first_write(doc, first)
        calls.append(self.write(doc, second, 300))
        pid = self.started(doc, second)["pid"]
        self.first_write(doc, second)
        os.kill(pid, signal.SIGKILL)
        calls.append(self.write(doc, third, 10))
        return calls[0], calls[1], calls[2]

    def ended(self, doc: str, name: str) -> float:
        """When ``name``'s loop ended."""
        return next(r["t"] for r in self.rows("ended", doc) if r["name"] == name)

    def timings(self, doc: str, sent: float, first_new: float, old_writes: list[Any]) -> str:
        """How soon after ``new`` was sent ``old`` stopped and new first wrote, and what
        became of old's writes after that."""
        return (
            f"send -> old holder stopped {self.ended(doc, 'old') - sent:.3f} s, send -> new "
            f"holder's first write {first_new - sent:.3f} s, old writes after it: "
            f"{len(after(old_writes, first_new, 'accepted'))} accepted, "
            f"{len(after(old_writes, first_new, 'refused'))} refused"
        )

    def holder_unreachable(self, doc: str, writes: int) -> tuple[Any, int]:
        """``old`` (``writes`` writes) runs; once it has written, its worker's main process
        is SIGSTOPped (the body's process runs on). Old's call and the stopped pid (the
        test sends it SIGCONT)."""
        old = self.write(doc, "old", writes)
        main = parent_of(self.started(doc, "old")["pid"])
        self.first_write(doc, "old")
        os.kill(main, signal.SIGSTOP)
        return old, main

    def taken_from_unreachable(self, doc: str, writes: int) -> tuple[float, list[Any]]:
        """``old`` (``writes`` writes), which no stop reached, was taken over by ``new``:
        none of its writes after new's first accepted, and it did not finish its loop.
        Returns new's first write time and old's writes."""
        first_new = self.first_write(doc, "new")["t"]
        old_writes = self.writes_of(doc, "old")
        assert after(old_writes, first_new, "accepted") == []
        assert len(old_writes) < writes
        return first_new, old_writes

    def stored(self, doc: str) -> tuple[bytes | None, int | None]:
        return fenced_get(self.store, f"{self.prefix}doc.{doc}")

    def takeover(self, doc: str, old: str = "old", new: str = "new") -> tuple[float, list[Any]]:
        """``new`` took the key from ``old``: a larger fence, 0 of old's writes accepted
        after new's first, all of new's accepted. Returns new's first write time and
        old's writes."""
        assert self.started(doc, new)["fence"] > self.started(doc, old)["fence"]
        first_new = self.first_write(doc, new)["t"]
        old_writes = self.writes_of(doc, old)
        assert after(old_writes, first_new, "accepted") == []
        assert all(r["outcome"] == "accepted" for r in self.writes_of(doc, new))
        return first_new, old_writes

    def deaf(self, doc: str, old_writes: int, new_writes: int) -> int:
        """A deaf ``old`` was taken over by ``new`` and wrote on: all its ``old_writes``
        made, those after new's first all refused (some), the interrupt it ignored
        logged; all ``new_writes`` of new made. Returns how many were refused."""
        first_new, writes = self.takeover(doc)
        assert {r["i"] for r in writes} == set(range(old_writes))  # it did not stop
        refused = after(writes, first_new, "refused")
        assert refused
        assert len(self.writes_of(doc, "new")) == new_writes
        assert any(r["name"] == "old" for r in self.rows("ignored", doc))
        return len(refused)

    def finished_alone(self, doc: str, name: str, writes: int) -> None:
        """Only ``name`` finished its loop, all its ``writes`` made; the store on its last."""
        assert [r["name"] for r in self.rows("done", doc)] == [name]
        assert len(self.writes_of(doc, name)) == writes
        fence = self.started(doc, name)["fence"]
        assert self.stored(doc) == (f"{name}.{writes - 1}".encode(), fence)

    def chain(self, doc: str, names: tuple[str, ...], writes: int) -> None:
        """Each of ``names`` started once, in rising fences, each taking the key from the
        one before; only the last finished (``writes`` writes)."""
        started = self.rows("started", doc)
        assert sorted(r["name"] for r in started) == sorted(names)
        fences = [next(r["fence"] for r in started if r["name"] == n) for n in names]
        assert fences == sorted(set(fences))
        for before, later in itertools.pairwise(names):
            self.takeover(doc, before, later)
        last = names[-1]
        first_last = self.first_write(doc, last)["t"]
        others = [r for r in self.rows("writes", doc) if r["name"] != last]
        assert after(others, first_last, "accepted") == []
        self.finished_alone(doc, last, writes)
