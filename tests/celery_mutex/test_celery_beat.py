"""The beat guard (celery_mutex.beat): slot functions with fake times, the scheduler guard
in-process, and real ``celery beat`` + ``celery worker -P prefork`` subprocesses.

Needs Redis at 127.0.0.1:6379 (broker, lock cache, results, records). A missing Redis
fails the tests; it never skips them.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import re
import shelve
import signal
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery import Celery
from celery.beat import ScheduleEntry, Scheduler
from celery.schedules import crontab, schedule
from celery_support.processes import REDIS_URL, Processes
from workers import stop, wait_until

# isort: split
from celery_mutex import is_skipped
from celery_mutex.beat import (
    HEADER,
    MutexScheduler,
    MutexSchedulerMixin,
    cron_slot,
    drop_duplicate_tick,
    tick_slot,
)
from simple_mutex import ConstraintError, InMemoryCache, cache_from_url

pytestmark = pytest.mark.integrations

UTC = dt.timezone.utc


def ts(*args: int) -> float:
    return dt.datetime(*args, tzinfo=UTC).timestamp()


# -- slots with fake times ----------------------------------------------------------------


def test_interval_slots_are_epoch_aligned_whatever_the_start() -> None:
    """An interval slot is the period containing now, counted from the epoch."""
    every = schedule(dt.timedelta(seconds=10))
    base = ts(2026, 11, 29, 11, 15, 0)
    assert tick_slot(every, base)[0] == "2026-11-29T11:15:00Z"
    assert tick_slot(every, base + 9.99)[0] == "2026-11-29T11:15:00Z"
    assert tick_slot(every, base + 10.0)[0] == "2026-11-29T11:15:10Z"
    assert tick_slot(every, base + 10.0)[1] == 30.0  # claim: 3 periods
    assert tick_slot(schedule(0.5), base + 0.7) == ("2026-11-29T11:15:00.500Z", 10.0)
    assert tick_slot(schedule(3600), base)[0] == "2026-11-29T11:00:00Z"


@pytest.mark.parametrize(
    ("cron", "now", "due"),
    [
        (crontab(), (2026, 11, 29, 11, 15, 42), (2026, 11, 29, 11, 15)),
        (crontab(minute="*/15"), (2026, 11, 29, 11, 15, 0), (2026, 11, 29, 11, 15)),
        (crontab(minute="*/15"), (2026, 11, 29, 11, 29, 59), (2026, 11, 29, 11, 15)),
        (crontab(minute="*/15"), (2026, 11, 29, 11, 14, 59), (2026, 11, 29, 11, 0)),
        (crontab(minute=0, hour=4), (2026, 11, 29, 3, 59, 0), (2026, 11, 28, 4, 0)),
        (crontab(minute=0, hour=4), (2026, 11, 29, 4, 0, 30), (2026, 11, 29, 4, 0)),
        (crontab(0, 0, day_of_month=1), (2026, 11, 29, 4, 0, 30), (2026, 11, 1, 0, 0)),
    ],
)
def test_cron_slot_is_the_last_due_time(cron: Any, now: tuple[int, ...], due: tuple[int, ...]):
    """A crontab slot is its most recent due minute at or before now."""
    cron.app = Celery(set_as_current=False)
    now_dt = dt.datetime(*now, tzinfo=UTC)
    assert cron_slot(cron, now_dt) == dt.datetime(*due, tzinfo=UTC)
    slot, lease = tick_slot(cron, now_dt.timestamp())
    assert slot == dt.datetime(*due, tzinfo=UTC).strftime("%Y-%m-%dT%H:%MZ")
    assert lease >= 10.0


def test_cron_slot_in_another_time_zone() -> None:
    """A crontab in the app's time zone gets its due minute written in UTC."""
    app = Celery(set_as_current=False)
    app.conf.timezone = "Europe/Paris"  # 04:00 Paris = 03:00 UTC in November
    cron = crontab(minute=0, hour=4, app=app)
    assert tick_slot(cron, ts(2026, 11, 29, 3, 20))[0] == "2026-11-29T03:00Z"
    assert tick_slot(cron, ts(2026, 11, 29, 2, 59))[0] == "2026-11-28T03:00Z"


def test_mutex_scheduler_fires_interval_entries_on_boundaries(monkeypatch) -> None:
    """MutexScheduler fires an interval entry just past each epoch-aligned boundary."""
    app = Celery(set_as_current=False)
    sched = MutexScheduler.__new__(MutexScheduler)  # is_due needs no state
    sched.app = app
    entry = SimpleNamespace(
        schedule=schedule(dt.timedelta(seconds=10), app=app),
        last_run_at=dt.datetime.fromtimestamp(ts(2026, 11, 29, 11, 15, 3), UTC),
    )
    now = ts(2026, 11, 29, 11, 15, 7)
    monkeypatch.setattr(time, "time", lambda: now)
    due, wait = sched.is_due(entry)
    assert not due
    assert wait == pytest.approx(3.015)
    now = ts(2026, 11, 29, 11, 15, 10) + 0.002
    due, wait = sched.is_due(entry)
    assert due
    assert wait == pytest.approx(10.013)


# -- the scheduler guard, in-process ------------------------------------------------------


class _Recording(MutexSchedulerMixin, Scheduler):  # type: ignore[misc]
    """A plain Scheduler with the guard; send_task records instead of publishing."""

    def __init__(self, app: Celery, sent: list[tuple[str, dict[str, Any]]]) -> None:
        super().__init__(app, lazy=True)
        self.sent = sent

    def send_task(self, name: str, *args: Any, **options: Any) -> Any:
        self.sent.append((name, options))
        return SimpleNamespace(id="x")


def test_two_guarded_schedulers_send_each_slot_once(monkeypatch) -> None:
    """Two guarded beats on one cache: one sends, stamped, the entry itself unchanged."""
    # Mid-slot, and still: on the wall clock the two sends could fall on both sides of a
    # 1 s slot's boundary (it failed so once, in CI), and both would rightly go out.
    monkeypatch.setattr(time, "time", lambda: ts(2026, 11, 29, 11, 15, 0) + 0.5)
    app = Celery(set_as_current=False)
    app.conf.mutex_beat_cache = InMemoryCache()  # shared by both "beats" here
    sent: list[tuple[str, dict[str, Any]]] = []
    beats = [_Recording(app, sent), _Recording(app, sent)]
    entry = ScheduleEntry(
        name="report",
        task="not.imported.report",  # unknown to this app: the send_task path
        schedule=schedule(1.0),
        options={"headers": {"mine": 1}},
        app=app,
    )
    for beat in beats:
        beat.apply_async(entry, producer=object(), advance=False)
    assert len(sent) == 1
    name, options = sent[0]
    assert name == "not.imported.report"
    assert options["headers"]["mine"] == 1
    assert options["headers"][HEADER].startswith("report@")
    assert entry.options == {"headers": {"mine": 1}}  # the entry itself is not stamped
    assert not any(beat.mutex_claim(entry) for beat in beats)  # the slot stays claimed


def test_crontab_entry_goes_out_once_per_due_minute(monkeypatch) -> None:
    """Beats sending the same crontab tick at different instants (one 80 s late) claim
    one slot: its due time. The next due time is a new slot. advance=True (Celery's
    default for apply_async) records the run in the schedule of the beat that sent it
    only."""
    app = Celery(set_as_current=False)
    app.conf.mutex_beat_cache = InMemoryCache()
    sent: list[tuple[str, dict[str, Any]]] = []
    beats = [_Recording(app, sent) for _ in range(3)]
    entry = ScheduleEntry(
        name="hourly", task="not.imported.hourly", schedule=crontab(minute=15), app=app
    )
    start = ts(2026, 11, 29, 11, 15, 0)
    for beat, now in zip(beats, (start + 0.3, start + 0.9, start + 80), strict=True):
        monkeypatch.setattr(time, "time", lambda now=now: now)
        beat.apply_async(entry, producer=object(), advance=True)
    assert [opts["headers"][HEADER] for _, opts in sent] == ["hourly@2026-11-29T11:15Z"]
    assert beats[0].schedule["hourly"].total_run_count == 1
    assert "hourly" not in beats[1].schedule
    assert "hourly" not in beats[2].schedule
    monkeypatch.setattr(time, "time", lambda: ts(2026, 11, 29, 12, 15, 1))
    beats[2].apply_async(entry, producer=object(), advance=False)
    assert [opts["headers"][HEADER] for _, opts in sent][1:] == ["hourly@2026-11-29T12:15Z"]


class _Crashing(_Recording):
    """A winner that dies between its claim and its publish."""

    def send_task(self, name: str, *args: Any, **options: Any) -> Any:
        raise SystemExit("killed between the claim and the publish")


def test_only_the_beat_that_sent_a_tick_records_it_as_run(monkeypatch) -> None:
    """Celery's tick: reserve (move on), then send. The losing beat's schedule store
    keeps the entry as it was (no last_run_at, no run counted) though its own heap
    moves on, so it does not send again at once; the winner's records the run once
    sent."""
    monkeypatch.setattr(time, "time", lambda: ts(2026, 11, 29, 11, 15, 0) + 0.5)
    app = Celery(set_as_current=False)
    app.conf.mutex_beat_cache = InMemoryCache()
    sent: list[tuple[str, dict[str, Any]]] = []
    beats = [_Recording(app, sent), _Recording(app, sent)]
    entry = ScheduleEntry(name="report", task="not.imported.report", schedule=schedule(10.0),
                          app=app)  # fmt: skip
    for beat in beats:
        beat.schedule["report"] = entry
    moved = []
    for beat in beats:  # what Scheduler.tick does with a due entry
        moved.append(beat.reserve(entry))
        beat.apply_entry(entry, producer=object())
    assert len(sent) == 1
    winner, loser = beats
    assert winner.schedule["report"].total_run_count == 1
    assert loser.schedule["report"] is entry  # its store unchanged
    assert entry.total_run_count == 0
    assert [m.total_run_count for m in moved] == [1, 0]  # the winner's heap counts its run
    assert not loser.is_due(moved[1])[0]  # its heap moved on all the same
    heap = moved[0]
    for n in (1, 2):  # the winner's later ticks, each a new slot it wins: counted on
        monkeypatch.setattr(time, "time", lambda n=n: ts(2026, 11, 29, 11, 15, 0) + 10 * n)
        following = winner.reserve(heap)
        winner.apply_entry(heap, producer=object())
        heap = following
    assert len(sent) == 3
    assert winner.schedule["report"].total_run_count == heap.total_run_count == 3
    assert loser.schedule["report"] is entry


def test_a_winner_that_dies_before_its_publish_records_nothing(monkeypatch) -> None:
    """The winner dies between its claim and its publish: the tick is lost (documented),
    and no store says it ran, so staleness alerts still fire."""
    monkeypatch.setattr(time, "time", lambda: ts(2026, 11, 29, 11, 15, 0) + 0.5)
    app = Celery(set_as_current=False)
    app.conf.mutex_beat_cache = InMemoryCache()
    beat = _Crashing(app, [])
    entry = ScheduleEntry(name="report", task="not.imported.report", schedule=schedule(10.0),
                          app=app)  # fmt: skip
    beat.schedule["report"] = entry
    beat.reserve(entry)
    with pytest.raises(SystemExit):
        beat.apply_async(entry, producer=object(), advance=False)
    assert beat.schedule["report"] is entry
    assert entry.total_run_count == 0


def test_guard_without_a_cache_names_the_setting() -> None:
    """No cache: the guard fails as beat starts, and at a send, naming mutex_cache."""
    beat = _Recording(Celery(set_as_current=False), [])
    entry = ScheduleEntry(name="e", task="t", schedule=schedule(1.0), app=beat.app)
    with pytest.raises(Exception, match="mutex_cache"):
        beat.apply_async(entry, producer=object(), advance=False)
    with pytest.raises(ConstraintError, match="mutex_cache"):
        beat.setup_schedule()  # what celery beat calls as it starts


def test_worker_side_record_drops_copies_and_redeliveries_but_not_retries() -> None:
    """A second message of a tick, or the same one again, is dropped with its reason;
    the tick's own Task.retry and busy retry go on."""
    cache = cache_from_url(REDIS_URL)
    prefix = f"cmbu{uuid.uuid4().hex[:8]}."
    tick = "report@2026-11-29T11:15:00Z"

    app = Celery(set_as_current=False)

    def deliver(task_id: str, retries: int = 0, busy: int = 0) -> dict[str, Any] | None:
        request = SimpleNamespace(retries=retries, mutex_busy_retries=busy, **{HEADER: tick})
        task = SimpleNamespace(name="report", request=request, _get_app=lambda: app)
        return drop_duplicate_tick(task, cache, prefix, task_id)

    assert deliver("a") is None  # the first message of the tick runs
    copy = deliver("b")  # a second publish of the same tick
    assert copy is not None
    assert is_skipped(copy)
    assert copy["reason"] == "duplicate"
    again = deliver("a")  # the same message again (visibility timeout, acks_late)
    assert again is not None
    assert is_skipped(again)
    assert again["reason"] == "redelivered"
    assert deliver("a", retries=1) is None  # its own Task.retry goes on
    assert deliver("a", retries=1, busy=1) is None  # and its busy retry


# -- real processes -----------------------------------------------------------------------


class Cluster(Processes):
    """One ``celery worker -P prefork -c 2`` and any number of ``celery beat`` processes
    of ``celery_support.beat_app``; every process bounded and killed at the end."""

    def __init__(self, tmp: Path, concurrency: int = 2) -> None:
        super().__init__("celery_support.beat_app", tmp)
        self.beats: list[subprocess.Popen[bytes]] = []
        self.start_worker("worker", concurrency, CM_ROLE="worker")
        wait_until(lambda: "ready." in self.log_text("worker"), 30, "the worker to be ready")

    def start_beats(self, count: int, scheduler: str, run: str, **env: str) -> None:
        """``count`` beats of ``scheduler`` for ``run``; ``env``: beat_app's knobs (e.g.
        ``CM_SLOW="1"``, ``CM_CRON="1"``, ``CM_OVERLAP="1"``), each off unless given."""
        for i in range(count):
            beat = f"beat-{run}-{i}"
            self.beats.append(
                self.start(
                    beat,
                    [
                        *("beat", "-S", scheduler, "-s", str(self.tmp / beat)),
                        *("--pidfile", str(self.tmp / f"{beat}.pid"), "--max-interval", "1"),
                    ],
                    CM_ROLE="beat",
                    CM_RUN=run,
                    **{"CM_SLOW": "0", "CM_CRON": "0", **env},
                )
            )

    def stop_beats(self) -> None:
        stop(self.beats)
        self.beats = []

    def sent(self) -> dict[str, float]:
        """Each tick a ``RecordingScheduler`` claimed, and when its send returned."""
        found = self.record.hgetall(self.prefix + "sent")
        return {slot.decode(): float(at) for slot, at in found.items()}

    def runs(self, run: str) -> list[dict[str, Any]]:
        rows = [json.loads(r) for r in self.record.lrange(self.prefix + "runs", 0, -1)]
        return [row for row in rows if row["run"] == run]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(Path(tmp))
        try:
            yield cluster
        finally:
            cluster.stop()


def _per_slot(rows: list[dict[str, Any]], entry: str) -> Counter[str]:
    return Counter(row["slot"] for row in rows if row["entry"] == entry)


def test_three_guarded_beats_run_every_slot_exactly_once(cluster: Cluster) -> None:
    """3 beats with MutexScheduler, 1 s entries (one sent by task.apply_async, one by
    send_task), a 2-process prefork worker, 20 s; the beat that sent most ticks is
    SIGKILLed halfway. Every slot of the window ran once, none twice, none missed; the
    2.5 s job never overlaps itself and the ticks that found it running were skipped and
    counted."""
    run = "guarded-" + uuid.uuid4().hex[:6]
    started = time.time()
    cluster.start_beats(3, "celery_mutex.beat:MutexScheduler", run, CM_SLOW="1")
    time.sleep(10 - time.time() % 1 + 0.5)  # mid-period: no send in flight (see README)
    claims = [cluster.log_text(f"beat-{run}-{i}").count(" claimed ") for i in range(3)]
    busiest = claims.index(max(claims))
    assert claims[busiest] > 0
    killed = cluster.beats[busiest]
    killed.kill()  # SIGKILL the beat that sent the most ticks so far
    time.sleep(10)
    stopped = time.time()
    cluster.stop_beats()
    time.sleep(3.5)  # the queue drains; a slow run in progress ends
    assert killed.returncode == -signal.SIGKILL
    # The window opens once some beat has claimed each entry: a loaded machine may start
    # the beats late, and a slot before any beat was up is not one the guard can miss.
    logs = "".join(cluster.log_text(f"beat-{run}-{i}") for i in range(3))
    first = max(
        min(int(_slot_time(t)) for t in re.findall(rf" claimed ({entry}@\S+)", logs))
        for entry in ("fast", "remote")
    )
    assert first <= started + 8  # beats start within a few seconds, even under load
    window = range(max(int(started) + 4, first), int(stopped) - 1)
    assert len(window) >= 11
    # A loaded machine's worker may still be behind: wait (up to 30 s) until every slot of
    # the window has a run of each entry, or for nothing more to come, then judge.
    wanted = [f"{e}@{tick_slot(schedule(1.0), s)[0]}" for e in ("fast", "remote") for s in window]
    rows, deadline = cluster.runs(run), time.monotonic() + 30
    while time.monotonic() < deadline:
        ran = {row["slot"] for row in rows}
        if all(tick in ran for tick in wanted):
            break
        time.sleep(1)
        rows = cluster.runs(run)
    killed_log = cluster.log_text(f"beat-{run}-{busiest}")
    for entry in ("fast", "remote"):
        counts = _per_slot(rows, entry)
        assert None not in counts  # every run carries its slot
        assert [s for s, n in counts.items() if n > 1] == []  # no slot ran twice
        expected = [f"{entry}@{tick_slot(schedule(1.0), s)[0]}" for s in window]
        # Every slot ran once, but one: the guide's "sent once" allows the killed beat's
        # last claim to be lost, killed between claim and publish. The kill aims at
        # mid-period, but a loaded machine may run that beat's send late, into it.
        claims = re.findall(rf" claimed ({entry}@\S+)", killed_log)
        lost = [s for s in expected if counts[s] != 1]
        assert lost in ([], claims[-1:]), f"slots that did not run once: {lost}"
        after_kill = [s for s in expected[-8:] if counts[s] == 1]
        assert len(after_kill) == 8
    winners = [i for i in range(3) if " claimed fast@" in cluster.log_text(f"beat-{run}-{i}")]
    assert len(winners) >= 2  # active-active: the others carried on at once
    # Each beat's schedule store (the -s shelve, saved as it shut down) counts the runs
    # of the ticks it sent, not every tick it saw come due (the others' too).
    for i in range(3):
        if i == busiest:
            continue  # SIGKILLed: its store holds what it saved last, at most
        beat_log = cluster.log_text(f"beat-{run}-{i}")
        with shelve.open(str(cluster.tmp / f"beat-{run}-{i}"), flag="r") as store:
            entries = store["entries"]
            for entry in ("fast", "remote"):
                claimed = len(re.findall(rf" claimed {entry}@", beat_log))
                assert entries[entry].total_run_count == claimed, (i, entry)
    slow = sorted((row["start"], row["end"]) for row in rows if row["entry"] == "slow")
    assert len(slow) >= 4
    assert all(b[0] >= a[1] for a, b in itertools.pairwise(slow))  # no overlap
    skipped = int(cluster.record.get(f"{cluster.prefix}busy.skip.slow.{run}") or 0)
    assert skipped >= len(slow)  # a 2.5 s job on a 1 s tick: most ticks are skipped


def test_three_plain_beats_send_duplicates(cluster: Cluster) -> None:
    """The same setup with Celery's own PersistentScheduler: every tick goes out about
    three times (so the guarded test above can fail)."""
    run = "plain-" + uuid.uuid4().hex[:6]
    started = time.time()
    cluster.start_beats(3, "celery.beat:PersistentScheduler", run)
    time.sleep(9)
    stopped = time.time()
    cluster.stop_beats()
    time.sleep(1.5)
    rows = [
        r
        for r in cluster.runs(run)
        if r["entry"] == "fast" and started + 4 <= r["start"] < stopped - 1
    ]
    seconds = stopped - 1 - (started + 4)
    assert all(row["slot"] is None for row in rows)  # no guard, no stamp
    assert len(rows) >= 2 * seconds  # about 3 runs per 1 s tick
    per_second = Counter(int(row["start"]) for row in rows)
    assert max(per_second.values()) >= 2


def test_worker_drops_a_second_copy_of_a_tick_and_keeps_its_retries(cluster: Cluster) -> None:
    """Two messages of one tick to a real worker: one runs, one is dropped and counted;
    a stamped task that retries itself still runs."""
    run = "drop-" + uuid.uuid4().hex[:6]
    tick = {HEADER: f"manual@{run}"}
    first = cluster.app.send_task("celery_support.beat_app.guarded", (run, 1), headers=tick)
    second = cluster.app.send_task("celery_support.beat_app.guarded", (run, 1), headers=tick)
    results = [first.get(timeout=20), second.get(timeout=20)]
    assert sorted(map(is_skipped, results)) == [False, True]
    dropped = next(r for r in results if is_skipped(r))
    assert dropped["reason"] == "duplicate"
    assert dropped["key"] == f"manual@{run}"
    assert len([r for r in cluster.runs(run) if r["entry"] == "guarded"]) == 1
    assert int(cluster.record.get(f"{cluster.prefix}dropped.duplicate") or 0) >= 1
    retried = cluster.app.send_task(
        "celery_support.beat_app.retried", (run,), headers={HEADER: f"again@{run}"}
    )
    assert retried.get(timeout=20) == 1  # the retry carries the slot and still runs


def test_three_guarded_beats_run_a_kolkata_crontab_tick_exactly_once(cluster: Cluster) -> None:
    """3 real beats with MutexScheduler, the app in Asia/Kolkata (UTC+05:30), a crontab
    every minute of the local hours the test runs in, across a minute boundary: that
    minute's tick ran exactly once, stamped with its due minute in UTC, and no tick ran
    twice or under another slot. Before the fix, on Celery 5.3 to 5.6 (remaining_delta
    read a UTC datetime's hour as Kolkata's), every tick of the day mapped to one slot of
    another hour (and all but the first were dropped as already claimed)."""
    run = "kolkata-" + uuid.uuid4().hex[:6]
    launched = time.time()
    kolkata = ZoneInfo("Asia/Kolkata")
    hours = sorted({dt.datetime.fromtimestamp(launched + s, kolkata).hour for s in (0, 180)})
    fields = {"minute": "*", "hour": ",".join(map(str, hours))}
    cluster.start_beats(
        3, "celery_mutex.beat:MutexScheduler", run, CM_CRON="1",
        CM_TIMEZONE="Asia/Kolkata", CM_CRON_FIELDS=json.dumps(fields),
    )  # fmt: skip
    names = [f"beat-{run}-{i}" for i in range(3)]
    wait_until(
        lambda: all("Starting..." in cluster.log_text(name) for name in names), 30, "the beats"
    )
    # The first boundary every beat is surely past its start for: no wait for a set second.
    boundary = (int(time.time() + 5) // 60 + 1) * 60
    time.sleep(max(0.0, boundary + 8 - time.time()))
    stopped = time.time()
    cluster.stop_beats()
    time.sleep(1.5)
    slots = Counter(row["slot"] for row in cluster.runs(run) if row["entry"] == "cron")

    def due(minute: int) -> str:
        return f"cron@{dt.datetime.fromtimestamp(minute, UTC).strftime('%Y-%m-%dT%H:%MZ')}"

    logs = [cluster.log_text(n)[-1500:] for n in names]
    assert slots[due(boundary)] == 1, (slots, logs)
    # A beat up before an earlier boundary may have sent that tick too: once, on its minute.
    window = {due(m) for m in range((int(launched) // 60 + 1) * 60, int(stopped) + 1, 60)}
    assert set(slots) <= window, (slots, logs)
    assert max(slots.values()) == 1, (slots, logs)


@pytest.fixture(scope="module")
def roomy_cluster() -> Iterator[Cluster]:
    """A worker of 4 processes: a tick is judged as it arrives, never behind a busy pool."""
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(Path(tmp), concurrency=4)
        try:
            yield cluster
        finally:
            cluster.stop()


def _slot_time(slot: str) -> float:
    return dt.datetime.fromisoformat(slot.partition("@")[2].replace("Z", "+00:00")).timestamp()


def test_overlap_skip_or_buffer_one(roomy_cluster: Cluster) -> None:
    """Temporal's two overlap choices on a guarded beat: a 2.5 s job (skip) and 2.2 s
    jobs (buffer one, two ways) on a 1 s tick, for 12 s. skip (``on_busy="skip"``): every
    run came from a tick due after the previous run ended (those due meanwhile were
    skipped). buffer one (``on_busy="queue"``, ``queue={"max": 2, "on_full": "skip"}``,
    or ``on_busy="latest"``): each run starts as its predecessor ends (a tick waited for
    it: with skip the next tick is 0.8 s away), and once the beat stops at most one more
    run starts (one was buffered, not the dozen ticks of the window). A buffered run is
    still its tick: it sees the tick's slot (``mutex_beat_slot``), each run its own, due
    before it started; with latest, a tick that came due during the run before. None
    ever overlaps itself."""
    cluster = roomy_cluster
    run = "overlap-" + uuid.uuid4().hex[:6]
    cluster.start_beats(1, "celery_support.beat_app:RecordingScheduler", run, CM_OVERLAP="1")
    time.sleep(12)
    cluster.stop_beats()
    stopped = time.time()
    time.sleep(6)  # the run in progress ends, and the one buffered behind it
    rows = cluster.runs(run)
    runs = {
        entry: sorted((r for r in rows if r["entry"] == entry), key=lambda r: r["start"])
        for entry in ("slow", "buffered", "newest")
    }
    for entry, done in runs.items():
        assert len(done) >= 3, (entry, done)
        assert all(b["start"] >= a["end"] for a, b in itertools.pairwise(done))  # no overlap
    skipping = runs["slow"]
    due = [_slot_time(r["slot"]) for r in skipping]
    # 0.5 s bounds the beat's and the broker's lag behind a tick's due time.
    assert all(t > a["end"] - 0.5 for a, t in zip(skipping, due[1:], strict=False)), skipping
    for entry in ("buffered", "newest"):
        buffering = runs[entry]
        gaps = [b["start"] - a["end"] for a, b in itertools.pairwise(buffering)]
        assert all(g < 0.4 for g in gaps), (entry, gaps)
        assert len([r for r in buffering if r["start"] > stopped]) <= 1, (stopped, buffering)
        slots = [r["slot"] for r in buffering]
        assert None not in slots, (entry, slots)
        assert len(set(slots)) == len(slots), (entry, slots)
        assert all(_slot_time(r["slot"]) <= r["start"] for r in buffering), (entry, buffering)
    # latest keeps the newest tick: a run's successor is at least as new as every tick the
    # beat had sent (parked, for these) while the run went on. (Sent, not due: a loaded
    # beat sends late, and a tick due during the run may not be in the line by its end.)
    newest = runs["newest"]
    sent = cluster.sent()
    compared = 0
    for a, b in itertools.pairwise(newest):
        during = [
            _slot_time(slot)
            for slot, at in sent.items()
            if slot.startswith("newest@") and a["start"] <= at <= a["end"]
        ]
        compared += len(during) > 1  # where keeping the newest differs from the oldest
        assert not during or _slot_time(b["slot"]) >= max(during), (a, b, sorted(during))
    assert compared, (newest, sent)
