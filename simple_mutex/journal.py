"""The journal: every lock event of a process, one JSON line each, in a directory.

Turn it on without touching code::

    SIMPLE_MUTEX_JOURNAL=/var/log/mutex-journal celery -A proj worker

Any process that imports ``simple_mutex`` with that variable set subscribes a writer to
``simple_mutex.events``. From code: ``stop = journal.start(directory)``. Read it back, or
draw it, with ``simple-mutex timeline DIR -o timeline.html`` (``simple_mutex.timeline``).

Each process writes its own file, ``<host>-<pid>.jsonl`` (opened at its first event, so a
process that never locks leaves nothing); a forked child opens its own on its first event.
Each line is written with one ``write()`` to a file opened for appending, so a process
killed with SIGKILL loses no line it had written, and never leaves half of one behind
another writer's. A line holds every ``LockEvent`` field (``at`` as ISO-8601 UTC, the
holder as host, pid, label, times, fence and slot; never a token) plus ``host`` and
``pid`` of the process that wrote it (for ``busy`` and ``timed_out`` that is the waiter;
the holder is the one in the way).

With the variable unset nothing is subscribed: the event stream builds nothing.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

from . import events, forksafe

ENV = "SIMPLE_MUTEX_JOURNAL"
VERSION = 1
SUFFIX = ".jsonl"

log = logging.getLogger("simple_mutex")


def start(directory: str | os.PathLike[str]) -> Callable[[], None]:
    """Write this process's lock events (and those of children it forks) under
    ``directory`` (created when missing); returns the function that stops it."""
    writer = JournalWriter(Path(directory))
    unsubscribe = events.subscribe(writer)

    def stop() -> None:
        unsubscribe()
        writer.close()

    return stop


def start_from_environment() -> Callable[[], None] | None:
    """``start($SIMPLE_MUTEX_JOURNAL)`` when the variable is set; called by the import of
    ``simple_mutex``. A directory that cannot be created is a warning, never a failed
    import: the journal must not take the application down."""
    directory = os.environ.get(ENV)
    if not directory:
        return None
    try:
        return start(directory)
    except OSError as exc:
        log.warning("%s=%s: cannot create the journal directory (%s); not journaling",
                    ENV, directory, exc.strerror or exc)  # fmt: skip
        return None


def to_json(event: events.LockEvent, host: str, pid: int) -> str:
    """One journal line (without its newline) for ``event`` written by ``host``/``pid``."""
    fields: dict[str, Any] = {"v": VERSION, "host": host, "pid": pid}
    fields.update(asdict(event))  # Holder is a dataclass: asdict nests it (no token in it)
    return json.dumps(fields, default=_iso, ensure_ascii=False, separators=(",", ":"))


def _iso(value: object) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def file_name(host: str, pid: int) -> str:
    """``<host>-<pid>.jsonl``; the host name reduced to characters safe in a file name."""
    return f"{_UNSAFE.sub('_', host) or 'host'}-{pid}{SUFFIX}"


class JournalWriter:
    """An ``events`` subscriber that appends each event to this process's journal file."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._host = socket.gethostname()
        self._guard = threading.Lock()  # forksafe: no thread is mid-write at fork()
        self._fd: int | None = None
        self._pid = 0
        self._closed = False
        self._failed = False
        forksafe.register(self)

    @property
    def path(self) -> Path:
        return self.directory / file_name(self._host, os.getpid())

    def __call__(self, event: events.LockEvent) -> None:
        pid = os.getpid()
        line = (to_json(event, self._host, pid) + "\n").encode()
        with self._guard:
            if self._closed:
                return
            try:
                if self._fd is None or self._pid != pid:
                    self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                    self._pid = pid
                os.write(self._fd, line)  # unbuffered: in the kernel once this returns
            except OSError as exc:
                if not self._failed:  # once per process: a full disk must not flood the log
                    self._failed = True
                    log.warning("simple_mutex journal: cannot write %s (%s); events are "
                                "being dropped", self.path, exc.strerror or exc)  # fmt: skip

    def close(self) -> None:
        with self._guard:
            self._closed = True
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _before_fork(self) -> None:
        pass

    def _after_fork(self) -> None:
        # The child's copy of the parent's descriptor would write into the parent's file.
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._failed = False
