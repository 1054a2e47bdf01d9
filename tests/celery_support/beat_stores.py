"""The beat guard over the schedulers that keep their schedule in a shared store:
django-celery-beat's ``DatabaseScheduler`` (a SQLite database here) and redbeat's
``RedBeatScheduler`` (Redis). Each is run as ``celery beat`` runs it, one tick at a time
(``Scheduler.tick``'s reserve-then-send for the database; redbeat's ``maybe_due``), with
three beats' outcomes: one that loses the claim, one that wins and dies between its claim
and its publish, one that wins and sends. Prints, as JSON, what each store says of each
entry afterwards.

    python -m celery_support.beat_stores django <sqlite path> <lock cache URL>
    python -m celery_support.beat_stores redbeat <redis URL> <lock cache URL>

Run in a process of its own: Django's settings are configured once per process.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import sys
import time
import uuid
from types import SimpleNamespace
from typing import Any

from celery import Celery

from celery_mutex.beat import MutexSchedulerMixin
from simple_mutex import cache_from_url

# Entry names of this run's own: a claim lives for three periods, and another run of the
# test within the hour must not find its ticks claimed.
RUN = uuid.uuid4().hex[:8]
NAMES = {how: f"{how}-{RUN}" for how in ("lost", "died", "sent")}
LONG_AGO = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=2)


class Died(BaseException):
    """A beat killed between its claim and its publish."""


def app_for(cache: str, **conf: Any) -> Celery:
    app = Celery("beat_stores", broker="memory://", set_as_current=True)
    app.conf.update(mutex_beat_cache=cache, beat_schedule={}, timezone="UTC", **conf)
    return app


def taken_by_another_beat(scheduler: Any, entry: Any) -> None:
    """Claim ``entry``'s current slot from outside, as a faster beat would have."""
    assert scheduler.mutex_claim(entry) is not None


def dying(scheduler: Any) -> None:
    def send_task(*args: Any, **kwargs: Any) -> Any:
        raise Died

    scheduler.send_task = send_task


def django_scenario(db: str, cache: str) -> dict[str, Any]:
    import django
    from django.conf import settings

    settings.configure(
        INSTALLED_APPS=["django_celery_beat"],
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": db}},
        USE_TZ=True,
        TIME_ZONE="UTC",
    )
    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from django_celery_beat.models import IntervalSchedule, PeriodicTask
    from django_celery_beat.schedulers import DatabaseScheduler

    class Guarded(MutexSchedulerMixin, DatabaseScheduler):  # type: ignore[misc]
        pass

    app = app_for(cache)
    every = IntervalSchedule.objects.create(every=3600, period=IntervalSchedule.SECONDS)
    for name in NAMES.values():
        PeriodicTask.objects.create(name=name, task=f"not.imported.{name}", interval=every)

    def tick(how: str, name: str) -> None:
        beat = Guarded(app=app)
        entry = beat.schedule[name]
        if how == "lost":
            taken_by_another_beat(beat, entry)
        if how == "died":
            dying(beat)
        beat.reserve(entry)  # what Scheduler.tick does with a due entry: move on, send
        with contextlib.suppress(Died):
            beat.apply_entry(entry, producer=None)
        beat.sync()  # what a beat saves at its next sync or as it stops

    for how, name in NAMES.items():
        tick(how, name)
    found = {}
    for how, name in NAMES.items():
        task = PeriodicTask.objects.get(name=name)
        found[how] = {
            "total_run_count": task.total_run_count,
            "last_run_at": None if task.last_run_at is None else task.last_run_at.isoformat(),
        }
    found["turns"] = turns(Guarded, app, every, PeriodicTask)
    return found


def turns(guarded: Any, app: Celery, every: Any, model: Any) -> list[int]:
    """Two beats sharing the table win four ticks in turn: the stored run count after
    each (each beat's own copy counts only its own sends)."""
    import celery_mutex.beat as guard

    name = f"turns-{RUN}"
    model.objects.create(name=name, task="not.imported.turns", interval=every)
    beats = [guarded(app=app), guarded(app=app)]
    start, counts = time.time(), []
    for n in range(4):
        guard.time = SimpleNamespace(time=lambda n=n: start + 3600 * n)  # a slot each
        beat = beats[n % 2]
        entry = beat.schedule[name]
        beat.reserve(entry)
        beat.apply_entry(entry, producer=None)
        beat.sync()
        counts.append(model.objects.get(name=name).total_run_count)
    guard.time = time
    return counts


def redbeat_scenario(redis_url: str, cache: str) -> dict[str, Any]:
    from celery.schedules import schedule
    from redbeat.schedulers import RedBeatScheduler, RedBeatSchedulerEntry

    # No redbeat lock: every beat active, the guard deciding who sends.
    app = app_for(cache, redbeat_redis_url=redis_url, redbeat_lock_key=None,
                  redbeat_key_prefix=f"redbeat-{RUN}:")  # fmt: skip

    class Guarded(MutexSchedulerMixin, RedBeatScheduler):  # type: ignore[misc]
        pass

    found = {}
    for how, name in NAMES.items():
        entry = RedBeatSchedulerEntry(name, f"not.imported.{name}", schedule(3600), app=app,
                                      last_run_at=LONG_AGO)  # fmt: skip
        entry.save()  # due: last run two hours ago
        beat = Guarded(app=app)
        if how == "lost":
            taken_by_another_beat(beat, entry)
        if how == "died":
            dying(beat)
        with contextlib.suppress(Died):
            beat.maybe_due(entry, producer=None)  # redbeat's tick: apply_async, advance=True
        stored = RedBeatSchedulerEntry.from_key(entry.key, app=app)
        found[how] = {
            "total_run_count": stored.total_run_count,
            "last_run_at": None if stored.last_run_at is None else stored.last_run_at.isoformat(),
        }
    return found


def main(argv: list[str]) -> None:
    kind, where, cache = argv
    cache_from_url(cache)  # a bad URL fails here, named
    result = django_scenario(where, cache) if kind == "django" else redbeat_scenario(where, cache)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
