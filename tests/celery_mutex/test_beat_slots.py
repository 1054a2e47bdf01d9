"""Beat slots on a simulated clock: every tick Celery's own schedule fires gets a slot of
its own, and every beat that sends the same tick names the same slot.

Celery's schedules run on a fake clock (``nowfun``) the way ``celery beat`` runs them: ask
``is_due(last_run_at)``, sleep what it answers (at most ``max_interval``), and on a fire
set ``last_run_at`` to now. Each fire then goes through the beat guard's claim
(``MutexSchedulerMixin.mutex_claim`` on an ``InMemoryCache``): a fire whose claim is
refused is a dropped tick. A second beat, started minutes later, and copies of each send a
little late must all be refused. Crontabs run a whole ordinary day and the days of both
DST changes of 2026, in several zones, for each schedule type; the zones and Celery's
arithmetic differ between Celery versions, so this file also runs on the lowest Celery
``pyproject.toml`` admits (``scripts/check_lower_bounds.sh``). No server, no sleep.
"""

from __future__ import annotations

import datetime as dt
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery import Celery
from celery.beat import ScheduleEntry, Scheduler
from celery.schedules import BaseSchedule, crontab, schedule, solar

# isort: split
from celery_mutex.beat import MutexScheduler, MutexSchedulerMixin, tick_slot
from simple_mutex import InMemoryCache

pytestmark = pytest.mark.fast

UTC = dt.timezone.utc
ZONES = ["Europe/Berlin", "America/New_York", "Asia/Kolkata", "Australia/Lord_Howe", "UTC"]
ORDINARY_DAY = dt.date(2026, 6, 10)
MAX_INTERVAL = 300.0  # celery beat's default: it looks again at least this often
SECOND_BEAT_LATE = 7 * 60 + 13.0  # s: the second beat starts this much later
COPY_LAGS = (0.001, 0.5, 30.0)  # s: how late another beat may send the same tick
AGAIN = 1.0  # s: a send this soon after the one before is the same tick sent again


class Clock:
    """Fake time: Unix seconds; ``aware`` is what ``app.now()`` would return then."""

    def __init__(self, start: float, zone: dt.tzinfo) -> None:
        self.now = start
        self.zone = zone

    def aware(self) -> dt.datetime:
        return self.aware_at(self.now)

    def aware_at(self, at: float) -> dt.datetime:
        return dt.datetime.fromtimestamp(at, UTC).astimezone(self.zone)


@dataclass(frozen=True)
class Fire:
    """One send of an entry by a simulated beat."""

    at: float  # when (Unix time)
    last_run: float  # the entry's last_run_at as it was sent
    again: bool  # Celery sent the entry again at once: the same tick (see celery_fires)


def celery_fires(
    make: Callable[[Callable[[], dt.datetime]], Any],
    zone: dt.tzinfo,
    start: float,
    end: float,
    max_interval: float = MAX_INTERVAL,
) -> list[Fire]:
    """When a ``celery beat`` started at ``start`` sends an entry of the schedule that
    ``make(nowfun)`` builds, up to ``end``: Celery's own ``is_due`` on a fake clock.

    A schedule that is due again right after a send (Celery before 5.7 does that for a
    solar event in the hour a DST change repeats, and beat then sends it in a loop) is
    looked at again a second later, and those sends are marked ``again``."""
    clock = Clock(start, zone)
    entry_schedule = make(clock.aware)
    last_run = start  # a new entry's last_run_at: the moment beat starts
    fires: list[Fire] = []
    while clock.now < end:
        due, wait = entry_schedule.is_due(clock.aware_at(last_run))
        if due:
            again = bool(fires) and clock.now - fires[-1].at <= AGAIN
            fires.append(Fire(clock.now, last_run, again))
            last_run = clock.now  # Scheduler.reserve: last_run_at = now
        clock.now += min(float(wait) if wait > 0 else AGAIN, max_interval)
    return fires


class Guarded(MutexSchedulerMixin, Scheduler):  # type: ignore[misc]
    """A beat's guard with nothing to send: ``mutex_claim`` is what is tested."""

    def __init__(self, app: Celery) -> None:
        super().__init__(app, lazy=True)


def guard_ticks(
    app: Celery,
    make: Callable[[Callable[[], dt.datetime]], Any],
    windows: list[tuple[float, float]],
    max_interval: float = MAX_INTERVAL,
) -> int:
    """Run the schedule ``make`` builds through two guarded beats over each window and
    assert: each tick the first beat fires (with the sends ``again`` that follow it) goes
    out exactly once, in a slot of its own; the second beat's sends (it started later)
    and late copies of each send claim nothing. Each window must see a tick. Returns the
    ticks sent."""
    zone = app.timezone
    fired = functools.partial(celery_fires, make, zone, max_interval=max_interval)
    claim = functools.partial(claim_send, app, make)

    sent = 0
    for start, end in windows:
        app.conf.mutex_beat_cache = InMemoryCache()  # a fresh claim store per window
        first, second = Guarded(app), Guarded(app)
        fires, later = fired(start, end), fired(start + SECOND_BEAT_LATE, end)
        ticks = _bursts(fires)
        assert ticks, f"no tick fired in {_span(start, end, zone)}"
        went_out = []  # per tick: the sends whose claim won
        for burst in ticks:
            won = [(fire, tick) for fire in burst if (tick := claim(first, fire)) is not None]
            went_out.append(won)
        wrong = [
            (_when(b[0].at, zone), len(w))
            for b, w in zip(ticks, went_out, strict=True)
            if len(w) != 1
        ]
        assert wrong == [], f"ticks not sent once of {len(ticks)} (when, times sent): {wrong}"
        assert len({won[0][1] for won in went_out}) == len(ticks)  # a slot each
        sent += len(ticks)
        for i, [(fire, _)] in enumerate(went_out):
            gap = (ticks[i + 1][0].at - fire.at) if i + 1 < len(ticks) else math.inf
            for lag in COPY_LAGS:
                if lag < gap / 2:
                    copy = claim(second, fire, lag)
                    assert copy is None, f"a copy {lag} s late of {_when(fire.at, zone)} went out"
        for burst in _bursts(later):  # the second beat's own sends of the same ticks
            twin = min(ticks, key=lambda b, at=burst[0].at: abs(b[0].at - at))
            assert abs(twin[0].at - burst[0].at) < 1.0, (
                f"only beat 2 fired {_when(burst[0].at, zone)}"
            )
            for fire in burst:
                assert claim(second, fire) is None, f"{_when(fire.at, zone)} went out twice"
    return sent


def claim_send(
    app: Celery,
    make: Callable[[Callable[[], dt.datetime]], Any],
    beat: Guarded,
    fire: Fire,
    lag: float = 0.0,
) -> str | None:
    """``beat``'s claim for ``fire``, sent ``lag`` s late: the tick if it won, else None."""
    clock = Clock(fire.at + lag, app.timezone)
    entry = ScheduleEntry(
        name="e", task="t", schedule=make(clock.aware), app=app,
        last_run_at=clock.aware_at(fire.last_run),
    )  # fmt: skip
    return beat.mutex_claim(entry, now=clock.now)


def _bursts(fires: list[Fire]) -> list[list[Fire]]:
    """The sends grouped by tick: each with the sends ``again`` that follow it."""
    bursts: list[list[Fire]] = []
    for fire in fires:
        if fire.again and bursts:
            bursts[-1].append(fire)
        else:
            bursts.append([fire])
    return bursts


def _when(at: float, zone: dt.tzinfo) -> str:
    return dt.datetime.fromtimestamp(at, UTC).astimezone(zone).isoformat()


def _span(start: float, end: float, zone: dt.tzinfo) -> str:
    return f"{_when(start, zone)} .. {_when(end, zone)}"


def dst_change_days(zone: ZoneInfo, year: int = 2026) -> list[dt.date]:
    """The local days on which ``zone``'s UTC offset changes (its DST changes)."""
    days = []
    for n in range(1, 366):
        day = dt.date(year, 1, 1) + dt.timedelta(days=n)
        noon = dt.datetime.combine(day, dt.time(12), tzinfo=zone)
        if noon.utcoffset() != (noon - dt.timedelta(days=1)).utcoffset():
            days.append(day)
    return days


def day_windows(zone: ZoneInfo, days: int = 1) -> list[tuple[float, float]]:
    """An ordinary day and each DST change day of 2026 (local midnight to midnight, and
    ``days - 1`` more days either side), as Unix-time windows."""
    windows = []
    for day in [ORDINARY_DAY, *dst_change_days(zone)]:
        first = dt.datetime.combine(day - dt.timedelta(days=days - 1), dt.time(), tzinfo=zone)
        last = dt.datetime.combine(day + dt.timedelta(days=days), dt.time(), tzinfo=zone)
        windows.append((first.timestamp(), last.timestamp()))
    return windows


@pytest.fixture(params=ZONES)
def zoned_app(request: pytest.FixtureRequest) -> Celery:
    app = Celery(set_as_current=False)
    app.conf.timezone = request.param
    return app


def test_the_zones_have_the_dst_changes_this_file_relies_on() -> None:
    """Berlin and New York change by an hour, Lord Howe by half an hour, Kolkata (+05:30)
    and UTC never: otherwise the tests below would test less than they say."""
    changes = {zone: len(dst_change_days(ZoneInfo(zone))) for zone in ZONES}
    assert changes == {
        "Europe/Berlin": 2,
        "America/New_York": 2,
        "Asia/Kolkata": 0,
        "Australia/Lord_Howe": 2,
        "UTC": 0,
    }
    howe = dt.datetime(2026, 6, 10, tzinfo=ZoneInfo("Australia/Lord_Howe")).utcoffset()
    assert howe == dt.timedelta(hours=10, minutes=30)


CRONTABS = {
    "*/15 9-17 (issue 21)": {"minute": "*/15", "hour": "9-17"},
    "*/5 every hour": {"minute": "*/5"},
    "*/30 01-03": {"minute": "*/30", "hour": "1-3"},
    "0,15,30,45 at 01 and 02": {"minute": "0,15,30,45", "hour": "1,2"},
    "sun,wed 30 */2": {"minute": 30, "hour": "*/2", "day_of_week": "sun,wed"},
}


@pytest.mark.parametrize("fields", CRONTABS.values(), ids=CRONTABS.keys())
def test_every_crontab_tick_celery_fires_gets_its_own_slot(zoned_app: Celery, fields) -> None:
    """Crontabs over a whole day, and the days of both DST changes, in each zone: none
    of the ticks Celery fires is dropped, none goes out twice (issue 21: on Celery 5.3 to
    5.6 a non-UTC crontab lost most of its ticks)."""

    def make(nowfun: Callable[[], dt.datetime]) -> crontab:
        return crontab(**fields, app=zoned_app, nowfun=nowfun)

    guard_ticks(zoned_app, make, day_windows(zoned_app.timezone))


@pytest.mark.parametrize(
    "fields", [{"minute": 30, "hour": 2}, {"minute": 0, "hour": 2}, {"minute": 45, "hour": 1}]
)
def test_a_daily_crontab_in_the_hour_dst_skips_or_repeats(zoned_app: Celery, fields) -> None:
    """A daily tick at a time the spring change skips (02:00, 02:30) or the autumn change
    shows twice (01:45 at Lord Howe): sent once each day, three days around each change."""

    def make(nowfun: Callable[[], dt.datetime]) -> crontab:
        return crontab(**fields, app=zoned_app, nowfun=nowfun)

    guard_ticks(zoned_app, make, day_windows(zoned_app.timezone, days=2))


def test_the_slots_of_a_berlin_workday_are_its_due_minutes() -> None:
    """The issue's case, slot by slot: 09:00, 09:15 ... 17:45 Berlin time on a June day
    are 36 slots, written in UTC (two hours behind)."""
    app = Celery(set_as_current=False)
    app.conf.timezone = "Europe/Berlin"
    cron = crontab(minute="*/15", hour="9-17", app=app)
    berlin = ZoneInfo("Europe/Berlin")
    slots = []
    for quarter in range(36):
        due = dt.datetime(2026, 6, 10, 9, tzinfo=berlin) + dt.timedelta(minutes=15 * quarter)
        slot, lease = tick_slot(cron, due.timestamp() + 0.2)
        assert tick_slot(cron, due.timestamp() + 14 * 60)[0] == slot  # late, same tick
        assert lease == 3 * (15 * 60 if quarter < 35 else 15.25 * 3600)  # 3 periods
        slots.append(slot)
    assert slots[:3] == ["2026-06-10T07:00Z", "2026-06-10T07:15Z", "2026-06-10T07:30Z"]
    assert slots[-1] == "2026-06-10T15:45Z"
    assert len(set(slots)) == 36
    evening = dt.datetime(2026, 6, 10, 23, 59, tzinfo=berlin).timestamp()
    assert tick_slot(cron, evening)[0] == "2026-06-10T15:45Z"  # the day's last tick


def test_dst_changes_give_the_slots_celery_fires_at() -> None:
    """Berlin, 29 March and 25 October 2026: a minute the spring change skips is due as
    the clock jumps (02:30 -> 03:00 CEST = 01:00Z); in autumn a repeated minute is due
    the first time it shows (02:30 CEST = 00:30Z), not again an hour later."""
    app = Celery(set_as_current=False)
    app.conf.timezone = "Europe/Berlin"
    daily = crontab(minute=30, hour=2, app=app)
    half_hours = crontab(minute="*/30", app=app)
    assert tick_slot(daily, dt.datetime(2026, 3, 29, 1, 0, 5, tzinfo=UTC).timestamp())[0] == (
        "2026-03-29T01:00Z"
    )
    assert tick_slot(daily, dt.datetime(2026, 3, 29, 0, 59, tzinfo=UTC).timestamp())[0] == (
        "2026-03-28T01:30Z"
    )
    repeated = dt.datetime(2026, 10, 25, 1, 40, tzinfo=UTC).timestamp()  # 02:40 CET
    assert tick_slot(half_hours, repeated)[0] == "2026-10-25T00:30Z"  # 02:30 CEST
    assert tick_slot(daily, repeated)[0] == "2026-10-25T00:30Z"
    after = dt.datetime(2026, 10, 25, 2, 0, 1, tzinfo=UTC).timestamp()  # 03:00:01 CET
    assert tick_slot(half_hours, after)[0] == "2026-10-25T02:00Z"


def test_interval_ticks_of_mutex_scheduler_get_their_own_slots(monkeypatch) -> None:
    """Intervals as MutexScheduler fires them (on epoch-aligned boundaries): two beats
    started 7 s apart send in the same slots, one slot per period."""
    app = Celery(set_as_current=False)
    app.conf.mutex_beat_cache = InMemoryCache()
    beats = []
    for _ in range(2):
        beat = MutexScheduler.__new__(MutexScheduler)  # is_due and mutex_claim need no state
        beat.app = app
        beats.append(beat)
    every = schedule(dt.timedelta(seconds=10), app=app)
    start = dt.datetime(2026, 6, 10, 11, 59, 55, 300000, tzinfo=UTC).timestamp()
    sent: dict[int, list[str | None]] = {0: [], 1: []}
    for index, begin in enumerate((start, start + 7.0)):
        now, last = begin, dt.datetime.fromtimestamp(begin, UTC)
        while now < start + 120:
            monkeypatch.setattr("time.time", lambda now=now: now)
            entry = ScheduleEntry(name="e", task="t", schedule=every, last_run_at=last, app=app)
            due, wait = beats[index].is_due(entry)
            if due:
                sent[index].append(beats[index].mutex_claim(entry, now=now))
                last = dt.datetime.fromtimestamp(now, UTC)
            now += wait
    assert None not in sent[0]
    assert len(set(sent[0])) == len(sent[0]) >= 11
    assert set(sent[1]) == {None}  # the second beat's sends: all copies


def test_solar_events_get_their_own_slots() -> None:
    """Each solar event kind, at four places, over three days in March, June and
    October: one slot per event Celery fires, the same for a copy 30 s late (the UTC
    minute used before split copies across a minute's edge). A solar event does not
    depend on the app's zone (but Celery's arithmetic does: see the test below)."""
    app = Celery(set_as_current=False)
    app.conf.timezone = "UTC"
    # Madrid, New York, Kolkata, Lord Howe: every event happens each day there (further
    # north June has no astronomical dusk, which Celery before 5.7 cannot schedule at all)
    places = [(40.42, -3.70), (40.71, -74.01), (22.57, 88.36), (-31.55, 159.08)]
    days = [dt.datetime(2026, m, d, tzinfo=UTC).timestamp() for m, d in ((3, 27), (6, 9), (10, 23))]
    windows = [(day, day + 3 * 86400) for day in days]
    for event in sorted(solar._all_events):
        sent = 0
        for lat, lon in places:

            def make(nowfun: Callable[[], dt.datetime], event=event, lat=lat, lon=lon) -> solar:
                return solar(event, lat, lon, app=app, nowfun=nowfun)

            # (beat wakes every 3 h here, not 5 min: ephem is slow, solar's waits exact)
            sent += guard_ticks(app, make, windows, max_interval=3 * 3600)
        assert sent >= 4 * 9 - 4, event  # 4 places, 9 days (less a window's edges)


def test_a_solar_event_celery_sends_early_at_a_dst_change_goes_out_once_on_time() -> None:
    """On the day Berlin's clock goes back (25 October 2026), Celery before 5.7 sends
    Lord Howe's solar noon (01:07:48 UTC) an hour early, again and again until the
    change, then on time: the guard sends it once, at the event; Celery 5.7 sends it once
    on time, and so does the guard."""
    import ephem

    app = Celery(set_as_current=False)
    app.conf.timezone = "Europe/Berlin"
    app.conf.mutex_beat_cache = InMemoryCache()

    def make(nowfun: Callable[[], dt.datetime]) -> solar:
        return solar("solar_noon", -31.55, 159.08, app=app, nowfun=nowfun)

    start = dt.datetime(2026, 10, 23, tzinfo=UTC)
    end = start + dt.timedelta(days=4)
    fires = celery_fires(make, app.timezone, start.timestamp(), end.timestamp(), 3 * 3600)
    beat = Guarded(app)
    sent = [fire.at for fire in fires if claim_send(app, make, beat, fire) is not None]
    observer = ephem.Observer()
    observer.lat, observer.lon = "-31.55", "159.08"
    noons, at = [], ephem.Date(start.replace(tzinfo=None))
    while (at := observer.next_transit(ephem.Sun(), start=at)).datetime() < end.replace(
        tzinfo=None
    ):
        noons.append(at.datetime().replace(tzinfo=UTC).timestamp())
    assert len(noons) == 4
    assert len(sent) == 4, [_when(t, UTC) for t in sent]
    assert all(-0.1 < t - noon < 1.0 for t, noon in zip(sent, noons, strict=True))


class EveryTenSeconds(BaseSchedule):  # type: ignore[misc]
    """A custom schedule: due on each tenth second of the clock (a shape the beat guard
    knows nothing about), with the two methods Celery's schedules have."""

    def remaining_estimate(self, last_run_at: dt.datetime) -> dt.timedelta:
        due = (math.floor(last_run_at.timestamp() / 10) + 1) * 10
        return dt.datetime.fromtimestamp(due, UTC) - self.now()

    def is_due(self, last_run_at: dt.datetime) -> tuple[bool, float]:
        remaining = self.remaining_estimate(last_run_at).total_seconds()
        if remaining > 0:
            return False, remaining
        return True, self.remaining_estimate(self.now()).total_seconds()


class Once(BaseSchedule):  # type: ignore[misc]
    """A custom one-off schedule (django-celery-beat's ``clocked`` shape)."""

    def __init__(self, at: dt.datetime, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.at = at

    def remaining_estimate(self, last_run_at: dt.datetime) -> dt.timedelta:
        return self.at - self.now()

    def is_due(self, last_run_at: dt.datetime) -> tuple[bool, float]:
        if last_run_at >= self.at:
            return False, 3600.0  # it ran
        remaining = self.remaining_estimate(last_run_at).total_seconds()
        return (True, 3600.0) if remaining <= 0 else (False, remaining)


def test_custom_schedules_get_the_due_time_they_report() -> None:
    """A schedule of its own making: the slot is the due time it reports for the send, so
    ticks 10 s apart are not one minute's slot (the UTC minute used before dropped five
    of six), and a one-off fires once whichever beat sends it."""
    app = Celery(set_as_current=False)
    app.conf.timezone = "Asia/Kolkata"
    start = dt.datetime(2026, 6, 10, 11, 58, 3, tzinfo=UTC).timestamp()

    def tens(nowfun: Callable[[], dt.datetime]) -> EveryTenSeconds:
        return EveryTenSeconds(app=app, nowfun=nowfun)

    guard_ticks(app, tens, [(start, start + 3600)])
    at = dt.datetime(2026, 6, 10, 12, 30, 30, tzinfo=UTC)

    def once(nowfun: Callable[[], dt.datetime]) -> Once:
        return Once(at, app=app, nowfun=nowfun)

    guard_ticks(app, once, [(start, start + 7200)])
    assert tick_slot(once(lambda: at), at.timestamp() + 5, at - dt.timedelta(hours=1)) == (
        "2026-06-10T12:30:30Z",
        180.0,
    )
