"""Operators see the line (issue 24, item 5): the parked count per key in ``list``,
``watch`` and ``show`` (in-process, ``simple-mutex list`` and ``celery mutex list`` as
subprocesses) and in the ``simple_mutex_parked`` gauge, all read from real lines on Redis
(DB 9), beside locks really held."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from simple_mutex import Mutex
from simple_mutex.admin import parked_by_key
from simple_mutex.admin.commands import list_locks, show_lock, watch_locks
from simple_mutex.busy.line import Lines
from simple_mutex.caches import RedisCache
from simple_mutex.contrib import prometheus

pytestmark = pytest.mark.integrations

URL = "redis://127.0.0.1:6379/9"
BIN = Path(sys.executable).parent


@dataclass
class Scene:
    """Under one fresh prefix: ``busy`` held, its ticket 1 running, a parked copy of it
    (the broker's redelivery, kept in case the holder died) and tickets 2 and 3 parked
    behind it; ``idle``: nothing held, ticket 1 sent and not arrived, ticket 2 parked
    behind it; ``plain``: held, no line."""

    cache: RedisCache
    prefix: str


@pytest.fixture
def scene() -> Iterator[Scene]:
    cache = RedisCache(redis.Redis.from_url(URL))
    prefix = f"parkedtest.{uuid.uuid4().hex[:10]}."
    mutex = Mutex(cache, prefix=prefix, lease=60)
    lines = Lines(cache, lease=60, prefix="line." + prefix, lock_prefix=prefix)
    held = [mutex.acquire("busy"), mutex.acquire("plain")]
    first = lines.take("busy")
    assert type(lines.start("busy", first, redelivers=True)).__name__ == "Run"
    assert type(lines.arrive("busy", first, {"copy": 1})).__name__ == "Park"  # lock held
    for n in (2, 3):
        assert lines.send("busy", lambda t, n=n: {"n": n})[1] is True  # parked at the send
    lines.take("idle")
    assert lines.send("idle", lambda t: {"n": 2})[1] is True
    line = lines.read("busy")
    assert line is not None
    assert sorted(line.parked) == [1, 2, 3]
    yield Scene(cache, prefix)
    for lease in held:
        lease.release()
    for key in ("busy", "idle"):
        drop(cache, lines.cache_key(key))


def drop(cache: RedisCache, cache_key: str) -> None:
    found = cache.get(cache_key)
    if found is not None:
        cache.compare_and_delete(cache_key, version=found.version)


def test_parked_counts_leave_out_the_running_tickets_copy(scene: Scene) -> None:
    assert parked_by_key(scene.cache, scene.prefix) == {"busy": 2, "idle": 1}


def rows_of(text: str) -> dict[str, list[str]]:
    lines = text.strip().splitlines()
    return {line.split()[0]: line.split() for line in lines[1:]}


def test_list_shows_a_parked_column_and_a_line_with_nothing_held(scene: Scene) -> None:
    out = io.StringIO()
    assert list_locks(scene.cache, scene.prefix, out) == 0
    head, *_ = out.getvalue().splitlines()
    assert head.split()[-1] == "PARKED"
    rows = rows_of(out.getvalue())
    assert rows["busy"][-1] == "2"
    assert rows["plain"][-1] == "-"  # held, no line
    assert rows["idle"][:3] == ["idle", "-", "(none)"]
    assert rows["idle"][-1] == "1"


def test_list_json_carries_parked_only_where_a_line_is(scene: Scene) -> None:
    out = io.StringIO()
    list_locks(scene.cache, scene.prefix, out, json_output=True)
    found = {row["key"]: row for row in json.loads(out.getvalue())}
    assert found["busy"]["parked"] == 2
    assert found["busy"]["fence"] is not None
    assert "parked" not in found["plain"]
    assert found["idle"]["parked"] == 1
    assert found["idle"]["host"] is None
    assert found["idle"]["fence"] is None


def test_watch_and_show_say_how_many_are_parked(scene: Scene) -> None:
    out = io.StringIO()
    assert watch_locks(scene.cache, scene.prefix, out, refreshes=1, sleep=lambda _: None) == 0
    text = out.getvalue()
    assert ", 2 held, 3 parked, refreshed" in text
    table = text.split("\n", 1)[1]
    assert rows_of(table)["busy"][-1] == "2"
    assert rows_of(table)["idle"][-1] == "1"
    shown = io.StringIO()
    assert show_lock(scene.cache, "busy", scene.prefix, shown) == 0
    assert shown.getvalue().startswith("parked:      2 in its line\n")
    free = io.StringIO()
    assert show_lock(scene.cache, "idle", scene.prefix, free) == 1  # nothing held
    assert "parked:      1 in its line" in free.getvalue()


def test_an_idle_line_is_not_listed(scene: Scene) -> None:
    """A line whose calls all ran (its record lives on for a day) is nothing to look at:
    ``list``, ``--json`` and ``watch`` leave it out, beside the lines that are not idle."""
    lines = Lines(scene.cache, lease=60, prefix="line." + scene.prefix, lock_prefix=scene.prefix)
    done = [f"done{n}" for n in range(3)]
    for key in done:
        ticket = lines.take(key)
        assert type(lines.start(key, ticket)).__name__ == "Run"
        lines.end(key, ticket)
    try:
        assert {key: parked_by_key(scene.cache, scene.prefix).get(key) for key in done} == {
            key: 0 for key in done
        }  # the records are there
        out, listed, watched = io.StringIO(), io.StringIO(), io.StringIO()
        list_locks(scene.cache, scene.prefix, out)
        list_locks(scene.cache, scene.prefix, listed, json_output=True)
        watch_locks(scene.cache, scene.prefix, watched, refreshes=1, sleep=lambda _: None)
        assert set(rows_of(out.getvalue())) == {"busy", "idle", "plain"}
        assert {row["key"] for row in json.loads(listed.getvalue())} == {"busy", "idle", "plain"}
        assert set(rows_of(watched.getvalue().split("\n", 1)[1])) == {"busy", "idle", "plain"}
    finally:
        for key in done:
            drop(scene.cache, lines.cache_key(key))


def test_no_line_no_parked_column(scene: Scene) -> None:
    """Locks under a prefix with no line: the table as it always was."""
    other = f"parkedtest.{uuid.uuid4().hex[:10]}."
    lease = Mutex(scene.cache, prefix=other).acquire("k")
    try:
        out = io.StringIO()
        list_locks(scene.cache, other, out)
        assert "PARKED" not in out.getvalue()
        listed = io.StringIO()
        list_locks(scene.cache, other, listed, json_output=True)
        assert "parked" not in json.loads(listed.getvalue())[0]
    finally:
        lease.release()


def celery_project(where: Path, prefix: str) -> None:
    """A Celery app ``proj`` in ``where`` whose lock cache is this module's Redis."""
    (where / "proj.py").write_text(
        "from celery import Celery\n"
        f"app = Celery('proj', broker='memory://', backend={URL!r})\n"
        f"app.conf.mutex_cache = {URL!r}\n"
        f"app.conf.mutex_prefix = {prefix!r}\n"
        "@app.task(name='proj.t')\n"
        "def t():\n"
        "    pass\n"
    )


def celery_mutex_command(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``celery -A proj mutex ARGS`` in ``project`` (``celery_project``)."""
    return subprocess.run(
        [str(BIN / "celery"), "-A", "proj", "mutex", *args], capture_output=True, text=True,
        timeout=60, cwd=project, env={**os.environ, "PYTHONPATH": str(project)},
    )  # fmt: skip


def test_the_commands_as_subprocesses(scene: Scene, tmp_path: Path) -> None:
    """``simple-mutex list`` and ``celery -A proj mutex list --json`` show the same."""
    listed = subprocess.run(
        [str(BIN / "simple-mutex"), "list", URL, "--prefix", scene.prefix],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert rows_of(listed.stdout)["busy"][-1] == "2"
    celery_project(tmp_path, scene.prefix)
    done = subprocess.run(
        [str(BIN / "celery"), "-A", "proj", "mutex", "list", "--json"], capture_output=True,
        text=True, timeout=60, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    parked = {row["key"]: row.get("parked") for row in json.loads(done.stdout)}
    assert parked == {"busy": 2, "idle": 1, "plain": None}


def test_show_lists_a_lines_calls_in_ticket_order(scene: Scene) -> None:
    """``show`` prints each call of the key's line with its ticket: what ``step-over``
    takes. The running ticket's parked copy is shown once, as running."""
    shown = io.StringIO()
    assert show_lock(scene.cache, "busy", scene.prefix, shown) == 0
    text = shown.getvalue()
    table = text[text.index("line (turn 1):") :].splitlines()[1:]
    assert [row.split()[:2] for row in table] == [
        ["TICKET", "STATE"], ["1", "running"], ["2", "parked"], ["3", "parked"],
    ]  # fmt: skip
    idle = io.StringIO()
    show_lock(scene.cache, "idle", scene.prefix, idle)
    rows = idle.getvalue()[idle.getvalue().index("line (turn 1):") :].splitlines()[2:]
    assert [row.split()[:2] for row in rows] == [["1", "sent,"], ["2", "parked"]]
    assert "sent, not arrived" in rows[0]


def test_an_operator_steps_over_a_head_that_never_arrived(scene: Scene) -> None:
    """``idle``'s ticket 1 was sent and never arrived; ticket 2 waits behind it, and would
    wait ``gap_for`` (120 s by default). ``simple-mutex step-over URL idle 1`` forgets it
    at once and promotes nothing: the next sweep of a worker sends ticket 2, and ticket
    1, should it arrive after all, is dropped as a duplicate. The running ticket and one
    not in the line are refused, and a "no" at the prompt steps over nothing."""
    lines = Lines(scene.cache, lease=60, prefix="line." + scene.prefix, lock_prefix=scene.prefix)
    assert lines.sweep("idle", promote_grace=30, gap_for=120).publish == ()  # it waits

    def step(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(BIN / "simple-mutex"), "step-over", URL, *args, "--prefix", scene.prefix],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    running = step("busy", "1", "--yes")
    assert running.returncode == 1
    assert "is running" in running.stdout
    assert step("idle", "9", "--yes").returncode == 1
    declined = subprocess.run(
        [str(BIN / "simple-mutex"), "step-over", URL, "idle", "1", "--prefix", scene.prefix],
        input="n\n", capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert declined.returncode == 1
    assert "not stepped over" in declined.stdout
    assert lines.read("idle").turn == 1  # type: ignore[union-attr]

    done = step("idle", "1", "--yes")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "stepped over ticket 1" in done.stdout
    assert "stepped over ticket 1 (?) of the line of 'idle'" in done.stderr  # the log names it
    line = lines.read("idle")
    assert line is not None
    assert line.turn == 2
    assert line.parked[2].promoted is None  # nothing promoted by the operator's tool
    swept = lines.sweep("idle", promote_grace=30, gap_for=120)
    assert [p.ticket for p in swept.publish] == [2]
    assert type(lines.arrive("idle", line.ticket(1), {"n": 1})).__name__ == "Duplicate"
    assert step("idle", "1", "--yes").returncode == 1  # done: nothing left to step over


def test_celery_mutex_step_over_names_the_parked_call(scene: Scene, tmp_path: Path) -> None:
    """``celery -A proj mutex step-over KEY TICKET`` on the app's cache: a parked call
    behind the running one is stepped over and named; the running one stays. A Celery
    call stepped over so has its result stored REVOKED: its caller's ``get()`` ends."""
    celery_project(tmp_path, scene.prefix)
    lines = Lines(scene.cache, lease=60, prefix="line." + scene.prefix, lock_prefix=scene.prefix)
    call_id = uuid.uuid4().hex
    _, parked = lines.send("busy", lambda t: {"task": "proj.t", "id": call_id})
    assert parked  # ticket 4, behind 1 (running), 2 and 3
    stepped = celery_mutex_command(tmp_path, "step-over", "busy", "4", "--yes")
    assert stepped.returncode == 0, stepped.stdout + stepped.stderr
    assert f"proj.t[{call_id}]" in stepped.stdout
    from celery import Celery

    reader = Celery("reader", backend=URL, set_as_current=False)
    assert reader.AsyncResult(call_id).state == "REVOKED"
    done = celery_mutex_command(tmp_path, "step-over", "busy", "2", "--yes")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "stepped over ticket 2" in done.stdout
    line = lines.read("busy")
    assert line is not None
    assert sorted(line.parked) == [1, 3]  # 4 was stepped over above
    assert line.running is not None
    assert line.running.ticket == 1


def test_the_parked_gauge_reads_the_lines_at_each_scrape(scene: Scene) -> None:
    registry = CollectorRegistry()
    uninstrument = prometheus.instrument_lines(scene.cache, prefix=scene.prefix, registry=registry)

    def gauge() -> dict[str, float]:
        families = text_string_to_metric_families(generate_latest(registry).decode())
        return {
            sample.labels["key"]: sample.value
            for family in families
            if family.name == "simple_mutex_parked"
            for sample in family.samples
            if sample.labels["prefix"] == scene.prefix
        }

    try:
        assert gauge() == {"busy": 2.0, "idle": 1.0}
        lines = Lines(scene.cache, lease=60, prefix="line." + scene.prefix,
                      lock_prefix=scene.prefix)  # fmt: skip
        line = lines.read("busy")
        assert line is not None
        lines.end("busy", line.ticket(1))  # ticket 2 promoted: still parked until it starts
        assert gauge() == {"busy": 2.0, "idle": 1.0}
        assert type(lines.start("busy", line.ticket(2))).__name__ == "Run"
        assert gauge() == {"busy": 1.0, "idle": 1.0}
        drop(scene.cache, lines.cache_key("idle"))  # a line gone leaves no series behind
        assert gauge() == {"busy": 1.0}
    finally:
        uninstrument()
    assert "simple_mutex_parked" not in generate_latest(registry).decode()
