"""The beat guard records a tick in the schedule store only once it is sent, for the
schedulers that keep their schedule in a store every beat shares: django-celery-beat's
``DatabaseScheduler`` and redbeat's ``RedBeatScheduler`` (each in a process of its own,
``celery_support.beat_stores``, as Django configures once per process), beside
Celery's own ``PersistentScheduler`` (``test_celery_beat.py``).

A beat that lost the claim, or won it and died before its publish, leaves the entry's
``last_run_at`` and ``total_run_count`` as they were: a store that says "ran" for a tick
nobody sent would silence the staleness alerts operators set on it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from celery_support.processes import REDIS_URL

pytestmark = pytest.mark.backends

TESTS = Path(__file__).resolve().parents[1]


def scenario(kind: str, where: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "celery_support.beat_stores", kind, where, REDIS_URL],
        cwd=TESTS, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def test_django_celery_beat_records_only_the_tick_this_beat_sent(tmp_path: Path) -> None:
    stores = scenario("django", str(tmp_path / "beat.sqlite3"))
    assert stores["lost"] == {"total_run_count": 0, "last_run_at": None}
    assert stores["died"] == {"total_run_count": 0, "last_run_at": None}
    assert stores["sent"]["total_run_count"] == 1
    assert stores["sent"]["last_run_at"] is not None
    # Two beats winning in turn: the table counts every run, not each beat's own.
    assert stores["turns"] == [1, 2, 3, 4]


def test_redbeat_records_only_the_tick_this_beat_sent() -> None:
    stores = scenario("redbeat", REDIS_URL)
    # Saved two hours ago (so due); a beat that did not send leaves that as it was.
    before = stores["lost"]["last_run_at"]
    assert stores["died"]["last_run_at"] == before
    assert stores["lost"]["total_run_count"] == stores["died"]["total_run_count"] == 0
    assert stores["sent"]["total_run_count"] == 1
    assert stores["sent"]["last_run_at"] > before
