"""rq_mutex's check of the RQ internals it relies on (``rq_mutex.host``): a changed RQ
fails the import, naming what changed and the RQ version, instead of breaking the line or
the dead-horse recovery silently."""

from __future__ import annotations

from typing import Any

import pytest
import rq
from rq import Queue
from rq.worker import Worker

from rq_mutex import host
from simple_mutex import ConstraintError

pytestmark = pytest.mark.fast


def test_the_installed_rq_has_what_rq_mutex_relies_on() -> None:
    host.check_host()  # as at import


def test_a_reshaped_push_fails_naming_it_and_the_rq_version(monkeypatch) -> None:
    def _enqueue_job(self: Any, pipeline: Any, job: Any) -> Any:  # arguments swapped
        raise AssertionError("never called")

    monkeypatch.setattr(Queue, "_enqueue_job", _enqueue_job)
    with pytest.raises(
        ConstraintError, match=r"Queue\._enqueue_job\(job, pipeline\): changed"
    ) as e:
        host.check_host()
    assert f"RQ {rq.__version__}" in str(e.value)


def test_a_missing_hook_fails_naming_it(monkeypatch) -> None:
    monkeypatch.delattr(Worker, "wait_for_horse")
    with pytest.raises(ConstraintError, match=r"Worker\.wait_for_horse\(\): missing"):
        host.check_host()


def test_importing_rq_mutex_changes_nothing_of_rqs() -> None:
    """What a user opts into is named (``rq_mutex.Queue``, ``rq_mutex.Worker``): after the
    import, every method rq_mutex overrides is still RQ's own, defined in RQ's modules."""
    import rq_mutex

    for cls, name in [
        (Queue, "create_job"),
        (Queue, "enqueue_many"),
        (Queue, "_enqueue_job"),
        (Worker, "fork_work_horse"),
        (Worker, "wait_for_horse"),
        (rq.SpawnWorker, "fork_work_horse"),
    ]:
        found = cls.__dict__[name]
        assert found.__module__.startswith("rq."), (cls, name, found.__module__)
        assert not hasattr(found, "__wrapped__"), (cls, name)
    assert issubclass(rq_mutex.Queue, Queue)
    assert rq_mutex.Queue.__dict__["create_job"].__module__ == "rq_mutex.queue"
