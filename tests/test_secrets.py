"""Secrets stay out of every output channel: a password in a Redis or PostgreSQL URL (and
S3 credentials from the environment) never appears in logs (every logger, DEBUG), lock
events, the journal, ``repr`` of caches, locks and leases, ``holder()``, the messages of
errors (busy, timed out, a fault, a refused login, a bad URL), or the CLI's output.

Each run is a real one: the Redis password is that of a user made for the test (the
server checks it), the PostgreSQL one that of a role made for the test.
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from redis_acl import lock_user, url_as

from simple_mutex import Mutex, SimpleMutexError, cache_from_url, events, journal
from simple_mutex.caches import RedisCache

pytestmark = pytest.mark.backends

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES_URL = os.environ.get("POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
BIN = Path(sys.executable).parent
RUN = uuid.uuid4().hex[:8]


def _said(call: Callable[[], Any], seen: list[str]) -> Any:
    """Run ``call``; its result's repr, or its error's message and repr, go to ``seen``."""
    try:
        result = call()
    except SimpleMutexError as exc:
        seen.extend([str(exc), repr(exc), repr(exc.args), repr(exc.__cause__)])
        return None
    seen.append(repr(result))
    return result


def scan(url: str, prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> list[str]:
    """Everything a run of locks on ``url`` says, channel by channel."""
    seen: list[str] = []
    caplog.set_level(logging.DEBUG)  # every logger: ours and the drivers'
    stop_journal = journal.start(tmp_path / "journal")
    stop_events = events.subscribe(lambda event: seen.append(repr(event)))
    try:
        cache = cache_from_url(url)
        locks = Mutex(cache, lease=30, prefix=prefix, name="secrets")
        seen += [repr(cache), repr(locks)]
        lease = _said(lambda: locks.acquire("k", timeout=5, renew=True), seen)
        assert lease is not None, seen
        _said(lease.renew, seen)
        _said(lambda: locks.holder("k"), seen)
        _said(lambda: locks.try_acquire("k"), seen)  # busy
        _said(lambda: locks.acquire("k", timeout=0.2), seen)  # timed out
        _said(lease.release, seen)
        run = subprocess.run(
            [str(BIN / "simple-mutex"), "list", url, "--prefix", prefix],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        seen += [run.stdout, run.stderr]
        with locks.acquire("shown", timeout=5):
            for command in (["show", url, "shown"], ["list", url, "--json"]):
                run = subprocess.run(
                    [str(BIN / "simple-mutex"), *command, "--prefix", prefix],
                    capture_output=True, text=True, timeout=60,
                )  # fmt: skip
                assert run.returncode == 0, run.stderr  # it did show the lock
                assert "shown" in run.stdout
                seen += [run.stdout, run.stderr]
    finally:
        stop_events()
        stop_journal()
    seen += [path.read_text() for path in (tmp_path / "journal").glob("*")]
    seen += [record.getMessage() for record in caplog.records]
    seen += [repr(record.args) for record in caplog.records]
    assert any('"kind":"acquired"' in text for text in seen)  # the journal was written
    return seen


def faults(url: str, seen: list[str]) -> None:
    """A URL the library refuses, and the CLI on it: messages only."""
    _said(lambda: cache_from_url(url + ("&" if "?" in url else "?") + "bogus_option=1"), seen)
    run = subprocess.run(
        [str(BIN / "simple-mutex"), "list", url + "?bogus_option=1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    seen += [run.stdout, run.stderr]


def test_a_redis_password_appears_in_no_output(tmp_path: Path, caplog) -> None:
    """A user made for the test, its password in the URL; then a wrong password (the
    server refuses the login) and a server that is not there."""
    admin = redis.Redis.from_url(REDIS_URL)
    prefix = f"sec{RUN}."
    with lock_user(admin, RedisCache.acl_rules((prefix,))) as (user, password):
        url = url_as(REDIS_URL, user, password)
        seen = scan(url, prefix, tmp_path, caplog)
        faults(url, seen)
        wrong = secrets.token_hex(8)
        _said(lambda: Mutex(cache_from_url(url_as(REDIS_URL, user, wrong))).acquire("k"), seen)
        gone = f"redis://{user}:{password}@127.0.0.1:1/0?socket_connect_timeout=0.5"
        _said(lambda: Mutex(cache_from_url(gone)).acquire("k", timeout=0.5), seen)
        assert any("AuthenticationError" in text or "WRONGPASS" in text for text in seen)
    admin.close()
    leaks = [text for text in seen if password in text or wrong in text]
    assert not leaks, leaks[:3]


def test_a_postgres_password_appears_in_no_output(tmp_path: Path, caplog) -> None:
    """A role made for the test, with a password, on a table made for it beforehand."""
    role, password, table = f"sec_{RUN}", secrets.token_hex(12), f"sec_{RUN}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE \"{role}\" LOGIN PASSWORD '{password}'")
        try:
            cache_from_url(f"{POSTGRES_URL}?table={table}").get("x")  # the table, as owner
            admin.execute(f'GRANT SELECT, INSERT, UPDATE, DELETE ON "{table}" TO "{role}"')
            host = POSTGRES_URL.partition("@")[2]
            url = f"postgresql://{role}:{password}@{host}?table={table}"
            seen = scan(url, f"sec{RUN}.", tmp_path, caplog)
            faults(f"postgresql://{role}:{password}@{host}", seen)
            gone = f"postgresql://{role}:{password}@127.0.0.1:1/x?connect_timeout=1"
            _said(lambda: Mutex(cache_from_url(gone)).acquire("k", timeout=0.5), seen)
        finally:
            admin.execute(f'DROP TABLE IF EXISTS "{table}"')
            admin.execute(f'DROP OWNED BY "{role}"')
            admin.execute(f'DROP ROLE "{role}"')
    leaks = [text for text in seen if password in text]
    assert not leaks, leaks[:3]


def test_s3_credentials_appear_in_no_output(monkeypatch) -> None:
    """Credentials from the environment, an endpoint that refuses: the cache's repr and
    the fault's message carry neither key."""
    key_id, secret = f"AKIA{RUN.upper()}", secrets.token_hex(20)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    seen: list[str] = []
    cache = cache_from_url("s3://bucket/locks?endpoint_url=http://127.0.0.1:1")
    seen.append(repr(cache))
    _said(lambda: Mutex(cache).acquire("k", timeout=0.5), seen)
    assert len(seen) > 1
    leaks = [text for text in seen if secret in text or key_id in text]
    assert not leaks, leaks[:3]
