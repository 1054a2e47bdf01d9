"""What a task-queue integration does when a lock is busy: the options both Celery and RQ
take (``on_busy`` and ``retry={...}``), checked in one place.

``on_busy``: ``skip`` (finish without running), ``retry`` (run again later), ``wait``
(block until free) or ``raise``. A busy retry runs again after
``countdown * backoff**n`` seconds, capped at ``cap``, jittered to [0.5, 1.5) of that when
``jitter``, at most ``max`` times (None: until the lock is free).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .durations import positive_seconds
from .errors import ConstraintError

ON_BUSY = ("skip", "retry", "wait", "raise")
RETRY_FIELDS = frozenset({"countdown", "backoff", "jitter", "cap", "max"})
RETRY_DEFAULTS: dict[str, Any] = {
    "countdown": 1.0,
    "backoff": 2.0,
    "jitter": True,
    "cap": 60.0,
    "max": None,
}


@dataclass(frozen=True)
class RetryPolicy:
    countdown: float
    backoff: float
    jitter: bool
    cap: float
    max: int | None

    def delay(self, busy_retries: int, unit: float) -> float:
        """Seconds before busy retry number ``busy_retries + 1``; ``unit`` in [0, 1)."""
        base = min(self.cap, self.countdown * self.backoff ** min(busy_retries, 64))
        return base * (0.5 + unit) if self.jitter else base


def check_on_busy(where: str, value: object) -> str:
    if not isinstance(value, str) or value not in ON_BUSY:
        raise ConstraintError(
            f"{where}: on_busy must be one of {', '.join(ON_BUSY)}, got {value!r}"
        )
    return value


def retry_policy(where: str, value: object) -> RetryPolicy:
    """``retry={...}`` merged over the defaults; unknown fields and bad values raise."""
    if value is None:
        value = {}
    if not isinstance(value, Mapping):
        raise ConstraintError(f"{where}: retry must be a dict, got {value!r}")
    unknown = sorted(set(value) - RETRY_FIELDS)
    if unknown:
        raise ConstraintError(
            f"{where}: unknown retry field(s) {', '.join(map(repr, unknown))}; "
            f"known: {', '.join(sorted(RETRY_FIELDS))}"
        )
    merged = {**RETRY_DEFAULTS, **value}
    countdown = positive_seconds(merged["countdown"], "retry countdown")
    cap = positive_seconds(merged["cap"], "retry cap")
    backoff = merged["backoff"]
    if isinstance(backoff, bool) or not isinstance(backoff, int | float) or not backoff >= 1:
        raise ConstraintError(f"{where}: retry backoff must be a number >= 1, got {backoff!r}")
    jitter = merged["jitter"]
    if not isinstance(jitter, bool):
        raise ConstraintError(f"{where}: retry jitter must be True or False, got {jitter!r}")
    limit = merged["max"]
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ConstraintError(f"{where}: retry max must be None or an int >= 0, got {limit!r}")
    return RetryPolicy(countdown, float(backoff), jitter, cap, limit)
