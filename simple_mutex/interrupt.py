"""Interrupt a thread that is running protected work on a lapsed lease.

CPython lets one thread schedule an exception in another (``PyThreadState_SetAsyncExc``);
the target raises it at its next bytecode boundary. What that can and cannot reach:

* Python code, including loops that never call into the library: interrupted at once.
* A blocking C call (``time.sleep``, a socket read without timeout, a long NumPy or
  database-driver call) is *not* cut short: the exception is raised when the call returns
  to Python. Give such calls their own timeouts shorter than the lease.
* Code that catches ``Exception`` broadly may swallow the interrupt; the lease's context
  manager still raises ``SimpleMutexLeaseExpiredError`` when the block exits.

The exception class is made per lease, so a nested lock's exit can tell whose loss it is,
and carries the key so it reads well even if it escapes untranslated.
"""

from __future__ import annotations

import ctypes
from typing import Any

from .errors import SimpleMutexLeaseExpiredError, _rebuild

# Two prototypes of one C function: one passes an exception class, one passes NULL
# (which withdraws a pending exception).
_set_async_exc = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.py_object)(
    ("PyThreadState_SetAsyncExc", ctypes.pythonapi)
)
_clear_async_exc = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)(
    ("PyThreadState_SetAsyncExc", ctypes.pythonapi)
)


class LeaseInterrupt(SimpleMutexLeaseExpiredError):
    """Raised inside the protected block when its lease is lost."""

    lost_message = "lease lost"
    lost_key: str | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Raised by CPython as cls(): take the message and key from the class. Rebuilt
        # from serialized args (Celery's JSON results), keep the ones given.
        message = str(args[0]) if args else self.lost_message
        key = args[1] if len(args) > 1 else self.lost_key
        super().__init__(message, key=key)

    def __reduce__(self) -> tuple[Any, ...]:
        # The per-lease class cannot be found by pickle: travel as the public error.
        return _rebuild, (SimpleMutexLeaseExpiredError, self.message, self.key)


def interrupt_class(key: str, message: str) -> type[LeaseInterrupt]:
    return type("LeaseInterrupt", (LeaseInterrupt,), {"lost_message": message, "lost_key": key})


def raise_in_thread(thread_id: int, exc_class: type[BaseException]) -> None:
    _set_async_exc(thread_id, exc_class)


def cancel_pending(thread_id: int) -> None:
    """Withdraw an interrupt that was scheduled but has not been raised yet."""
    _clear_async_exc(thread_id, None)
