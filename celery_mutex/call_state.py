"""What celery_mutex knows of the call a request runs: one typed object per request,
``of(task.request)``, in place of attributes scattered on Celery's request.

Only ``request.mutex_beat_slot`` stays an attribute of the request: it is the body's to
read (the tick a guarded beat sent the call for), as the Celery guide shows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from simple_mutex import Lease
from simple_mutex.busy.line import Ticket

ATTRIBUTE = "mutex_state"


@dataclass
class CallState:
    """One call's state in this process, from ``before_start`` to its end."""

    lease: Lease | None = None  # held for the body, its loss interrupt armed in this thread
    started: float | None = None  # time.monotonic() when the lease was granted
    skipped: dict[str, Any] | None = None  # the marker the call returns instead of running
    parked: bool = False  # the line keeps the call: this delivery is not its end
    late: str | None = None  # why it runs out of order in its line (None: in order)
    ticket: tuple[str, Ticket] | None = None  # (key, ticket) whose turn ends with the run
    done: bool = False  # its lease was released (or handed on to a retry)
    running: bool = False  # the body runs: a call of this task from it is a direct call


def of(request: Any) -> CallState:
    """The state of the call ``request`` runs (made empty on first use)."""
    found = getattr(request, ATTRIBUTE, None)
    if isinstance(found, CallState):
        return found
    return fresh(request)


def fresh(request: Any, *, running: bool = False) -> CallState:
    """A new, empty state for ``request`` (a direct call made from a running body: not the
    caller's, even where Celery shares the request between them)."""
    state = CallState(running=running)
    setattr(request, ATTRIBUTE, state)
    return state


def attempt_of(request: Any) -> int | None:
    """Which attempt (``retries``) a worker Request or a task Context is, if it says."""
    found = getattr(request, "retries", None)
    if found is None:
        found = (getattr(request, "request_dict", None) or {}).get("retries")
    return found if isinstance(found, int) and not isinstance(found, bool) else None
