"""Locks owned by a Celery task id: the one place that reaches into the core's internals.

The core's ``Mutex.acquire`` draws a fresh random token per call. A task needs a token
derived from its id, so that

* a retry of the same task id (``Task.retry`` publishes the new message *before* the old
  run unwinds) can take over the record its previous attempt still holds, and
* the worker's parent process, which sees a child die (``WorkerLostError``, hard time
  limit, ``revoke(terminate=True)``), can free that child's lock by compare-and-delete.

The token is ``"<owner>.<attempt>"``: ``owner`` the task id (hashed when it holds
characters a JSON record or a log should not carry), ``attempt`` the task's ``retries``.
Re-entry needs a *lower* attempt in the record: an ``acks_late`` redelivery of the same
attempt (its holder may still be running, e.g. after a visibility timeout) is treated as
busy and gets the lock only once the holder frees it or its lease lapses (DESIGN §6).

Proposed core change (see the report): ``acquire(key, token=...)`` and
``release_token(key, match=...)`` on ``Mutex``/``Semaphore`` would replace this module.
"""

from __future__ import annotations

import hashlib
import random
import re
import time

from simple_mutex import Lease, MalfunctionError, Mutex, Semaphore, SimpleCacheConditionError
from simple_mutex.engine import Grant, acquire_flow, run
from simple_mutex.records import encode_record, record_token

_SAFE_OWNER = re.compile(r"[A-Za-z0-9_:-]{1,100}")
_rng = random.Random()


def owner_of(task_id: str) -> str:
    """The owner part of a token for ``task_id`` (UUIDs pass through unchanged)."""
    if _SAFE_OWNER.fullmatch(task_id):
        return task_id
    return "h" + hashlib.sha256(task_id.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def _split(token: str) -> tuple[str, int]:
    owner, _, attempt = token.rpartition(".")
    return owner, int(attempt) if attempt.isdigit() else -1


class OwnedLocks:
    """A Mutex (``permits == 1``) or Semaphore whose holders are task ids."""

    def __init__(self, cache: object, *, permits: int, lease: float, prefix: str) -> None:
        self.space: Mutex | Semaphore
        if permits == 1:
            self.space = Mutex(cache, lease=lease, prefix=prefix)
        else:
            self.space = Semaphore(cache, permits=permits, lease=lease, prefix=prefix)

    def acquire(
        self,
        key: str,
        *,
        owner: str,
        attempt: int,
        timeout: float | None,
        renew: bool,
        label: str,
    ) -> Lease:
        """Take a permit of ``key`` for ``owner``; raises SimpleMutexAcquireTimeoutError
        when it stays busy for ``timeout`` (0: one try)."""
        space = self.space
        slot_keys = space._slot_keys(key)
        token = f"{owner}.{attempt}"
        value = encode_record(token, label, time.time())
        grant = self._reenter(slot_keys, owner, attempt, value) if attempt > 0 else None
        if grant is None:
            flow = acquire_flow(
                key=key,
                slot_keys=slot_keys,
                value=value,
                lease=space.lease,
                timeout=timeout,
                interval=space.interval,
                now=time.monotonic,
                rng=_rng,
            )
            try:
                grant = run(space.cache, flow)
            except MalfunctionError as exc:
                exc.key = key
                raise
        return Lease(
            key=key,
            cache=space.cache,
            cache_key=slot_keys[grant.slot],
            value=value,
            token=token,
            grant=grant,
            length=space.lease,
            renew=renew,
        )

    def _reenter(self, slot_keys: list[str], owner: str, attempt: int, value: str) -> Grant | None:
        """Take over a record an earlier attempt of the same task still holds."""
        cache = self.space.cache
        for slot, cache_key in enumerate(slot_keys):
            entry = cache.get(cache_key)
            if entry is None:
                continue
            held_by, held_attempt = _split(record_token(entry, cache.name, cache_key))
            if held_by != owner or not 0 <= held_attempt < attempt:
                continue
            started = time.monotonic()
            try:
                new = cache.compare_and_set(
                    cache_key, value, ttl=self.space.lease, version=entry.version
                )
            except SimpleCacheConditionError:
                continue  # freed or changed meanwhile: take the ordinary path
            return Grant(slot, new, started)
        return None

    def release_owner(self, key: str, owner: str) -> bool:
        """Free every permit of ``key`` that ``owner`` holds (from any process).

        Compare-and-delete on the version read: if the record changed in between (freed,
        renewed or taken over), nothing is deleted."""
        cache = self.space.cache
        freed = False
        for cache_key in self.space._slot_keys(key):
            entry = cache.get(cache_key)
            if entry is None:
                continue
            if _split(record_token(entry, cache.name, cache_key))[0] != owner:
                continue
            try:
                cache.compare_and_delete(cache_key, version=entry.version)
            except SimpleCacheConditionError:
                continue
            freed = True
        return freed

    def holder_label(self, key: str) -> str | None:
        """The label of a current holder of ``key`` (``task.name[task id]``), if any."""
        holder = self.space.holder(key)
        return None if holder is None else holder.label
