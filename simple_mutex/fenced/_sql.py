"""The fenced SQL statements, as tokens any driver renders with its own quoting.

A statement is a list of ``("sql", text)``, ``("id", name)`` and ``("param", value)``:
the psycopg module renders identifiers with ``psycopg.sql.Identifier`` and values as
``%s`` placeholders, the SQLAlchemy module with its dialect's identifier quoting and
bound parameters. No name or value is ever formatted into SQL text here.

**NULL in the fence column** is a row written before the table adopted fences: it counts
as fence 0, so any fenced write is accepted there and stores its fence.

PostgreSQL, ``fenced_update`` (one statement)::

    WITH matched(fence_seen) AS MATERIALIZED (
        SELECT fence FROM t WHERE <where> FOR UPDATE),          -- lock, read the newest
    verdict AS (
        SELECT max(fence_seen) FILTER (WHERE fence_seen > :f) AS current FROM matched),
    written AS (
        UPDATE t SET <values>, fence = :f
        WHERE <where> AND (fence IS NULL OR fence <= :f)
          AND (SELECT current FROM verdict) IS NULL              -- all rows or none
        RETURNING 1)
    SELECT (SELECT count(*) FROM written), (SELECT current FROM verdict)

Why the lock comes first: a plain ``UPDATE ... WHERE fence <= :f`` plus a read of the
stale rows in the same statement reads them in the statement's snapshot. A writer with a
larger fence that commits while our UPDATE waits for its row lock makes the UPDATE skip
the row (READ COMMITTED re-checks it), yet the snapshot still shows the old, smaller
fence: "no row matched" would be reported for a stale write. ``FOR UPDATE`` returns the
newest version of each row and holds it, so the verdict and the UPDATE (gated on the
verdict, an InitPlan evaluated before it scans) judge the same, newest fences. A ``where``
that matches several rows writes all of them or, when any holds a larger fence, none.

SQLite (through SQLAlchemy): two statements in the caller's transaction, both under the
database's single write lock (the UPDATE takes it, even when it writes nothing), so no
writer can come between them::

    UPDATE t SET ... WHERE <where> AND (fence IS NULL OR fence <= :f)
      AND NOT EXISTS (SELECT 1 FROM t WHERE <where> AND fence > :f)
    SELECT max(fence) FROM t WHERE <where> AND fence > :f       -- only when 0 rows written

``fenced_upsert`` (PostgreSQL and SQLite, one statement)::

    INSERT INTO t AS fenced_target (<key>, <values>, fence) VALUES (...)
    ON CONFLICT (<key>) DO UPDATE SET <values> = EXCLUDED..., fence = EXCLUDED.fence
    WHERE fenced_target.fence IS NULL OR fenced_target.fence <= EXCLUDED.fence
    RETURNING 1

No row returned means the stored fence was larger (the row stays locked by the statement
on PostgreSQL); a second read, only on that path, says how large, for the error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from simple_mutex.errors import ConstraintTypeError, ConstraintValueError

from ._common import check_name

Token = tuple[Literal["sql", "id", "param"], Any]
Dialect = Literal["postgresql", "sqlite"]


@dataclass(frozen=True)
class Target:
    """A table: its name and, when qualified, its schema."""

    name: str
    schema: str | None = None

    @classmethod
    def parse(cls, table: object) -> Target:
        """``"table"`` or ``"schema.table"``; each part is quoted when rendered."""
        if not isinstance(table, str):
            raise ConstraintTypeError(
                f"table must be a table name ('orders' or 'schema.orders'), an SQLAlchemy "
                f"Table or a mapped class, got {type(table).__name__}"
            )
        parts = table.split(".")
        if len(parts) > 2:
            raise ConstraintValueError(
                f"table {table!r} has more than one dot: give 'table' or 'schema.table' "
                "(an SQLAlchemy Table(..., schema=...) for a name with dots in it)"
            )
        if len(parts) == 2:
            return cls(check_name(parts[1], "table"), check_name(parts[0], "schema"))
        return cls(check_name(parts[0], "table"))

    def label(self) -> str:
        return self.name if self.schema is None else f"{self.schema}.{self.name}"


class Statement:
    """Tokens of one SQL statement."""

    def __init__(self) -> None:
        self.tokens: list[Token] = []

    def sql(self, text: str) -> Statement:
        self.tokens.append(("sql", text))
        return self

    def id(self, name: str) -> Statement:
        self.tokens.append(("id", name))
        return self

    def param(self, value: object) -> Statement:
        self.tokens.append(("param", value))
        return self

    def table(self, target: Target) -> Statement:
        if target.schema is not None:
            self.id(target.schema).sql(".")
        return self.id(target.name)

    def conditions(self, where: Mapping[str, object], prefix: str | None = None) -> Statement:
        """``a = :v AND b IS NULL ...``: a None in ``where`` means SQL NULL, matched by
        IS NULL (``= NULL`` would match nothing)."""
        for n, (column, value) in enumerate(where.items()):
            if n:
                self.sql(" AND ")
            if prefix is not None:
                self.id(prefix).sql(".")
            self.id(column)
            if value is None:
                self.sql(" IS NULL")
            else:
                self.sql(" = ").param(value)
        return self

    def fence_not_above(self, column: str, fence: int, prefix: str | None = None) -> Statement:
        """``(fence IS NULL OR fence <= :f)``: NULL is a row from before fences, fence 0."""

        def ref() -> None:
            if prefix is not None:
                self.id(prefix).sql(".")
            self.id(column)

        self.sql("(")
        ref()
        self.sql(" IS NULL OR ")
        ref()
        self.sql(" <= ").param(fence)
        return self.sql(")")


def update(
    dialect: Dialect,
    target: Target,
    where: Mapping[str, object],
    values: Mapping[str, object],
    fence: int,
    fence_column: str,
) -> Statement:
    """The guarded UPDATE. PostgreSQL: one row (written, current). SQLite: a rowcount."""
    s = Statement()
    if dialect == "postgresql":
        s.sql("WITH matched(fence_seen) AS MATERIALIZED (SELECT ").id(fence_column)
        s.sql(" FROM ").table(target).sql(" WHERE ").conditions(where).sql(" FOR UPDATE), ")
        s.sql("verdict AS (SELECT max(fence_seen) FILTER (WHERE fence_seen > ")
        s.param(fence).sql(") AS current FROM matched), written AS (UPDATE ").table(target)
        _set(s, values, fence_column, fence)
        s.sql(" WHERE ").conditions(where).sql(" AND ").fence_not_above(fence_column, fence)
        s.sql(" AND (SELECT current FROM verdict) IS NULL RETURNING 1) ")
        return s.sql("SELECT (SELECT count(*) FROM written), (SELECT current FROM verdict)")
    s.sql("UPDATE ").table(target)
    _set(s, values, fence_column, fence)
    s.sql(" WHERE ").conditions(where).sql(" AND ").fence_not_above(fence_column, fence)
    s.sql(" AND NOT EXISTS (SELECT 1 FROM ").table(target).sql(" WHERE ").conditions(where)
    return s.sql(" AND ").id(fence_column).sql(" > ").param(fence).sql(")")


def stale_fence(target: Target, where: Mapping[str, object], fence: int, column: str) -> Statement:
    """The largest fence above ours among the rows ``where`` names (NULL: none)."""
    s = Statement().sql("SELECT max(").id(column).sql(") FROM ").table(target).sql(" WHERE ")
    return s.conditions(where).sql(" AND ").id(column).sql(" > ").param(fence)


def upsert(
    target: Target,
    key: Mapping[str, object],
    values: Mapping[str, object],
    fence: int,
    fence_column: str,
) -> Statement:
    """The guarded INSERT ... ON CONFLICT; returns a row only when it wrote."""
    row = {**key, **values, fence_column: fence}
    s = Statement().sql("INSERT INTO ").table(target).sql(" AS fenced_target (")
    for n, column in enumerate(row):
        s.sql(", " if n else "").id(column)
    s.sql(") VALUES (")
    for n, value in enumerate(row.values()):
        s.sql(", " if n else "").param(value)
    s.sql(") ON CONFLICT (")
    for n, column in enumerate(key):
        s.sql(", " if n else "").id(column)
    s.sql(") DO UPDATE SET ")
    for n, column in enumerate([*values, fence_column]):
        s.sql(", " if n else "").id(column).sql(" = EXCLUDED.").id(column)
    s.sql(" WHERE ").id("fenced_target").sql(".").id(fence_column).sql(" IS NULL OR ")
    s.id("fenced_target").sql(".").id(fence_column).sql(" <= EXCLUDED.").id(fence_column)
    return s.sql(" RETURNING 1")


def _set(s: Statement, values: Mapping[str, object], fence_column: str, fence: int) -> None:
    s.sql(" SET ")
    for column, value in values.items():
        s.id(column).sql(" = ").param(value).sql(", ")
    s.id(fence_column).sql(" = ").param(fence)


def describe(target: Target, where: Mapping[str, object]) -> str:
    """How errors name the rows: ``orders where {'id': 7}``."""
    return f"{target.label()} where {dict(where)!r}"
