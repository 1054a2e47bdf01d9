"""The sweep in every worker: a thread of the worker's main process that sweeps the lines
of the app's queueing tasks every ``sweep_every`` seconds (the line's driver does the
sweeping: ``simple_mutex.busy.line.driver``). Started by ``worker_ready`` and stopped by
``worker_shutdown`` (``safety_net``)."""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from simple_mutex.busy.line import Lines, driver
from simple_mutex.busy.policy import QueuePolicy

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

    def spaces(self) -> list[tuple[Any, Lines, Config]]:
        """One (task, lines, config) per line prefix in a cache, of the queueing tasks."""
        found: dict[tuple[int, str], tuple[Any, Lines, Config]] = {}
        for task in list(self.app.tasks.values()):
            if not isinstance(task, MutexTask) or task._mutex_spec is None:
                continue
            try:
                cfg = config_of(task)
            except (ValueError, TypeError):
                continue  # a task with no cache configured fails when it runs
            if cfg.policy.in_line:
                found.setdefault((id(cfg.lines.cache), cfg.lines.prefix), (task, cfg.lines, cfg))
        return list(found.values())

    def sweep_once(self) -> int:
        """Sweep every line once; returns how many lines were swept."""
        swept = 0
        for task, lines, cfg in self.spaces():
            bounds = functools.partial(_same, cfg.policy.queue)
            swept += driver.sweep_lines(line.TaskPublisher(task), lines, bounds)
        return swept

    def every(self) -> float:
        spaces = self.spaces()
        return min((cfg.policy.queue.sweep_every for _, _, cfg in spaces), default=0.0)

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


def _same(bounds: QueuePolicy, _key: str) -> QueuePolicy:
    return bounds  # a task's lines share its bounds
