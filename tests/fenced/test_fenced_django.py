"""simple_mutex.fenced.django on a real PostgreSQL through Django's psycopg 3 backend:
missing versus stale, equal fences, NULL as 0, several rows all or none, the upsert."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from fenced_support import POSTGRES_URL, django_model, drop_table, new_table

from simple_mutex import ConstraintTypeError, ConstraintValueError, FencedOutError
from simple_mutex.fenced.django import fenced_update_queryset, fenced_upsert_model

pytestmark = pytest.mark.backends


@pytest.fixture
def table() -> Iterator[str]:
    name = new_table("fenced_dj")
    yield name
    from django.db import connections

    connections.close_all()  # Django's session would keep the table busy
    drop_table(name)


def rows(table: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        return conn.execute(f'SELECT id, writer, fence FROM "{table}" ORDER BY id').fetchall()


def test_queryset_update_missing_equal_null_and_stale(table):
    """NULL counts as 0; an equal fence is accepted; a missing row is 0; a larger stored
    fence raises FencedOutError with both fences and leaves the row alone."""
    model = django_model(table)
    one = model.objects.filter(id=1)
    assert fenced_update_queryset(one, {"writer": "a"}, fence=5) == 1
    assert fenced_update_queryset(one, {"writer": "b"}, fence=5) == 1
    assert fenced_update_queryset(model.objects.filter(id=99), {"writer": "x"}, fence=9) == 0
    with pytest.raises(FencedOutError) as info:
        fenced_update_queryset(one, {"writer": "stale"}, fence=4)
    assert (info.value.fence, info.value.current, info.value.store) == (4, 5, "django")
    assert rows(table) == [(1, "b", 5)]


def test_queryset_of_several_rows_writes_all_or_none(table):
    """One row with a larger fence keeps every row of the queryset unwritten."""
    model = django_model(table)
    model.objects.create(id=2, writer="nobody", fence=3)
    model.objects.create(id=3, writer="nobody", fence=8)
    everyone = model.objects.all()
    with pytest.raises(FencedOutError) as info:
        fenced_update_queryset(everyone, {"writer": "late"}, fence=5)
    assert info.value.current == 8
    assert rows(table) == [(1, "nobody", None), (2, "nobody", 3), (3, "nobody", 8)]
    assert fenced_update_queryset(everyone, {"writer": "all"}, fence=8) == 3


def test_upsert_creates_updates_and_refuses(table):
    """Create when absent, update on an equal or larger fence, refuse a smaller one."""
    model = django_model(table)
    fenced_upsert_model(model, {"id": 5}, {"writer": "new"}, fence=4)
    fenced_upsert_model(model, {"id": 5}, {"writer": "again"}, fence=4)
    fenced_upsert_model(model, {"id": 1}, {"writer": "over NULL"}, fence=1)
    with pytest.raises(FencedOutError) as info:
        fenced_upsert_model(model, {"id": 5}, {"writer": "stale"}, fence=3)
    assert info.value.current == 4
    assert rows(table) == [(1, "over NULL", 1), (5, "again", 4)]


def test_bad_input(table):
    model = django_model(table)
    with pytest.raises(ConstraintTypeError, match="QuerySet"):
        fenced_update_queryset([], {"writer": "x"}, fence=1)
    with pytest.raises(ConstraintValueError, match="fence="):
        fenced_update_queryset(model.objects.all(), {"fence": 1}, fence=1)
    with pytest.raises(ConstraintTypeError, match="model class"):
        fenced_upsert_model(object, {"id": 1}, {}, fence=1)
