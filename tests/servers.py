"""Servers a test run starts for itself, on free loopback ports: never a shared one, and
never a fixed port (other test runs share this machine). ``scripts`` is
scripts/servers.py, whose starters (a secantusd-py, a weed mini, a redis-server) the
extras check uses too."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"  # the support modules and scripts every test folder shares


def load_module(path: Path) -> ModuleType:
    """Import a module by its path (scripts/ and docs/hooks/ are not packages)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


scripts = load_module(ROOT / "scripts" / "servers.py")


def free_port(also: int = 0) -> int:
    """A loopback port nobody listens on now (and port + ``also`` too, for a Redis
    Cluster's bus)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not also:
            return port
        if port + also < 65536:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + also))
                    return port
                except OSError:
                    pass


class OwnServer:
    """A server process run in the foreground, its output in ``workdir/<name>.log``."""

    def __init__(
        self, args: list[str], workdir: Path, answers: Callable[[], bool], **popen: object
    ) -> None:
        self.args, self.workdir, self.answers, self.popen = args, workdir, answers, popen
        self.log = workdir / f"{Path(args[0]).name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 30) -> OwnServer:
        """Start it and wait until it answers; fail the test, with its log, if it does not."""
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.args, stdout=out, stderr=subprocess.STDOUT, cwd=self.workdir,
                start_new_session=True, **self.popen,  # type: ignore[call-overload]
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while not self.answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"{self.args[0]} did not answer:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.02)
        return self

    def stop(self, grace: float = 5) -> None:
        """Politely, then by force; waits until it is gone."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


class RedisServer(OwnServer):
    """A redis-server (or Sentinel, from a config file) a test runs in the foreground, with
    nothing kept on disk."""

    def __init__(self, port: int, workdir: Path, *extra: str, config: Path | None = None):
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not on PATH (apt-get install -y redis-server)")
        head = [binary, str(config), "--sentinel"] if config else [binary, "--save", ""]
        args = [*head, "--appendonly", "no", "--dir", str(workdir), "--port", str(port)]
        super().__init__([*args, "--bind", "127.0.0.1", *extra], workdir, self._pings)
        self.port = port

    def _pings(self) -> bool:
        probe = redis.Redis(port=self.port, socket_timeout=0.5, retry=Retry(NoBackoff(), 0))
        with contextlib.suppress(redis.ConnectionError), probe:
            return bool(probe.ping())
        return False

    def shutdown(self) -> None:
        conn = redis.Redis(port=self.port, socket_timeout=1, retry=Retry(NoBackoff(), 0))
        with contextlib.suppress(redis.ConnectionError):  # it hangs up as it goes
            conn.shutdown(nosave=True)
        assert self.proc is not None
        self.proc.wait(5)


def own_redis(servers: list[RedisServer], workdir: Path, port: int, *extra: str) -> RedisServer:
    workdir.mkdir(parents=True, exist_ok=True)
    server = RedisServer(port, workdir, *extra)
    servers.append(server)
    server.start()
    return server


def own_cluster(servers: list[RedisServer], workdir: Path) -> list[int]:
    """A three-master Redis Cluster of servers this test owns; the masters' ports, once
    the cluster reports ok."""
    ports = [free_port(also=10_000) for _ in range(3)]  # and each one's cluster bus
    for port in ports:
        node_dir = workdir / str(port)
        node_dir.mkdir()
        own_redis(servers, node_dir, port, "--cluster-enabled", "yes",
                  "--cluster-config-file", str(node_dir / "nodes.conf"))  # fmt: skip
    subprocess.run(
        ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
         "--cluster-replicas", "0", "--cluster-yes"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    deadline = time.monotonic() + 15
    while any(redis.Redis(port=p).cluster("info")["cluster_state"] != "ok" for p in ports):
        assert time.monotonic() < deadline, "cluster did not become ok"
        time.sleep(0.1)
    return ports


class PostgresServer:
    """A PostgreSQL cluster of this test's own, on a free port: the shared server is never
    stopped (other test runs use it at the same time). initdb runs as the postgres user
    when we are root (PostgreSQL refuses to run as root)."""

    def __init__(self) -> None:
        versions = sorted(Path("/usr/lib/postgresql").glob("*/bin"))
        if not versions:
            raise RuntimeError("no /usr/lib/postgresql/*/bin (apt-get install -y postgresql)")
        self.bin = versions[-1]
        self.dir = Path(tempfile.mkdtemp(prefix="simple-mutex-pg-"))
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self.user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        self.extra = ""  # more server options for pg_ctl -o (test_tls.py: ssl=on ...)
        if self.user:
            shutil.chown(self.dir, "postgres")
        self._run("initdb", "-D", "data", "-A", "trust", "-U", "postgres", "--no-sync")

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run(
            [*self.user, str(self.bin / tool), *args],
            check=True, capture_output=True, timeout=120, cwd=self.dir,
        )  # fmt: skip

    def pg_ctl(self, action: str) -> None:
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        options += f" {self.extra}" if self.extra else ""
        self._run("pg_ctl", "-D", "data", "-l", "log", "-w", "-o", options, action)

    def remove(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self.pg_ctl("stop")
        shutil.rmtree(self.dir, ignore_errors=True)


class EtcdMember(OwnServer):
    """One member of an etcd cluster of this test's own: its client and peer ports, its
    data in ``workdir/<name>``. Fast elections (50 ms heartbeat, 500 ms election
    timeout), so the server's minimum lease TTL is 1 s, not 2 s."""

    def __init__(self, name: str, client: int, peer: int, cluster: str, workdir: Path) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            pytest.fail("etcd is not on PATH (apt-get install -y etcd-server)")
        self.name, self.client_port, self.peer_port = name, client, peer
        self.endpoint = f"127.0.0.1:{client}"
        data = workdir / name
        args = [
            binary, "--name", name, "--data-dir", str(data),
            "--listen-client-urls", f"http://{self.endpoint}",
            "--advertise-client-urls", f"http://{self.endpoint}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", cluster, "--initial-cluster-token", workdir.name,
            "--initial-cluster-state", "new",
            "--heartbeat-interval", "50", "--election-timeout", "500",
            "--logger", "zap", "--log-level", "warn",
        ]  # fmt: skip
        super().__init__(args, workdir, self._answers)
        self.log = workdir / f"{name}.log"

    def _answers(self) -> bool:
        return self.status() is not None

    def status(self) -> dict[str, object] | None:
        """The member's /v3/maintenance/status reply (its leader's id...), or None."""
        import requests

        try:
            reply = requests.post(
                f"http://{self.endpoint}/v3/maintenance/status", json={}, timeout=0.5
            )
        except requests.RequestException:
            return None
        if reply.status_code != 200:
            return None
        found: dict[str, object] = reply.json()
        return found if "leader" in found else None

    def kill(self) -> None:
        """SIGKILL: no goodbye to the other members."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(5)


class EtcdCluster:
    """Three etcd members on free loopback ports, each its own data directory under a
    temporary one; ``start`` returns once every member answers and a leader is elected."""

    # A port picked free can be taken by another test worker before etcd binds it, and a
    # member that exits leaves no way to tell that from other causes but its log: a new
    # cluster on new ports, up to three times, each failure's log kept for the report.
    TRIES = 3

    def __init__(self, size: int = 3) -> None:
        self.size = size
        self.dir = Path(tempfile.mkdtemp(prefix="simple-mutex-etcd-"))
        self.members = self._plan(0)

    def _plan(self, attempt: int) -> list[EtcdMember]:
        workdir = self.dir / f"try{attempt}"
        workdir.mkdir()
        ports = [(free_port(), free_port()) for _ in range(self.size)]
        cluster = ",".join(f"m{n}=http://127.0.0.1:{peer}" for n, (_, peer) in enumerate(ports))
        return [
            EtcdMember(f"m{n}", client, peer, cluster, workdir)
            for n, (client, peer) in enumerate(ports)
        ]

    @property
    def endpoints(self) -> list[str]:
        return [member.endpoint for member in self.members]

    def start(self, timeout: float = 30) -> EtcdCluster:
        failures: list[str] = []
        for attempt in range(self.TRIES):
            if attempt:
                self.members = self._plan(attempt)
            failure = self._start_once(timeout)
            if failure is None:
                return self
            failures.append(failure)
            for member in self.members:
                member.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
        pytest.fail("\n\n".join(failures))

    def _start_once(self, timeout: float) -> str | None:
        """None once every member answers, else why not (with the member's log, read
        before anything is removed)."""
        # Every member before waiting on one: a member answers only once a quorum is up.
        for member in self.members:
            with member.log.open("ab") as out:
                member.proc = subprocess.Popen(
                    member.args, stdout=out, stderr=subprocess.STDOUT, cwd=member.workdir,
                    start_new_session=True,
                )  # fmt: skip
        deadline = time.monotonic() + timeout
        for member in self.members:
            while not member.answers():
                if member.proc is None or member.proc.poll() is not None:
                    return f"etcd {member.name} exited:\n{member.log.read_text()[-2000:]}"
                if time.monotonic() > deadline:
                    return f"etcd {member.name} did not answer:\n{member.log.read_text()[-2000:]}"
                time.sleep(0.05)
        return None

    def leader(self, timeout: float = 15) -> EtcdMember:
        """The member that is the leader now (waits for an election to end)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for member in self.members:
                status = member.status()
                if status is not None and status["leader"] == status["header"]["member_id"]:  # type: ignore[index]
                    return member
            time.sleep(0.05)
        raise AssertionError("no etcd leader was elected")

    def stop(self) -> None:
        for member in self.members:
            member.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


# -- servers a test session starts once ------------------------------------------------
#
# Every suite that needs one of these asks for the session's (conftest.py imports them),
# so a session starts each at most once, however many modules use it; under pytest-xdist
# each worker is a session of its own, with servers of its own. A suite whose test breaks
# its server (kills a member, fills its disk) starts one of its own instead.


@contextlib.contextmanager
def _given_or_started(variable: str, start: Callable[[], Any]) -> Iterator[str]:
    """The server ``variable`` names (a real one: ``MONGODB_URL``, ...), else one of our
    own that ``start`` runs for the session."""
    given = os.environ.get(variable)
    with contextlib.nullcontext(given) if given else start() as url:
        yield url


@pytest.fixture(scope="session")
def mongo_url() -> Iterator[str]:
    """MONGODB_URL, or a secantusd-py of the session's; fails (never skips) if none
    answers. Each suite writes into a database named for its run."""
    import pymongo

    with _given_or_started("MONGODB_URL", scripts.mongo_server) as url:
        with pymongo.MongoClient(url, serverSelectionTimeoutMS=3000) as probe:
            try:
                probe.admin.command("ping")
            except pymongo.errors.PyMongoError as exc:
                pytest.fail(f"no MongoDB answers at {url}: {exc!r}")
        yield url


@pytest.fixture(scope="session")
def seaweed() -> Iterator[str]:
    """S3_SEAWEED_ENDPOINT, or a SeaweedFS (``weed mini``) of the session's: its S3
    endpoint. Each suite makes its own bucket (``s3_bucket``)."""
    with _given_or_started("S3_SEAWEED_ENDPOINT", scripts.s3_server) as endpoint:
        yield endpoint


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """``moto_server`` on a free loopback port; yields its endpoint."""
    binary = shutil.which("moto_server", path=os.path.dirname(sys.executable))
    binary = binary or shutil.which("moto_server")
    if binary is None:
        pytest.fail("no `moto_server` binary: pip install moto")
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="simple-mutex-moto-") as workdir:
        args = [binary, "-H", "127.0.0.1", "-p", str(port)]
        server = OwnServer(args, Path(workdir), lambda: scripts._http_answers(endpoint + "/"))
        server.start()
        try:
            yield endpoint
        finally:
            server.stop(grace=10)


@pytest.fixture(scope="session")
def moto() -> Iterator[str]:
    """S3_MOTO_ENDPOINT, or moto's server of the session's (AWS's own error codes)."""
    with _given_or_started("S3_MOTO_ENDPOINT", moto_server) as endpoint:
        yield endpoint


def s3_bucket(endpoint: str, bucket: str) -> str:
    """Make ``bucket`` on the S3 server at ``endpoint`` unless it is there; fails the test
    (never skips it) when the server does not answer."""
    import boto3
    from botocore.exceptions import ClientError

    client = boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1",
        aws_access_key_id=scripts.S3_ACCESS_KEY, aws_secret_access_key=scripts.S3_SECRET_KEY,
    )  # fmt: skip
    try:
        client.create_bucket(Bucket=bucket)
    except ClientError as exc:
        if "BucketAlready" not in str(exc):
            raise
    except Exception as exc:
        pytest.fail(f"no S3 server answers at {endpoint}: {exc!r}")
    return bucket


@pytest.fixture(scope="session")
def etcd_cluster() -> Iterator[EtcdCluster]:
    """A three-member etcd cluster of the session's. Suites keep to prefixes of their own;
    a test that kills a member starts a cluster of its own."""
    started = EtcdCluster().start()
    yield started
    started.stop()
