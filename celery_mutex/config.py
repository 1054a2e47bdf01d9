"""A task's configuration: its ``mutex={...}`` options, checked when the task class is
made, and in each process (again in a forked child) those options over the app's
``mutex_*`` settings over the defaults, with the locks built from them. The shared
options (``on_busy``, ``timeout``, ``retry``, ``lease``, ``renew``, ``permits``) mean
what they mean for RQ and are checked by ``simple_mutex.busy``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from simple_mutex import ConstraintTypeError, ConstraintValueError, Mutex
from simple_mutex.busy import (
    SHARED,
    BusyPolicy,
    PerProcess,
    check_known,
    check_option,
    check_prefix,
    positive_seconds,
    shared_cache,
)
from simple_mutex.busy.line import Lines

from ._owned import OwnedLocks

OPTIONS = SHARED | {"key", "cache", "prefix", "enqueue", "enqueue_ttl", "enqueue_until"}

DEFAULTS: dict[str, Any] = {  # of the options only Celery has; the shared ones: BusyPolicy
    "cache": None,  # no default: the broker is never used silently
    "prefix": "mutex.",
    "enqueue": None,  # off; "return" or "raise" de-duplicates at apply_async
    "enqueue_ttl": 3600.0,  # how long a queued call blocks duplicates at most
    "enqueue_until": "end",  # "start": an equal call may be queued once this one runs
}


# The records celery_mutex keeps beside task locks live in spaces named *before* the
# prefix ("queued.mutex.<key>"), never under it: no user key can then equal one (a key
# "queued.x" under "mutex." stays a task lock), and listing "mutex." shows task locks only.
# A prefix that begins one of these names (or is begun by one) could still meet them.
BESIDE = ("queued.", "beat.", "ticks.", "line.", "taken.")


def beside(kind: str, prefix: str) -> str:
    """The prefix of ``kind``'s records ("queued.", "beat.", "ticks.", "line." or
    "taken.") beside ``prefix``."""
    assert kind in BESIDE
    return kind + prefix


def acl_prefixes(prefix: str = "mutex.") -> tuple[str, ...]:
    """Every lock prefix celery_mutex writes under for ``mutex_prefix = prefix``: the task
    locks and the records beside them (enqueue markers, beat claims, beat-run ticks, the
    lines of ``on_busy="queue"``, the calls ``on_busy="replace"`` replaced). For
    ``RedisCache.acl_rules(prefixes=acl_prefixes())``, the words of a least-privileged
    Redis user for a Celery app."""
    return (check_prefix(prefix), *(beside(kind, prefix) for kind in BESIDE))


def check_prefix_room(where: str, prefix: str) -> str:
    clash = [name for name in BESIDE if prefix.startswith(name) or name.startswith(prefix)]
    if clash:
        raise ConstraintValueError(
            f"{where}: prefix {prefix!r} could meet the records celery_mutex keeps under "
            f"{', '.join(clash)}; choose one that starts otherwise, e.g. 'mutex.'"
        )
    longest = max(map(len, BESIDE))
    if len(prefix) > 64 - longest:
        raise ConstraintValueError(
            f"{where}: prefix must be at most {64 - longest} characters (its records get "
            f"up to {longest} more), got {len(prefix)}"
        )
    return prefix


def check_options(task_name: str, options: object) -> dict[str, Any]:
    """Validate the per-task dict (unknown names and bad values fail at definition)."""
    if options is None:
        return {}
    checked = dict(check_known(task_name, "mutex option", options, OPTIONS))
    for name, value in checked.items():
        check_value(task_name, name, value)
    check_combination(task_name, checked)
    return checked


def check_combination(where: str, options: dict[str, Any]) -> None:
    """Options that contradict each other (here, at definition, when the task's own dict
    names its on_busy: what the app sets cannot change what the task asked for; again
    once merged with the app's settings). Debounce's fields merge one by one with the
    app's ``mutex_debounce``, so they are checked merged only."""
    if options.get("on_busy") in (None, "debounce"):
        return
    BusyPolicy.from_options(where, options)  # permits, timeout, queue= against on_busy
    if options["on_busy"] == "replace" and options.get("enqueue") is not None:
        raise ConstraintValueError(
            f"{where}: enqueue answers a new call with the one already queued or running, "
            "and on_busy='replace' makes the new call win: drop enqueue, or choose "
            "another on_busy"
        )


def check_value(where: str, name: str, value: Any) -> Any:
    """One option's value, as given (a cache is checked when first built, a key when the
    key function is made)."""
    if name in SHARED:
        check_option(where, name, value)
    elif name == "enqueue" and value not in (None, "return", "raise"):
        raise ConstraintValueError(
            f"{where}: enqueue must be None, 'return' or 'raise', got {value!r}"
        )
    elif name == "enqueue_until" and value not in ("start", "end"):
        raise ConstraintValueError(
            f"{where}: enqueue_until must be 'start' or 'end', got {value!r}"
        )
    elif name == "enqueue_ttl":
        positive_seconds(value, f"{where}: enqueue_ttl")
    elif name == "prefix":
        if not isinstance(value, str):
            raise ConstraintTypeError(f"{where}: prefix must be a str, got {value!r}")
        check_prefix_room(where, value)
    return value


@dataclass(frozen=True)
class Config:
    policy: BusyPolicy
    locks: OwnedLocks
    markers: OwnedLocks | None  # "queued or running" records, when enqueue is on
    enqueue: str | None
    enqueue_until: str
    lines: Lines  # the lines of on_busy="queue", beside the locks (used only by it)


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
    # defaults < the base class's (celery_mutex.compat: the peers' settings) < the app's
    # mutex_* settings < the task's mutex={...}
    below = check_options(task.name, task.mutex_defaults())
    settings = settings_of(task)
    options = task._mutex_spec.options
    merged = {**DEFAULTS, **below, **settings, **options}
    # retry and queue fields merge field by field, in the same order
    for nested in ("retry", "queue", "debounce"):
        merged[nested] = {
            **below.get(nested, {}),
            **settings.get(nested, {}),
            **options.get(nested, {}),
        }
    if merged["cache"] is None:
        raise ConstraintValueError(
            f"{task.name}: no lock cache configured; set app.conf.mutex_cache "
            "(e.g. 'redis://host:6379/0') or mutex={'cache': ...} on the task. "
            "The broker is never used silently"
        )
    cache = shared_cache(merged["cache"])
    policy = BusyPolicy.from_options(task.name, merged)
    check_combination(task.name, merged)
    markers = None
    if merged["enqueue"] is not None:
        ttl = positive_seconds(merged["enqueue_ttl"], "enqueue_ttl")
        markers = OwnedLocks(
            Mutex(cache, lease=ttl, prefix=beside("queued.", merged["prefix"]), name="enqueue")
        )
    locks = OwnedLocks(policy.lock_space(cache, merged["prefix"], name=task.name))
    lines = Lines(
        cache, lease=policy.lease, park_for=policy.queue.park_for, lock_prefix=merged["prefix"]
    )
    return Config(policy, locks, markers, merged["enqueue"], merged["enqueue_until"], lines)


_configs: PerProcess[Config] = PerProcess(_build)
