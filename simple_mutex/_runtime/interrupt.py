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
import dis
import signal
import sys
import threading
import time
from types import CodeType, FrameType
from typing import Any

from simple_mutex.errors import SimpleMutexLeaseExpiredError, _rebuild

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


# Before CPython 3.12, a thread being started carries the id of the thread that starts it
# until it runs (its state is made by its parent and stamped with its own id only once it
# runs): an exception sent to a holder that is starting a thread at that moment may land
# in the new thread instead, which dies before it ever runs, while the holder, never
# interrupted, waits in Thread.start() for it for good (seen by the nemesis: a holder's
# concurrent renewals; 42 of 300 sends in a loop that starts threads, on 3.11). 3.12
# stamps a thread's own id on it in the thread itself.
_STAMPED_BY_PARENT = sys.version_info < (3, 12)
_SETTLE = 1.0  # how long a send waits for threads being started to run (then sends)


def raise_in_thread(thread_id: int, exc_class: type[BaseException]) -> None:
    if not _STAMPED_BY_PARENT:
        _set_async_exc(thread_id, exc_class)
        return
    # threading.Thread.start() puts a thread in _limbo, under _active_limbo_lock, before
    # its state is made, and takes it out only once it runs with its own id: with that
    # lock held and _limbo empty, no thread's state carries another's id.
    deadline = time.monotonic() + _SETTLE
    while True:
        with threading._active_limbo_lock:  # type: ignore[attr-defined]
            if not threading._limbo or time.monotonic() > deadline:  # type: ignore[attr-defined]
                _set_async_exc(thread_id, exc_class)
                return
        time.sleep(0.0005)


def cancel_pending(thread_id: int) -> None:
    """Withdraw an interrupt that was scheduled but has not been raised yet."""
    _clear_async_exc(thread_id, None)


def pre_empted_signal(exc: BaseException) -> int | None:
    """The signal whose Python handler ``exc`` (our interrupt) landed on before the
    handler ran a single instruction, if any.

    CPython runs a pending signal handler first and raises a pending thread exception at
    the handler's first instruction: when a SIGTERM arrives as the lease lapses, our
    interrupt replaces the handler's ``sys.exit()`` before it runs, and the process lives
    on (found by the nemesis). The handler never ran, so the signal is the caller's to
    deliver again. A handler our interrupt caught part-way is not reported: it ran."""
    tb = exc.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    if tb.tb_lasti > _first_instruction(tb.tb_frame.f_code):
        return None
    return _handled_by(tb.tb_frame)


def _handled_by(frame: FrameType) -> int | None:
    """The signal whose installed Python handler ``frame`` runs, if any. A code object
    alone does not tell: every function a decorator wrapped, and every closure a factory
    made, shares one; their free variables (and a bound handler's ``self``) do."""
    code = frame.f_code
    for signum in signal.valid_signals():
        try:
            handler = signal.getsignal(signum)
        except (OSError, ValueError):  # pragma: no cover - a signal this OS reserves
            continue
        function = getattr(handler, "__func__", handler)
        if getattr(function, "__code__", None) is code and _runs(frame, function, handler):
            return int(signum)
    return None


def _runs(frame: FrameType, function: Any, handler: Any) -> bool:
    """Is ``frame`` (running ``function``'s code) a call of ``handler`` itself?"""
    seen = frame.f_locals
    for name, cell in zip(frame.f_code.co_freevars, function.__closure__ or (), strict=False):
        try:
            if seen.get(name, _MISSING) is not cell.cell_contents:
                return False
        except ValueError:  # an empty cell: nothing to tell them apart by
            continue
    bound = getattr(handler, "__self__", None)
    names = frame.f_code.co_varnames
    return bound is None or not names or seen.get(names[0], _MISSING) is bound


_MISSING = object()


def not_theirs(exc: BaseException) -> bool:
    """Did ``exc`` come from outside the code it was raised in: a Python signal handler
    (a job timeout, a soft time limit, an alarm: the handler is one of the frames it
    passed through) or a lease's interrupt? Code that catches the failures of callbacks
    (event subscribers) must pass such an exception on, or the caller's timeout is lost:
    a handler runs inside whatever Python code the main thread runs at that moment."""
    if isinstance(exc, LeaseInterrupt):
        return True
    tb = exc.__traceback__
    while tb is not None:
        if _handled_by(tb.tb_frame) is not None:
            return True
        tb = tb.tb_next
    return False


def swallowed_by_driver(fault: BaseException) -> BaseException | None:
    """The signal handler's exception (a job timeout) or lease interrupt that a driver
    turned into an error of its own, if ``fault`` (a backend fault) stands for one.

    A driver's broad ``except Exception`` (psycopg's, around parsing a connection string)
    may catch what a signal handler raised while it ran and raise its own error instead:
    the caller's job timeout would become a backend fault, which a waiting acquire treats
    as passing trouble and retries. The exception is still there, as the driver error's
    context; it goes to the caller instead."""
    seen = fault.__cause__ or fault.__context__
    for _ in range(8):  # the chain, bounded
        if seen is None:
            return None
        if isinstance(seen, Exception) and not_theirs(seen):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _first_instruction(code: CodeType) -> int:
    """The offset at which a frame of ``code`` first checks for pending exceptions: its
    RESUME (3.11 on), or before its first instruction (3.10 reports -2 there)."""
    for instruction in dis.get_instructions(code):
        if instruction.opname == "RESUME":
            return instruction.offset
    return -1
