"""TLS through ``cache_from_url``, against servers this module starts with certificates
of a private CA it makes (tests/tls.py): a ``rediss://`` redis-server and a PostgreSQL
cluster with ``ssl=on``. The right host is trusted through the URL's CA option; a
certificate for another host is refused with a ``MalfunctionError`` that keeps the URL's
scheme and never the password. Never the shared servers: their configuration is not
ours to change.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import PostgresServer, RedisServer, free_port, own_redis
from tls import make_ca

from simple_mutex import MalfunctionError, Mutex, cache_from_url

pytestmark = pytest.mark.backends

PASSWORD = "tls-s3cret-pw"


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = make_ca(tmp_path_factory.mktemp("ca"))
    folder.chmod(0o755)  # the postgres user reads its key from here
    return folder


def tls_redis(servers: list[RedisServer], workdir: Path, ca: Path, cert: str) -> int:
    """A redis-server answering TLS only, with ``cert``; its TLS port."""
    port, tls_port = free_port(), free_port()
    own_redis(
        servers, workdir, port,
        "--tls-port", str(tls_port), "--tls-cert-file", str(ca / f"{cert}.pem"),
        "--tls-key-file", str(ca / f"{cert}.key"), "--tls-ca-cert-file", str(ca / "ca.pem"),
        "--tls-auth-clients", "no",  # default user nopass: AUTH with any password passes
    )  # fmt: skip
    return tls_port


def test_rediss_url_with_a_private_ca(redis_servers, tmp_path: Path, ca: Path) -> None:
    """``rediss://...?ssl_ca_certs=ca.pem`` takes and frees a lock; the same server's
    certificate read against the system's CAs only is refused (no silent trust)."""
    port = tls_redis(redis_servers, tmp_path / "r", ca, "server")
    url = f"rediss://:{PASSWORD}@localhost:{port}/0?ssl_ca_certs={ca / 'ca.pem'}"
    lease = Mutex(cache_from_url(url), lease=10).acquire("tls.k", timeout=2)
    assert lease.release()
    bare = cache_from_url(f"rediss://:{PASSWORD}@localhost:{port}/0?socket_timeout=2")
    with pytest.raises(MalfunctionError, match="rediss://") as refused:
        Mutex(bare).acquire("tls.k", timeout=0)
    assert PASSWORD not in str(refused.value)


def test_rediss_wrong_host_certificate_is_refused_naming_rediss(
    redis_servers, tmp_path: Path, ca: Path
) -> None:
    """A certificate of our CA but for another host: refused, a MalfunctionError whose
    message says rediss:// (it said redis:// before) and never the password."""
    port = tls_redis(redis_servers, tmp_path / "w", ca, "wrong")
    url = f"rediss://:{PASSWORD}@localhost:{port}/0?ssl_ca_certs={ca / 'ca.pem'}"
    with pytest.raises(MalfunctionError) as refused:
        Mutex(cache_from_url(url)).acquire("tls.k", timeout=0)
    message = str(refused.value)
    assert f"rediss://localhost:{port}/0" in message
    assert "certificate" in message.lower() or "hostname" in message.lower()
    assert PASSWORD not in message
    assert PASSWORD not in repr(refused.value)


@pytest.fixture
def tls_postgres(ca: Path) -> Iterator[tuple[PostgresServer, Path]]:
    """Our own PostgreSQL cluster with ssl=on and the server certificate (a copy its
    owner can read), and a password for postgres over TCP."""
    server = PostgresServer()
    certs = server.dir / "certs"
    certs.mkdir()
    for name in ("server.pem", "server.key", "wrong.pem", "wrong.key"):
        shutil.copy(ca / name, certs / name)
    if server.user:
        for path in (certs, *certs.iterdir()):
            shutil.chown(path, "postgres")
    for name in ("server.key", "wrong.key"):
        (certs / name).chmod(0o600)
    yield server, certs
    server.remove()


def _start(server: PostgresServer, certs: Path, cert: str) -> None:
    server.extra = (
        f"-c ssl=on -c ssl_cert_file={certs / (cert + '.pem')} "
        f"-c ssl_key_file={certs / (cert + '.key')}"
    )
    server.pg_ctl("start")


def test_postgresql_verify_full_with_a_private_ca(tls_postgres, ca: Path) -> None:
    """``sslmode=verify-full&sslrootcert=ca.pem`` takes and frees a lock over TLS (the
    server reports the session encrypted); a certificate for another host is refused
    with a MalfunctionError naming postgres, never the password."""
    server, certs = tls_postgres
    _start(server, certs, "server")
    base = f"postgresql://postgres:{PASSWORD}@localhost:{server.port}/postgres"
    url = f"{base}?sslmode=verify-full&sslrootcert={ca / 'ca.pem'}&connect_timeout=5"
    cache = cache_from_url(url)
    lease = Mutex(cache, lease=10).acquire("tls.k", timeout=5)
    conn = cache._conn  # type: ignore[attr-defined]
    assert conn.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone() == (
        True,
    )
    assert lease.release()
    cache.close()  # type: ignore[attr-defined]
    server.pg_ctl("stop")
    _start(server, certs, "wrong")
    with pytest.raises(MalfunctionError, match="postgres") as refused:
        Mutex(cache_from_url(url)).acquire("tls.k", timeout=0)
    message = str(refused.value)
    assert "certificate" in message.lower() or "server name" in message.lower()
    assert PASSWORD not in message
