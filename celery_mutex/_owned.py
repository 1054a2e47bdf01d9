"""Locks owned by a Celery task id: the token is ``"<owner>.<attempt>"``, ``owner`` the
task id (hashed when it holds characters a record or a log should not carry),
``attempt`` the task's ``retries``. So the worker's parent, which sees a child die
(WorkerLostError, hard time limit, ``revoke(terminate=True)``), can free that child's
lock by owner and attempt (``release_where``), and never a retry's. A retry of the same
task id, which ``Task.retry`` publishes *before* the old run unwinds, finds the record
its earlier attempt still holds: it waits for that attempt to let go (up to a lease,
whatever ``on_busy`` says), since the earlier attempt is still running its ``finally:``
blocks under the lock. (Taking the record over, as this did before, ran the retry beside
that clean-up with the same fence.) An ``acks_late`` redelivery of the *same* attempt
(its holder may still run) is busy until the holder frees the lock or its lease lapses
(lifecycle rule 12).
"""

from __future__ import annotations

import hashlib
import re

from simple_mutex import Holder, Lease, Mutex, Semaphore, SimpleMutexError

_SAFE_OWNER = re.compile(r"[A-Za-z0-9_:-]{1,100}")


def owner_of(task_id: str) -> str:
    """The owner part of a token for ``task_id`` (UUIDs pass through unchanged)."""
    if _SAFE_OWNER.fullmatch(task_id):
        return task_id
    return "h" + hashlib.sha256(task_id.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def _split(token: str) -> tuple[str, int]:
    owner, _, attempt = token.rpartition(".")
    return owner, int(attempt) if attempt.isdigit() else -1


class OwnedLocks:
    """A Mutex or Semaphore whose holders are task ids."""

    def __init__(self, space: Mutex | Semaphore) -> None:
        self.space = space

    def acquire(
        self,
        key: str,
        *,
        owner: str,
        attempt: int,
        timeout: float | None,
        renew: bool,
        label: str,
        retry_takes_over: bool = False,
    ) -> Lease:
        """Take a permit of ``key`` for ``owner``; raises SimpleMutexAcquireTimeoutError
        when it stays busy for ``timeout`` (0: one try). ``retry_takes_over``: a record
        that only says "this call started" (a beat tick's), not a lock around work: a
        retry takes it over from its earlier attempt instead of waiting for it."""
        token = f"{owner}.{attempt}"
        if attempt > 0:

            def earlier_attempt(held: str) -> bool:
                held_by, held_attempt = _split(held)
                return held_by == owner and 0 <= held_attempt < attempt

            if retry_takes_over:
                lease = self.space.take_over(
                    key, token=token, owns=earlier_attempt, renew=renew, label=label
                )
                if lease is not None:
                    return lease
            elif self.space.held_by(key, earlier_attempt):
                # Our earlier attempt is unwinding (its finally: blocks run under the
                # lock) or died (its parent frees it once its process is gone): wait.
                timeout = None if timeout is None else max(timeout, self.space.lease)
        return self.space.acquire(key, timeout=timeout, renew=renew, label=label, token=token)

    def release_owner(self, key: str, owner: str, *, attempt: int | None) -> bool:
        """Free the permits of ``key`` that attempt ``attempt`` of ``owner`` holds (None:
        every attempt's), from any process. A retry shares its owner with the attempt
        before it: freeing a dead attempt must leave a live retry's lock alone."""
        if attempt is None:
            return self.space.release_where(key, lambda held: _split(held)[0] == owner)
        return self.space.release_where(key, lambda held: _split(held) == (owner, attempt))

    def evict_owner(self, key: str, owner: str, *, by: str) -> bool:
        """Free every permit of ``key`` that ``owner`` holds while its call may still run
        (a newer call replacing it): its own release then reports the loss."""
        return self.space.evict(key, lambda held: _split(held)[0] == owner, by=by)

    def holder(self, key: str) -> Holder | None:
        """A current holder of ``key``, if any; None also when it cannot be read (it is
        for logs, markers and a second try)."""
        try:
            return self.space.holder(key)
        except SimpleMutexError:  # a fault, never a soft time limit landing here
            return None

    def holder_label(self, key: str) -> str | None:
        """The label of a current holder of ``key`` (``task.name[task id]``), if any."""
        holder = self.holder(key)
        return None if holder is None else holder.label
