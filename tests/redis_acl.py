"""Redis users made from ``RedisCache.acl_rules()`` for the suites that run as one.

Each user has a unique name and a random password, starts from ``reset`` (no keys, no
commands, and ``resetchannels``: Redis 7's default that broke a lock library's scripts)
and gets nothing but the rules; it is deleted when the block ends. Creating users on the
shared server is harmless to other runs: no existing user is touched.
"""

from __future__ import annotations

import contextlib
import secrets
import uuid
from collections.abc import Iterator, Sequence
from urllib.parse import quote, urlsplit, urlunsplit

import redis


@contextlib.contextmanager
def lock_user(admin: redis.Redis, *rule_sets: Sequence[str]) -> Iterator[tuple[str, str]]:
    """A user made from ``reset resetchannels`` plus the union of ``rule_sets``: its
    name and password."""
    name = f"sm-test-{uuid.uuid4().hex[:12]}"
    password = secrets.token_hex(16)
    rules = list(dict.fromkeys(word for rules in rule_sets for word in rules))
    admin.execute_command(
        "ACL", "SETUSER", name, "reset", "on", f">{password}", "resetchannels", *rules
    )
    try:
        yield name, password
    finally:
        admin.acl_deluser(name)


def url_as(url: str, user: str, password: str) -> str:
    """``url`` with its credentials replaced by ``user`` and ``password``."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    return urlunsplit(parts._replace(netloc=netloc))
