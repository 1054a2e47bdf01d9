"""Options for one call: ``task.apply_async(args, mutex={"key": ..., "on_busy": ...,
"timeout": ...})``.

Only what can differ between two calls of one task may be given per call: the lock ``key``
(a literal key, instead of the one the task's template makes from the arguments), what a
busy key means (``on_busy``) and how long to wait (``timeout``). The rest (cache, prefix,
lease, permits, retry, enqueue) describes the task's locks as a whole, so a per-call value
raises ConstraintError instead of being ignored. The options travel in a message header,
so busy re-publishes keep them; ``send_task`` and beat send none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from simple_mutex import ConstraintValueError
from simple_mutex.busy import check_known, check_option

from .config import OPTIONS, Config

HEADER = "mutex_call"  # a worker also makes it the request attribute of that name
PER_CALL = frozenset({"key", "on_busy", "timeout"})


def check(task_name: str, given: object) -> dict[str, Any]:
    """The per-call options, checked; JSON-safe (they travel in a header)."""
    where = f"{task_name}: apply_async(mutex=...)"
    given = check_known(where, "mutex option", given, OPTIONS)  # a typo: the known names
    fixed = sorted(set(given) - PER_CALL)
    if fixed:
        raise ConstraintValueError(
            f"{where}: {', '.join(map(repr, fixed))} cannot change per call (only key, "
            "on_busy and timeout can); set it on the task's mutex={...} or app.conf.mutex_*"
        )
    checked: dict[str, Any] = {}
    for name, value in given.items():
        if name == "key":
            if not isinstance(value, str) or not value:
                raise ConstraintValueError(f"{where}: key must be a non-empty str, got {value!r}")
            checked[name] = value
        else:
            checked[name] = check_option(where, name, value)
    return checked


def into_headers(task_name: str, options: dict[str, Any]) -> None:
    """Move ``mutex={...}`` from apply_async's options into the message header, checked
    (every sending path of a MutexTask calls this, the compat classes' too)."""
    given = options.pop("mutex", None)
    if given is not None:
        call = check(task_name, given)
        options["headers"] = {**(options.get("headers") or {}), HEADER: call}


def of_request(request: Any) -> dict[str, Any]:
    """The per-call options a request carries ({} when none, or no request): a task's
    request context (header as attribute, or in ``headers`` under apply()) or a worker's
    Request (``request_dict``, in task_revoked)."""
    for found in (
        getattr(request, HEADER, None),
        (getattr(request, "headers", None) or {}).get(HEADER),
        (getattr(request, "request_dict", None) or {}).get(HEADER),
    ):
        if isinstance(found, Mapping):
            return dict(found)
    return {}


def applied(cfg: Config, call: Mapping[str, Any]) -> Config:
    """The task's configuration with this call's on_busy and timeout."""
    changes = {name: call[name] for name in ("on_busy", "timeout") if name in call}
    if not changes:
        return cfg
    return dataclasses.replace(cfg, policy=dataclasses.replace(cfg.policy, **changes))


def key_of(task: Any, args: Any, kwargs: Any, call: Mapping[str, Any]) -> str:
    """The lock key of a call: its own ``key`` if given, else the task's from arguments."""
    key = call.get("key")
    return key if isinstance(key, str) else str(task.mutex_key(*(args or ()), **(kwargs or {})))
