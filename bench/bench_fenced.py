"""Benchmark: fenced writes against the plain writes they replace, in the same run.

    .venv/bin/python bench/bench_fenced.py [--cycles 2000] [--repeats 5]

PostgreSQL (POSTGRES_URL, default postgresql://postgres@127.0.0.1:5432/test), one
autocommit psycopg connection each, one row by primary key in a table of 10,000 rows:

* plain UPDATE: ``UPDATE t SET v = %s, fence = %s WHERE id = %s`` (no guard at all);
* fenced_update: the guarded statement (lock the row, judge, update), rows round-robin;
* fenced_upsert: the guarded ``INSERT ... ON CONFLICT ... DO UPDATE ... WHERE``.

Redis (REDIS_URL, default redis://127.0.0.1:6379/0): a plain ``SET`` against
``fenced_set`` (one EVALSHA of the compare-and-write script over one hash).

Mean µs per write over ``--cycles`` in each of ``--repeats`` rounds, the contenders taking
turns round by round; median and fastest round with their ratio to the plain write.
The target (issue 23): fenced_update within 1.1x of the plain UPDATE.
"""

from __future__ import annotations

import argparse
import itertools
import os
import secrets

import psycopg
import redis
from rounds import interleaved_rounds, print_ratio_table

from simple_mutex.fenced import fenced_set, fenced_update, fenced_upsert

URL = os.environ.get("POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
TABLE = f"bench_fenced_{secrets.token_hex(4)}"
ROWS = 10_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    admin = psycopg.connect(URL, autocommit=True)
    admin.execute(f'CREATE TABLE "{TABLE}" (id int PRIMARY KEY, v text, fence bigint)')
    admin.execute(f"INSERT INTO \"{TABLE}\" SELECT g, 'x', 1 FROM generate_series(1, {ROWS}) g")
    plain_conn = psycopg.connect(URL, autocommit=True)
    fenced_conn = psycopg.connect(URL, autocommit=True)
    upsert_conn = psycopg.connect(URL, autocommit=True)
    ids = itertools.cycle(range(1, ROWS + 1))
    fence = itertools.count(2)
    plain_sql = f'UPDATE "{TABLE}" SET v = %s, fence = %s WHERE id = %s'

    def plain() -> None:
        plain_conn.execute(plain_sql, ("y", next(fence), next(ids)))

    def fenced() -> None:
        fenced_update(fenced_conn, TABLE, {"id": next(ids)}, {"v": "y"}, fence=next(fence))

    def upsert() -> None:
        fenced_upsert(upsert_conn, TABLE, {"id": next(ids)}, {"v": "y"}, fence=next(fence))

    client = redis.Redis.from_url(REDIS_URL)
    key = f"bench.fenced.{secrets.token_hex(4)}"
    redis_fence = itertools.count(1)

    def redis_plain() -> None:
        client.set(key + ".plain", b"value")

    def redis_fenced() -> None:
        fenced_set(client, key, b"value", fence=next(redis_fence))

    try:
        sql_rounds = interleaved_rounds(
            {"plain UPDATE": plain, "fenced_update": fenced, "fenced_upsert": upsert},
            cycles=args.cycles, repeats=args.repeats, warmup=100,
        )  # fmt: skip
        redis_rounds = interleaved_rounds(
            {"plain SET": redis_plain, "fenced_set": redis_fenced},
            cycles=args.cycles, repeats=args.repeats, warmup=100,
        )  # fmt: skip
    finally:
        admin.execute(f'DROP TABLE IF EXISTS "{TABLE}"')
        client.delete(key, key + ".plain")
    rounds = f"{args.repeats} rounds x {args.cycles} writes"
    print_ratio_table(f"PostgreSQL, one row by key; {rounds}", sql_rounds, floor="plain UPDATE")
    print_ratio_table(f"Redis, one key; {rounds}", redis_rounds, floor="plain SET")


if __name__ == "__main__":
    main()
