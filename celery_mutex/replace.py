"""``on_busy="replace"`` for Celery: the round and the holder's side are
``simple_mutex.busy.replace``; here, how a task is named and how its worker is told.

The new call, in its ``before_start``, reads the holder's label ``"<task name>[<task
id>]"``, frees that task id's record and broadcasts ``mutex_stop(<task id>)``: the worker
main process running it sends its pool child STOP_SIGNAL (SIGUSR2); a threads or solo
pool runs the body in that process, so it renews there at once. The child's watch thread
renews its leases, finds the record gone, and the loss interrupt ends the body: FAILURE
with SimpleMutexLeaseExpiredError.

Why not ``revoke(terminate=True)``: Celery's worker then stores REVOKED for the task right
after its signal, while the stopped child stores its own outcome a moment later; which of
the two a client sees is a race. SIGTERM instead ends the child with SystemExit (REVOKED,
no lock error: lifecycle rule 13). The stop here only hastens a renewal, so the outcome is
the lease's, every time. A SIGUSR2 that reaches a child after the task ended (the same
race as Celery's own terminate) renews whatever that child holds: nothing else happens.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

from simple_mutex import Holder, Lease
from simple_mutex.busy.replace import (
    STOP_SIGNAL,
    Marks,
    NewerCall,
    Takeover,
    answer_stop_signal,
    call_in_brackets,
    check_now,
    watch,
)
from simple_mutex.busy.replace import take as take_over

from ._celery import (
    KombuError,
    control_command,
    runs_in_children,
    worker_process_init,
    worker_state,
)
from ._owned import owner_of
from .config import Config, beside

log = logging.getLogger("celery_mutex")

COMMAND = "mutex_stop"  # the remote control command a replacing call broadcasts
__all__ = ["COMMAND", "NewerCall", "mutex_stop", "take", "watch"]


def take(task: Any, cfg: Config, key: str, owner: str, take_once: Callable[[], Lease]) -> Lease:
    """The key's lease for this call (owner ``owner``), taken from its holder if need be."""
    cfg.policy.check_replace(task.name)  # a per-call on_busy="replace" (the task's own is checked)
    space = cfg.locks.space
    marks = Marks(space.cache, beside("taken.", space.prefix))
    # Only a retry reads the mark: a fresh call that reuses a replaced call's task id
    # (task_id= to de-duplicate) is a new call, and the newest.
    if task.request.retries:
        marks.check(owner)
    label = f"{task.name}[{task.request.id}]"

    def free(victim: str) -> bool:
        freed = cfg.locks.evict_owner(key, owner_of(victim), by=label)
        if freed:
            marks.mark(owner_of(victim), label)
        return freed

    def victim_of(holder: Holder) -> str | None:
        victim = call_in_brackets(holder.label)
        # Not a task's record, or our own earlier attempt (take_once waits for that one
        # to unwind): nothing here can stop it.
        return None if victim is None or owner_of(victim) == owner else victim

    return take_over(
        Takeover(
            key=key,
            call=label,
            take_once=take_once,
            holder=lambda: cfg.locks.holder(key),
            victim_of=victim_of,
            free=free,
            stop=lambda victim: stop(task, victim),
            log=log,
        )
    )


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


def _answer_stop(**_: Any) -> None:
    """``worker_process_init``: a pool child answers the stop signal (its default would
    kill the child)."""
    answer_stop_signal()


worker_process_init.connect(_answer_stop, weak=False)
