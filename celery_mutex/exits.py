"""Act once a process has exited: how the worker's main process frees a pool child's lock
after a hard time limit or ``revoke(terminate=True)`` (lifecycle rule 12).

A signal sent is not a process dead. billiard reports a hard time limit before it sends
SIGTERM (and SIGKILL 0.1 s later); a revoke is announced right after its SIGTERM; either
way the child may still be unwinding its body and ``finally:`` blocks, or ignoring the
signal altogether.

A process is watched through a pidfd (Linux 5.3 and later). It is opened before billiard
can reap the child (the Celery handlers that call ``after_exit`` run in the thread that
reaps, before it does), so it refers to that very process: a later one given the same pid
cannot be taken for it. It becomes readable as the process ends; a zombie is gone (it
runs no more code) whether or not it has been reaped yet. Without pidfds the pid is
polled every 50 ms with ``os.kill(pid, 0)``: a pool child's pid is not reused before
billiard reaps it, but one taken by another process between that reap and our next
poll keeps the key until that process ends or the lease lapses (the safe direction).

One daemon thread per process waits for all of them. At interpreter exit (the worker
shutting down) the actions of processes already gone still run; live ones are left to
their leases.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import select
import threading
from collections.abc import Callable

from simple_mutex.busy import OnePerProcess

log = logging.getLogger("celery_mutex")

POLL = 0.05  # seconds between two looks at a pid we hold no pidfd for
DRAIN = 5.0  # seconds interpreter exit waits for the actions of processes already gone


class _Watch:
    """One process to outlive, and what to do then."""

    def __init__(self, pid: int, name: str, action: Callable[[], None]) -> None:
        self.pid, self.name, self.action = pid, name, action
        self.fd: int | None = None
        self.exited = False
        try:
            self.fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.exited = True  # exited and reaped already
        except (AttributeError, OSError):  # no pidfd here (not Linux 5.3+, a sandbox)
            pass

    def gone(self) -> bool:
        if self.exited:
            return True
        if self.fd is not None:
            poller = select.poll()
            poller.register(self.fd, select.POLLIN)
            self.exited = bool(poller.poll(0))
        else:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.exited = True
            except PermissionError:
                self.exited = True  # another user's process has the pid: ours is gone
        return self.exited

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class ExitWatch:
    """Runs actions once processes have exited, from a thread of its own."""

    def __init__(self) -> None:
        self._owner = os.getpid()
        self._lock = threading.Lock()
        self._watches: list[_Watch] = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None
        self._closed = False

    def after_exit(self, pid: int, name: str, action: Callable[[], None]) -> None:
        """Run ``action`` once process ``pid`` has exited: here and now if it has, else
        from the watch's thread. A second action of the same ``name`` while the first
        waits is dropped (Celery reports a hard time limit twice)."""
        watch = _Watch(pid, name, action)
        if watch.gone():
            watch.close()
            _run(watch)
            return
        with self._lock:
            if self._closed or any(w.name == name for w in self._watches):
                watch.close()
                return
            self._watches.append(watch)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="celery_mutex-exits", daemon=True
                )
                self._thread.start()
        self._wake()

    def pending(self) -> list[int]:
        """The pids still watched."""
        with self._lock:
            return [w.pid for w in self._watches]

    def _loop(self) -> None:
        while True:
            for watch in self._take_gone():
                _run(watch)
            with self._lock:
                if self._closed:
                    return
                fds = [w.fd for w in self._watches if w.fd is not None]
                polled = any(w.fd is None for w in self._watches)
            poller = select.poll()
            for fd in (*fds, self._wake_r):
                poller.register(fd, select.POLLIN)
            poller.poll(POLL * 1000 if polled else None)
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # full: wake-ups are pending already
            os.write(self._wake_w, b"w")

    def _take_gone(self) -> list[_Watch]:
        with self._lock:
            gone = [w for w in self._watches if w.gone()]
            self._watches = [w for w in self._watches if w not in gone]
        for watch in gone:
            watch.close()
        return gone

    def drain(self, timeout: float = DRAIN) -> None:
        """At exit: let the thread finish an action under way (up to ``timeout``), run
        those of processes gone by now, and leave the rest to their leases."""
        if os.getpid() != self._owner:
            return  # a forked child's copy of the atexit list: not its watch
        with self._lock:
            self._closed = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)
        for watch in self._take_gone():
            _run(watch)
        with self._lock:
            left, self._watches = self._watches, []
        for watch in left:
            watch.close()
            log.warning(
                "process %d still runs at exit; %s is left to its lease", watch.pid, watch.name
            )

    def forget(self) -> None:
        """In a forked child: the parent's thread does not exist here; close its fds."""
        self._closed = True
        for watch in self._watches:
            watch.close()
        self._watches = []
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


def _run(watch: _Watch) -> None:
    try:
        watch.action()
    except Exception:  # one failed release must not stop the watch of the others
        log.exception("celery_mutex: freeing %s after process %d exited", watch.name, watch.pid)


def _started() -> ExitWatch:
    watch = ExitWatch()
    atexit.register(watch.drain)
    return watch


_watch = OnePerProcess(_started, forget=ExitWatch.forget)  # a forked child's is its own


def exit_watch() -> ExitWatch:
    """This process's watch, created on first use."""
    return _watch.get()
