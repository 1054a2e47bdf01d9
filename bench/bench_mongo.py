"""Benchmark: the acquire+release cycle of Mutex(MongoCache) against pymongo's floor.

Runs against MONGODB_URL when set; otherwise it starts a ``secantusd-py`` (the test-only
MongoDB wire-protocol server from the PyPI package ``secantusdb``) on a free loopback
port with a scratch directory, and stops it at the end. Figures from secantusdb are NOT
MongoDB's: it is a Python server, so its round trip dwarfs the client's cost; the ratio
says how much the library adds over the same statements, not how fast MongoDB is::

    .venv/bin/python bench/bench_mongo.py                 # about 30 s
    .venv/bin/python bench/bench_mongo.py --cycles 100 --repeats 5

One table: an uncontended acquire + release, mean µs over ``--cycles`` in each of
``--repeats`` rounds, the contenders taking turns round by round so that load from
other programs falls on all alike; the median round and the fastest, each with its
ratio to the floor's. The floor is the same two statements MongoCache sends, issued bare
through pymongo: the filtered ``find_one_and_update(upsert=True)`` pipeline that takes a
freed key by the server's clock, then the ``update_one`` that frees it (w="majority"),
on a collection with the same TTL index.
"MongoCache ops" is the backend alone (put_if_absent + compare_and_delete with a lock
record of the usual size), and "simple-mutex InMemoryCache" the core with no I/O.
Everything is written to the database ``simple_mutex_bench``, dropped at the end.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pymongo
from pymongo import ReturnDocument
from pymongo.write_concern import WriteConcern
from rounds import RECORD, interleaved_rounds, our_contenders, print_ratio_table

from simple_mutex.caches.mongo import MongoCache

DB = "simple_mutex_bench"
LEASE = 30.0


@contextmanager
def server() -> Iterator[tuple[str, str]]:
    """(url, what it is): MONGODB_URL, or a secantusd-py of our own."""
    url = os.environ.get("MONGODB_URL")
    if url:
        yield url, "MONGODB_URL"
        return
    binary = shutil.which("secantusd-py") or str(Path(sys.executable).parent / "secantusd-py")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="bench-mongo-") as workdir:
        proc = subprocess.Popen(
            [binary, "--host", "127.0.0.1", "--port", str(port), "--storage-path", workdir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            url = f"mongodb://127.0.0.1:{port}/"
            probe: pymongo.MongoClient[Any] = pymongo.MongoClient(
                url, serverSelectionTimeoutMS=10_000
            )
            probe.admin.command("ping")
            probe.close()
            yield url, "secantusdb (a Python wire-protocol server, test-only)"
        finally:
            proc.terminate()
            proc.wait(10)


def cycle_functions(client: pymongo.MongoClient[Any]) -> dict[str, Callable[[], None]]:
    coll = client[DB]["floor"].with_options(
        write_concern=WriteConcern(w="majority", wtimeout=10_000)
    )
    coll.create_index("expires_at", expireAfterSeconds=86_400)  # as MongoCache's own
    ms = int(LEASE * 1000)
    now_ms = {"$toLong": "$$NOW"}

    def floor() -> None:
        version = secrets.token_hex(8)
        coll.find_one_and_update(
            {"_id": "cycle", "$or": [
                {"value": None},
                {"$expr": {"$lte": [{"$toLong": "$expires_at"}, now_ms]}},
            ]},
            [{"$set": {
                "value": {"$literal": RECORD % secrets.token_hex(16)},
                "version": version,
                "fence": {"$add": [{"$ifNull": ["$fence", {"$multiply": [now_ms, 1000]}]}, 1]},
                "expires_at": {"$add": ["$$NOW", ms]},
            }}],
            projection={"_id": 0, "value": 1, "version": 1, "fence": 1, "expires_at": 1},
            upsert=True, return_document=ReturnDocument.AFTER,
        )  # fmt: skip
        coll.update_one(
            {"_id": "cycle", "version": version, "value": {"$ne": None},
             "$expr": {"$gt": [{"$toLong": "$expires_at"}, now_ms]}},
            {"$set": {"value": None}},
        )  # fmt: skip

    cache = MongoCache(client, database=DB)
    cache.ready()
    return {
        "floor: bare pymongo, same 2 stmts": floor,
        **our_contenders(cache, "MongoCache", lease=LEASE),
    }


def bench_cycle(client: pymongo.MongoClient[Any], cycles: int, repeats: int) -> None:
    rounds = interleaved_rounds(cycle_functions(client), cycles=cycles, repeats=repeats, warmup=20)
    print_ratio_table(
        f"uncontended acquire+release cycle, µs ({repeats} interleaved rounds of {cycles})",
        rounds,
        floor="floor: bare pymongo, same 2 stmts",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=200, help="cycles per round")
    parser.add_argument("--repeats", type=int, default=11, help="rounds per contender")
    args = parser.parse_args()
    with server() as (url, what):
        print(f"server: {what}")
        client: pymongo.MongoClient[Any] = pymongo.MongoClient(url)
        try:
            bench_cycle(client, args.cycles, args.repeats)
        finally:
            client.drop_database(DB)
            client.close()


if __name__ == "__main__":
    main()
