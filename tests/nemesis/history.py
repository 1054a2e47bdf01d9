"""The history: every grant, release, loss, body step, store write and fault, recorded
with its process and ``time.monotonic()`` (CLOCK_MONOTONIC on Linux: one clock for every
process on the machine, so events of different processes can be ordered).

Each process appends JSON lines to a file of its own, one ``os.write`` of one line per
event on an ``O_APPEND`` descriptor: a SIGKILL can cut the history short but never mixes
two events, and a torn last line is dropped when reading.

Event fields: ``t`` (monotonic seconds), ``pid`` (the history: a process, or a thread
of the memory tier, whose OS pid is then ``os``), ``w`` (the history's name), ``op``
(below), and the op's own fields.

=============  ==========================================================================
op             fields and meaning
=============  ==========================================================================
start / exit   a process began / ended on its own (``exit`` absent: it was killed)
acquire        ``id``, ``key``, ``timeout``, ``lease``, ``renew``: an acquire is invoked
granted        ``id``, ``key``, ``fence``, ``slot``, ``deadline``: it returned a lease;
               ``deadline`` is the holder's own belief (monotonic)
busy           ``id``, ``key``, ``error``: it returned without a lease (timeout, busy)
failed         ``id``, ``error``: it raised something else (a backend fault, an interrupt)
step           ``id``, ``key``, ``fence``, ``slot``, ``n``, ``t0`` (invoked), ``t``
               (done), ``deadline`` (believed after the step), ``accepted`` (the fenced
               store's verdict), ``last`` (the store's fence after the write)
released       ``id``, ``key``, ``ok`` (what ``release`` said), ``t0``
lost           ``id``, ``key``, ``error``: the body learnt its lease was lost
done           ``id``: the op ended (after released or lost)
fault          ``kind``, ``target`` (a pid, or a server), ``id`` (for in-process faults),
               ``until`` (for faults with a duration, the planned end) and its parameters
resumed        ``target``: a SIGSTOPped process was sent SIGCONT
alarm          ``id``: an alarm (a job timeout) fired in this process
submit / run / outcome
               task queues: ``task`` (an id), the run's ``fence`` and ``deadline``, and the
               final state the queue reported; ``submit.queued``: sent through the line
               (``on_busy="queue"``), in send order per key; ``submit.retries``: RQ's
               retries the job was given (``submit.ticket``: its line's ticket);
               ``outcome.reason``: RQ's skip reason (``job.meta``); ``granted.late``:
               the line's reason a queued run is out of send order, else None
stranded       ``task``: RQ: at the end, the job sat in its queue's intermediate list and in
               no registry (a worker popped it, then was killed before it started it)
parked         ``on_busy="queue"``: ``id``, ``key``, ``task``: an arrival parked (or was
               dropped as a duplicate) and raised Ignore (Celery) or returned ``rq.Retry``
               / the skip marker (RQ: ``reason`` "parked" / "duplicate"), its acquire
               ended with no grant; ``at="send"`` (no ``id``): a call parked at its send,
               behind a ticket ahead
superseded     ``on_busy="latest"`` / ``"debounce"``: ``id``, ``key``, ``task``, ``by``: an
               arrival found a newer call waiting and returned the skip marker, its
               acquire with no grant; ``submit.supersedes`` marks such calls,
               ``outcome.reason`` / ``outcome.by`` what a superseded call's result said
=============  ==========================================================================
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

Event = dict[str, Any]


class Recorder:
    """Appends this process's events to ``<dir>/<name>.<pid>.jsonl``."""

    def __init__(self, directory: str | os.PathLike[str], name: str) -> None:
        self.name = name
        self.pid = os.getpid()
        self._dir = Path(directory)
        self._fd = self._open()

    def _open(self) -> int:
        path = self._dir / f"{self.name}.{os.getpid()}.jsonl"
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def after_fork(self, name: str) -> None:
        """In a forked child: a file of its own, so the parent's stays whole."""
        self.name = f"{self.name}.{name}"
        self.pid = os.getpid()
        self._fd = self._open()

    def __call__(self, op: str, t: float | None = None, **fields: Any) -> float:
        """Record ``op`` now (or at ``t``); returns the time recorded."""
        when = time.monotonic() if t is None else t
        event = {"t": when, "pid": self.pid, "w": self.name, "op": op, **fields}
        if self.pid != os.getpid():
            event["os"] = os.getpid()  # a thread's history: signals go to its process
        line = json.dumps(event)
        os.write(self._fd, (line + "\n").encode())
        return when

    def close(self) -> None:
        os.close(self._fd)


def load(directory: str | os.PathLike[str]) -> list[Event]:
    """Every event recorded under ``directory``, in time order (ties keep file order)."""
    events: list[Event] = []
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # the torn last line of a killed process
    events.sort(key=lambda e: e["t"])
    return events
