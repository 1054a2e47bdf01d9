"""The options of ``mutex_job``, checked when the job function is decorated.

Same names and meanings as the Celery integration; the busy policy both share
(``on_busy``, ``retry={...}``) lives in ``simple_mutex.busy``.
"""

from __future__ import annotations

import math

from simple_mutex import ConstraintError
from simple_mutex.busy import RetryPolicy, check_on_busy, retry_policy

__all__ = [
    "RetryPolicy",
    "check_bool",
    "check_on_busy",
    "check_permits",
    "retry_policy",
    "whole_seconds",
]

UNLIMITED_RETRIES = 2**31 - 1  # rq.Retry needs a number; None means "until it is free"


def whole_seconds(policy: RetryPolicy, busy_retries: int, unit: float) -> int:
    """The policy's delay in whole seconds (RQ schedules by the second, and ``rq.Retry``
    takes ints), at least one."""
    return max(1, math.ceil(policy.delay(busy_retries, unit)))


def check_permits(where: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConstraintError(f"{where}: permits must be an int >= 1, got {value!r}")
    return value


def check_bool(where: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConstraintError(f"{where}: {name} must be True or False, got {value!r}")
    return value
