"""The sweep in every worker: a thread of the worker's main process that sweeps the lines
of the app's queueing tasks every ``sweep_every`` seconds (the line's driver does the
sweeping: ``simple_mutex.busy.line.driver``). Started by ``worker_ready`` and stopped by
``worker_shutdown`` (``safety_net``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from simple_mutex.busy.line import Lines, driver
from simple_mutex.busy.policy import QueuePolicy, most_patient

from . import line
from .config import Config, config_of
from .task import MutexTask

log = logging.getLogger("celery_mutex")


class Sweeper:
    """A thread of a worker's main process that sweeps the lines of the app's queueing
    tasks every ``sweep_every`` seconds: a head nobody ran is published, a dead holder's
    turn ends, a ticket that never arrived is stepped over. Every worker runs one; their
    sweeps are compare-and-set writes, so two at once do each change once."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None

    def spaces(self) -> list[Space]:
        """The app's queueing tasks, grouped by the lines they share (a cache and a
        prefix)."""
        found: dict[tuple[int, str], Space] = {}
        for task in list(self.app.tasks.values()):
            if not isinstance(task, MutexTask) or task._mutex_spec is None:
                continue
            try:
                cfg = config_of(task)
            except (ValueError, TypeError):
                continue  # a task with no cache configured fails when it runs
            if cfg.policy.in_line:
                where = (id(cfg.lines.cache), cfg.lines.prefix)
                found.setdefault(where, Space(cfg.lines, {})).tasks[task.name] = (task, cfg)
        return list(found.values())

    def sweep_once(self) -> int:
        """Sweep every line once; returns how many lines were swept."""
        return sum(driver.sweep_lines(space.lines, space.of_line, log) for space in self.spaces())

    def every(self) -> float:
        tasks = [cfg for space in self.spaces() for _, cfg in space.tasks.values()]
        return min((cfg.policy.queue.sweep_every for cfg in tasks), default=0.0)

    def start(self) -> None:
        period = self.every()
        if period <= 0 or self.thread is not None:
            return  # no task of this app queues
        self.thread = threading.Thread(
            target=self._run, args=(period,), name="celery-mutex-sweep", daemon=True
        )
        self.thread.start()

    def _run(self, period: float) -> None:
        while not self.stopped.wait(period):
            try:
                self.sweep_once()
            except Exception as exc:  # the thread outlives any one failed sweep
                log.warning("sweep failed: %r", exc)

    def stop(self) -> None:
        self.stopped.set()


@dataclass(frozen=True)
class Space:
    """The queueing tasks (by name) whose lines share one cache and prefix."""

    lines: Lines
    tasks: dict[str, tuple[Any, Config]]

    def of_line(self, key: str) -> tuple[line.TaskPublisher, QueuePolicy]:
        """The publisher and bounds of ``key``'s line: the task its first parked call
        names publishes, and the bounds are the most patient of the tasks its parked
        calls name (tasks of several kinds may share a key). A line with no parked call
        (a running one alone, whose task the record does not name) gets the most
        patient bounds of every task here: a sweep that waited another task's shorter
        ``gap_for`` for a dead holder's redelivered copy ended its turn early, and the
        copy was dropped as a duplicate."""
        record = self.lines.read(key)
        named = []
        for parked in [] if record is None else record.parked.values():
            name = parked.message.get("task") if isinstance(parked.message, Mapping) else None
            if name in self.tasks:
                named.append(self.tasks[name])
        task = named[0][0] if named else next(iter(self.tasks.values()))[0]
        chosen = named or list(self.tasks.values())
        bounds = most_patient(cfg.policy.queue for _, cfg in chosen)
        assert bounds is not None  # a Space holds one task at least
        return line.TaskPublisher(task), bounds
