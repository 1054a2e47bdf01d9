"""The worker's sweep of the lines (``celery_mutex.sweeper``): each line is swept by the
bounds and publisher of the task its calls belong to, not by the first queueing task
found in the same cache."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

# isort: split
from celery_mutex import MutexTask
from celery_mutex.config import config_of
from celery_mutex.sweeper import Sweeper

pytestmark = pytest.mark.fast


def _app() -> tuple[Celery, Any, Any]:
    app = Celery("sweep", set_as_current=False, broker="memory://", backend="cache+memory://")
    app.conf.update(mutex_cache="memory://")

    @app.task(shared=False, base=MutexTask, mutex={"key": "a.{n}", "on_busy": "queue"})
    def plain(n: int) -> int:
        return n

    @app.task(
        shared=False,
        base=MutexTask,
        mutex={"key": "b.{n}", "on_busy": "latest", "queue": {"gap_for": 10, "sweep_every": 2}},
    )
    def quick(n: int) -> int:
        return n

    app.finalize()
    return app, plain, quick


def _park(task: Any, key: str) -> None:
    """A call of ``task`` parked in ``key``'s line, behind a ticket ahead of it."""
    lines = config_of(task).lines
    lines.take(key)
    message = {"task": task.name, "id": f"{task.name}-1", "args": [1], "kwargs": {}}
    _, parked = lines.send(key, lambda ticket: {**message, "ticket": ticket.number})
    assert parked


def test_each_line_is_swept_by_its_own_tasks_bounds() -> None:
    """Two queueing tasks share a cache: the line holding ``quick``'s call is swept with
    ``quick``'s ``gap_for`` (10 s) and promotes as ``quick``, whichever task was found
    first."""
    app, plain, quick = _app()
    # (Shared tasks of other modules join every app of the process: they are ignored.)
    [space] = [space for space in Sweeper(app).spaces() if quick.name in space.tasks]
    assert {plain.name, quick.name} <= set(space.tasks)
    _park(quick, "b.1")
    publisher, bounds = space.of_line("b.1")
    assert publisher.task.name == quick.name
    assert bounds.gap_for == 10
    # A line with no parked call (a dead holder's running ticket alone): the most
    # patient bounds of the tasks here, so its redelivered copy is waited for.
    publisher, bounds = space.of_line("a.1")
    assert bounds.gap_for == max(cfg.policy.queue.gap_for for _, cfg in space.tasks.values())
    assert bounds.gap_for >= 120  # plain's default, longer than quick's 10 s
    assert Sweeper(app).every() <= 2  # the shortest sweep_every of the tasks


def test_a_line_holding_calls_of_two_tasks_is_swept_by_the_most_patient() -> None:
    """Calls of ``quick`` (gap_for 10 s) and ``plain`` (120 s) parked in one line,
    ``quick``'s first: ``quick`` publishes, but the sweep waits ``plain``'s 120 s before
    stepping over a gap, so ``plain``'s call is not stepped over sooner than its own
    options allow."""
    app, plain, quick = _app()
    [space] = [space for space in Sweeper(app).spaces() if quick.name in space.tasks]
    _park(quick, "b.2")
    _park(plain, "b.2")
    publisher, bounds = space.of_line("b.2")
    assert publisher.task.name == quick.name
    assert bounds.gap_for == plain_gap(plain) > 10


def plain_gap(task: Any) -> float:
    return config_of(task).policy.queue.gap_for
