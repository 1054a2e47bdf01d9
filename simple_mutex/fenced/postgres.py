"""Fenced writes through a psycopg 3 connection (PostgreSQL).

The statements are in ``_sql``; this module renders them with ``psycopg.sql`` (names as
``Identifier``, values as placeholders) and runs them on the caller's connection, inside
the caller's transaction: the write commits when the caller commits (at once on an
autocommit connection), and the rows stay locked until then.
"""

from __future__ import annotations

from typing import Any

from simple_mutex.errors import ConstraintTypeError, FencedOutError, MalfunctionError

from . import _sql

# Rendered statements by (tokens, client encoding): quoting depends on nothing else.
_RENDERED: dict[tuple[_sql.Tokens, str], str] = {}


def _render(conn: Any, tokens: _sql.Tokens) -> str:
    cached = _RENDERED.get((tokens, conn.info.encoding))
    if cached is not None:
        return cached
    from psycopg import sql

    parts: list[Any] = []
    for kind, value in tokens:
        if kind == "sql":
            parts.append(sql.SQL(value))
        elif kind == "id":
            # Identifier quotes it; a "%" in it would still read as a placeholder.
            quoted = sql.Identifier(value).as_string(conn)
            parts.append(sql.SQL(quoted.replace("%", "%%")))
        else:
            parts.append(sql.Placeholder(value))
    text: str = sql.Composed(parts).as_string(conn)
    if len(_RENDERED) >= 256:
        _RENDERED.clear()  # bounded: shapes are few in a real program
    _RENDERED[(tokens, conn.info.encoding)] = text
    return text


def _execute(
    conn: Any, tokens: _sql.Tokens, params: dict[str, object], operation: str, rows: str
) -> Any:
    import psycopg

    if not isinstance(conn, psycopg.Connection):
        raise ConstraintTypeError(
            f"{operation} needs a blocking psycopg.Connection, got {type(conn).__name__} "
            "(an AsyncConnection or a pool is not supported: take a connection from the pool)"
        )
    try:
        query = _render(conn, tokens)  # quoting asks the connection for its encoding
        return conn.execute(query, params).fetchone()
    except psycopg.Error as exc:
        raise MalfunctionError(f"postgresql {operation} of {rows} failed: {exc!r}") from exc


def update(conn: Any, target: _sql.Target, write: _sql.Write) -> int:
    tokens = _sql.update("postgresql", target, write.shape, tuple(write.values), write.fence_column)
    rows = _sql.describe(target, write.rows)
    written, current = _execute(conn, tokens, write.params(), "fenced_update", rows)
    if current is not None:
        raise FencedOutError.refused("postgresql", rows, write.fence, int(current))
    return int(written)


def upsert(conn: Any, target: _sql.Target, write: _sql.Write) -> None:
    rows = _sql.describe(target, write.rows)
    tokens = _sql.upsert(target, write.shape, tuple(write.values), write.fence_column)
    if _execute(conn, tokens, write.params(), "fenced_upsert", rows):
        return
    # Refused. The statement decided; this read only says by how much, for the error.
    stale = _sql.stale_fence(target, write.shape, write.fence_column)
    (current,) = _execute(conn, stale, write.params(with_values=False), "fenced_upsert", rows)
    current = None if current is None else int(current)
    raise FencedOutError.refused("postgresql", rows, write.fence, current)
