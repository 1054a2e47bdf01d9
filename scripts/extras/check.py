"""Prove that one install of simple-mutex works on its own: run inside a fresh environment
that holds only ``simple-mutex[EXTRAS]``.

    python scripts/extras/check.py celery,redis

For every extra named, it imports what the README promises for it and does one acquire /
release round trip against the extra's real server. Celery and RQ run a real worker
process. The core (DiskCache, no extra) is always checked, and ``import simple_mutex`` must
pull in no driver. Servers come from the environment: REDIS_URL, POSTGRES_URL, AMQP_URL,
MONGODB_URL, S3_ENDPOINT (scripts/check_extras.sh starts what is missing). Exits non-zero
on the first failure, with what went wrong.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # scripts/servers.py: standard library only
import servers  # noqa: E402

RUN = uuid.uuid4().hex[:8]
DRIVERS = ("redis", "psycopg", "pymongo", "boto3", "celery", "kombu", "rq", "sqlalchemy", "django")
SINKS = ("prometheus_client", "opentelemetry")  # simple_mutex.contrib only, never the core


class CheckFailed(Exception):
    """What the check saw that the extra promised otherwise."""


def require(condition: object, problem: object) -> None:
    """A check that survives ``python -O`` (an assert would not)."""
    if not condition:
        raise CheckFailed(str(problem))


def ok(what: str) -> None:
    print(f"  ok  {what}", flush=True)


def env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise SystemExit(f"{name} is not set: scripts/check_extras.sh sets it")
    return value


def round_trip(cache: Any, label: str) -> None:
    """Acquire, see it held, release, see it free: the smallest proof a cache works."""
    from simple_mutex import Mutex

    mutex = Mutex(cache, lease=10)
    key = f"check-extras.{RUN}.{label}"
    with mutex.acquire(key, timeout=10) as lease:
        holder = mutex.holder(key)
        require(holder is not None and holder.fence == lease.fence, f"holder() gave {holder}")
        require(mutex.try_acquire(key) is None, "a second holder got a held lock")
    require(not mutex.locked(key), "the lock stayed held after release")
    ok(f"{label}: acquired and released {key} (fence {lease.fence})")


def async_round_trip(open_cache: Callable[[], Awaitable[tuple[Any, Any]]], label: str) -> None:
    """The round trip through the ``_async`` methods, on a loop of its own; ``open_cache``
    opens a client on that loop and returns what ``Mutex`` takes, and the client."""

    async def main() -> None:
        cache, client = await open_cache()
        mutex = Mutex(cache, lease=10)
        key = f"check-extras.{RUN}.{label}"
        async with mutex.acquire_async(key, timeout=10) as lease:
            holder = await mutex.holder_async(key)
            require(holder is not None and holder.fence == lease.fence, f"holder gave {holder}")
            require(await mutex.try_acquire_async(key) is None, "a second holder got the lock")
        require(not await mutex.locked_async(key), "the lock stayed held after release")
        await client.close()
        ok(f"{label}: acquired and released {key} on the event loop (fence {lease.fence})")

    from simple_mutex import Mutex

    asyncio.run(main())


def refused_at_4(stale_write: Callable[[], object]) -> None:
    """``stale_write`` (fence 4, after a write at 5) must raise FencedOutError(current=5)."""
    from simple_mutex import FencedOutError

    try:
        stale_write()
    except FencedOutError as exc:
        require(exc.current == 5, f"FencedOutError.current is {exc.current}, not 5")
    else:
        require(False, "a stale fence was accepted")


def check_core() -> None:
    import simple_mutex
    import simple_mutex.fenced  # its modules import a driver only when called
    from simple_mutex import DiskCache, InMemoryCache, cache_from_url

    loaded = sorted(name for name in DRIVERS + SINKS if name in sys.modules)
    require(not loaded, f"import simple_mutex pulled in {loaded}")
    ok(f"import simple_mutex {simple_mutex.__version__}: standard library only")
    round_trip(InMemoryCache(), "InMemoryCache")
    with tempfile.TemporaryDirectory() as path:
        round_trip(DiskCache(path), "DiskCache")
        round_trip(cache_from_url(f"file://{path}"), "cache_from_url(file://)")
    check_integration_without_its_queue("celery_mutex", "celery", "billiard")
    check_integration_without_its_queue("rq_mutex", "rq", "rq")


def check_integration_without_its_queue(package: str, extra: str, module: str) -> None:
    """Without its task queue installed, importing an integration names the extra."""
    if importlib.util.find_spec(module) is not None:
        return
    try:
        importlib.import_module(package)
    except ImportError as exc:
        require(f"pip install 'simple-mutex[{extra}]'" in str(exc), f"import {package}: {exc}")
        ok(f"import {package} without {module}: names simple-mutex[{extra}]")
    else:
        require(False, f"import {package} worked without {module}")


def check_redis() -> None:
    import redis

    from simple_mutex import cache_from_url
    from simple_mutex.caches import RedisCache

    url = env("REDIS_URL")
    round_trip(RedisCache(redis.Redis.from_url(url, socket_timeout=5)), "RedisCache")
    round_trip(redis.Redis.from_url(url), "Mutex(redis.Redis)")
    round_trip(cache_from_url(url), "cache_from_url(redis://)")


def check_postgres() -> None:
    import psycopg
    from psycopg import sql
    from psycopg_pool import ConnectionPool

    from simple_mutex import cache_from_url
    from simple_mutex.caches import AsyncPostgresCache, PostgresCache

    url = env("POSTGRES_URL")
    table = f"check_extras_{RUN}"
    round_trip(PostgresCache(url, table=table), "PostgresCache(conninfo)")
    with ConnectionPool(url, kwargs={"autocommit": True}, min_size=1, max_size=2) as pool:
        round_trip(PostgresCache(pool, table=table), "PostgresCache(ConnectionPool)")
    round_trip(cache_from_url(f"{url}?table={table}"), "cache_from_url(postgresql://)")

    async def connection() -> tuple[Any, Any]:
        conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
        return AsyncPostgresCache(conn, table=table), conn

    async_round_trip(connection, "AsyncPostgresCache(AsyncConnection)")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)))


def check_sqlalchemy() -> None:
    """The extra brings SQLAlchemy alone (a PostgreSQL driver is the postgres extra's):
    the fenced writes on SQLite, which needs nothing more, refuse a stale fence."""
    import sqlalchemy as sa

    from simple_mutex.fenced import fenced_update, fenced_upsert

    with tempfile.TemporaryDirectory() as path:
        engine = sa.create_engine(f"sqlite:///{path}/fenced.db")
        with engine.begin() as c:
            c.exec_driver_sql("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT, fence INTEGER)")
        fenced_upsert(engine, "t", {"id": 1}, {"v": "new"}, fence=5)
        require(fenced_update(engine, "t", {"id": 1}, {"v": "same"}, fence=5) == 1, "not written")
        refused_at_4(lambda: fenced_update(engine, "t", {"id": 1}, {"v": "stale"}, fence=4))
        engine.dispose()
    ok(f"simple_mutex.fenced on SQLAlchemy {sa.__version__} (SQLite): a stale fence refused")


def check_django() -> None:
    """The extra brings Django alone: the fenced queryset update on SQLite (which needs
    nothing more) refuses a stale fence."""
    import django
    from django.conf import settings

    with tempfile.TemporaryDirectory() as path:
        settings.configure(
            DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3",
                                   "NAME": f"{path}/fenced.db"}},
            INSTALLED_APPS=[], USE_TZ=True,
        )  # fmt: skip
        django.setup()
        from django.db import connection, models

        from simple_mutex.fenced.django import fenced_update_queryset, fenced_upsert_model

        class Account(models.Model):
            balance = models.IntegerField()
            fence = models.BigIntegerField(null=True)

            class Meta:
                app_label = "check_extras"

        with connection.schema_editor() as editor:
            editor.create_model(Account)
        fenced_upsert_model(Account, {"id": 1}, {"balance": 10}, fence=5)
        one = Account.objects.filter(id=1)
        require(fenced_update_queryset(one, {"balance": 9}, fence=5) == 1, "not written")
        refused_at_4(lambda: fenced_update_queryset(one, {"balance": 0}, fence=4))
        connection.close()
    ok(f"simple_mutex.fenced.django on Django {django.__version__} (SQLite): a stale fence refused")


def check_mongo() -> None:
    import pymongo

    from simple_mutex import cache_from_url
    from simple_mutex.caches import MongoCache

    url = env("MONGODB_URL")
    client: Any = pymongo.MongoClient(url, serverSelectionTimeoutMS=5000)
    database = f"check_extras_{RUN}"
    round_trip(MongoCache(client, database=database), "MongoCache")
    round_trip(cache_from_url(f"{url.rstrip('/')}/{database}"), "cache_from_url(mongodb://)")

    async def async_client() -> tuple[Any, Any]:
        aio = pymongo.AsyncMongoClient(url, serverSelectionTimeoutMS=5000)
        return aio[database], aio

    async_round_trip(async_client, "Mutex(AsyncDatabase)")
    client.drop_database(database)


def check_etcd() -> None:
    import etcd3gw

    from simple_mutex import cache_from_url
    from simple_mutex.caches import EtcdCache

    url = env("ETCD_URL")
    round_trip(cache_from_url(f"{url}/check_extras_{RUN}"), "cache_from_url(etcd://)")
    host, _, port = url.removeprefix("etcd://").partition(":")
    client = etcd3gw.Etcd3Client(host=host, port=int(port), timeout=5)
    round_trip(EtcdCache(client, prefix=f"check_extras_{RUN}"), "EtcdCache(Etcd3Client)")

    async def async_client() -> tuple[Any, Any]:
        import aetcd

        aio = aetcd.Client(host=host, port=int(port), timeout=5)
        return aio, aio

    async_round_trip(async_client, "Mutex(aetcd.Client)")
    client.delete_prefix(f"check_extras_{RUN}/")
    for kind in "kt":  # Mutex(aetcd.Client)'s entry and trace, under the default prefix
        client.delete_prefix(f"simple_mutex/{kind}/mutex.check-extras.{RUN}.")


def check_s3() -> None:
    import boto3

    from simple_mutex.caches import S3Cache

    client = boto3.client(
        "s3", endpoint_url=env("S3_ENDPOINT"), region_name="us-east-1",
        aws_access_key_id=env("AWS_ACCESS_KEY_ID"),
        aws_secret_access_key=env("AWS_SECRET_ACCESS_KEY"),
    )  # fmt: skip
    bucket = f"check-extras-{RUN}"
    client.create_bucket(Bucket=bucket)
    cache = S3Cache(client, bucket, "locks/")
    cache.verify()
    ok("S3Cache.verify(): the server honours If-None-Match and If-Match")
    round_trip(cache, "S3Cache")


def _wait_for_file(path: Path, worker: subprocess.Popen[bytes], log: Path, what: str) -> Any:
    deadline = time.monotonic() + 60
    while not path.exists() or not path.read_text():
        if worker.poll() is not None:
            raise CheckFailed(f"{what} exited with {worker.returncode}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            raise CheckFailed(f"{what} ran nothing within 60 s:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)
    return json.loads(path.read_text())


def _worker_env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "CHECK_RUN": RUN, **extra}


def check_celery(extras: list[str]) -> None:
    """A real ``celery worker`` (prefork) runs one MutexTask. With ``redis`` the broker and
    the lock cache are the Redis server; otherwise the broker is RabbitMQ and the lock cache
    the other extra's server (``celery,postgres``), or a DiskCache on ``celery`` alone."""
    from celery_mutex import MutexTask, current_lease, is_skipped  # noqa: F401
    from celery_mutex.beat import MutexScheduler  # noqa: F401

    ok("import celery_mutex (MutexTask, current_lease, is_skipped), celery_mutex.beat")
    scratch = Path(tempfile.mkdtemp(prefix="check-extras-celery-"))
    if "redis" in extras:
        broker = cache = env("REDIS_URL")
    elif "postgres" in extras:
        broker, cache = env("AMQP_URL"), f"{env('POSTGRES_URL')}?table=check_extras_{RUN}"
    else:
        broker, cache = env("AMQP_URL"), f"file://{scratch / 'locks'}"
    worker_env = _worker_env(CHECK_BROKER=broker, CHECK_CACHE=cache)
    os.environ.update({k: worker_env[k] for k in ("CHECK_BROKER", "CHECK_CACHE", "CHECK_RUN")})
    log, out = scratch / "worker.log", scratch / "result.json"
    with log.open("wb") as sink:
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "celery_app", "worker", "-P", "prefork",
             "-c", "1", "--without-gossip", "--without-mingle", "--without-heartbeat",
             # a node name of its own: two checks at once on one RabbitMQ would otherwise
             # both declare the exclusive control queue of "celery@<host>"
             "-n", f"check-{RUN}@%h", "-l", "INFO"],
            stdout=sink, stderr=subprocess.STDOUT, env=worker_env,
        )  # fmt: skip
    try:
        sys.path.insert(0, str(HERE))
        app_module = importlib.import_module("celery_app")
        app_module.charge.delay(7, str(out))
        seen = _wait_for_file(out, worker, log, "celery worker")
        require(seen["key"] == "order.7" and seen["fence"] >= 1, f"the task saw {seen}")
        ok(f"celery worker on {broker.split(':')[0]} ran a MutexTask (key order.7, "
           f"fence {seen['fence']}, lock cache {cache.split(':')[0]})")  # fmt: skip
    finally:
        servers.stop(worker)


def check_rq() -> None:
    """A real ``rq worker -w rq_mutex.Worker`` (as the guide starts them) runs one
    ``mutex_job`` on the Redis at REDIS_URL."""
    import redis

    from rq_mutex import Queue, current_lease, is_skipped, mutex_job, once_per_tick  # noqa: F401

    ok("import rq_mutex (Queue, mutex_job, current_lease, is_skipped, once_per_tick)")
    sys.path.insert(0, str(HERE))
    jobs = importlib.import_module("rq_jobs")
    url = env("REDIS_URL")
    queue = Queue(f"check-extras-{RUN}", connection=redis.Redis.from_url(url))
    job = queue.enqueue(jobs.charge, 7)
    log = Path(tempfile.mkdtemp(prefix="check-extras-rq-")) / "worker.log"
    rq = str(Path(sys.executable).with_name("rq"))
    with log.open("wb") as sink:
        worker = subprocess.run(
            [rq, "worker", "-w", "rq_mutex.Worker", "--burst", "--url", url, queue.name],
            stdout=sink, stderr=subprocess.STDOUT, env=_worker_env(), timeout=120,
        )  # fmt: skip
    seen = job.return_value()
    require(worker.returncode == 0 and seen is not None, log.read_text())
    require(seen["key"] == "order.7" and seen["fence"] >= 1, f"the job saw {seen}")
    ok(f"rq worker ran a mutex_job (key order.7, fence {seen['fence']})")


def check_prometheus() -> None:
    from prometheus_client import CollectorRegistry

    from simple_mutex import InMemoryCache
    from simple_mutex.contrib import prometheus

    registry = CollectorRegistry()
    uninstrument = prometheus.instrument(registry)
    try:
        round_trip(InMemoryCache(), "InMemoryCache, instrumented")
        labels = {"name": "mutex", "outcome": "acquired"}
        counted = registry.get_sample_value("simple_mutex_acquires_total", labels)
        require(counted == 1, f"simple_mutex_acquires_total{labels} = {counted}, not 1")
        labels["outcome"] = "busy"
        busy = registry.get_sample_value("simple_mutex_acquires_total", labels)
        require(busy == 1, f"the busy try was counted {busy} times, not once")
    finally:
        uninstrument()
    ok("simple_mutex.contrib.prometheus: one grant and one busy try counted")


def check_otel() -> None:
    # The API alone (no SDK): the providers are no-ops, and instrumenting must cost nothing
    # more than that. Spans themselves are tested with the SDK in
    # tests/contrib/test_opentelemetry.py.
    from opentelemetry import trace

    from simple_mutex import InMemoryCache
    from simple_mutex.contrib import opentelemetry

    require("opentelemetry.sdk" not in sys.modules, "the otel extra pulled in the SDK")
    uninstrument = opentelemetry.instrument()
    try:
        with trace.get_tracer("check").start_as_current_span("check"):
            round_trip(InMemoryCache(), "InMemoryCache, instrumented (API only)")
    finally:
        uninstrument()
    ok("simple_mutex.contrib.opentelemetry: instruments on opentelemetry-api alone")


def main(spec: str) -> None:
    extras = [name for name in spec.split(",") if name]
    checks: dict[str, Callable[[], None]] = {
        "redis": check_redis,
        "postgres": check_postgres,
        "mongo": check_mongo,
        "etcd": check_etcd,
        "s3": check_s3,
        "sqlalchemy": check_sqlalchemy,
        "django": check_django,
        "celery": lambda: check_celery(extras),
        "rq": check_rq,
        "prometheus": check_prometheus,
        "otel": check_otel,
    }
    unknown = set(extras) - set(checks)
    if unknown:
        raise SystemExit(f"no check for extra(s) {sorted(unknown)}; known: {sorted(checks)}")
    try:
        check_core()
        for name in extras:
            checks[name]()
    except CheckFailed as failure:
        raise SystemExit(f"  FAILED: {failure}") from None


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
