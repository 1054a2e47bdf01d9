"""What the backends share: the driver-import guard, fault and malformed-entry errors,
versions, ttl rounding, the clock floor of fences and the garbage-collection knobs, a
base class with the fork hooks, and the sleeping wait of blocking caches."""

from __future__ import annotations

import contextlib
import math
import random
import threading
import time
from collections.abc import Iterator, Sequence

from simple_mutex._runtime import forksafe
from simple_mutex.errors import ConstraintError, MalfunctionError, bad_input

from . import registry


@contextlib.contextmanager
def driver_imports(backend: str) -> Iterator[None]:
    """Wrap a backend module's driver imports: a missing driver names the extra to install."""
    try:
        yield
    except ImportError as exc:
        found = registry.named(backend)
        raise ConstraintError(
            f"{found.cls} needs {' and '.join(found.drivers)}: "
            f"pip install 'simple-mutex[{found.extra}]'"
        ) from exc


def fault(
    backend: str,
    operation: str,
    key: str,
    exc: BaseException,
    place: str = "",
    *,
    lasting: bool = False,
) -> MalfunctionError:
    """A driver's error as users see it: which cache, doing what, on which key, and why.
    ``lasting``: the backend's mapping judged it a refusal that does not pass by itself
    (permission denied), which a waiter raises at once; any other fault it rides out."""
    detail = str(exc).strip()
    cause = f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
    return MalfunctionError(
        f"{backend} cache{place} failed during {operation} on {key!r}: {cause}",
        key=key,
        lasting=lasting,
    )


def malformed(backend: str, operation: str, key: str, detail: str) -> MalfunctionError:
    """The one rule for an entry this library did not write, on every tier: a fault from
    every operation that reads it, never a busy key (which would hide it behind timeouts)."""
    return MalfunctionError(
        f"{backend} cache found a malformed entry for {key!r} during {operation} ({detail}); "
        "is another program writing under this prefix?",
        key=key,
        lasting=True,  # waiting does not repair a record
    )


def new_version() -> str:
    """A version for one write: 64 random bits, so a stale version never matches again."""
    return f"{random.getrandbits(64):016x}"


TOOK_OVER = "+"
"""Ends the version a grant writes over a record whose holder never freed it (it lapsed),
on the tiers whose one statement sees the old record but returns only the new one (SQL's
``RETURNING``, MongoDB's ``ReturnDocument.AFTER``): the put tells ``Entry.took_over`` from
the version it gets back. ``new_version`` writes hex, so the mark is never part of one."""


def took_over_version(version: str) -> str:
    """The version a grant written as ``version`` has when it took over a lapsed record."""
    return version + TOOK_OVER


def clock_fence(seconds: float) -> int:
    """The clock floor of a fence: Unix time in whole microseconds (about 1.8e15 in 2026,
    exact in JSON and in a double up to 2**53, the year 2255).

    Every tier grants ``max(previous fence + 1, clock_fence(now))`` in the grant's own
    atomic step, so a counter that is lost (collected, flushed, restarted without
    persistence, a failover that missed the last write) never makes a fence go back: the
    clock has moved past every fence granted before, unless it stepped back further than
    the time since (docs/guides/leases.md)."""
    return int(seconds * 1_000_000)


DEFAULT_GC_AFTER = 60.0
"""Seconds a freed or expired key's fence is kept before it may be collected: the clock
floor covers it after that, for any clock step back smaller than this."""


def gc_after_seconds(owner: str, value: object) -> float | None:
    """A ``gc_after`` option: seconds in [0, 2**31), or None for no garbage collection."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 2**31:
        raise bad_input(
            value, (int, float),
            f"{owner} gc_after must be seconds in [0, 2**31) or None (collect nothing), "
            f"got {value!r}",
        )  # fmt: skip
    return float(value)


def gc_due() -> bool:
    """Whether this grant also runs a collection pass: one grant in 64, at random, so that
    many short-lived processes collect as surely as one long-lived one."""
    return random.getrandbits(6) == 0


def prefix_end(prefix: str) -> str | None:
    """The least string above every string that starts with ``prefix`` (code point order,
    which is UTF-8 byte order too), or None when there is none (an empty prefix): the
    exclusive end of an index range that lists exactly the keys under ``prefix``."""
    while prefix:
        last = ord(prefix[-1]) + 1
        if last == 0xD800:  # surrogates are not characters: the next one is U+E000
            last = 0xE000
        if last <= 0x10FFFF:
            return prefix[:-1] + chr(last)
        prefix = prefix[:-1]
    return None


def ttl_ms(ttl: float) -> int:
    """The ttl in whole ms, rounded up: the cache's expiry never comes before the holder's
    own deadline."""
    return max(1, math.ceil(ttl * 1000))


class CacheBase:
    """Registered for fork safety (``_guard`` is held while the process forks). Backends
    override the hooks they need."""

    name = "cache"

    def __init__(self) -> None:
        self._guard = threading.Lock()
        forksafe.register(self)

    def _before_fork(self) -> None:
        """In the parent, ``_guard`` held, just before the process is copied."""

    def _after_fork(self) -> None:
        """In the child: drop what belongs to the parent (connections, waiters)."""


class SleepingWait:
    """The ``wait`` of a blocking cache that cannot notify: a sleep, the engine's jittered
    poll doing the rest. (Not in ``CacheBase``: an asyncio face's ``wait`` is a coroutine.)"""

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        time.sleep(max(timeout, 0.0))
