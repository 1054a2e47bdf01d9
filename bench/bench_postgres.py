"""Benchmark: simple-mutex on PostgreSQL against the bare floor, in the same run.

Run against the server at POSTGRES_URL (default postgresql://postgres@127.0.0.1:5432/test)::

    .venv/bin/python bench/bench_postgres.py [--cycles 2000] [--repeats 5]

One uncontended acquire + release, mean µs over ``--cycles`` in each of ``--repeats``
rounds, the contenders taking turns round by round so that load from other programs falls
on all of them alike; the median round and the fastest, each with its ratio to the floor.

* floor: the same two statements PostgresCache sends (the put, then the release with its
  ``pg_notify``), issued bare with psycopg on one autocommit connection: a lock cannot
  do it in fewer round trips.
* floor without notify: the release as a plain UPDATE, to show what waking waiters costs.
* PostgresCache ops: put_if_absent + compare_and_delete with a lock record of the usual
  size, no Mutex around them (the backend alone).
* Mutex(PostgresCache): the whole library.

A second table, on asyncio: the same two statements bare on a psycopg ``AsyncConnection``
(the async floor) against ``Mutex(AsyncPostgresCache)``; each cycle is one
``run_until_complete`` on one loop, for both alike.

Everything lives in one table ``bench_<random>``, dropped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
from collections.abc import Callable
from typing import Any

import psycopg
from rounds import interleaved_rounds, print_ratio_table

from simple_mutex import Mutex
from simple_mutex.caches.postgres import AsyncPostgresCache, PostgresCache
from simple_mutex.caches.postgres import statements as postgres

URL = os.environ.get("POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
TABLE = f"bench_{secrets.token_hex(4)}"
RECORD = '{"token":"%s","host":"bench-host","pid":12345,"label":null,"acquired":1.0}'


def bare(notify: bool) -> Callable[[], None]:
    conn = psycopg.connect(URL, autocommit=True)
    quoted = f'"{TABLE}"'
    put = postgres._PUT.format(t=quoted)
    if notify:
        release = postgres._DELETE.format(t=quoted)
    else:
        release = (
            f"UPDATE {quoted} SET value = NULL WHERE key = %(key)s AND version = %(version)s "
            f"AND {postgres._LIVE}"
        )
    key = "bench.floor.notify" if notify else "bench.floor.plain"

    def cycle() -> None:
        version = secrets.token_hex(8)
        value = RECORD % secrets.token_hex(16)
        params: dict[str, Any] = {"key": key, "value": value, "version": version, "ttl": 30.0}
        row = conn.execute(put, params).fetchone()
        assert row is not None
        assert row[1] == version
        freed = conn.execute(release, {"key": key, "version": version, "channel": "sm_bench"})
        assert freed.rowcount == 1

    return cycle


def cache_ops() -> Callable[[], None]:
    cache = PostgresCache(URL, table=TABLE)

    def cycle() -> None:
        entry = cache.put_if_absent("bench.ops", RECORD % secrets.token_hex(16), ttl=30.0)
        cache.compare_and_delete("bench.ops", version=entry.version)

    return cycle


def mutex_cycle() -> Callable[[], None]:
    mutex = Mutex(PostgresCache(URL, table=TABLE), lease=30)

    def cycle() -> None:
        mutex.acquire("bench.mutex").release()

    return cycle


def async_contenders() -> dict[str, Callable[[], None]]:
    """The async floor and Mutex(AsyncPostgresCache), each cycle run on one loop."""
    loop = asyncio.new_event_loop()
    conn = loop.run_until_complete(psycopg.AsyncConnection.connect(URL, autocommit=True))
    quoted = f'"{TABLE}"'
    put, release = postgres._PUT.format(t=quoted), postgres._DELETE.format(t=quoted)
    mutex = Mutex(AsyncPostgresCache(URL, table=TABLE), lease=30)

    async def bare_cycle() -> None:
        version = secrets.token_hex(8)
        params = {"key": "bench.afloor", "value": RECORD % secrets.token_hex(16),
                  "version": version, "ttl": 30.0}  # fmt: skip
        row = await (await conn.execute(put, params)).fetchone()
        assert row is not None
        assert row[1] == version
        freed = await conn.execute(
            release, {"key": "bench.afloor", "version": version, "channel": "sm_bench"}
        )
        assert freed.rowcount == 1

    async def mutex_cycle() -> None:
        await (await mutex.acquire_async("bench.amutex")).release_async()

    return {
        "async floor (same 2 statements, AsyncConnection)": lambda: loop.run_until_complete(
            bare_cycle()
        ),
        "Mutex(AsyncPostgresCache)": lambda: loop.run_until_complete(mutex_cycle()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    PostgresCache(URL, table=TABLE).get("bench.create")  # creates the table
    contenders = {
        "floor (same 2 statements, bare psycopg)": bare(notify=True),
        "floor without notify": bare(notify=False),
        "PostgresCache ops": cache_ops(),
        "Mutex(PostgresCache)": mutex_cycle(),
    }
    aio = async_contenders()
    try:
        rounds = interleaved_rounds(contenders, cycles=args.cycles, repeats=args.repeats, warmup=50)
        aio_rounds = interleaved_rounds(aio, cycles=args.cycles, repeats=args.repeats, warmup=50)
    finally:
        with psycopg.connect(URL, autocommit=True) as conn:
            conn.execute(f'DROP TABLE IF EXISTS "{TABLE}"')
    print_ratio_table(
        f"acquire + release, uncontended; {args.repeats} rounds x {args.cycles} cycles",
        rounds,
        floor="floor (same 2 statements, bare psycopg)",
    )
    print_ratio_table(
        f"asyncio: acquire + release, uncontended; {args.repeats} rounds x {args.cycles} cycles",
        aio_rounds,
        floor="async floor (same 2 statements, AsyncConnection)",
    )


if __name__ == "__main__":
    main()
