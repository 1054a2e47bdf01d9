"""Wake-ups across the processes of one machine: a futex per bucket of keys, in one file.

The file holds ``BUCKETS`` 32-bit counters, mapped shared by every process that uses it.
A key's base (the part before ``#``, so a semaphore's slots share one) hashes to a
bucket. ``wake`` adds one to the bucket's counter and wakes every thread blocked on it;
``block`` sleeps until the counter differs from the one read before, a wake, a signal, or
its timeout. Read the counter, then check the key, then block: a release after the check
changes the counter first, so the block returns at once and no wake-up is lost. Keys that
share a bucket wake each other's waiters early, which a cache's ``wait`` allows.

Linux only (futex(2), through ctypes); ``open_gate`` returns None elsewhere.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import sys
import zlib
from pathlib import Path

BUCKETS = 1024
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE): other processes map it too
_WAKE_ALL = 2**31 - 1
# futex's system call number where we know it (it differs per architecture).
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "riscv64": 98, "ppc64le": 221, "s390x": 238}


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Gate:
    def __init__(self, path: Path, number: int) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size < 4 * BUCKETS:
                os.ftruncate(fd, 4 * BUCKETS)  # zeros; racing openers agree on the size
            self._map = mmap.mmap(fd, 4 * BUCKETS)
        finally:
            os.close(fd)
        self._words = (ctypes.c_uint32 * BUCKETS).from_buffer(self._map)
        self._base = ctypes.addressof(self._words)
        self._futex = ctypes.CDLL(None, use_errno=True).syscall  # releases the GIL
        self._number = ctypes.c_long(number)

    @staticmethod
    def bucket(key: str) -> int:
        return zlib.crc32(key.partition("#")[0].encode("utf-8", "surrogatepass")) % BUCKETS

    def counter(self, bucket: int) -> int:
        return int(self._words[bucket])

    def block(self, bucket: int, counter: int, timeout: float) -> None:
        """Sleep while the bucket's counter is still ``counter``, at most ``timeout`` s.
        Every return is fine (woken, changed already, timed out, interrupted)."""
        whole = int(timeout)
        span = _Timespec(whole, int((timeout - whole) * 1e9))
        self._futex(
            self._number, ctypes.c_void_p(self._base + 4 * bucket), ctypes.c_long(_FUTEX_WAIT),
            ctypes.c_long(counter), ctypes.byref(span), None, ctypes.c_long(0),
        )  # fmt: skip

    def wake(self, bucket: int) -> bool:
        """Move the bucket on and wake its waiters; True if one was blocked."""
        # Not atomic across processes, and needs not be: racing releasers both write a
        # value other than the one a waiter read, and each wakes every waiter.
        self._words[bucket] = (self._words[bucket] + 1) & 0xFFFFFFFF
        woken = self._futex(
            self._number, ctypes.c_void_p(self._base + 4 * bucket), ctypes.c_long(_FUTEX_WAKE),
            ctypes.c_long(_WAKE_ALL), None, None, ctypes.c_long(0),
        )  # fmt: skip
        return int(woken) > 0


def open_gate(path: Path) -> Gate | None:
    """The gate at ``path`` (created when missing), or None where futex(2) is not known or
    the file cannot be mapped: the cache then polls."""
    number = _SYS_FUTEX.get(platform.machine()) if sys.platform == "linux" else None
    if number is None:
        return None
    try:
        return Gate(path, number)
    except (OSError, ValueError):
        return None
