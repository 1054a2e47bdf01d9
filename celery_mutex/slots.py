"""Which tick a beat's send belongs to: its **slot**, the same in every beat process.

A slot must tell ticks apart (two ticks of an entry never share one: the second would be
taken for a copy of the first and dropped) and must not tell copies apart (every beat
sending the same tick, a little early or late, names the same slot). Each schedule type
gets a rule that holds on every Celery version the package supports:

* ``schedule`` (an interval): the period containing now, counted from the Unix epoch.
* ``crontab``: its most recent due time at or before now, computed here from the crontab's
  fields on the wall clock of its time zone, not with ``crontab.remaining_delta``: before
  Celery 5.7 that reads the hour and minute of a datetime in the datetime's own zone, so a
  UTC datetime gave a non-UTC crontab the wrong ticks. Across a DST change the
  due time of a wall-clock minute is the first instant the clock shows it: a minute the
  clock skips in spring is due when the clock jumps past it, a minute it shows twice in
  autumn is due the first time only (what Celery fires).
* ``solar``: the most recent event at or before now, named by the observer's local solar
  day, with the day's edge hours away from any event of that kind, so that two beats whose
  event times differ by ephem's milliseconds still agree.
* any other schedule: the due time the schedule itself reports for this send
  (``remaining_estimate`` from the entry's last run, with the clock pinned to now), to the
  millisecond; without ``remaining_estimate``, the UTC minute.
"""

from __future__ import annotations

import copy
import datetime as dt
import math
from collections.abc import Callable
from typing import Any

from celery.schedules import crontab, solar  # type: ignore[import-untyped]
from celery.schedules import schedule as interval_schedule

# The header a guarded beat stamps on a tick's message, naming its slot. A call the
# key's line parks and sends again keeps it (celery_mutex.line.message_of).
BEAT_SLOT = "mutex_beat_slot"
MIN_CLAIM = 10.0  # seconds a claim lives at least (the clock-skew tolerance floor)
MAX_CLAIM = 7 * 24 * 3600.0
_UTC = dt.timezone.utc
_MINUTE = dt.timedelta(minutes=1)
_DAY = 86400.0
_CRON_SEARCH_DAYS = 5 * 366  # a crontab with no due day in five years gets the minute rule
_SOLAR_SEARCH_DAYS = 366  # as Celery's solar: days without the event (polar) are skipped
_SOLAR_EARLY = 1.0  # s: Celery's event time may precede ours by ephem's milliseconds
# Where a solar day starts, in hours of local mean time: risings come between the sun's
# lowest point (about 00:00) and its highest (about 12:00), settings between 12:00 and
# 24:00, the transit near 12:00; each day starts about six hours from any such event.
_SOLAR_DAY_START = {"next_rising": -6.0, "next_setting": 6.0, "next_transit": 0.0}


def tick_slot(schedule: Any, now: float, last_run_at: Any = None) -> tuple[str, float]:
    """The slot a send at Unix time ``now`` belongs to, and how long its claim lives.

    ``last_run_at`` (the entry's, before this send) is read for custom schedules only."""
    if isinstance(schedule, interval_schedule):
        period = schedule.run_every.total_seconds()
        if period > 0:
            start = math.floor(now / period) * period
            return _iso(start), _claim_for(period)
    elif isinstance(schedule, crontab):
        due = cron_slot(schedule, dt.datetime.fromtimestamp(now, _UTC))
        if due is not None:
            period = (_next_cron_due(schedule, due) - due).total_seconds()
            return _minute(due), _claim_for(period)
    elif isinstance(schedule, solar):
        found = _solar_slot(schedule, now)
        if found is not None:
            return found, _claim_for(_DAY)
    else:
        own = _reported_due(schedule, now, last_run_at)
        if own is not None:
            return _iso(own.timestamp()), _claim_for(60)
    return _minute(dt.datetime.fromtimestamp(now, _UTC)), _claim_for(60)


def _claim_for(period: float) -> float:
    return min(MAX_CLAIM, max(MIN_CLAIM, 3 * period))


def _iso(ts: float) -> str:
    when = dt.datetime.fromtimestamp(ts, _UTC)
    if when.microsecond:
        return when.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def _minute(when: dt.datetime) -> str:
    return when.astimezone(_UTC).strftime("%Y-%m-%dT%H:%MZ")


# -- crontab ------------------------------------------------------------------------------


def cron_slot(schedule: Any, now: dt.datetime) -> dt.datetime | None:
    """The most recent due time of a crontab at or before ``now`` (to the minute), in the
    schedule's time zone; None if it has none in the last five years."""
    zone = schedule.tz
    now = now if now.tzinfo is not None else now.replace(tzinfo=_UTC)
    wall = _high_water(zone, now.astimezone(_UTC))
    minute = _last_cron_minute(schedule, wall.replace(second=0, microsecond=0))
    return None if minute is None else _first_shown(zone, minute).astimezone(zone)


def _next_cron_due(schedule: Any, due: dt.datetime) -> dt.datetime:
    """The due time after ``due`` (for the claim's lifetime: a period); a day on if none."""
    zone = schedule.tz
    wall = due.astimezone(zone).replace(tzinfo=None)
    for _ in range(24 * 60):  # minutes a DST gap folds into ``due`` are skipped
        following = _next_cron_minute(schedule, wall)
        if following is None:
            break
        after = _first_shown(zone, following)
        if after > due:
            return after
        wall = following
    return due + dt.timedelta(days=1)


def _day_matches(schedule: Any, day: dt.date) -> bool:
    # Celery's rule: month, day of month and day of week must all match (Sunday is 0).
    return (
        day.month in schedule.month_of_year
        and day.day in schedule.day_of_month
        and day.isoweekday() % 7 in schedule.day_of_week
    )


def _last_cron_minute(schedule: Any, wall: dt.datetime) -> dt.datetime | None:
    """The latest wall-clock minute at or before ``wall`` (naive) that the fields match."""
    day, latest = wall.date(), (wall.hour, wall.minute)
    for _ in range(_CRON_SEARCH_DAYS):
        if _day_matches(schedule, day):
            times = [(h, m) for h in schedule.hour for m in schedule.minute if (h, m) <= latest]
            if times:
                hour, minute = max(times)
                return dt.datetime.combine(day, dt.time(hour, minute))
        day, latest = day - dt.timedelta(days=1), (23, 59)
    return None


def _next_cron_minute(schedule: Any, wall: dt.datetime) -> dt.datetime | None:
    """The first wall-clock minute after ``wall`` (naive) that the fields match."""
    day, earliest = wall.date(), (wall.hour, wall.minute)
    for _ in range(_CRON_SEARCH_DAYS):
        if _day_matches(schedule, day):
            times = [(h, m) for h in schedule.hour for m in schedule.minute if (h, m) > earliest]
            if times:
                hour, minute = min(times)
                return dt.datetime.combine(day, dt.time(hour, minute))
        day, earliest = day + dt.timedelta(days=1), (-1, -1)
    return None


def _high_water(zone: dt.tzinfo, now: dt.datetime) -> dt.datetime:
    """The latest wall-clock time (naive) that ``zone`` has shown by ``now`` (UTC): the
    local time, except in the hour an autumn change repeats, where it is the time just
    before the clock went back (those minutes were due the first time round)."""
    local = now.astimezone(zone)
    if not local.fold:  # zoneinfo marks the second showing of a repeated time
        return local.replace(tzinfo=None)
    first = local.replace(fold=0).astimezone(_UTC)  # the first showing of this wall time
    change = _offset_change(zone, first, now)
    before = (change - dt.timedelta(microseconds=1)).astimezone(zone)
    return before.replace(tzinfo=None)


def _first_shown(zone: dt.tzinfo, wall: dt.datetime) -> dt.datetime:
    """The first instant (UTC) at which ``zone``'s clock shows ``wall`` (naive) or later:
    its first showing, or for a minute a spring change skips, the change itself."""
    first = wall.replace(tzinfo=zone, fold=0).astimezone(_UTC)
    if first.astimezone(zone).replace(tzinfo=None) == wall:
        return first
    # skipped: fold=0 reads it with the offset before the change (an instant after the
    # jump), fold=1 with the offset after it (an instant before): the change lies between
    return _offset_change(zone, wall.replace(tzinfo=zone, fold=1).astimezone(_UTC), first)


def _offset_change(zone: dt.tzinfo, before: dt.datetime, after: dt.datetime) -> dt.datetime:
    """The first whole second in (before, after] that has ``after``'s UTC offset."""
    target = after.astimezone(zone).utcoffset()
    low, high = math.floor(before.timestamp()), math.ceil(after.timestamp())
    while high - low > 1:  # invariant: low has the old offset, high the new one
        middle = (low + high) // 2
        if dt.datetime.fromtimestamp(middle, _UTC).astimezone(zone).utcoffset() == target:
            high = middle
        else:
            low = middle
    return dt.datetime.fromtimestamp(high, _UTC)


# -- solar and other schedules ------------------------------------------------------------


def _solar_slot(schedule: Any, now: float) -> str | None:
    """The local solar day (ISO date) of the most recent event at or before ``now``."""
    ephem = schedule.ephem
    observer = schedule.cal.copy()  # Celery moves its own observer's date
    previous: Callable[..., Any] = getattr(observer, schedule.method.replace("next_", "previous_"))
    sun = ephem.Sun()
    options = {"use_center": True} if schedule.use_center else {}
    start = ephem.Date(dt.datetime.fromtimestamp(now + _SOLAR_EARLY, _UTC).replace(tzinfo=None))
    for _ in range(_SOLAR_SEARCH_DAYS):
        try:
            event = previous(sun, start=start, **options)
            break
        except ephem.CircumpolarError:  # no such event that day: look a day earlier
            start = observer.previous_antitransit(sun, start=start)
    else:
        return None
    at = ephem.Date(event).datetime().replace(tzinfo=_UTC).timestamp()
    local_mean = at + float(schedule.lon) / 15 * 3600
    day = math.floor((local_mean - _SOLAR_DAY_START[schedule.method] * 3600) / _DAY)
    return (dt.date(1970, 1, 1) + dt.timedelta(days=day)).isoformat()


def _reported_due(schedule: Any, now: float, last_run_at: Any) -> dt.datetime | None:
    """When the schedule says this send was due: now plus its ``remaining_estimate`` (at
    most zero for a send that is due), on a copy whose clock is pinned to ``now`` so
    every beat reads the same instant; None if it has no estimate."""
    if last_run_at is None or not hasattr(schedule, "remaining_estimate"):
        return None
    at = dt.datetime.fromtimestamp(now, _UTC)
    pinned = copy.copy(schedule)
    pinned.nowfun = lambda: at.astimezone(schedule.tz)
    try:
        remaining = pinned.remaining_estimate(last_run_at)
    except NotImplementedError:
        return None
    if not isinstance(remaining, dt.timedelta):
        return None
    due: dt.datetime = at + min(remaining, dt.timedelta(0))
    return due


__all__ = ["MAX_CLAIM", "MIN_CLAIM", "cron_slot", "tick_slot"]
