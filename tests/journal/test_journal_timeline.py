"""The journal (SIMPLE_MUTEX_JOURNAL) and its timeline page, as an operator uses them:
real OS processes turn the journal on by the environment variable alone (one of them
killed with SIGKILL while it holds a lock, another taking it over, one forking), the page
is drawn by ``python -m simple_mutex.journal.timeline`` and opened in a real Chromium."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from browser import chromium_page
from procs import wait_for_file
from servers import ROOT

from simple_mutex import InMemoryCache, Mutex, journal
from simple_mutex.journal import timeline

pytestmark = [pytest.mark.system, pytest.mark.xdist_group("journal")]  # its journal, once

CHILD = ROOT / "tests" / "journal_children.py"
HOSTILE_KEY = "<script>alert('key')</script>&\"x"
WORKERS, CYCLES = 3, 8


def spawn(journal_dir: Path, cache_dir: Path, role: str, key: str, *rest: str) -> Any:
    env = {**os.environ, journal.ENV: str(journal_dir)}
    return subprocess.Popen([sys.executable, str(CHILD), role, str(cache_dir), key, *rest],
                            env=env)  # fmt: skip


def finish(*procs: Any) -> None:
    for proc in procs:
        assert proc.wait(60) == 0, f"{proc.args[2]} exited with {proc.returncode}"


def lines_of(directory: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for path in sorted(directory.glob("*.jsonl"))
            for line in path.read_text().splitlines()]  # fmt: skip


@pytest.fixture(scope="module")
def journal_dir(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A journal written by processes that only had the variable set: WORKERS contending
    on one key (with busy try-onces), a holder SIGKILLed and taken over while another
    waiter times out, a hostile key, a lease overrun and lost, three processes sharing a
    semaphore of two permits, and a process that forks."""
    base = tmp_path_factory.mktemp("journal")
    jdir, cache = base / "journal", base / "locks"
    workers = [spawn(jdir, cache, "worker", "account.alice", str(CYCLES), f"worker-{n}",
                     str(WORKERS)) for n in range(WORKERS)]  # fmt: skip
    hostile = spawn(jdir, cache, "worker", HOSTILE_KEY, "2", "<b>bold</b>")
    loser = spawn(jdir, cache, "loser", "import.feed")
    permits = [spawn(jdir, cache, "permit", "api.quota", "3") for _ in range(3)]
    marker = base / "stuck.json"
    stuck = spawn(jdir, cache, "stuck", "report.daily", str(marker))
    try:
        assert wait_for_file(marker, 30), "the holder never took its lock"
        waiting = [base / "rescuer.waits", base / "timeout.waits"]
        rescuer = spawn(jdir, cache, "rescuer", "report.daily", str(waiting[0]))
        waiter = spawn(jdir, cache, "timeout", "report.daily", str(waiting[1]))
        # Each marks the moment before its acquire (a loaded machine once started the
        # 0.1 s waiter after the lease had lapsed: it got the lock, no time-out).
        assert all(wait_for_file(path, 30) for path in waiting), "a waiter never started"
        time.sleep(0.05)  # both are in their acquire now
        os.kill(stuck.pid, signal.SIGKILL)
        assert stuck.wait(10) == -signal.SIGKILL
        finish(*workers, hostile, rescuer, waiter, loser, *permits)
        forker = spawn(jdir, cache, "forker", "migrate")
        finish(forker)
    finally:
        for proc in (*workers, hostile, stuck, loser, *permits):
            if proc.poll() is None:
                proc.kill()
    return {"dir": jdir, "stuck": json.loads(marker.read_text()), "forker": forker.pid}


def test_every_process_writes_its_own_file_of_complete_lines(journal_dir):
    """One <host>-<pid>.jsonl per process that locked, every line JSON carrying every
    LockEvent field with `at` in ISO-8601 UTC, and never a token."""
    jdir = journal_dir["dir"]
    files = sorted(jdir.glob("*.jsonl"))
    # workers, hostile, stuck, rescuer, timeout, loser, permits, the forker and its child
    assert len(files) == WORKERS + 10
    for path in files:
        pid = int(path.stem.rsplit("-", 1)[1])
        for line in path.read_text().splitlines():
            record = json.loads(line)
            assert record["pid"] == pid
            assert set(record) >= {"v", "host", "pid", "kind", "key", "name", "cache", "at",
                                   "fence", "slot", "holder", "waited", "held", "took_over",
                                   "reason"}  # fmt: skip
            assert record["at"].endswith("+00:00")
            assert "token" not in line
    assert journal_dir["stuck"]["token"] not in "".join(p.read_text() for p in files)


def test_contending_processes_hold_in_turn_with_rising_fences(journal_dir):
    """Every grant on the shared key is matched by its release, fences rise in the order
    of the grants, and the try-onces that found it held are journaled as busy."""
    records = [r for r in lines_of(journal_dir["dir"]) if r["key"] == "account.alice"]
    kinds = Counter(r["kind"] for r in records)
    assert kinds["acquired"] == kinds["released"] == WORKERS * CYCLES
    grants = sorted((r for r in records if r["kind"] == "acquired"), key=lambda r: r["at"])
    fences = [r["fence"] for r in grants]
    assert fences == sorted(fences)
    assert len(set(fences)) == len(fences)
    assert kinds["busy"] > 0  # three processes on one key: some try-once found it held
    # The holder in the way is read after the refused put: one that let go in between
    # leaves it unknown (None, as LockEvent.holder says), never the waiter itself.
    named = [r for r in records if r["kind"] == "busy" and r["holder"] is not None]
    assert named, "no busy try-once named the holder in its way"
    for busy in named:
        assert busy["holder"]["pid"] != busy["pid"]  # the one in the way, not the waiter


def test_a_killed_holder_loses_no_line_and_its_takeover_is_marked(journal_dir):
    """The SIGKILLed holder's grant is in its file; the rescuer's grant of the same key
    says took_over with a higher fence; the other waiter timed out with its wait."""
    stuck = journal_dir["stuck"]
    records = [r for r in lines_of(journal_dir["dir"]) if r["key"] == "report.daily"]
    by_stuck = [r for r in records if r["pid"] == stuck["pid"]]
    assert [(r["kind"], r["fence"]) for r in by_stuck] == [("acquired", stuck["fence"])]
    takeover = [r for r in records if r["kind"] == "acquired" and r["pid"] != stuck["pid"]]
    assert len(takeover) == 1
    assert takeover[0]["took_over"] is True
    assert takeover[0]["fence"] > stuck["fence"]
    timed_out = [r for r in records if r["kind"] == "timed_out"]
    assert len(timed_out) == 1
    assert timed_out[0]["waited"] >= 0.1


def test_a_lost_lease_and_semaphore_slots_are_journaled(journal_dir):
    """The overrun lease is journaled as lost with its reason and how long it was held;
    the semaphore's grants carry their slot, and both slots were used."""
    records = lines_of(journal_dir["dir"])
    lost = [r for r in records if r["key"] == "import.feed" and r["kind"] == "lost"]
    assert len(lost) == 1
    assert lost[0]["reason"]
    assert lost[0]["held"] >= 0.2
    slots = {r["slot"] for r in records if r["key"] == "api.quota" and r["kind"] == "acquired"}
    assert slots == {0, 1}


def test_a_forked_child_writes_its_own_file(journal_dir):
    """After fork() the child opens a file named by its own pid; the parent goes on
    writing to its own file."""
    jdir = journal_dir["dir"]
    parent = journal_dir["forker"]
    records = [r for r in lines_of(jdir) if r["key"] == "migrate"]
    pids = Counter(r["pid"] for r in records)
    assert len(pids) == 2
    assert pids[parent] == 4  # two cycles, before and after the fork
    (child,) = set(pids) - {parent}
    assert pids[child] == 2
    for record in records:
        assert record["holder"]["pid"] == record["pid"]


def test_start_from_code_and_stop(tmp_path):
    """journal.start(directory) journals this process until its stop is called, and the
    import of simple_mutex without the variable subscribes nothing."""
    from simple_mutex import events

    env = {k: v for k, v in os.environ.items() if k != journal.ENV}
    out = subprocess.run([sys.executable, "-c", "import simple_mutex.events as e, simple_mutex;"
                          "print(len(e.subscribers))"], env=env, capture_output=True,
                         text=True, check=True)  # fmt: skip
    assert out.stdout.strip() == "0"
    before = len(events.subscribers)
    stop = journal.start(tmp_path / "j")
    Mutex(InMemoryCache(), name="code").acquire("k").release()
    stop()
    Mutex(InMemoryCache(), name="code").acquire("k").release()  # after stop: not journaled
    assert len(events.subscribers) == before
    assert [r["kind"] for r in lines_of(tmp_path / "j")] == ["acquired", "released"]


def test_a_journal_directory_that_cannot_be_made_is_a_warning_not_a_failed_import(tmp_path):
    """The journal must never take the application down: a path that is a file is one
    warning on stderr, and the process locks as usual."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {**os.environ, journal.ENV: str(blocker / "journal")}
    code = "import simple_mutex as m; m.Mutex(m.InMemoryCache()).acquire('k').release()"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "cannot create the journal directory" in done.stderr
    assert "not journaling" in done.stderr


def run_timeline(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "simple_mutex.journal.timeline", *args],
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_corrupt_lines_are_reported_with_their_numbers_and_skipped(tmp_path):
    """A line that is not JSON, one with an unknown kind, one with a bad time and one cut
    short are each named file:line on stderr; the good lines are drawn."""
    stop = journal.start(tmp_path)
    Mutex(InMemoryCache()).acquire("good").release()
    stop()
    (path,) = tmp_path.glob("*.jsonl")
    good = path.read_text().splitlines()
    record = json.loads(good[0])
    bad_kind = json.dumps({**record, "kind": "exploded"})
    bad_time = json.dumps({**record, "at": "yesterday"})
    path.write_text("\n".join([good[0], "{not json", bad_kind, good[1], bad_time,
                               good[1][:40]]) + "\n")  # fmt: skip
    out = run_timeline(str(tmp_path), "-o", str(tmp_path / "t.html"))
    assert out.returncode == 0, out.stderr
    assert f"{path}:2: not JSON" in out.stderr
    assert f"{path}:3: unknown kind 'exploded'" in out.stderr
    assert f"{path}:5: field 'at' is not an ISO-8601 time" in out.stderr
    assert f"{path}:6: not JSON" in out.stderr
    assert out.stderr.count("skipped") == 4
    assert str(tmp_path / "t.html") in out.stdout
    assert (tmp_path / "t.html").read_text().count('class="hold"') == 1


def test_a_missing_path_is_exit_status_2_with_one_line(tmp_path):
    """A path that does not exist: status 2 and one line naming what to give."""
    out = run_timeline(str(tmp_path / "nowhere"), "-o", str(tmp_path / "t.html"))
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1
    assert "no such file or directory" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.fast
def test_render_escapes_every_string_it_is_given():
    """Keys, labels and reasons are user input: none reaches the page unescaped."""
    from simple_mutex import events

    got: list[events.LockEvent] = []
    stop = events.subscribe(got.append)
    try:
        Mutex(InMemoryCache(), label="<img src=x onerror=alert(1)>").acquire(HOSTILE_KEY).release()
    finally:
        stop()
    page = timeline.render(got)
    assert "<script>alert" not in page
    assert "<img" not in page
    assert "&lt;script&gt;alert(&#x27;key&#x27;)&lt;/script&gt;&amp;&quot;x" in page


@pytest.fixture(scope="module")
def page_path(journal_dir: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("page") / "timeline.html"
    done = run_timeline(str(journal_dir["dir"]), "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert f"timeline written to {out}" in done.stdout
    return out


def test_the_page_needs_nothing_but_itself(page_path):
    """No script, no stylesheet or image from anywhere: the file is the whole page."""
    page = page_path.read_text()
    for outside in ("http://", "https://", "//cdn", "<link", "<script", "@import", "src="):
        if outside == "http://":
            page = page.replace('xmlns="http://www.w3.org/2000/svg"', "")
        assert outside not in page


def test_the_page_in_a_real_browser(journal_dir, page_path, tmp_path):
    """Chromium loads the page offline with no console error and no request but the file;
    there is one .hold per hold in the journal, each titled with its holder and fence;
    the hostile key shows as text. A screenshot is kept beside the page."""
    records = lines_of(journal_dir["dir"])
    holds = Counter((r["key"], str(r["fence"]), str(r["holder"]["pid"]))
                    for r in records if r["kind"] == "acquired")  # fmt: skip
    requests: list[str] = []
    with chromium_page(1320, 900) as (page, problems):
        page.on("dialog", lambda d: problems.append(f"dialog: {d.message}"))
        page.on("request", lambda r: requests.append(r.url))
        page.goto(page_path.as_uri())
        bars = page.eval_on_selector_all(
            ".hold",
            "els => els.map(e => [e.dataset.key, e.dataset.fence, e.dataset.pid,"
            " e.querySelector('title').textContent])",
        )
        labels = page.eval_on_selector_all("svg > text", "els => els.map(e => e.textContent)")
        scripts = page.eval_on_selector_all("script", "els => els.length")
        lost_marks = page.eval_on_selector_all("svg.chart .lost", "els => els.length")
        page.screenshot(path=str(page_path.with_suffix(".png")), full_page=True)
    assert problems == []
    assert requests == [page_path.as_uri()]
    assert Counter((key, fence, pid) for key, fence, pid, _ in bars) == holds
    for _, fence, pid, title in bars:
        assert f"pid {pid}" in title
        assert f"fence {fence}" in title
    assert scripts == 0
    assert any(HOSTILE_KEY in label for label in labels)
    assert any("took over" in title for *_, title in bars)
    assert any("never released" in title for *_, title in bars)  # the killed holder
    assert any("LOST" in title for key, *_, title in bars if key == "import.feed")
    assert lost_marks == 1


@pytest.mark.fast
def test_holds_are_built_from_partial_journals():
    """A release whose grant is not in the journal starts at ``at - held``; a grant never
    released ends at its lease's expiry when a later event comes after it; the same line
    read twice counts once."""
    from datetime import datetime, timedelta, timezone

    from simple_mutex._core.records import Holder
    from simple_mutex.events import LockEvent

    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)

    def holder(pid: int, fence: int, lease: float) -> Holder:
        return Holder("h", pid, None, t0, t0 + timedelta(seconds=lease), fence)

    def event(kind: str, seconds: float, pid: int, fence: int, **more: Any) -> str:
        lease = more.pop("lease", 10.0)
        e = LockEvent(kind, "k", "mutex", "memory", t0 + timedelta(seconds=seconds),
                      fence=fence, slot=0, holder=holder(pid, fence, lease), **more)  # fmt: skip
        return journal.to_json(e, "h", pid)

    lines = [
        event("released", 5, 1, 1, held=2.0),  # its grant at 3 s is not in the journal
        event("acquired", 6, 2, 2, lease=8.0),  # killed: never released, lease ends at 8 s
        event("acquired", 9, 3, 3, took_over=True),
        event("released", 10, 3, 3, held=1.0),
    ]
    records = [journal.parse_line(line) for line in [*lines, lines[1]]]
    spans = [((h.start - t0).total_seconds(), (h.end - t0).total_seconds(), h.ending, h.took_over)
             for h in timeline.build(records).holds]  # fmt: skip
    assert spans == [(3, 5, "released", False), (6, 8, "open", False), (9, 10, "released", True)]


@pytest.mark.fast
def test_parked_calls_are_drawn_apart_from_holds():
    """``parked`` to ``promoted`` (paired by key and ticket) is a parked band, not a hold:
    a promotion whose park the journal lacks starts at ``at - waited``; one never promoted
    is outlined to the journal's end; the table counts them per key."""
    from datetime import datetime, timedelta, timezone

    from simple_mutex._core.records import Holder
    from simple_mutex.events import LockEvent

    t0 = datetime(2026, 1, 1, tzinfo=timezone.utc)

    def at(seconds: float) -> datetime:
        return t0 + timedelta(seconds=seconds)

    def line(kind: str, seconds: float, ticket: int, **more: Any) -> str:
        e = LockEvent(kind, "order.7", "tasks.ship", "redis", at(seconds), ticket=ticket, **more)
        return journal.to_json(e, "h", 9)

    held = Holder("h", 5, None, at(0), at(30), 1)

    def lock(kind: str, seconds: float, fence: int, pid: int, **more: Any) -> str:
        e = LockEvent(kind, "order.7", "tasks.ship", "redis", at(seconds), fence=fence,
                      slot=0, holder=held, **more)  # fmt: skip
        return journal.to_json(e, "h", pid)

    lines = [
        lock("acquired", 0, 1, 5),
        line("parked", 1, 2),
        line("parked", 2, 3),
        line("parked", 2.5, 2),  # the broker's copy of 2 parks again: one wait, from 1 s
        lock("released", 4, 1, 5, held=4.0),
        line("promoted", 4, 2, waited=3.0, reason="end"),
        line("promoted", 6, 4, waited=1.5, reason="sweep"),  # its park is not in the journal
        line("parked", 7, 5),  # never promoted
        lock("acquired", 8, 2, 6),  # keeps the journal open to 8 s
    ]
    built = timeline.build([journal.parse_line(text) for text in lines])
    spans = [(p.ticket, (p.start - t0).total_seconds(), (p.end - t0).total_seconds(), p.by)
             for p in built.parkings]  # fmt: skip
    assert spans == [(2, 1, 4, "end"), (3, 2, 8, None), (4, 4.5, 6, "sweep"), (5, 7, 8, None)]
    assert [(h.fence, h.ending) for h in built.holds] == [(1, "released"), (2, "open")]
    assert built.waits == []  # a promotion's wait is its parked band, not an acquire's wait
    page = timeline.render([journal.parse_line(text) for text in lines])
    chart = page.split('<p class="symbols">', 1)[0]
    assert chart.count('<rect class="parked" ') == 2
    assert chart.count('<rect class="parked open" ') == 2
    assert 'data-ticket="2"' in chart
    assert "ticket 2: parked 3 s" in chart
    assert chart.count('<rect class="hold') == 2  # the holds are drawn as before, apart
    assert "parked in the line" in page  # the key to the symbols names the band
    assert "4 parked" in page
    assert "<td>order.7</td>" in page
    row = page.split("<td>order.7</td>", 1)[1].split("</tr>", 1)[0]
    assert row.endswith("<td>4</td><td>6 s</td>")  # parked calls, longest parked
