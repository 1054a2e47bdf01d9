"""Bounded state on Redis: lock and release many distinct keys, and watch memory come back.

Run: ``.venv/bin/python bench/bench_state.py`` (about 2 minutes with the defaults). It
starts a redis-server of its own on a free loopback port (nothing kept on disk), reads
``used_memory`` and the key count, locks and releases ``--keys`` distinct keys (as
per-entity locks such as ``order.{id}`` do), reads them again right after, then waits for
the window after which a released key leaves nothing (max(2 x lease, 60 s)) and reads
them once more. The issue's bar: memory within 1 MB of where it started.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import tempfile
import time

import redis

from simple_mutex import Mutex
from simple_mutex.caches import RedisCache


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def reading(client: redis.Redis) -> tuple[int, int]:
    """(used_memory bytes, number of keys)."""
    return int(client.info("memory")["used_memory"]), int(client.dbsize())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--lease", type=float, default=30.0)
    args = parser.parse_args()
    binary = shutil.which("redis-server") or "redis-server"
    port = free_port()
    with tempfile.TemporaryDirectory() as workdir:
        server = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", workdir],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            client = redis.Redis(port=port)
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.02)
            mutex = Mutex(RedisCache(redis.Redis(port=port)), lease=args.lease)
            mutex.acquire("warm-up").release()  # scripts loaded, connection open
            time.sleep(0.5)
            memory0, keys0 = reading(client)
            start = time.monotonic()
            for n in range(args.keys):
                mutex.acquire(f"order.{n}").release()
            took = time.monotonic() - start
            memory1, keys1 = reading(client)
            window = max(2 * args.lease, 60.0)
            print(f"{args.keys} keys locked and released in {took:.1f} s; waiting {window:.0f} s")
            time.sleep(window + 1)
            deadline = time.monotonic() + 60  # Redis's active expiry needs a moment
            while reading(client)[1] > keys0 and time.monotonic() < deadline:
                time.sleep(0.5)
            memory2, keys2 = reading(client)
        finally:
            server.terminate()
            server.wait(10)
    print()
    print("| when | keys | used_memory | vs start |")
    print("|---|---|---|---|")
    for when, memory, keys in [
        ("before", memory0, keys0),
        ("right after the last release", memory1, keys1),
        (f"after the window ({window:.0f} s)", memory2, keys2),
    ]:
        print(f"| {when} | {keys:,} | {memory / 1e6:.2f} MB | {(memory - memory0) / 1e6:+.2f} MB |")
    within = abs(memory2 - memory0) <= 1_000_000
    print(f"\nwithin 1 MB of the start after the window: {'yes' if within else 'NO'}")


if __name__ == "__main__":
    main()
