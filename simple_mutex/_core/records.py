"""The lock record a holder writes (JSON, never pickle) and what ``holder()`` shows of it.

The record names the holder for people (host, pid, label, when) and carries the secret
token that proves ownership. The token never leaves this module through ``Holder``.
"""

from __future__ import annotations

import functools
import json
import os
import re
import secrets
import socket
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from simple_mutex.contract import Entry
from simple_mutex.errors import MalfunctionError, bad_input

_HOST_JSON = json.dumps(socket.gethostname())


def new_token() -> str:
    """An unguessable owner token: 128 bits from ``secrets``, as hex."""
    return secrets.token_hex(16)


_TOKEN_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


def check_token(token: object) -> str:
    """A caller-chosen token: it goes verbatim into the JSON record, so only plain
    characters. Making it unique (a task id) is the caller's part."""
    if not isinstance(token, str) or not _TOKEN_RE.fullmatch(token):
        raise bad_input(
            token,
            str,
            "token must be 1 to 128 characters from A-Z a-z 0-9 _ . : -, "
            f"got {type(token).__name__} of length {len(token) if isinstance(token, str) else 0}",
        )
    return token


EVICTED_BY = "evicted by "
"""How the label of a record that stands for a moment in an evicted holder's place
begins (``Mutex.evict``): no holder to stop, it is deleted right after it is written."""


def encode_record(token: str, label: str | None, acquired_at: float, key: str | None = None) -> str:
    """The JSON record. Formatted by hand (json.dumps was a third of an in-memory cycle):
    the token is hex and the pid an int, so only host and label need escaping. ``key`` is
    the user's key, written only when its cache key was hashed (too long to decode back):
    ``simple_mutex.admin`` then reads it from here."""
    # The pid is read at call time: a forked child is a different holder.
    tail = "" if key is None else f',"key":{json.dumps(key)}'
    return (
        f'{{"v":1,"token":"{token}","host":{_HOST_JSON},"pid":{os.getpid()},'
        f'"label":{_json_str(label)},"acquired_at":{acquired_at:.6f}{tail}}}'
    )


def record_key(entry: Entry, cache_name: str, key: str) -> str | None:
    """The user's key a record carries (only records of hashed keys carry one)."""
    found = _decode(entry, cache_name, key).get("key")
    return found if isinstance(found, str) else None


@functools.lru_cache(maxsize=256)
def _json_str(text: str | None) -> str:
    return json.dumps(text)


def record_token(entry: Entry, cache_name: str, key: str) -> str:
    return str(_decode(entry, cache_name, key)["token"])


@dataclass(frozen=True)
class Holder:
    """Who holds a lock, for people and dashboards. Never carries the token."""

    host: str
    pid: int
    label: str | None
    acquired_at: datetime
    expires_at: datetime
    fence: int
    slot: int = 0


def holder_of(entry: Entry, cache_name: str, key: str, slot: int) -> Holder:
    record = _decode(entry, cache_name, key)
    try:
        return Holder(
            host=str(record["host"]),
            pid=int(record["pid"]),
            label=None if record.get("label") is None else str(record["label"]),
            acquired_at=datetime.fromtimestamp(float(record["acquired_at"]), timezone.utc),
            expires_at=datetime.fromtimestamp(entry.expires_at, timezone.utc),
            fence=entry.fence,
            slot=slot,
        )
    except (KeyError, TypeError, ValueError, OverflowError, OSError) as exc:
        # OverflowError: a pid or time of 1e400 (JSON's Infinity) or 2**1000; OSError:
        # a time the platform's gmtime cannot take. Each is a record we never wrote.
        raise MalfunctionError(
            f"{cache_name} cache holds a malformed lock record for key {key!r}: {exc!r}",
            key=key,
        ) from None


def _decode(entry: Entry, cache_name: str, key: str) -> dict[str, Any]:
    try:
        record = json.loads(entry.value)
    except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested 10**5 deep
        record = None
    if not isinstance(record, dict) or not isinstance(record.get("token"), str):
        raise MalfunctionError(
            f"{cache_name} cache holds a value for key {key!r} that is not a lock record; "
            "is another program writing under the lock prefix?",
            key=key,
        )
    return record
