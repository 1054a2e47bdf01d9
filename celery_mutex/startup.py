"""What a worker checks as it starts (``worker_init``), so that no task runs unguarded
without a word.

* A task given ``mutex={...}`` whose base is not ``MutexTask``: Celery keeps the option as
  a plain attribute, and the task takes no lock at all, silently. The worker refuses to
  start.
* A ``MutexTask`` whose options make no configuration (no lock cache, options that do not
  fit together): every call of it would fail. When no guarded task of the app could run,
  the worker refuses to start; when some could, it starts and logs one CRITICAL line per
  task that cannot. (A shared task is registered on every app of the process, so in a
  process with several apps, a test suite's, another app's tasks can lack this app's
  cache without this worker ever being sent them.)
* The lines of ``on_busy="queue"`` tasks in a cache that keeps no data across a restart
  (a Redis with no persistence): their parked calls live only there, so a restart loses
  them. The worker starts, and says so in a warning naming the fix.

A signal handler's ``Exception`` is only logged by Celery, so the refusal is a
``SystemExit`` carrying the message: the worker exits with it before it consumes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from simple_mutex import ConstraintError
from simple_mutex.busy.line import Lines

from . import _celery
from .config import config_of
from .task import MutexTask

log = logging.getLogger("celery_mutex")


@dataclass
class Findings:
    """What ``check`` found among an app's tasks, each problem a line naming the fix."""

    unguarded: list[str] = field(default_factory=list)  # mutex= without MutexTask
    unconfigured: list[str] = field(default_factory=list)  # a MutexTask that cannot run
    guarded: int = 0  # MutexTasks that can
    lines: dict[tuple[int, str], Lines] = field(default_factory=dict)  # their lines, per cache

    def refused(self) -> bool:
        """Whether a worker must not start with them."""
        return bool(self.unguarded) or (bool(self.unconfigured) and not self.guarded)


def check(app: Any) -> Findings:
    """The tasks of ``app`` a worker must not run as they are, with their fixes."""
    found = Findings()
    for name, task in sorted(app.tasks.items()):
        if not isinstance(task, MutexTask):
            # Options given to a plain task: a mapping (a base class's own `mutex`, a
            # threading.Lock say, is no such thing and none of our business).
            if isinstance(getattr(task, "mutex", None), Mapping):
                found.unguarded.append(
                    f"{name}: mutex={{...}} is set, but the task's base is not MutexTask, so "
                    "it takes no lock; declare it @app.task(base=MutexTask, mutex={...})"
                )
            continue
        try:
            cfg = config_of(task)
        except ConstraintError as bad:
            found.unconfigured.append(str(bad))
        else:
            found.guarded += 1
            if cfg.policy.in_line:
                found.lines.setdefault((id(cfg.lines.cache), cfg.lines.prefix), cfg.lines)
    return found


def _check_at_start(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None:
        return
    found = check(app)
    if found.refused():
        lines = found.unguarded + found.unconfigured
        # Python prints a SystemExit's message on the way out: said once, whatever logging.
        raise SystemExit("celery_mutex: this worker will not start:\n  " + "\n  ".join(lines))
    for line in found.unconfigured:
        log.critical("celery_mutex: every call of this task will fail: %s", line)
    for in_line in found.lines.values():
        reason = in_line.unkept()
        if reason is not None:
            log.warning("celery_mutex: %s", reason)


_celery.worker_init.connect(_check_at_start, weak=False)
