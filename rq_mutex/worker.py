"""``rq_mutex.Worker``: RQ's forking ``Worker``, named so that ``rq worker -w
rq_mutex.Worker`` imports ``rq_mutex`` in the worker's main process (``rq worker`` alone
imports job code only in the work horses). There it does three things RQ's own
worker cannot know to do:

* records the horses it reaps, so the next run of a job id whose horse died frees what
  that horse held (``rq_mutex.horses``);
* answers the stop of ``on_busy="replace"``: a newer job took the key of the one its
  horse runs, and the horse is told to renew now, which fails it (``rq_mutex.replace``);
* sweeps the lines of ``on_busy="queue"`` on its own connection (the default cache) every
  ``line_sweep_every`` seconds, in its main loop (no thread: the worker forks), between
  jobs, while idle and while a horse runs: a head nobody ran is published, a dead horse's
  turn ends once its lock lapsed, a ticket that never arrived is stepped over
  (``rq_mutex.line``). Lines in a cache of their own (a job's ``cache=``) are swept
  when the worker is told of it: ``RQ_MUTEX_LINE_CACHES`` (URLs, comma-separated) in its
  environment, or ``line_caches`` on a subclass; else by their keys' next arrivals only.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Any

from rq.command import handle_command, parse_payload
from rq.worker import Worker as RQWorker

from simple_mutex.busy import shared_cache
from simple_mutex.busy.line import Lines
from simple_mutex.busy.policy import QueuePolicy

from . import replace
from .connection import cache_on
from .horses import LINE_KEEPER_ENV, RecordsReapedHorses
from .line import sweep_all

log = logging.getLogger("rq_mutex")

_DEFAULTS = QueuePolicy()
LINE_CACHES = "RQ_MUTEX_LINE_CACHES"  # more caches to sweep: URLs, comma-separated


class Worker(RecordsReapedHorses):
    """RQ's ``Worker`` that reaps horses on the record and sweeps the lines (above)."""

    line_sweep_every: float = _DEFAULTS.sweep_every
    line_caches: tuple[object, ...] = ()
    """Caches (or URLs) other than the worker's own Redis whose lines it sweeps too."""

    _line_swept_at = 0.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Its horses (forked or spawned) inherit it: a line job can tell it runs where
        # a dead horse's turn is passed on.
        os.environ[LINE_KEEPER_ENV] = "1"

    @property
    def dequeue_timeout(self) -> int:
        # An idle worker blocks in BLPOP this long: it wakes in time to sweep.
        rq_own = int(RQWorker.dequeue_timeout.fget(self))  # type: ignore[attr-defined]
        return max(1, min(rq_own, math.ceil(self.line_sweep_every)))

    @property
    def connection_timeout(self) -> int:
        # The socket timeout RQ gives the connection stays what it was (RQ's own sum).
        return int(RQWorker.dequeue_timeout.fget(self)) + 10  # type: ignore[attr-defined]

    def handle_payload(self, message: Any) -> None:
        """RQ's pubsub commands, and ``on_busy="replace"``'s stop (``rq_mutex.replace``)."""
        payload = parse_payload(message)
        if payload.get("command") == replace.COMMAND:
            replace.stop_here(self, payload.get("job_id"))
        else:
            handle_command(self, payload)

    def unsubscribe(self) -> None:
        """RQ's, without a wait of up to a minute at shutdown.

        RQ's pubsub thread waits up to 60 s for a message, and since redis-py 8.2 the
        thread's ``stop()`` waits for it to end: a worker whose thread read the
        unsubscribe's reply before the stop took a minute to shut down, warm or cold.
        Here the stop runs on a helper thread and the worker waits a second at most, as RQ
        meant to; a thread still waiting then has been told to stop, and closes its
        connection itself when its wait ends (a daemon: it never holds the process)."""
        thread = self.pubsub_thread
        if not thread:
            return
        self.pubsub.unsubscribe()
        threading.Thread(target=thread.stop, name="rq-mutex-unsubscribe", daemon=True).start()
        thread.join(timeout=1)
        if not thread.is_alive():
            self.pubsub.close()

    def _install_signal_handlers(self) -> None:
        super()._install_signal_handlers()  # type: ignore[no-untyped-call]
        replace.ignore_stop_signal()  # a horse inherits it until it answers the stop

    def setup_work_horse_signals(self) -> None:
        super().setup_work_horse_signals()  # type: ignore[no-untyped-call]
        replace.answer_stop_signal()  # its default action would end the horse

    def heartbeat(self, timeout: int | None = None, pipeline: Any = None) -> None:
        super().heartbeat(timeout, pipeline)
        if time.monotonic() - self._line_swept_at >= self.line_sweep_every:
            self._line_swept_at = time.monotonic()
            self.sweep_lines()

    def _tell_if_unkept(self, where: object, lines: Lines) -> None:
        """Once per cache, at the first sweep that found lines in it: a warning when the
        cache keeps no data across a restart (its parked jobs' places would be lost)."""
        told = self.__dict__.setdefault("_unkept_told", set())
        named = where if where is None or isinstance(where, str) else id(where)
        if named in told:
            return
        told.add(named)
        reason = lines.unkept()
        if reason is not None:
            log.warning("%s: %s", self.name, reason)

    def sweep_lines(self) -> None:
        """One sweep of every line in the worker's caches; never raises into RQ."""
        named = [url.strip() for url in os.environ.get(LINE_CACHES, "").split(",")]
        for where in [None, *self.line_caches, *filter(None, named)]:
            try:
                cache = cache_on(self.connection) if where is None else shared_cache(where)
                lines = Lines(cache, lease=60.0, park_for=_DEFAULTS.park_for)
                if sweep_all(self.connection, lines, _DEFAULTS, "rq_mutex.Worker"):
                    self._tell_if_unkept(where, lines)
            except Exception as exc:  # the worker's own loop must go on
                shown = (  # never the URL: it may hold a password
                    "its own Redis" if where is None
                    else f"a {where.split(':', 1)[0]} cache" if isinstance(where, str)
                    else type(where).__name__
                )  # fmt: skip
                log.warning("sweeping the lines in %s failed: %r", shown, exc)
