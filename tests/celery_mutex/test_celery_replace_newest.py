"""``on_busy="replace"`` for Celery: a replaced call that retries itself (here
``autoretry_for`` the lost lease) never takes the key back from the call that replaced
it. Real ``celery worker -P prefork`` processes, as in ``test_celery_replace.py``.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import test_celery_replace
from workers import wait_until

# isort: split
from celery_mutex import is_skipped

pytestmark = pytest.mark.integrations


workers = test_celery_replace.workers  # its two prefork workers, for this module


TASK = "celery_support.replace_app.writer_retrying"


def _replaced(workers: Any) -> tuple[str, Any, Any, Any]:
    """A holder (300 writes) replaced by a newer call (20 writes), which finished; the
    holder's retry ended. Returns the doc, both calls and the holder's final value."""
    doc = uuid.uuid4().hex[:8]
    old = workers.app.send_task(TASK, args=(doc, "old", 300))
    workers.first_write(doc, "old")
    new = workers.app.send_task(TASK, args=(doc, "new", 20))
    assert new.get(timeout=60) == "new"
    return doc, old, new, old.get(timeout=60)


def test_a_replaced_calls_retry_finishes_superseded(workers):
    """The holder retries itself on the lost lease (1 s countdown, the newer call's 20
    writes done by then): its retry finds the mark of the call that replaced it and ends
    with the skip marker (reason superseded, the holder named), its body started once; the
    store keeps the newer call's last write. Without the mark the retry took the key
    back and wrote its older data over the newer call's."""
    doc, _, new, value = _replaced(workers)
    assert is_skipped(value), value
    assert value["reason"] == "superseded"
    assert value["holder"].endswith(f"[{new.id}]")
    assert [r["name"] for r in workers.rows("started", doc)] == ["old", "new"]
    workers.takeover(doc)
    workers.finished_alone(doc, "new", 20)
    wait_until(lambda: not workers.locks.locked(f"doc.{doc}"), 10, "the key to be free")


def test_a_new_call_reusing_a_replaced_calls_task_id_runs(workers):
    """Only a retry reads the mark: a new call sent later with the replaced call's
    ``task_id`` (de-duplication by id) runs."""
    doc, old, _, value = _replaced(workers)
    assert is_skipped(value)  # its retry gave way
    workers.app.send_task(TASK, args=(doc, "again", 5), task_id=old.id)
    # Read from its rows: the client's backend keeps the id's first ready result.
    done = lambda: [r["name"] for r in workers.rows("done", doc)]  # noqa: E731
    wait_until(lambda: "again" in done(), 60, "the new call to run to its end")
    assert done() == ["new", "again"]
    assert workers.stored(doc)[0] == b"again.4"
