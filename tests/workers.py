"""What the suites share: bounded waits and busy loops, and, for the Celery and RQ suites,
real worker subprocesses.

Every wait is bounded in time; a process that does not stop is killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # where ``celery`` and ``rq`` are installed
ENV = {
    **os.environ,
    # An outer PYTHONPATH (e.g. another rq version installed with --target) stays first.
    "PYTHONPATH": os.pathsep.join(
        p for p in [os.environ.get("PYTHONPATH"), str(ROOT / "tests"), str(ROOT)] if p
    ),
}


def start(argv: list[str], log: Path | None = None, **env: str) -> subprocess.Popen[bytes]:
    """``BIN/argv[0] argv[1:]`` with the test support importable; stderr to ``log`` (a
    file, not a pipe: a full pipe would block the process). It leads a process group of
    its own (its horses, pool children and scheduler with it), which ``stop`` ends whole."""
    with open(log or os.devnull, "wb") as err:
        return subprocess.Popen(
            [str(BIN / argv[0]), *argv[1:]],
            env={**ENV, **env},
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )


# The second signal of a shutdown: a cold one, which ends the job under way (a warm one
# waits for it: a test's last job may hold its lock for seconds yet). RQ takes a second
# SIGTERM (at least 1 s after the first: sooner it is dropped as a duplicate), Celery a
# SIGQUIT.
COLD = {"celery": signal.SIGQUIT}


def stop(procs: Iterable[subprocess.Popen[bytes]], warm: float = 3.0) -> None:
    """End the worker processes a test started: SIGTERM (a warm shutdown) to the live
    ones; those still running after ``warm`` seconds get the cold one; what lingers 5 s
    more is SIGKILLed. Then whatever is left of each one's process group (a scheduler or
    a pool child a killed parent left behind) is SIGKILLed, so nothing outlives the test."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=warm)
        except subprocess.TimeoutExpired:
            name = Path(str(proc.args[0] if isinstance(proc.args, list) else proc.args)).name
            proc.send_signal(COLD.get(name, signal.SIGTERM))
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


def wait_until(condition: Callable[[], object], timeout: float, what: str) -> None:
    """Poll ``condition`` until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def spin(guard: float = 5.0) -> float:
    """A pure-Python busy loop that never calls into the library, so a lease interrupt lands
    in it at once; after ``guard`` seconds it ends anyway, so a broken interrupt fails the
    test (it took too long) instead of hanging it. Returns how long it ran."""
    start = time.monotonic()
    while time.monotonic() - start < guard:
        pass
    return time.monotonic() - start


class ReleaseLater(threading.Thread):
    """Calls ``release`` (a lease's, or a cache's compare_and_delete) from a thread of its
    own after ``delay`` seconds; ``at`` is when. Join it before closing what it writes to:
    the release may still be reading its reply."""

    def __init__(self, delay: float, release: Callable[[], object]) -> None:
        super().__init__(daemon=True)
        self.delay, self.release = delay, release
        self.at: float | None = None
        self.start()

    def run(self) -> None:
        time.sleep(self.delay)
        self.at = time.monotonic()
        self.release()

    def woke(self) -> float:
        """How long after the release a wait that just returned ended."""
        woke = time.monotonic()
        assert self.at is not None, "the wait ended before the release: it never waited"
        self.join(5)
        return woke - self.at
