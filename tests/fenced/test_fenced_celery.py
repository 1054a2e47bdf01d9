"""The Celery guide's fencing recipe in a real ``celery worker -P prefork`` process: a
MutexTask body calls ``fenced_update(..., fence=current_lease().fence)``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from celery_support.processes import Processes
from fenced_support import POSTGRES_URL, drop_table, new_table, pg_row

from simple_mutex import FencedOutError

pytestmark = pytest.mark.integrations


@pytest.fixture
def table() -> Iterator[str]:
    name = new_table()
    yield name
    drop_table(name)


def test_a_mutex_task_body_writes_with_its_lease_fence_and_a_stale_one_fails(
    table: str, tmp_path: Path
) -> None:
    """The task writes with its lease's fence (the row then holds exactly that fence);
    once the row holds a larger fence (a later holder wrote), the task fails with
    FencedOutError, reported through the result backend, and the row is untouched."""
    workers = Processes("celery_support.fenced_app", tmp_path)
    try:
        workers.start_worker("w", 1)
        send = workers.app.send_task
        fence = send("celery_support.fenced_app.set_balance", args=(table, 1, 100)).get(60)
        assert pg_row(table) == ("100", fence)
        with psycopg.connect(POSTGRES_URL, autocommit=True) as db:
            db.execute(f'UPDATE "{table}" SET writer = %s, fence = %s', ("later", 2**62))
        stale = send("celery_support.fenced_app.set_balance", args=(table, 1, 5))
        with pytest.raises(FencedOutError) as info:  # rebuilt from the result backend
            stale.get(60)
        assert "fence 4611686018427387904" in str(info.value)
        assert pg_row(table) == ("later", 2**62)
    finally:
        workers.stop()
