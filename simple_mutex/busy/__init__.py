"""The busy policy Celery (``celery_mutex``) and RQ (``rq_mutex``) share; neither imports
the other, and nothing here imports either.

* ``policy``: the shared options (``on_busy``, ``timeout``, ``retry={...}``, ``lease``,
  ``renew``, ``permits``) and what they decide: how long to wait, whether to skip, fail or
  run again later and when, in a worker and in synchronous execution.
* ``running``: ``current_lease()``, the loss interrupt turned into the public error, and
  the skip marker that ``is_skipped`` recognizes.
* ``per_process``: caches and lock spaces built once per process, again after fork.
* ``line``: the line of ``on_busy="queue"``, ``"latest"`` and ``"debounce"``: one JSON
  record per key beside its lock, the pure decisions on it, the flow that writes it
  (``Lines``) and the per-call driver Celery and RQ both run (``line.driver``).
* ``port``: what that driver needs from a task queue (``Call``, ``Publisher``); each
  integration implements it (``docs/design/tasks.md``).
* The core's checks the integrations apply to their own options (``positive_seconds``,
  ``Duration``, ``check_prefix``, ``template_fields``), and its ``OnePerProcess`` (the
  keeper's idiom, for the Celery exit watch): re-exported here, so neither integration
  imports a private module of the core (``tests/test_layers.py``).
"""

from __future__ import annotations

from simple_mutex._core.durations import Duration, positive_seconds
from simple_mutex._core.keys import check_prefix, template_fields
from simple_mutex._runtime.forksafe import OnePerProcess
from simple_mutex.current import current_lease

from .per_process import PerProcess, reset, shared_cache
from .policy import (
    IN_LINE,
    SHARED,
    Busy,
    BusyPolicy,
    OnBusy,
    RunAgain,
    Skip,
    check_known,
    check_option,
    unreachable,
)
from .running import SKIPPED, is_skipped, running, skip_marker

__all__ = [
    "IN_LINE",
    "SHARED",
    "SKIPPED",
    "Busy",
    "BusyPolicy",
    "Duration",
    "OnBusy",
    "OnePerProcess",
    "PerProcess",
    "RunAgain",
    "Skip",
    "check_known",
    "check_option",
    "check_prefix",
    "current_lease",
    "is_skipped",
    "positive_seconds",
    "reset",
    "running",
    "shared_cache",
    "skip_marker",
    "template_fields",
    "unreachable",
]
