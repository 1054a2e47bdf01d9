"""A task's configuration in this process: its ``mutex={...}`` over the app's ``mutex_*``
settings over the defaults, and the locks built from it (again in a forked child)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from simple_mutex import ConstraintError, Mutex
from simple_mutex.busy import BusyPolicy, PerProcess, shared_cache
from simple_mutex.durations import positive_seconds

from ._owned import OwnedLocks
from .options import DEFAULTS, OPTIONS, check_value


@dataclass(frozen=True)
class Config:
    policy: BusyPolicy
    locks: OwnedLocks
    markers: OwnedLocks | None  # "queued or running" records, when enqueue is on
    enqueue: str | None


def config_of(task: Any) -> Config:
    """The configuration of ``task`` (a MutexTask), built on first use in this process."""
    return _configs.get(task)


def settings_of(task: Any) -> dict[str, Any]:
    """The app's ``mutex_*`` settings (Django: ``CELERY_MUTEX_*``), checked by name."""
    conf = task._get_app().conf
    found = {name: conf.get(f"mutex_{name}") for name in sorted(OPTIONS - {"key"})}
    return {
        name: check_value(f"app.conf.mutex_{name}", name, value)
        for name, value in found.items()
        if value is not None
    }


def _build(task: Any) -> Config:
    settings = settings_of(task)
    options = task._mutex_spec.options
    merged = {**DEFAULTS, **settings, **options}
    # retry fields merge field by field: defaults < app.conf.mutex_retry < the task's
    merged["retry"] = {**settings.get("retry", {}), **options.get("retry", {})}
    if merged["cache"] is None:
        raise ConstraintError(
            f"{task.name}: no lock cache configured; set app.conf.mutex_cache "
            "(e.g. 'redis://host:6379/0') or mutex={'cache': ...} on the task. "
            "The broker is never used silently"
        )
    cache = shared_cache(merged["cache"])
    policy = BusyPolicy.from_options(task.name, merged)
    markers = None
    if merged["enqueue"] is not None:
        ttl = positive_seconds(merged["enqueue_ttl"], "enqueue_ttl")
        markers = OwnedLocks(Mutex(cache, lease=ttl, prefix=merged["prefix"] + "queued."))
    locks = OwnedLocks(policy.lock_space(cache, merged["prefix"]))
    return Config(policy, locks, markers, merged["enqueue"])


_configs: PerProcess[Config] = PerProcess(_build)
