"""Durations: seconds, ``timedelta`` or a mapping like ``{"minutes": 5}``, checked up front.

A lease or poll interval must lie in (0, 2**31 - 1 ms] (about 24.8 days, the bound the
seed library took from timers); a wait timeout may also be 0 (try once) or None (wait
forever). Anything else raises a ConstraintError that says what to pass instead (a
ConstraintTypeError for a wrong type, a ConstraintValueError for a bad value).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import timedelta

from simple_mutex.errors import ConstraintTypeError, ConstraintValueError

Duration = int | float | timedelta | Mapping[str, int | float]

MAX_SECONDS = (2**31 - 1) / 1000.0

_UNIT_SECONDS = {
    "weeks": 7 * 86400.0,
    "days": 86400.0,
    "hours": 3600.0,
    "minutes": 60.0,
    "seconds": 1.0,
    "milliseconds": 0.001,
    "microseconds": 0.000001,
}


def _to_seconds(value: object, name: str) -> float:
    # bool is an int subclass; lease=True is a mistake, not one second.
    if isinstance(value, bool):
        raise ConstraintTypeError(
            f"{name} must be a duration (seconds, timedelta or {{'minutes': 5}}), not a bool"
        )
    if isinstance(value, (int, float)):
        return _as_float(value)
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, Mapping):
        if not value:
            raise ConstraintValueError(f"{name} is an empty mapping; give e.g. {{'seconds': 30}}")
        total = 0.0
        for unit, amount in value.items():
            if unit not in _UNIT_SECONDS:
                known = ", ".join(_UNIT_SECONDS)
                raise ConstraintValueError(f"{name} has unknown unit {unit!r}; use one of: {known}")
            if isinstance(amount, bool) or not isinstance(amount, (int, float)):
                raise ConstraintTypeError(f"{name}[{unit!r}] must be a number, got {amount!r}")
            total += _as_float(amount) * _UNIT_SECONDS[unit]
        return total
    raise ConstraintTypeError(
        f"{name} must be seconds (int/float), a timedelta or a mapping like "
        f"{{'minutes': 5}}, got {type(value).__name__}"
    )


def _as_float(number: int | float) -> float:
    try:
        return float(number)
    except OverflowError:  # an int beyond float range: out of bounds, reported as such
        return math.inf


def positive_seconds(value: object, name: str) -> float:
    """A lease or interval: in (0, MAX_SECONDS]."""
    seconds = _to_seconds(value, name)
    if not math.isfinite(seconds) or seconds <= 0 or seconds > MAX_SECONDS:
        hint = "; for longer work use renew=True with a shorter lease" if name == "lease" else ""
        raise ConstraintValueError(
            f"{name} must be greater than 0 and at most {MAX_SECONDS:.3f} s (about 24.8 days), "
            f"got {seconds!r}{hint}"
        )
    return seconds


def timeout_seconds(value: object, name: str = "timeout") -> float | None:
    """A wait bound: None (wait forever), 0 (try once) or in (0, MAX_SECONDS]."""
    if value is None:
        return None
    seconds = _to_seconds(value, name)
    if seconds == 0:
        return 0.0
    if not math.isfinite(seconds) or seconds < 0 or seconds > MAX_SECONDS:
        raise ConstraintValueError(
            f"{name} must be None (wait forever), 0 (try once) or a duration up to "
            f"{MAX_SECONDS:.3f} s, got {seconds!r}"
        )
    return seconds
