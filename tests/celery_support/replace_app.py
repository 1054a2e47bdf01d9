"""The app the ``on_busy="replace"`` suite's ``celery worker -P prefork`` subprocesses run.

``writer`` holds ``doc.<doc>`` and writes ``<name>.<i>`` through the fence guard
(``fenced_set`` into Redis DB 9) every 20 ms, logging each write's outcome; a newer call
of the same key replaces it. Configured from ``CM_*`` like ``celery_support.app``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable

import redis

from celery_support.env_app import app_from_env

# isort: split
from celery_mutex import MutexTask, current_lease
from simple_mutex import FencedOutError
from simple_mutex.fenced import fenced_set

app = app_from_env("celery_support.replace_app")
PREFIX: str = app.conf.mutex_prefix
_record = redis.Redis.from_url(app.conf.mutex_cache)
STORE_URL = "redis://127.0.0.1:6379/9"  # the fenced store the bodies write to
_store = redis.Redis.from_url(STORE_URL)
LEASE = float(os.environ.get("CM_LEASE", "30"))


def _off_thread(call: Callable[[], object]) -> None:
    """Run ``call`` in a thread of its own and wait for it: the loss interrupt lands in
    the body's thread, never inside a Redis command (one cut between its send and its
    reply would leave the reply for the next command on that connection). The wait polls
    a flag with sleeps and takes no lock: an exception landing inside ``Thread.join``
    (Python 3.11) can leave the thread's lock held, and the next join then hangs."""
    done = threading.Event()

    def run() -> None:
        try:
            call()
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    try:
        while not done.is_set():
            time.sleep(0.002)
    except BaseException:
        while not done.is_set():  # the row or the write completes, then the body unwinds
            time.sleep(0.002)
        raise


def log(doc: str, what: str, **row: object) -> None:
    """One JSON row on ``<prefix><what>.<doc>``; times are time.monotonic() (system-wide
    on Linux, so comparable across the workers' processes)."""
    key = f"{PREFIX}{what}.{doc}"
    value = json.dumps({**row, "t": time.monotonic()})
    _off_thread(lambda: _record.pipeline().rpush(key, value).expire(key, 600).execute())


def _write(doc: str, name: str, fence: int, i: int) -> None:
    """One fenced write, and its row (with the time the outcome was known)."""

    def write() -> None:
        try:
            fenced_set(_store, f"{PREFIX}doc.{doc}", f"{name}.{i}", fence=fence)
            outcome = "accepted"
        except FencedOutError:
            outcome = "refused"
        row = {"name": name, "fence": fence, "i": i, "outcome": outcome, "t": time.monotonic()}
        key = f"{PREFIX}writes.{doc}"
        _record.pipeline().rpush(key, json.dumps(row)).expire(key, 600).execute()

    _off_thread(write)


@app.task(base=MutexTask, mutex={"key": "doc.{doc}", "on_busy": "replace", "lease": LEASE})
def writer(doc: str, name: str, writes: int, deaf: bool = False) -> str:
    """``writes`` fenced writes, 20 ms apart. ``deaf``: the loss interrupt is caught and
    the loop goes on (a body that cannot be stopped); its later writes carry its fence."""
    fence = current_lease().fence
    log(doc, "started", name=name, fence=fence, pid=os.getpid())
    i = 0
    try:
        while i < writes:
            try:
                _write(doc, name, fence, i)
                i += 1
                time.sleep(0.02)
            except BaseException as exc:  # the loss interrupt, or SIGTERM's SystemExit
                if not deaf:
                    raise
                log(doc, "ignored", name=name, error=type(exc).__name__)
    finally:
        log(doc, "ended", name=name, writes=i)
    log(doc, "done", name=name)
    return name
