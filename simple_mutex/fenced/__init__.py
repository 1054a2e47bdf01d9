"""Fenced writes: the store itself refuses a holder whose lease is gone.

A lease lock alone cannot stop a holder paused past its lease (a GC pause, a SIGSTOP, a
VM migration) from writing after the next holder has. Every grant carries a fence that
only grows (``lease.fence``); these helpers write it beside your data and, in one atomic
step of the store, refuse a write whose fence is lower than the one stored. An equal fence
is accepted (one holder may write many times). A refusal raises ``FencedOutError``, a
``SimpleMutexLeaseExpiredError``.

* SQL: ``fenced_update`` / ``fenced_upsert`` for a psycopg 3 connection, or an SQLAlchemy
  ``Connection`` / ``Session`` / ``Engine`` (PostgreSQL, SQLite); ``fenced_update_queryset``
  / ``fenced_upsert_model`` (``simple_mutex.fenced.django``) for Django.
* Redis: ``fenced_set`` / ``fenced_get``.  S3: ``fenced_put``.

No module here imports a driver until it is called with that driver's object.
Guide: docs/guides/fencing.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from simple_mutex.current import current_lease
from simple_mutex.errors import ConstraintTypeError, ConstraintValueError, FencedOutError

from . import _sql
from .redis import fenced_get, fenced_set
from .s3 import fenced_put

__all__ = [
    "FencedOutError",
    "current_lease",
    "fenced_get",
    "fenced_put",
    "fenced_set",
    "fenced_update",
    "fenced_upsert",
]


def _driver(conn: object) -> str:
    top = type(conn).__module__.split(".", 1)[0]
    if top in ("psycopg", "sqlalchemy"):
        return top
    raise ConstraintTypeError(
        "conn must be a psycopg (3) Connection, or an SQLAlchemy Connection, Session or "
        f"Engine, got {type(conn).__module__}.{type(conn).__qualname__} (for Django use "
        "simple_mutex.fenced.django)"
    )


def fenced_update(
    conn: Any,
    table: object,
    where: Mapping[str, object],
    values: Mapping[str, object],
    *,
    fence: int,
    fence_column: str = "fence",
) -> int:
    """Write ``values`` and ``fence`` into the rows matching ``where`` (column -> value, all
    equal; None matches NULL), in one statement, only if none holds a fence above ours.

    Returns the rows written: 0 when no row matches (missing is not stale). Raises
    ``FencedOutError`` (``.current``: the largest stored fence) when a matching row holds
    a larger fence; then no row is written, even those with smaller fences. A NULL fence
    column (a row from before fences) counts as 0. ``table``: ``"name"``,
    ``"schema.name"``, or for SQLAlchemy a ``Table`` or mapped class.
    """
    write = _sql.Write.checked("where", where, values, fence, fence_column)
    if _driver(conn) == "psycopg":
        from . import postgres

        return postgres.update(conn, _sql.Target.parse(table), write)
    from . import sqlalchemy

    return sqlalchemy.update(conn, table, write)


def fenced_upsert(
    conn: Any,
    table: object,
    key: Mapping[str, object],
    values: Mapping[str, object],
    *,
    fence: int,
    fence_column: str = "fence",
) -> None:
    """Insert the row ``key`` + ``values`` + ``fence``, or update the existing row with that
    ``key`` (its columns must carry a unique index) unless it holds a larger fence, in one
    ``INSERT ... ON CONFLICT ... DO UPDATE ... WHERE`` statement; raises ``FencedOutError``
    if it does. A NULL fence column counts as 0."""
    write = _sql.Write.checked("key", key, values, fence, fence_column)
    if any(value is None for value in write.rows.values()):
        raise ConstraintValueError(
            f"key {write.rows!r} has a None: NULL never conflicts, so each call would insert "
            "a new row"
        )
    overlap = sorted(set(write.rows) & set(write.values))
    if overlap:
        raise ConstraintValueError(
            f"columns {overlap} are in both key and values: keep them in key only"
        )
    if _driver(conn) == "psycopg":
        from . import postgres

        postgres.upsert(conn, _sql.Target.parse(table), write)
        return
    from . import sqlalchemy

    sqlalchemy.upsert(conn, table, write)
