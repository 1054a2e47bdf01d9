"""Fenced writes to Redis: the value and its fence in one hash, compared and written by
one Lua script. One key per value, so the script runs on Redis Cluster as it is."""

from __future__ import annotations

from typing import Any

from simple_mutex._core.durations import positive_seconds
from simple_mutex.errors import ConstraintTypeError, FencedOutError, MalfunctionError

from ._common import check_fence

# KEYS[1]  the hash: field "v" the value, field "f" its fence (a decimal string)
# ARGV[1]  our fence, decimal, no leading zeros   ARGV[2] the value
# ARGV[3]  a ttl in ms, or "" to keep the key (and so its fence) forever
# returns  {1, ours} written, or {0, stored} refused: the stored fence is larger
# Fences are compared as decimal strings (length, then bytes): Lua's numbers are doubles,
# exact only below 2**53, and a fence may reach 2**63 - 1.
_SET = """
local stored = redis.call('HGET', KEYS[1], 'f')
if stored and (#stored > #ARGV[1] or (#stored == #ARGV[1] and stored > ARGV[1])) then
    return {0, stored}
end
redis.call('HSET', KEYS[1], 'v', ARGV[2], 'f', ARGV[1])
if ARGV[3] == '' then redis.call('PERSIST', KEYS[1])
else redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
return {1, ARGV[1]}
"""


def _value(value: object) -> bytes | str | int | float:
    if isinstance(value, (bytes, str, int, float)) and not isinstance(value, bool):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise ConstraintTypeError(
        f"value must be bytes, str, int or float (serialize it first), got {type(value).__name__}"
    )


def fenced_set(client: Any, key: str, value: object, *, fence: int, ttl: object = None) -> None:
    """Write ``value`` under ``key`` unless the key holds a larger fence than ``fence``
    (an equal one is accepted); raise ``FencedOutError`` if it does.

    ``ttl`` (a duration; default: none) expires the key, and with it the fence: after it
    lapses a stale holder's write is accepted as a first one. Pick it longer than any pause.
    Read the pair back with ``fenced_get``; the key is a hash (``v``, ``f``).
    """
    fence = check_fence(fence)
    if not isinstance(key, (str, bytes)):
        raise ConstraintTypeError(f"key must be a str, got {type(key).__name__}")
    ttl_ms = "" if ttl is None else str(max(1, round(positive_seconds(ttl, "ttl") * 1000)))
    import redis

    try:
        written, stored = client.register_script(_SET)(
            keys=[key], args=[str(fence), _value(value), ttl_ms]
        )
    except redis.RedisError as exc:
        raise MalfunctionError(f"redis fenced_set of key {key!r} failed: {exc!r}") from exc
    if not int(written):
        raise FencedOutError.refused("redis", f"key {key!r}", fence, int(stored))


def fenced_get(client: Any, key: str) -> tuple[bytes | None, int | None]:
    """``(value, fence)`` that ``fenced_set`` stored under ``key``; ``(None, None)`` when
    there is none. A client with ``decode_responses=True`` still gets bytes."""
    import redis

    try:
        value, fence = client.hmget(key, ["v", "f"])
    except redis.RedisError as exc:
        raise MalfunctionError(f"redis fenced_get of key {key!r} failed: {exc!r}") from exc
    if isinstance(value, str):
        value = value.encode()
    return value, None if fence is None else int(fence)
