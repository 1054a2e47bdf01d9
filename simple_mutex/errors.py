"""The errors simple-mutex raises.

::

    SimpleMutexError
    ├── ConstraintError                 the caller's to fix (bad option, busy, lease too short)
    │   ├── ConstraintValueError             a bad value (also a ValueError)
    │   ├── ConstraintTypeError              a wrong type (also a TypeError)
    │   ├── SimpleMutexAcquireTimeoutError   (also a TimeoutError)
    │   └── SimpleMutexLeaseExpiredError     the lease lapsed or was taken while the work ran
    │       └── FencedOutError                   a store refused a write: it holds a larger fence
    ├── LineFullError                   a key's line (``on_busy="queue"``) holds ``queue_max``
    ├── MalfunctionError                a system fault: backend down, corrupt record
    └── SimpleCacheConditionError       a precondition miss inside a cache: a lost race;
                                        the engine handles it and it never escapes a Mutex

Every error carries the user's ``key`` verbatim (``None`` when no key was involved, as
for a bad option) so logs can be grepped for it. Every error pickles, because Celery and
RQ serialize exceptions to report them: ``__reduce__`` rebuilds from the message and key.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

MAX_MESSAGE = 600
"""The longest error message, in characters: one that quotes a huge input (a key, a
server's reply) is cut in its middle, so a log line stays a line."""


def _bounded(message: str) -> str:
    if len(message) <= MAX_MESSAGE:
        return message
    cut = len(message) - MAX_MESSAGE + 40
    head = MAX_MESSAGE - 140
    return f"{message[:head]} [... {cut} characters cut ...] {message[head + cut :]}"


def shown(value: object, limit: int = 80) -> str:
    """``repr(value)`` for a message, cut to about ``limit`` characters."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[: limit - 20]}...({len(text)} characters)"


class SimpleMutexError(Exception):
    """The root of every error this library raises."""

    def __init__(self, message: str, key: str | None = None) -> None:
        message = _bounded(message)
        # Both in args: Celery's JSON result backend rebuilds an error as cls(*args).
        super().__init__(message, key)
        self.message = message
        self.key = key

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.message, self.key)

    def __str__(self) -> str:
        return self.message


def _rebuild(cls: type[SimpleMutexError], message: str, key: str | None) -> SimpleMutexError:
    return cls(message, key=key)


class ConstraintError(SimpleMutexError):
    """Something the caller can fix: a bad option, a busy key, a lease too short.

    Not itself a ``ValueError``: a lock that stayed busy (a subclass) must not vanish into
    an ``except ValueError`` around unrelated code. Bad input is raised as one of its two
    subclasses that are: ``ConstraintValueError`` and ``ConstraintTypeError``.
    """


class ConstraintValueError(ConstraintError, ValueError):
    """A bad argument or option value (out of range, an unknown name, malformed): also a
    ``ValueError``, as Python code and the libraries users migrate from expect."""


class ConstraintTypeError(ConstraintError, TypeError):
    """An argument or option of the wrong type (or a call that does not fit the object,
    such as a blocking method on an asyncio cache): also a ``TypeError``."""


def bad_input(
    value: object, expected: type | tuple[type, ...], message: str, key: str | None = None
) -> ConstraintError:
    """The error for a bad argument: a ConstraintTypeError when ``value`` is not an
    ``expected`` (a bool is never taken for a number), else a ConstraintValueError."""
    numbers = expected in (int, float) or (
        isinstance(expected, tuple) and any(t in (int, float) for t in expected)
    )
    if isinstance(value, expected) and not (numbers and isinstance(value, bool)):
        return ConstraintValueError(message, key=key)
    return ConstraintTypeError(message, key=key)


class SimpleMutexAcquireTimeoutError(ConstraintError, TimeoutError):
    """The lock stayed busy for the whole wait ``timeout`` (or on the single try of 0)."""


class SimpleMutexLeaseExpiredError(ConstraintError):
    """The lease lapsed, or could not be renewed, while the protected work was running.

    The work was interrupted (or is reported as unprotected): another holder may have
    entered. Raise the lease above the section's worst case, or use ``renew=True``.
    """


class FencedOutError(SimpleMutexLeaseExpiredError):
    """A fenced write (``simple_mutex.fenced``) was refused: the store already holds a
    larger fence than ours, so a later holder of the lock has written there and this one's
    lease is gone, whatever it believes. A ``SimpleMutexLeaseExpiredError``, so code that
    handles a lost lease handles this too.

    ``fence`` is the fence the refused write carried; ``current`` the store's (``None``
    when the store could not say, e.g. the row vanished before it could be read back);
    ``store`` names where (``"postgresql"``, ``"redis"``, ``"s3"``...); ``key`` the row,
    key or object, as the caller named it.
    """

    def __init__(
        self,
        message: str,
        key: str | None = None,
        *,
        fence: int | None = None,
        current: int | None = None,
        store: str | None = None,
    ) -> None:
        super().__init__(message, key)
        self.fence = fence
        self.current = current
        self.store = store

    @classmethod
    def refused(cls, store: str, key: str, fence: int, current: int | None) -> FencedOutError:
        """The error for ``store`` refusing our ``fence`` on ``key``, in one wording."""
        held = "a larger fence" if current is None else f"fence {current}"
        message = (
            f"{store} refused a write to {key} with fence {fence}: it holds {held}, so a "
            "later holder of the lock has written there (this lease was lost)"
        )
        return cls(message, key, fence=fence, current=current, store=store)

    def __reduce__(self) -> tuple[Any, ...]:
        # The fences travel as state: Celery and RQ pickle the error to report it.
        state = {"fence": self.fence, "current": self.current, "store": self.store}
        return _rebuild, (type(self), self.message, self.key), state


class LineFullError(SimpleMutexError):
    """A send found its key's line (``on_busy="queue"``, ``simple_mutex.busy.line``) full:
    ``limit`` tickets (``queue_max``) are waiting or running already.

    Neither bad input (the call was right) nor a fault (nothing broke): the user's
    choice of ``queue_max`` said to refuse this send, so it is a ``SimpleMutexError`` of
    its own, raised at the send, before anything is published.
    """

    def __init__(self, message: str, key: str | None = None, *, limit: int | None = None) -> None:
        super().__init__(message, key)
        self.limit = limit

    def __reduce__(self) -> tuple[Any, ...]:
        # The limit travels as state: Celery and RQ pickle the error to report it.
        return _rebuild, (type(self), self.message, self.key), {"limit": self.limit}


class MalfunctionError(SimpleMutexError):
    """A system fault: the backend is down or answered nonsense; the message names it.

    ``unsent`` is True when the request provably never reached the server (the connection
    was refused): a write that failed so cannot have landed, and needs no read-back.
    ``withheld`` is True when the server took the write but it must not count (too few
    replicas acknowledged it): it is never read back as a grant, and what may remain of
    it is freed in the background. ``lasting`` is True when the server refused for a
    reason that does not pass by itself (permission denied, a malformed record, a server
    that broke the contract): a waiter raises it at once instead of riding it out as it
    rides out a connection refused, reset or timed out, or an election."""

    unsent = False
    withheld = False
    lasting = False
    denied = False
    """True when the server refused the request for want of rights (a Redis ACL)."""

    def __init__(
        self,
        message: str,
        key: str | None = None,
        *,
        unsent: bool = False,
        withheld: bool = False,
        lasting: bool = False,
    ) -> None:
        super().__init__(message, key)
        self.unsent = unsent
        self.withheld = withheld
        self.lasting = lasting

    def __reduce__(self) -> tuple[Any, ...]:
        # The flags travel as state: Celery and RQ pickle the error to report it, and a
        # rebuilt one must still say whether the write can have landed.
        state = {"unsent": self.unsent, "withheld": self.withheld, "lasting": self.lasting}
        return _rebuild, (type(self), self.message, self.key), state

    def about(self, key: str, cache_keys: Iterable[str]) -> MalfunctionError:
        """Name the user's ``key``, verbatim, where the cache named its own keys."""
        for cache_key in cache_keys:
            self.message = self.message.replace(repr(cache_key), repr(key))
        self.key = key
        self.args = (self.message, key)
        return self


class SimpleCacheConditionError(SimpleMutexError):
    """A cache's precondition missed (the key was present, or its version changed).

    Caches raise it; the lock engine treats it as a lost race. It never escapes a Mutex.
    """


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, on Python 3.10 too (where only ``__notes__`` exists, which
    the traceback module shows from 3.11 on and exceptiongroup's backport shows before)."""
    adder = getattr(exc, "add_note", None)
    if adder is not None:
        adder(note)
        return
    notes = getattr(exc, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
        exc.__notes__ = notes  # type: ignore[attr-defined]
    notes.append(note)


def passes_through(exc: BaseException | None) -> bool:
    """True for what a lock must never replace with its own error (lifecycle rule 13):
    ``KeyboardInterrupt``, ``SystemExit``, ``GeneratorExit`` and asyncio cancellation,
    every exception that is not an ``Exception``. A lost lease is reported beside them
    (a note, a log line, the ``lost`` event), never instead of them."""
    return exc is not None and not isinstance(exc, Exception)


def displaced_by(exc: BaseException) -> BaseException | None:
    """The KeyboardInterrupt, SystemExit... that was unwinding where ``exc`` was raised
    (a lease's interrupt landing in a ``finally:`` that SIGTERM's SystemExit runs), if
    any: that one must leave instead of ``exc``."""
    seen = exc.__context__
    while seen is not None and not passes_through(seen):
        seen = seen.__context__
    return seen
