"""The options of ``mutex_job``, checked when the job function is decorated.

Same names and meanings as the Celery integration (``celery_mutex.options``). That module
cannot be imported here without importing Celery (its package ``__init__`` loads the
task class), so the few checks needed are restated; moving the shared pieces into
``simple_mutex`` would let both integrations use one copy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from simple_mutex import ConstraintError
from simple_mutex.durations import positive_seconds

ON_BUSY = ("skip", "retry", "wait", "raise")
RETRY_FIELDS = frozenset({"countdown", "backoff", "jitter", "cap", "max"})
RETRY_DEFAULTS: dict[str, object] = {
    "countdown": 1.0,
    "backoff": 2.0,
    "jitter": True,
    "cap": 60.0,
    "max": None,
}
UNLIMITED_RETRIES = 2**31 - 1  # rq.Retry needs a number; None means "until it is free"


@dataclass(frozen=True)
class RetryPolicy:
    """When a busy job runs again: ``countdown * backoff**n`` seconds, capped at ``cap``,
    jittered to [0.5, 1.5) of that when ``jitter``; at most ``max`` busy retries."""

    countdown: float
    backoff: float
    jitter: bool
    cap: float
    max: int | None

    def delay(self, busy_retries: int, unit: float) -> int:
        """Whole seconds (RQ schedules by the second, and ``rq.Retry`` takes ints) before
        busy retry number ``busy_retries + 1``; ``unit`` is a random number in [0, 1)."""
        base = min(self.cap, self.countdown * self.backoff ** min(busy_retries, 64))
        seconds = base * (0.5 + unit) if self.jitter else base
        return max(1, math.ceil(seconds))


def check_on_busy(where: str, value: object) -> str:
    if not isinstance(value, str) or value not in ON_BUSY:
        raise ConstraintError(
            f"{where}: on_busy must be one of {', '.join(ON_BUSY)}, got {value!r}"
        )
    return value


def check_permits(where: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConstraintError(f"{where}: permits must be an int >= 1, got {value!r}")
    return value


def check_bool(where: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConstraintError(f"{where}: {name} must be True or False, got {value!r}")
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
    jitter = check_bool(where, "retry jitter", merged["jitter"])
    limit = merged["max"]
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise ConstraintError(f"{where}: retry max must be None or an int >= 0, got {limit!r}")
    return RetryPolicy(countdown, float(backoff), jitter, cap, limit)
