"""The fenced SQL statements, as tokens any driver renders with its own quoting.

A statement is a tuple of ``("sql", text)``, ``("id", name)`` and ``("param", name)``
tokens, and depends only on the shape of the call (the table, the column names, which
``where`` values are None): the drivers render each shape once and cache it (rendering
costs as much as a round trip). Values travel apart, as named parameters. The psycopg
module renders identifiers with ``psycopg.sql.Identifier`` and ``%(name)s`` placeholders,
the SQLAlchemy module with its dialect's quoting and bound parameters. No name or value
is ever formatted into SQL text here.

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

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from simple_mutex.errors import ConstraintTypeError, ConstraintValueError

from ._common import check_columns, check_fence, check_name

Token = tuple[Literal["sql", "id", "param"], str]
Tokens = tuple[Token, ...]
# The shape of a where / key mapping: each column, and whether its value is None.
Shape = tuple[tuple[str, bool], ...]
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

    def param(self, name: str) -> Statement:
        self.tokens.append(("param", name))
        return self

    def table(self, target: Target) -> Statement:
        if target.schema is not None:
            self.id(target.schema).sql(".")
        return self.id(target.name)

    def conditions(self, where: Shape) -> Statement:
        """``a = :w0 AND b IS NULL ...``: a None in ``where`` means SQL NULL, matched by
        IS NULL (``= NULL`` would match nothing)."""
        for n, (column, is_null) in enumerate(where):
            if n:
                self.sql(" AND ")
            self.id(column)
            if is_null:
                self.sql(" IS NULL")
            else:
                self.sql(" = ").param(f"w{n}")
        return self

    def fence_not_above(self, column: str) -> Statement:
        """``(fence IS NULL OR fence <= :fence)``: NULL is a row from before fences, 0."""
        self.sql("(").id(column).sql(" IS NULL OR ").id(column)
        return self.sql(" <= ").param("fence").sql(")")

    def done(self) -> Tokens:
        return tuple(self.tokens)


@dataclass(frozen=True)
class Write:
    """One fenced write, its arguments checked: ``rows`` names the rows (an update's
    ``where``, an upsert's ``key``; never empty), ``values`` what it writes beside the fence."""

    rows: dict[str, object]
    values: dict[str, object]
    fence: int
    fence_column: str

    @classmethod
    def checked(
        cls, rows_are: str, rows: object, values: object, fence: object, fence_column: object
    ) -> Write:
        """The write, or the ConstraintError of its first bad argument (``rows_are``: the
        parameter's name for the messages)."""
        fence, column = check_fence(fence), check_name(fence_column, "fence_column")
        return cls(
            check_columns(rows_are, rows, column, empty_ok=False),
            check_columns("values", values, column, empty_ok=True),
            fence,
            column,
        )

    @property
    def shape(self) -> Shape:
        return shape(self.rows)

    def params(self, *, with_values: bool = True) -> dict[str, object]:
        return params(self.rows, self.values if with_values else {}, self.fence)


def shape(where: Mapping[str, object]) -> Shape:
    return tuple((column, value is None) for column, value in where.items())


def params(
    where: Mapping[str, object], values: Mapping[str, object], fence: int
) -> dict[str, object]:
    """The named values of a statement built from the same mappings."""
    named: dict[str, object] = {"fence": fence}
    named.update((f"w{n}", value) for n, value in enumerate(where.values()) if value is not None)
    named.update((f"v{n}", value) for n, value in enumerate(values.values()))
    return named


@functools.lru_cache(maxsize=256)
def update(
    dialect: Dialect, target: Target, where: Shape, values: tuple[str, ...], fence_column: str
) -> Tokens:
    """The guarded UPDATE. PostgreSQL: one row (written, current). SQLite: a rowcount."""
    s = Statement()
    if dialect == "postgresql":
        s.sql("WITH matched(fence_seen) AS MATERIALIZED (SELECT ").id(fence_column)
        s.sql(" FROM ").table(target).sql(" WHERE ").conditions(where).sql(" FOR UPDATE), ")
        s.sql("verdict AS (SELECT max(fence_seen) FILTER (WHERE fence_seen > ")
        s.param("fence").sql(") AS current FROM matched), written AS (UPDATE ").table(target)
        _set(s, values, fence_column)
        s.sql(" WHERE ").conditions(where).sql(" AND ").fence_not_above(fence_column)
        s.sql(" AND (SELECT current FROM verdict) IS NULL RETURNING 1) ")
        s.sql("SELECT (SELECT count(*) FROM written), (SELECT current FROM verdict)")
        return s.done()
    s.sql("UPDATE ").table(target)
    _set(s, values, fence_column)
    s.sql(" WHERE ").conditions(where).sql(" AND ").fence_not_above(fence_column)
    s.sql(" AND NOT EXISTS (SELECT 1 FROM ").table(target).sql(" WHERE ").conditions(where)
    return s.sql(" AND ").id(fence_column).sql(" > ").param("fence").sql(")").done()


@functools.lru_cache(maxsize=256)
def stale_fence(target: Target, where: Shape, column: str) -> Tokens:
    """The largest fence above ours among the rows ``where`` names (NULL: none)."""
    s = Statement().sql("SELECT max(").id(column).sql(") FROM ").table(target).sql(" WHERE ")
    return s.conditions(where).sql(" AND ").id(column).sql(" > ").param("fence").done()


@functools.lru_cache(maxsize=256)
def upsert(target: Target, key: Shape, values: tuple[str, ...], fence_column: str) -> Tokens:
    """The guarded INSERT ... ON CONFLICT; returns a row only when it wrote. Its named
    values are those of ``params(key, values, fence)``."""
    columns = [*(c for c, _ in key), *values, fence_column]
    names = [*(f"w{n}" for n in range(len(key))), *(f"v{n}" for n in range(len(values)))]
    s = Statement().sql("INSERT INTO ").table(target).sql(" AS fenced_target (")
    for n, column in enumerate(columns):
        s.sql(", " if n else "").id(column)
    s.sql(") VALUES (")
    for n, name in enumerate([*names, "fence"]):
        s.sql(", " if n else "").param(name)
    s.sql(") ON CONFLICT (")
    for n, (column, _) in enumerate(key):
        s.sql(", " if n else "").id(column)
    s.sql(") DO UPDATE SET ")
    for n, column in enumerate([*values, fence_column]):
        s.sql(", " if n else "").id(column).sql(" = EXCLUDED.").id(column)
    s.sql(" WHERE ").id("fenced_target").sql(".").id(fence_column).sql(" IS NULL OR ")
    s.id("fenced_target").sql(".").id(fence_column).sql(" <= EXCLUDED.").id(fence_column)
    return s.sql(" RETURNING 1").done()


def _set(s: Statement, values: tuple[str, ...], fence_column: str) -> None:
    s.sql(" SET ")
    for n, column in enumerate(values):
        s.id(column).sql(" = ").param(f"v{n}").sql(", ")
    s.id(fence_column).sql(" = ").param("fence")


def describe(target: Target, where: Mapping[str, object]) -> str:
    """How errors name the rows: ``orders where {'id': 7}``."""
    return f"{target.label()} where {dict(where)!r}"
