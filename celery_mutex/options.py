"""The ``mutex={...}`` options of a task, checked when the task class is made; the shared
ones (``on_busy``, ``timeout``, ``retry``, ``lease``, ``renew``, ``permits``) mean what
they mean for RQ and are checked by ``simple_mutex.busy``."""

from __future__ import annotations

from typing import Any

from simple_mutex import ConstraintError
from simple_mutex.busy import SHARED, check_known, check_option
from simple_mutex.durations import positive_seconds

OPTIONS = SHARED | {"key", "cache", "prefix", "enqueue", "enqueue_ttl"}

DEFAULTS: dict[str, Any] = {  # of the options only Celery has; the shared ones: BusyPolicy
    "cache": None,  # no default: the broker is never used silently
    "prefix": "mutex.",
    "enqueue": None,  # off; "return" or "raise" de-duplicates at apply_async
    "enqueue_ttl": 3600.0,  # how long a queued call blocks duplicates at most
}


def check_options(task_name: str, options: object) -> dict[str, Any]:
    """Validate the per-task dict (unknown names and bad values fail at definition)."""
    if options is None:
        return {}
    checked = dict(check_known(task_name, "mutex option", options, OPTIONS))
    for name, value in checked.items():
        check_value(task_name, name, value)
    return checked


def check_value(where: str, name: str, value: Any) -> Any:
    """One option's value, as given (a cache is checked when first built, a key when the
    key function is made)."""
    if name in SHARED:
        check_option(where, name, value)
    elif name == "enqueue" and value not in (None, "return", "raise"):
        raise ConstraintError(f"{where}: enqueue must be None, 'return' or 'raise', got {value!r}")
    elif name == "enqueue_ttl":
        positive_seconds(value, f"{where}: enqueue_ttl")
    elif name == "prefix" and not isinstance(value, str):
        raise ConstraintError(f"{where}: prefix must be a str, got {value!r}")
    return value
