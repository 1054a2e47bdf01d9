"""What a task or job body sees while it holds its lock, and what a skipped run returns."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from simple_mutex import Lease, SimpleMutexLeaseExpiredError
from simple_mutex._runtime.interrupt import LeaseInterrupt
from simple_mutex.current import _current
from simple_mutex.errors import add_note, displaced_by

SKIPPED = "skipped"
SOURCES = ("celery_mutex", "rq_mutex")
"""Who may have made a skip marker: ``{"<source>": "skipped", "key": ..., ...}``."""


@contextmanager
def running(lease: Lease) -> Iterator[None]:
    """Run a body under ``lease``: ``current_lease()`` answers with it, and the loss
    interrupt leaves as the public ``SimpleMutexLeaseExpiredError`` (the per-lease class
    cannot be found by name when Celery or RQ store the failure); the chained interrupt
    shows where the body was when the lease was lost. An interrupt that landed while a
    SystemExit or KeyboardInterrupt unwound the body (a ``finally:`` after SIGTERM)
    displaced it: that one leaves instead, with a note (lifecycle rule 13), or Celery
    would record an ordinary failure and keep the terminated child alive."""
    token = _current.set(lease)
    try:
        yield
    except LeaseInterrupt as lost:
        displaced = displaced_by(lost)
        if displaced is not None:
            add_note(displaced, f"simple-mutex: while this unwound the body, {lost.message}")
            raise displaced from None
        raise SimpleMutexLeaseExpiredError(lost.message, key=lost.key) from lost
    finally:
        _current.reset(token)


def skip_marker(source: str, key: str, **details: Any) -> dict[str, Any]:
    """The result of a run that did not happen: distinct from any return value."""
    return {source: SKIPPED, "key": key, **details}


def is_skipped(result: object) -> bool:
    """True if ``result`` (``AsyncResult.get()``, ``job.return_value()``) is the marker of
    a run that was skipped: its key was busy, or its tick already ran."""
    return isinstance(result, Mapping) and any(result.get(s) == SKIPPED for s in SOURCES)
