"""``on_busy="replace"``: the newest call takes the key from the running holder and stops it.

One round, in the new call's ``before_start`` (a worker's call; a synchronous one waits)::

    new call                       lock record                 old holder (a pool child)
    try once: busy                 {old token, fence f}
    read the holder: "name[old]"
    compare-and-delete old's       (gone)
      record, on the version read
    broadcast mutex_stop(old)  ->  every worker's main process: the one running "old"
                                   sends its child SIGUSR2 (threads, solo: no signal)
    put-if-absent: ours            {new token, fence > f}
    runs the body                                              SIGUSR2: a thread of the
                                                               child renews its leases
                                                               now; the renewal finds
                                                               the record gone: the loss
                                                               interrupt stops the body
                                                               -> FAILURE, LeaseExpired

The lease passes on whatever becomes of the stop: the record is taken by compare-and-set
steps on the lock itself, never by asking the holder. A holder that cannot be reached (its
worker gone, partitioned, a threads or solo pool, a body deaf to the interrupt) finds its
lease lost at its next renewal, a third of a lease later at most, and meanwhile writes
with the older fence: a fenced store refuses it once the new holder has written
(``simple_mutex.fenced``). Replace is only as safe as the fences downstream: it is the one
place that frees a record while its holder may still act (DESIGN §4 rule 12 waits for the
holder to be gone), because the user asked for exactly that.

Why not ``revoke(terminate=True)``: Celery's worker then stores REVOKED for the task right
after its signal, while the stopped child stores its own outcome a moment later; which of
the two a client sees is a race. SIGTERM instead ends the child with SystemExit (REVOKED,
no lock error: DESIGN §4 rule 13). The stop here only hastens a renewal, so the outcome is
the lease's, every time: FAILURE with SimpleMutexLeaseExpiredError. A SIGUSR2 that reaches
a child after the task ended (the same race as Celery's own terminate) renews whatever
that child holds: a lease still held renews, nothing else happens.

``ROUNDS`` bounds the rounds against other replacing calls: each round frees the holder
it read, and the call that then writes first holds the key; the others replace it in
their next round. Past the bound the call fails with SimpleMutexAcquireTimeoutError.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import weakref
from collections.abc import Callable
from typing import Any

from simple_mutex import (
    ConstraintValueError,
    Lease,
    SimpleMutexAcquireTimeoutError,
    SimpleMutexError,
)

from ._celery import (
    KombuError,
    control_command,
    runs_in_children,
    worker_process_init,
    worker_state,
)
from ._owned import owner_of
from .config import Config

log = logging.getLogger("celery_mutex")

COMMAND = "mutex_stop"  # the remote control command a replacing call broadcasts
STOP_SIGNAL = signal.SIGUSR2  # SIGUSR1 is billiard's soft time limit; SIGTERM ends the child
ROUNDS = 5


def take(task: Any, cfg: Config, key: str, owner: str, take_once: Callable[[], Lease]) -> Lease:
    """The key's lease for this call (owner ``owner``), taken from its holder if need be."""
    if cfg.policy.permits != 1:  # a per-call on_busy="replace" (the task's own is checked)
        raise ConstraintValueError(
            f"{task.name}: on_busy='replace' stops the one running holder of a key; with "
            f"permits={cfg.policy.permits} there is no single holder to replace"
        )
    busy: SimpleMutexAcquireTimeoutError | None = None
    for _ in range(ROUNDS):
        try:
            return take_once()
        except SimpleMutexAcquireTimeoutError as exc:
            busy = exc
        holder = cfg.locks.holder(key)
        if holder is None:
            continue  # freed meanwhile
        victim = task_id_of(holder.label)
        if victim is None or owner_of(victim) == owner:
            # Not a task's record, or our own earlier attempt (take_once waits for that
            # one to unwind): nothing here can stop it.
            continue
        if cfg.locks.release_owner(key, owner_of(victim)):
            log.warning(
                "%s[%s]: took %r from %s (fence %d), which is being stopped",
                task.name,
                task.request.id,
                key,
                holder.label,
                holder.fence,
            )
        stop(task, victim)
    assert busy is not None
    raise SimpleMutexAcquireTimeoutError(
        f"{key!r}: on_busy='replace' met a new holder in each of {ROUNDS} rounds (other "
        "replacing calls of this key); the newest of them holds it",
        key=key,
    ) from busy


def task_id_of(label: str | None) -> str | None:
    """The task id in a MutexTask lock's label, ``"<task name>[<task id>]"``."""
    if not label or not label.endswith("]") or "[" not in label:
        return None
    return label[label.rindex("[") + 1 : -1] or None


def stop(task: Any, task_id: str) -> None:
    """Ask every worker to stop ``task_id`` (no reply awaited: the key is ours already)."""
    try:
        task.app.control.broadcast(COMMAND, arguments={"task_id": task_id}, reply=False)
    except (OSError, KombuError) as exc:  # the broker: the lease passes on all the same,
        # and the holder's renewal ends it. (Narrow: a soft time limit must pass.)
        log.warning("%s: could not ask the workers to stop %s: %r", task.name, task_id, exc)


@control_command(args=[("task_id", str)], signature="<task_id>")  # type: ignore[untyped-decorator]
def mutex_stop(state: Any, task_id: str, **_: Any) -> dict[str, str]:
    """celery_mutex: stop a running MutexTask whose key was taken (on_busy='replace')."""
    for request in list(worker_state.active_requests):
        if request.id != task_id:
            continue
        pid = request.worker_pid
        pool = getattr(getattr(state, "consumer", None), "pool", None)
        if runs_in_children(pool) and isinstance(pid, int) and pid != os.getpid():
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.kill(pid, STOP_SIGNAL)
        else:
            check_now()  # a threads or solo pool: its body runs in this process
        return {"ok": f"stopping {task_id}"}
    return {"ok": f"{task_id} does not run here"}


# -- the holder's side: renew at once when told -------------------------------------------


class _Watch:
    """The leases this process's MutexTasks hold, and the thread that renews them at once
    when a stop arrives (a signal handler may not take locks: it only writes to a pipe)."""

    def __init__(self) -> None:
        self.leases: weakref.WeakSet[Lease] = weakref.WeakSet()
        self.lock = threading.Lock()
        self.pipe: tuple[int, int] | None = None

    def start(self) -> None:
        with self.lock:
            if self.pipe is not None:
                return
            self.pipe = os.pipe()
        threading.Thread(target=self._loop, args=(self.pipe[0],), daemon=True,
                         name="celery_mutex-replace").start()  # fmt: skip

    def _loop(self, fd: int) -> None:
        while True:
            try:
                os.read(fd, 64)
            except OSError:
                return  # closed: a forked child's copy
            with self.lock:
                held = list(self.leases)
            for lease in held:
                if lease.lost:
                    continue
                try:
                    lease.renew()  # a record gone: marks the loss, interrupts the body
                except SimpleMutexError as exc:
                    log.debug("replace: renewing %r on a stop: %r", lease.key, exc)

    def nudge(self) -> None:
        if self.pipe is not None:
            with contextlib.suppress(OSError):
                os.write(self.pipe[1], b"!")


_watch = _Watch()


def watch(lease: Lease) -> None:
    """Renew ``lease`` at once when this process is told to stop a replaced holder."""
    _watch.start()
    with _watch.lock:
        _watch.leases.add(lease)


def check_now() -> None:
    """Renew every lease watched here now (a stop arrived)."""
    _watch.nudge()


def _on_stop_signal(signum: int, frame: object) -> None:
    _watch.nudge()  # one write to a pipe: safe wherever the main thread was


def _install_handler(**_: Any) -> None:
    """``worker_process_init``: a pool child answers the stop signal (its default would
    kill the child)."""
    signal.signal(STOP_SIGNAL, _on_stop_signal)


def _forget_after_fork() -> None:
    global _watch
    inherited, _watch = _watch, _Watch()  # the parent's thread does not exist here
    for fd in inherited.pipe or ():
        with contextlib.suppress(OSError):
            os.close(fd)


os.register_at_fork(after_in_child=_forget_after_fork)
worker_process_init.connect(_install_handler, weak=False)
