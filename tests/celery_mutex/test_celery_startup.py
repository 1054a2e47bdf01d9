"""A real ``celery worker`` checks its tasks as it starts. It refuses to start, naming
each fix, when a task could never be guarded: ``mutex={...}`` without ``base=MutexTask``
(it would take no lock), or no ``MutexTask`` with a lock cache (every call would fail).
Before, the worker started "ready", ran the first kind unguarded, silently, and failed
every call of the second. When only some guarded tasks cannot run, it starts and logs
each of them.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from celery_support.processes import Processes
from workers import wait_until

pytestmark = pytest.mark.integrations

FORGOT = "unguarded: mutex={...} is set, but the task's base is not MutexTask"
NO_CACHE = ": no lock cache configured; set app.conf.mutex_cache"


def _worker_log(case: str, *, refused: bool) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        procs = Processes("celery_support.unguarded_app", Path(tmp))
        try:
            procs.start_worker("w", 1, CM_CASE=case)
            if refused:
                assert procs.procs[0].wait(timeout=60) != 0, "the worker started"
            else:
                wait_until(lambda: "ready." in procs.log_text("w"), 60, "the worker to start")
            return procs.log_text("w")
        finally:
            procs.stop()


@pytest.mark.parametrize("case", ["forgot the base", "no cache"])
def test_a_worker_refuses_tasks_it_could_not_guard(case: str) -> None:
    log = _worker_log(case, refused=True)
    assert "celery_mutex: this worker will not start" in log
    assert (FORGOT in log) == (case == "forgot the base")
    assert ("guarded" + NO_CACHE in log) == (case == "no cache")
    assert "ready." not in log  # it never consumed


def test_a_worker_with_one_guarded_task_that_cannot_run_starts_and_names_it() -> None:
    log = _worker_log("one without a cache", refused=False)
    assert "celery_mutex: every call of this task will fail" in log
    assert "uncached" + NO_CACHE in log
    assert "will not start" not in log
