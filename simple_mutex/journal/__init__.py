"""The journal: every lock event of a process, one JSON line each, in a directory.

Turn it on without touching code::

    SIMPLE_MUTEX_JOURNAL=/var/log/mutex-journal celery -A proj worker

Any process that imports ``simple_mutex`` with that variable set subscribes a writer to
``simple_mutex.events``. From code: ``stop = journal.start(directory)``. Read it back, or
draw it, with ``simple-mutex timeline DIR -o timeline.html`` (``simple_mutex.journal.timeline``).

Each process writes its own file, ``<host>-<pid>.jsonl`` (opened at its first event, so a
process that never locks leaves nothing); a forked child opens its own on its first event.
Each line is written with one ``write()`` to a file opened for appending, so a process
killed with SIGKILL loses no line it had written, and never leaves half of one behind
another writer's. A line holds every ``LockEvent`` field (``at`` as ISO-8601 UTC, the
holder as host, pid, label, times, fence and slot; never a token) plus ``host`` and
``pid`` of the process that wrote it (for ``busy`` and ``timed_out`` that is the waiter;
the holder is the one in the way).

With the variable unset nothing is subscribed: the event stream builds nothing.

``read(paths)`` parses journal files back into ``Record``s, reporting each line that is not
a journal line as ``file:line: why``; ``simple_mutex.journal.timeline`` draws them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from simple_mutex import events
from simple_mutex._core.records import Holder
from simple_mutex._runtime import forksafe
from simple_mutex.events import KINDS, LockEvent

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


def to_json(event: LockEvent, host: str, pid: int) -> str:
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

    def __call__(self, event: LockEvent) -> None:
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


# -- reading it back ---------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """A journal line: the event, and the process that wrote it (when known)."""

    event: LockEvent
    host: str | None = None
    pid: int | None = None


class CorruptLine(ValueError):
    """A line that is not a journal line; the message says why."""


def journal_files(paths: Iterable[str | Path]) -> list[Path]:
    """The files named, and the ``*.jsonl`` files of the directories named (sorted).
    A path that does not exist raises ``FileNotFoundError``."""
    found: list[Path] = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            found += sorted(p for p in path.iterdir() if p.name.endswith(SUFFIX) and p.is_file())
        elif path.exists():
            found.append(path)
        else:
            raise FileNotFoundError(name)
    return found


def read(paths: Iterable[str | Path]) -> tuple[list[Record], list[str]]:
    """Every record in the journal files and directories named, and a ``file:line: why``
    for each line that was skipped."""
    records: list[Record] = []
    problems: list[str] = []
    seen: set[str] = set()
    for path in journal_files(paths):
        with open(path, encoding="utf-8", errors="replace") as lines:
            for number, line in enumerate(lines, 1):
                text = line.strip()
                if not text or text in seen:
                    continue
                try:
                    records.append(parse_line(text))
                except CorruptLine as exc:
                    problems.append(f"{path}:{number}: {exc}")
                else:
                    seen.add(text)
    return records, problems


def parse_line(text: str) -> Record:
    """The record of one journal line; ``CorruptLine`` saying why it is not one."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CorruptLine(f"not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(data, dict):
        raise CorruptLine("not a JSON object")
    kind = _get(data, "kind", str)
    if kind not in KINDS:
        raise CorruptLine(f"unknown kind {kind!r}")
    holder = data.get("holder")
    if holder is not None and not isinstance(holder, dict):
        raise CorruptLine("field 'holder' is not an object")
    event = LockEvent(
        kind=kind,
        key=_get(data, "key", str),
        name=_get(data, "name", str),
        cache=_get(data, "cache", str),
        at=_time(data, "at"),
        fence=_get(data, "fence", int, optional=True),
        slot=_get(data, "slot", int, optional=True),
        holder=None if holder is None else _holder(holder),
        waited=_seconds(data, "waited"),
        held=_seconds(data, "held"),
        took_over=bool(_get(data, "took_over", bool, optional=True)),
        reason=_get(data, "reason", str, optional=True),
        ticket=_get(data, "ticket", int, optional=True),
    )
    host = _get(data, "host", str, optional=True)
    return Record(event, host, _get(data, "pid", int, optional=True))


def _holder(data: dict[str, Any]) -> Holder:
    try:
        return Holder(
            host=_get(data, "host", str),
            pid=_get(data, "pid", int),
            label=_get(data, "label", str, optional=True),
            acquired_at=_time(data, "acquired_at"),
            expires_at=_time(data, "expires_at"),
            fence=_get(data, "fence", int),
            slot=_get(data, "slot", int, optional=True) or 0,
        )
    except CorruptLine as exc:
        raise CorruptLine(f"holder: {exc}") from None


def _get(data: dict[str, Any], name: str, kind: type, *, optional: bool = False) -> Any:
    value = data.get(name)
    if value is None and optional:
        return None
    # bool is an int in Python, never in a journal
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        want = {str: "a string", int: "an integer", bool: "true or false"}[kind]
        raise CorruptLine(f"field {name!r} is missing" if value is None else
                          f"field {name!r} is not {want}")  # fmt: skip
    return value


def _seconds(data: dict[str, Any], name: str) -> float | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise CorruptLine(f"field {name!r} is not a number of seconds")
    return float(value)


def _time(data: dict[str, Any], name: str) -> datetime:
    text = _get(data, name, str)
    try:
        at = datetime.fromisoformat(text)
    except ValueError:
        raise CorruptLine(f"field {name!r} is not an ISO-8601 time") from None
    if at.tzinfo is None:
        raise CorruptLine(f"field {name!r} has no UTC offset")
    return at
