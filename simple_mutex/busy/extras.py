"""``queue_imports``: a task-queue integration imported without its task queue installed
names the extra to install, whichever of the queue's modules was missing (Celery brings
billiard and kombu; a bare "No module named 'billiard'" says nothing of simple-mutex)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def queue_imports(package: str, queue: str, extra: str) -> Iterator[None]:
    """Wrap an integration's first import of its task queue."""
    try:
        yield
    except ImportError as exc:
        raise ImportError(
            f"{package} needs {queue} ({exc}): pip install 'simple-mutex[{extra}]'",
            name=exc.name,
        ) from exc
