"""A private certificate authority for the TLS tests, made with the ``openssl`` command
(scripts/lib.sh installs it when missing; a test fails, never skips, without it).

``make_ca(folder)`` writes ``ca.pem`` and, signed by it, ``server.pem``/``server.key``
for ``localhost`` and 127.0.0.1 and ``wrong.pem``/``wrong.key`` for another host name.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def _openssl(*args: str, cwd: Path) -> None:
    binary = shutil.which("openssl")
    if binary is None:
        pytest.fail("openssl is not on PATH (apt-get install -y openssl)")
    subprocess.run([binary, *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _signed(folder: Path, name: str, host: str, alt: str) -> None:
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
             "-subj", f"/CN={host}", "-out", f"{name}.csr", cwd=folder)  # fmt: skip
    (folder / f"{name}.ext").write_text(f"subjectAltName={alt}\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext",
             "-out", f"{name}.pem", cwd=folder)  # fmt: skip
    (folder / f"{name}.key").chmod(0o600)  # PostgreSQL refuses a key others can read


def make_ca(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key",
             "-subj", "/CN=simple-mutex test CA", "-days", "2", "-out", "ca.pem",
             cwd=folder)  # fmt: skip
    _signed(folder, "server", "localhost", "DNS:localhost,IP:127.0.0.1")
    _signed(folder, "wrong", "wrong.example", "DNS:wrong.example")
    return folder
