"""Stores for the fenced-write suites: a fresh PostgreSQL table, Redis key or S3 object
per test, and one ``write(fence, writer) -> bool`` per guard (True accepted, False
refused with a FencedOutError) plus the plain, unguarded write each guard replaces.

Every writer is built from plain strings, so a forked or spawned process builds its own
connection (none crosses a fork)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import psycopg

from simple_mutex import FencedOutError
from simple_mutex.fenced import fenced_get, fenced_put, fenced_set, fenced_update

POSTGRES_URL = os.environ.get("POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = "redis://127.0.0.1:6379/0"
SA_URL = POSTGRES_URL.replace("postgresql://", "postgresql+psycopg://", 1)
S3_BUCKET = "fenced-tests"
S3_KEYS = {"aws_access_key_id": "simplemutex", "aws_secret_access_key": "simplemutexsecret"}

Write = Callable[[int, str], bool]


def new_table(prefix: str = "fenced") -> str:
    """A table (id int primary key, writer text, fence bigint) holding row id 1 (fence NULL:
    written before fences)."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f'CREATE TABLE "{name}" (id int PRIMARY KEY, writer text, fence bigint)')
        conn.execute(f"INSERT INTO \"{name}\" VALUES (1, 'nobody', NULL)")
    return name


def drop_table(name: str) -> None:
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f'DROP TABLE IF EXISTS "{name}"')


def pg_row(table: str) -> tuple[str, int | None]:
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        row = conn.execute(f'SELECT writer, fence FROM "{table}" WHERE id = 1').fetchone()
    assert row is not None
    return row[0], row[1]


def s3_client(endpoint: str) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **S3_KEYS)


def _refused(write: Callable[[], object]) -> bool:
    try:
        write()
    except FencedOutError:
        return False
    return True


def writer(kind: str, target: str) -> Write:
    """The write of ``kind`` into ``target`` (a table, a Redis key, an S3 endpoint#key)."""
    if kind in ("psycopg", "psycopg-plain"):
        conn = psycopg.connect(POSTGRES_URL, autocommit=True)
        if kind == "psycopg-plain":
            sql = f'UPDATE "{target}" SET writer = %s, fence = %s WHERE id = 1'
            return lambda fence, who: bool(conn.execute(sql, (who, fence)).rowcount)
        where = {"id": 1}
        return lambda fence, who: _refused(
            lambda: fenced_update(conn, target, where, {"writer": who}, fence=fence)
        )
    if kind == "sqlalchemy-core":
        import sqlalchemy as sa

        engine = sa.create_engine(SA_URL, poolclass=sa.pool.NullPool)
        table = sa.Table(
            target, sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True),
            sa.Column("writer", sa.Text), sa.Column("fence", sa.BigInteger),
        )  # fmt: skip
        return lambda fence, who: _refused(
            lambda: fenced_update(engine, table, {"id": 1}, {"writer": who}, fence=fence)
        )
    if kind == "sqlalchemy-orm":
        import sqlalchemy as sa
        from sqlalchemy import orm

        class Base(orm.DeclarativeBase):
            pass

        # Built without annotations: they would be resolved at module level.
        Row = type(
            "Row", (Base,),
            {"__tablename__": target, "id": orm.mapped_column(sa.Integer, primary_key=True),
             "writer": orm.mapped_column(sa.Text), "fence": orm.mapped_column(sa.BigInteger)},
        )  # fmt: skip

        engine = sa.create_engine(SA_URL, poolclass=sa.pool.NullPool)

        def orm_write(fence: int, who: str) -> bool:
            with orm.Session(engine) as session, session.begin():
                return _refused(
                    lambda: fenced_update(session, Row, {"id": 1}, {"writer": who}, fence=fence)
                )

        return orm_write
    if kind in ("redis", "redis-plain"):
        import redis

        client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
        if kind == "redis-plain":
            return lambda fence, who: bool(client.hset(target, mapping={"v": who, "f": fence}) >= 0)
        return lambda fence, who: _refused(lambda: fenced_set(client, target, who, fence=fence))
    if kind in ("s3", "s3-plain"):
        endpoint, key = target.split("#", 1)
        s3 = s3_client(endpoint)
        if kind == "s3-plain":

            def plain_put(fence: int, who: str) -> bool:
                meta = {"fence": str(fence)}
                s3.put_object(Bucket=S3_BUCKET, Key=key, Body=who.encode(), Metadata=meta)
                return True

            return plain_put
        return lambda fence, who: _refused(lambda: fenced_put(s3, S3_BUCKET, key, who, fence=fence))
    if kind == "django":
        from simple_mutex.fenced.django import fenced_update_queryset

        rows = django_model(target).objects.filter(id=1)
        return lambda fence, who: _refused(
            lambda: fenced_update_queryset(rows, {"writer": who}, fence=fence)
        )
    raise AssertionError(kind)


def final_state(kind: str, target: str) -> tuple[str, int | None]:
    """(writer, fence) the store holds now."""
    if kind.startswith(("psycopg", "sqlalchemy", "django")):
        return pg_row(target)
    if kind.startswith("redis"):
        import redis

        value, fence = fenced_get(redis.Redis.from_url(REDIS_URL), target)
        return (value or b"").decode(), fence
    endpoint, key = target.split("#", 1)
    s3 = s3_client(endpoint)
    got = s3.get_object(Bucket=S3_BUCKET, Key=key)
    return got["Body"].read().decode(), int(got["Metadata"]["fence"])


def django_model(table: str) -> Any:
    """A Django model over ``table`` (settings configured once, on first use: PostgreSQL
    through Django's psycopg 3 backend)."""
    import django
    from django.conf import settings
    from django.db import models

    if not settings.configured:
        url = urlsplit(POSTGRES_URL)
        settings.configure(
            DATABASES={"default": {
                "ENGINE": "django.db.backends.postgresql", "NAME": url.path.lstrip("/"),
                "USER": url.username or "postgres", "HOST": url.hostname, "PORT": url.port,
            }},
            USE_TZ=True, INSTALLED_APPS=[],
        )  # fmt: skip
        django.setup()
    meta = type("Meta", (), {"app_label": "fenced_tests", "db_table": table, "managed": False})
    return type(
        f"Row_{table}", (models.Model,),
        {"__module__": __name__, "Meta": meta, "id": models.IntegerField(primary_key=True),
         "writer": models.TextField(null=True), "fence": models.BigIntegerField(null=True)},
    )  # fmt: skip
