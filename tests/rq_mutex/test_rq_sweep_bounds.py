"""The bounds a worker's sweep applies to an RQ line: read from the jobs parked in it
(a worker has no job code), the most patient of them when jobs of several functions with
different ``gap_for`` / ``park_for`` share one key."""

from __future__ import annotations

import pytest

from rq_mutex.line import message_of, policy_in
from simple_mutex.busy.line.record import Line, Parked
from simple_mutex.busy.policy import BusyPolicy, QueuePolicy

pytestmark = pytest.mark.fast

DEFAULT = QueuePolicy()


def _policy(gap_for: float, park_for: float) -> BusyPolicy:
    return BusyPolicy(on_busy="queue", queue=QueuePolicy(gap_for=gap_for, park_for=park_for))


def line_with(*bounds: tuple[float, float]) -> Line:
    parked = {
        n + 2: Parked(message_of(f"job-{n}", "q", _policy(g, p)), at=0.0)
        for n, (g, p) in enumerate(bounds)
    }
    return Line(key="k", epoch="e", next=len(bounds) + 2, turn=1, parked=parked)


def test_the_most_patient_parked_job_sets_the_sweeps_bounds():
    """A short-gap job parked first must not make the sweep step over a head that a
    longer-gap job behind it would wait for: the longest of each bound wins."""
    found = policy_in(line_with((10, 3600), (600, 60)), DEFAULT)
    assert (found.gap_for, found.park_for) == (600, 3600)


def test_with_nothing_parked_the_workers_defaults_apply():
    assert policy_in(line_with(), DEFAULT) == DEFAULT
    assert policy_in(None, DEFAULT) == DEFAULT


def test_a_parked_message_without_bounds_is_ignored():
    """A message of another shape (an older version's, a hand-written one) sets nothing."""
    line = line_with((300, 100))
    parked = {**line.parked, 9: Parked({"id": "x", "queue": "q"}, at=0.0)}
    found = policy_in(Line(key="k", epoch="e", next=10, turn=1, parked=parked), DEFAULT)
    assert (found.gap_for, found.park_for) == (300, 100)


def test_a_copy_carries_its_bounds_too():
    """A line whose head went to its queue (its copy kept) with nothing parked behind it
    is swept by that job's bounds, not the worker's defaults."""
    line = Line(key="k", epoch="e", next=2, turn=1, issued={1: 0.0},
                copies={1: message_of("job-1", "q", _policy(600, 3600))})  # fmt: skip
    found = policy_in(line, DEFAULT)
    assert (found.gap_for, found.park_for) == (600, 3600)
