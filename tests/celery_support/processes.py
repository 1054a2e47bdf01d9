"""Real ``celery worker`` and ``celery beat`` subprocesses for the prefork and beat suites.

Each ``Processes`` gets a queue, a lock prefix and record keys of its own (passed to the
app module through ``CM_*`` variables); Redis at 127.0.0.1:6379 is the result backend,
the lock cache and where tasks record their runs. A missing Redis fails, never skips.
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import redis
from celery import Celery
from workers import start, stop

REDIS_URL = "redis://127.0.0.1:6379/11"


class Processes:
    """Celery subprocesses of ``app_module``, logging to ``<tmp>/<name>.log``."""

    def __init__(self, app_module: str, tmp: Path, broker: str = REDIS_URL) -> None:
        redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2).ping()
        self.run = uuid.uuid4().hex[:10]
        self.app_module = app_module
        self.tmp = tmp
        self.prefix = f"cm{self.run}."
        self.queue = f"cm-{self.run}"
        self.env = {
            "CM_BROKER": broker,
            "CM_BACKEND": REDIS_URL,
            "CM_CACHE": REDIS_URL,
            "CM_PREFIX": self.prefix,
            "CM_QUEUE": self.queue,
        }
        self.app = Celery(app_module, set_as_current=False)
        self.app.conf.update(
            broker_url=broker, result_backend=REDIS_URL, task_default_queue=self.queue
        )
        self.record = redis.Redis.from_url(REDIS_URL)
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, argv: list[str], **env: str) -> subprocess.Popen[bytes]:
        log = self.tmp / f"{name}.log"
        argv = ["celery", "-A", self.app_module, *argv, "-l", "INFO"]
        self.procs.append(start(argv, log, **self.env, **env))
        return self.procs[-1]

    def start_worker(self, name: str, concurrency: int, **env: str) -> None:
        """``celery worker -P prefork -c <concurrency>`` on this queue."""
        self.start(
            name,
            [
                *("worker", "-P", "prefork", "-c", str(concurrency), "-Q", self.queue),
                *("-n", f"{name}-{self.run}@%h"),
                *("--without-gossip", "--without-mingle", "--without-heartbeat"),
            ],
            **env,
        )

    def log_text(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        stop(self.procs)
