"""Fenced writes through a psycopg 3 connection (PostgreSQL).

The statements are in ``_sql``; this module renders them with ``psycopg.sql`` (names as
``Identifier``, values as placeholders) and runs them on the caller's connection, inside
the caller's transaction: the write commits when the caller commits (at once on an
autocommit connection), and the rows stay locked until then.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from simple_mutex.errors import FencedOutError, MalfunctionError

from . import _sql


def _render(conn: Any, statement: _sql.Statement) -> tuple[Any, list[object]]:
    from psycopg import sql

    parts: list[Any] = []
    params: list[object] = []
    for kind, value in statement.tokens:
        if kind == "sql":
            parts.append(sql.SQL(value))
        elif kind == "id":
            # Identifier quotes it; a "%" in it would still read as a placeholder.
            quoted = sql.Identifier(value).as_string(conn)
            parts.append(sql.SQL(quoted.replace("%", "%%")))
        else:
            parts.append(sql.Placeholder())
            params.append(value)
    return sql.Composed(parts), params


def _execute(conn: Any, statement: _sql.Statement, operation: str, rows: str) -> Any:
    import psycopg

    try:
        query, params = _render(conn, statement)  # quoting asks the connection's encoding
        return conn.execute(query, params).fetchone()
    except psycopg.Error as exc:
        raise MalfunctionError(f"postgresql {operation} of {rows} failed: {exc!r}") from exc


def update(
    conn: Any,
    target: _sql.Target,
    where: Mapping[str, object],
    values: Mapping[str, object],
    fence: int,
    fence_column: str,
) -> int:
    rows = _sql.describe(target, where)
    statement = _sql.update("postgresql", target, where, values, fence, fence_column)
    written, current = _execute(conn, statement, "fenced_update", rows)
    if current is not None:
        raise FencedOutError.refused("postgresql", rows, fence, int(current))
    return int(written)


def upsert(
    conn: Any,
    target: _sql.Target,
    key: Mapping[str, object],
    values: Mapping[str, object],
    fence: int,
    fence_column: str,
) -> None:
    rows = _sql.describe(target, key)
    statement = _sql.upsert(target, key, values, fence, fence_column)
    if _execute(conn, statement, "fenced_upsert", rows) is not None:
        return
    # Refused. The statement decided; this read only says by how much, for the error.
    stale = _sql.stale_fence(target, key, fence, fence_column)
    (current,) = _execute(conn, stale, "fenced_upsert", rows)
    current = None if current is None else int(current)
    raise FencedOutError.refused("postgresql", rows, fence, current)
