"""Fenced writes through SQLAlchemy (2.0): a ``Connection``, ``Session`` or ``Engine``,
on PostgreSQL (any driver) or SQLite.

PostgreSQL runs the same single statement as the psycopg module. SQLite has no row locks
and no data-modifying CTE; its two statements (``_sql``) run in one transaction that holds
the database's write lock from the UPDATE on, so nothing comes between them. Other
dialects are refused: the single-statement guarantee has not been shown there.

A ``Connection`` or ``Session`` writes inside the caller's transaction (commit it
yourself; a ``FencedOutError`` raised inside ``with session.begin():`` rolls it back).
An ``Engine`` gets a transaction of its own, committed on success. A ``Session``'s
already-loaded objects are not refreshed: ``session.expire_all()`` or re-query.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from simple_mutex.errors import (
    ConstraintTypeError,
    ConstraintValueError,
    FencedOutError,
    MalfunctionError,
)

from . import _sql

DIALECTS = ("postgresql", "sqlite")


def is_sqlalchemy(obj: object) -> bool:
    return type(obj).__module__.split(".", 1)[0] == "sqlalchemy"


def target_of(table: object, columns: list[str]) -> _sql.Target:
    """A name, a ``Table`` or a mapped class as a Target; a Table's columns are checked."""
    if isinstance(table, str):
        return _sql.Target.parse(table)
    import sqlalchemy as sa

    found: Any = table
    if not isinstance(table, sa.Table):
        mapper = sa.inspect(table, raiseerr=False)
        found = getattr(mapper, "local_table", None)
        if not isinstance(found, sa.Table):
            raise ConstraintTypeError(
                f"table must be a table name, an SQLAlchemy Table or a mapped class, got {table!r}"
            )
    unknown = [c for c in columns if c not in found.c]
    if unknown:
        raise ConstraintValueError(
            f"table {found.fullname!r} has no column(s) {unknown}: use column names "
            f"(one of {sorted(found.c.keys())})"
        )
    return _sql.Target(found.name, found.schema)


@contextlib.contextmanager
def connection(conn: Any) -> Iterator[Any]:
    import sqlalchemy as sa
    from sqlalchemy import orm

    if isinstance(conn, sa.Engine):
        with conn.begin() as own:
            yield own
    elif isinstance(conn, orm.Session):
        yield conn.connection()
    elif isinstance(conn, sa.Connection):
        yield conn
    else:
        raise ConstraintTypeError(
            f"an SQLAlchemy Connection, Session or Engine is needed, got {type(conn).__name__}"
        )


def _dialect(conn: Any, operation: str) -> _sql.Dialect:
    name = conn.dialect.name
    if name not in DIALECTS:
        raise ConstraintValueError(
            f"{operation} supports PostgreSQL and SQLite through SQLAlchemy, not {name!r}: "
            "on other databases no one-statement guard is shown correct here"
        )
    return name  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=256)
def _render(dialect: Any, tokens: _sql.Tokens) -> Any:
    """The statement as ``text()``, once per dialect and shape (dialects hash by identity)."""
    import sqlalchemy as sa

    quote = dialect.identifier_preparer.quote_identifier
    text: list[str] = []
    for kind, value in tokens:
        if kind == "sql":
            text.append(value)
        elif kind == "id":
            # text() reads ":name" as a bound parameter, even inside quotes: escape it.
            text.append(quote(value).replace(":", "\\:"))
        else:
            text.append(f":{value}")
    return sa.text("".join(text))


def _execute(
    conn: Any, tokens: _sql.Tokens, params: dict[str, object], operation: str, rows: str
) -> Any:
    import sqlalchemy as sa

    try:
        return conn.execute(_render(conn.dialect, tokens), params)
    except sa.exc.SQLAlchemyError as exc:
        raise MalfunctionError(
            f"{conn.dialect.name} {operation} of {rows} failed: {exc!r}"
        ) from exc


def update(conn: Any, table: object, write: _sql.Write) -> int:
    target = target_of(table, [*write.rows, *write.values, write.fence_column])
    rows = _sql.describe(target, write.rows)
    params = write.params()
    with connection(conn) as c:
        dialect = _dialect(c, "fenced_update")
        tokens = _sql.update(dialect, target, write.shape, tuple(write.values), write.fence_column)
        result = _execute(c, tokens, params, "fenced_update", rows)
        if dialect == "postgresql":
            written, current = result.one()
        else:
            written, current = result.rowcount, None
            if not written:
                stale = _sql.stale_fence(target, write.shape, write.fence_column)
                current = _execute(c, stale, params, "fenced_update", rows).scalar()
        if current is not None:
            raise FencedOutError.refused(dialect, rows, write.fence, int(current))
        return int(written)


def upsert(conn: Any, table: object, write: _sql.Write) -> None:
    target = target_of(table, [*write.rows, *write.values, write.fence_column])
    rows = _sql.describe(target, write.rows)
    with connection(conn) as c:
        dialect = _dialect(c, "fenced_upsert")
        tokens = _sql.upsert(target, write.shape, tuple(write.values), write.fence_column)
        if _execute(c, tokens, write.params(), "fenced_upsert", rows).first() is not None:
            return
        stale = _sql.stale_fence(target, write.shape, write.fence_column)
        params = write.params(with_values=False)
        current = _execute(c, stale, params, "fenced_upsert", rows).scalar()
        current = None if current is None else int(current)
        raise FencedOutError.refused(dialect, rows, write.fence, current)
