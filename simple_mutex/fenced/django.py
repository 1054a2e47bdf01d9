"""Fenced writes through the Django ORM: a queryset, or a model and a key.

Django has no one-statement form of the lock-then-judge statement the psycopg module runs,
so these run **two statements in one transaction** (``transaction.atomic``, a savepoint
inside yours): ``SELECT ... FOR UPDATE`` of the rows, which locks them and reads their
newest fences (PostgreSQL, MySQL, Oracle), then, only if none is larger than ours, the
``UPDATE`` (or ``INSERT``). No writer can come between the two on those databases. SQLite
ignores ``FOR UPDATE``; there, by its locking rules (not tested here), a concurrent
writer makes the write fail loudly (``database is locked``, a ``MalfunctionError``),
never pass silently.

The rules are the package's: an equal fence is accepted, a NULL fence counts as 0, no
matching row returns 0 (missing is not stale), a larger fence raises ``FencedOutError``
and writes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from simple_mutex.errors import ConstraintTypeError, FencedOutError, MalfunctionError

from ._common import check_columns, check_fence, check_name


def _refuse_if_stale(fences: list[Any], fence: int, where: str) -> None:
    current = max((f for f in fences if f is not None and f > fence), default=None)
    if current is not None:
        raise FencedOutError.refused("django", where, fence, int(current))


def fenced_update_queryset(
    queryset: Any, values: Mapping[str, object], *, fence: int, fence_field: str = "fence"
) -> int:
    """``queryset.update(**values, fence=fence)`` if no row of ``queryset`` holds a fence
    above ``fence``; returns the rows written (0: none matched). Raises ``FencedOutError``
    (and writes none) if one does."""
    from django.db import DatabaseError, transaction  # type: ignore[import-untyped, unused-ignore]
    from django.db.models import Q, QuerySet  # type: ignore[import-untyped, unused-ignore]

    if not isinstance(queryset, QuerySet):
        raise ConstraintTypeError(
            f"queryset must be a Django QuerySet (Model.objects.filter(...)), got "
            f"{type(queryset).__name__}"
        )
    fence, fence_field = check_fence(fence), check_name(fence_field, "fence_field")
    values = check_columns("values", values, fence_field, empty_ok=True)
    where = f"{queryset.model._meta.label} rows {queryset.query.where}"
    try:
        with transaction.atomic(using=queryset.db):
            locked = list(queryset.select_for_update().values_list(fence_field, flat=True))
            if not locked:
                return 0
            _refuse_if_stale(locked, fence, where)
            not_above = Q(**{f"{fence_field}__isnull": True}) | Q(**{f"{fence_field}__lte": fence})
            written: int = queryset.filter(not_above).update(**values, **{fence_field: fence})
            return written
    except DatabaseError as exc:
        raise MalfunctionError(f"django fenced_update_queryset of {where} failed: {exc!r}") from exc


def fenced_upsert_model(
    model: Any,
    key: Mapping[str, object],
    values: Mapping[str, object],
    *,
    fence: int,
    fence_field: str = "fence",
    using: str | None = None,
) -> None:
    """Create the ``model`` row ``key`` + ``values`` + ``fence``, or update the one with
    that ``key`` (unique) unless it holds a larger fence; raises ``FencedOutError`` if it
    does. A create that loses a race to another creator is judged against that row."""
    from django.db import DatabaseError, IntegrityError, router, transaction  # type: ignore[import-untyped, unused-ignore]
    from django.db.models import Model  # type: ignore[import-untyped, unused-ignore]

    if not (isinstance(model, type) and issubclass(model, Model)):
        raise ConstraintTypeError(f"model must be a Django model class, got {model!r}")
    manager: Any = model._default_manager  # type: ignore[attr-defined]
    label: str = model._meta.label  # type: ignore[attr-defined]
    fence, fence_field = check_fence(fence), check_name(fence_field, "fence_field")
    key = check_columns("key", key, fence_field, empty_ok=False)
    values = check_columns("values", values, fence_field, empty_ok=True)
    db = using or router.db_for_write(model)
    where = f"{label} {dict(key)!r}"
    rows = manager.using(db).filter(**key)
    try:
        with transaction.atomic(using=db):
            for _ in range(2):  # the second round only after losing a create race
                locked = list(rows.select_for_update().values_list(fence_field, flat=True))
                if locked:
                    _refuse_if_stale(locked, fence, where)
                    rows.update(**values, **{fence_field: fence})
                    return
                try:
                    with transaction.atomic(using=db):  # a savepoint: a lost race undoes it
                        manager.using(db).create(**key, **values, **{fence_field: fence})
                    return
                except IntegrityError:
                    continue  # someone created it first: lock and judge theirs
            raise MalfunctionError(f"django fenced_upsert_model of {where}: the row came and went")
    except DatabaseError as exc:
        raise MalfunctionError(f"django fenced_upsert_model of {where} failed: {exc!r}") from exc
