"""The nemesis in bounded mode, one test per tier: seeded faults against real processes
and servers, then the history checker (tests/nemesis/checker.py). A test fails on any
anomaly, printing the run's figures, each anomaly and the faults dealt to it, and the
directory of its history (kept when it fails).

``NEMESIS_SEED`` (default 1) and ``NEMESIS_DURATION`` (seconds per tier, default 15;
Celery and RQ get 25) choose the run; replay a failing seed with
``python -m tests.nemesis --tier <tier> --seed <seed> --duration <seconds>``, and run for
hours with ``--duration 3600 --seeds 10``.
"""

from __future__ import annotations

import os

import nemesis  # noqa: F401  (sys.path)
import pytest
from nemesis import runner

pytestmark = pytest.mark.system

SEED = int(os.environ.get("NEMESIS_SEED", "1"))
DURATION = float(os.environ.get("NEMESIS_DURATION", "15"))
LONGER = {"celery": 25.0, "rq": 25.0}
# Anomalies a tier's run may show from a known, reported library bug (tier -> (kind, a
# phrase of its detail, the bug)): the test then xfails with it, printed, instead of
# failing CI until the fix lands; anything else still fails. Delete an entry with its fix.
KNOWN: dict[str, tuple[str, str, str]] = {}


@pytest.mark.parametrize("tier", [*runner.LIB_TIERS, "celery", "rq", "beat", "cron"])
def test_nemesis_finds_no_anomaly(tier: str) -> None:
    """A bounded run of ``tier`` under its faults: no anomaly in its history."""
    duration = DURATION
    if "NEMESIS_DURATION" not in os.environ:
        duration = max(DURATION, LONGER.get(tier, 0.0))
    result = runner.run(tier, SEED, duration)
    print(result.report())
    assert result.figures["histories"] >= 2, "the run recorded no client history"
    known = KNOWN.get(tier)
    if (
        known
        and result.anomalies
        and all(a.kind == known[0] and known[1] in a.detail for a in result.anomalies)
    ):
        pytest.xfail(f"known bug: {known[2]}\n{result.report()}")
    assert result.anomalies == [], result.report()
    if tier == "rq":  # its queued jobs went through the line: some reached it and parked
        assert result.figures["queued"], result.report()
        assert result.figures["parked"], result.report()
    runner.cleanup(result)
