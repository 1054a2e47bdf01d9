"""Benchmark: simple-mutex on etcd against the bare client's floor, in the same run.

Runs against ETCD_URL (``etcd://host:port``) if set, else a one-member etcd of its own on
free ports (scripts/servers.py; the ``etcd`` binary from Debian's etcd-server)::

    .venv/bin/python bench/bench_etcd.py [--cycles 500] [--repeats 5] [--handoffs 100]

One uncontended acquire + release, mean µs over ``--cycles`` in each of ``--repeats``
rounds, the contenders taking turns round by round; the median round and the fastest,
each with its ratio to the floor.

* floor: the four requests EtcdCache sends, bare on etcd3gw (a lease grant, the
  ``create_revision == 0`` put, the ``mod_revision`` delete, the lease's revoke).
* floor without a lease: the two transactions alone (what a lease costs).
* EtcdCache ops: put_if_absent + compare_and_delete, no Mutex around them.
* Mutex(EtcdCache): the whole library.

Then the same cycle on the asyncio face, on one event loop: the floor is the same four
requests bare on aetcd (its grant transaction also reads the entry back, since aetcd
returns no header revision: as AsyncEtcdCache's does), against ``Mutex(AsyncEtcdCache)``.

Then the hand-off: a holder releases while a waiter (another thread, blocked in
``acquire``) waits; p50 and p90 ms from ``release()`` to the waiter holding, beside the
floor: etcd3gw's bare watch, from a delete to its event arriving.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import os
import secrets
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aetcd
import etcd3gw
from aetcd import transactions
from etcd3gw.lease import Lease
from etcd3gw.watch import Watcher
from rounds import RECORD, interleaved_rounds, interleaved_rounds_async, print_ratio_table

from simple_mutex import Mutex
from simple_mutex.caches.etcd import AsyncEtcdCache, EtcdCache, from_url

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import servers

PREFIX = f"bench_{secrets.token_hex(4)}"


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def bare(client: Any, leased: bool) -> Callable[[], None]:
    key = b64(f"{PREFIX}/floor/{'leased' if leased else 'plain'}")

    def cycle() -> None:
        lease = client.lease(30) if leased else None
        put: dict[str, Any] = {"key": key, "value": b64(RECORD % secrets.token_hex(16))}
        if lease is not None:
            put["lease"] = lease.id
        granted = client.transaction({
            "compare": [{"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": 0}],
            "success": [{"request_put": put}],
        })  # fmt: skip
        assert granted.get("succeeded")
        revision = int(granted["header"]["revision"])
        freed = client.transaction({
            "compare": [{"key": key, "result": "EQUAL", "target": "MOD", "mod_revision": revision}],
            "success": [{"request_delete_range": {"key": key}}],
        })  # fmt: skip
        assert freed.get("succeeded")
        if lease is not None:
            Lease(lease.id, client).revoke()

    return cycle


def cache_ops(cache: EtcdCache) -> Callable[[], None]:
    def cycle() -> None:
        entry = cache.put_if_absent("bench.ops", RECORD % secrets.token_hex(16), ttl=30.0)
        cache.compare_and_delete("bench.ops", version=entry.version)

    return cycle


def mutex_cycle(cache: EtcdCache) -> Callable[[], None]:
    mutex = Mutex(cache, lease=30)

    def cycle() -> None:
        mutex.acquire("bench.mutex").release()

    return cycle


async def asyncio_rounds(host: str, port: int, cycles: int, repeats: int) -> dict[str, list[float]]:
    """The uncontended cycle on aetcd, bare and through the library, on this loop."""
    client = aetcd.Client(host=host, port=port, timeout=5)
    key = f"{PREFIX}/floor/asyncio".encode()

    async def floor() -> None:
        lease = await client.lease(30)
        granted, (_, written) = await client.transaction(
            [transactions.Create(key) == 0],
            [transactions.Put(key, (RECORD % secrets.token_hex(16)).encode(), lease=lease.id),
             transactions.Get(key)],
            [],
        )  # fmt: skip
        assert granted
        revision = written[0][1].mod_revision
        freed, _ = await client.transaction(
            [transactions.Mod(key) == revision], [transactions.Delete(key)], []
        )
        assert freed
        await client.revoke_lease(lease.id)

    mutex = Mutex(AsyncEtcdCache(client, prefix=PREFIX), lease=30)

    async def ours() -> None:
        await (await mutex.acquire_async("bench.asyncio")).release_async()

    contenders = {"floor (same 4 requests, bare aetcd)": floor, "Mutex(AsyncEtcdCache)": ours}
    warmup = min(50, cycles)
    rounds = await interleaved_rounds_async(
        contenders, cycles=cycles, repeats=repeats, warmup=warmup
    )
    await client.close()
    return rounds


def percentiles(gaps: list[float]) -> tuple[float, float]:
    gaps = sorted(gaps)
    return statistics.median(gaps) * 1e3, gaps[int(len(gaps) * 0.9)] * 1e3


def handoff(url: str, rounds: int) -> tuple[float, float]:
    """release() -> a waiter thread (its own cache, blocked in acquire) holds, seconds."""
    key = f"handoff.{secrets.token_hex(4)}"
    holder = Mutex(from_url(url), lease=30)
    waiter = Mutex(from_url(url), lease=30, interval=5)
    go, got = threading.Event(), threading.Event()
    held_at: list[float] = []

    def wait_for_it() -> None:
        for _ in range(rounds):
            go.wait()
            go.clear()
            lease = waiter.acquire(key, timeout=30)
            held_at.append(time.monotonic())
            got.set()
            lease.release()

    thread = threading.Thread(target=wait_for_it, daemon=True)
    thread.start()
    gaps = []
    for _ in range(rounds):
        lease = holder.acquire(key, timeout=30)
        go.set()
        time.sleep(0.05)  # the waiter tries, finds it held, watches
        start = time.monotonic()
        lease.release()
        got.wait(30)
        got.clear()
        gaps.append(held_at[-1] - start)
        time.sleep(0.01)  # the waiter releases
    thread.join(10)
    return percentiles(gaps)


def bare_watch(client: Any, rounds: int) -> tuple[float, float]:
    """A delete -> etcd3gw's watch event on that key, seconds."""
    key = f"{PREFIX}/watch"
    gaps = []
    for _ in range(rounds):
        client.put(key, "v")
        seen = threading.Event()
        watcher = Watcher(client, key, lambda event, seen=seen: seen.set(), filters=["NOPUT"])
        time.sleep(0.05)
        start = time.monotonic()
        client.delete(key)
        seen.wait(10)
        gaps.append(time.monotonic() - start)
        watcher.stop()
    return percentiles(gaps)


@contextlib.contextmanager
def etcd_url() -> Iterator[str]:
    given = os.environ.get("ETCD_URL")
    if given:
        yield given
        return
    with servers.etcd_server() as url:
        yield url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--handoffs", type=int, default=100)
    args = parser.parse_args()
    with etcd_url() as base:
        url = f"{base}/{PREFIX}"
        host, port = base.removeprefix("etcd://").split(":")
        client = etcd3gw.Etcd3Client(host=host, port=int(port), timeout=5, api_path="/v3/")
        cache = from_url(url)
        contenders = {
            "floor (same 4 requests, bare etcd3gw)": bare(client, leased=True),
            "floor without a lease (2 txns)": bare(client, leased=False),
            "EtcdCache ops": cache_ops(cache),
            "Mutex(EtcdCache)": mutex_cycle(cache),
        }
        warmup = min(50, args.cycles)
        rounds = interleaved_rounds(
            contenders, cycles=args.cycles, repeats=args.repeats, warmup=warmup
        )
        on_loop = asyncio.run(asyncio_rounds(host, int(port), args.cycles, args.repeats))
        ours = handoff(url, args.handoffs)
        floor = bare_watch(client, args.handoffs)
        client.delete_prefix(f"{PREFIX}/")
    print_ratio_table(
        f"acquire + release, uncontended; {args.repeats} rounds x {args.cycles} cycles",
        rounds,
        floor="floor (same 4 requests, bare etcd3gw)",
    )
    print_ratio_table(
        f"the same on one event loop; {args.repeats} rounds x {args.cycles} cycles",
        on_loop,
        floor="floor (same 4 requests, bare aetcd)",
    )
    print(f"\nhand-off, {args.handoffs} rounds | p50 ms | p90 ms |")
    print("|---|---|---|")
    print(f"| floor: a delete -> etcd3gw's bare watch event | {floor[0]:.2f} | {floor[1]:.2f} |")
    print(f"| Mutex(EtcdCache): release() -> the waiter holds | {ours[0]:.2f} | {ours[1]:.2f} |")


if __name__ == "__main__":
    main()
