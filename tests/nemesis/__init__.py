"""The nemesis: many OS processes take locks on shared keys and write to a fenced store
while random faults are injected; a checker then proves, from the recorded history alone,
that the lock kept its promises (see ``checker`` for the exact properties).

Modules: ``history`` (the recorder and the event schema), ``store`` (fenced stores that
enforce fence order themselves), ``checker`` (the properties), ``faults`` (the seeded
schedule and what each fault does), ``workload`` (the client processes), ``runner`` (one
run of one tier), and one module per task-queue tier (``celery_tier``, ``rq_tier``,
``beat_tier``, ``cron_tier``); ``failover`` kills the primary of a replicated tier (Redis
with Sentinel, PostgreSQL with a standby) under the same clients and checker. Run it with
``python -m tests.nemesis --tier redis --seed 7``.

Everything imports as ``nemesis.*`` with ``tests/`` on ``sys.path`` (as pytest and the
worker subprocesses have it), so that the package is one module tree in every process.
"""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
for _path in (str(TESTS), str(ROOT)):
    if _path not in sys.path:
        sys.path.insert(0, _path)
