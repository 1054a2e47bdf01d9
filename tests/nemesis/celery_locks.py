"""The mutex options of the Celery tier's tasks, shared by the workers' app
(``celery_app``) and the nemesis's client, whose stand-ins of the queueing tasks take each
call's ticket at the send (importing ``celery_app`` there would make a second app)."""

from __future__ import annotations

from typing import Any

LOCK: dict[str, Any] = {"key": "k.{key}", "on_busy": "wait", "timeout": 20, "lease": 2,
                        "renew": True}  # fmt: skip
QUEUED: dict[str, Any] = {"key": "q.{key}", "on_busy": "queue", "lease": 2, "renew": True,
                          "queue": {"sweep_every": 0.5, "gap_for": 3}}  # fmt: skip
# Keep latest (issue 25): the same line, one waiting call per key, on l.<key>.
LATEST: dict[str, Any] = {**QUEUED, "key": "l.{key}", "on_busy": "latest"}
DEBOUNCE: dict[str, Any] = {**QUEUED, "key": "d.{key}", "on_busy": "debounce",
                            "debounce": {"period": 0.5, "max_delay": 2}}  # fmt: skip
REPLACING: dict[str, Any] = {"key": "r.{key}", "on_busy": "replace", "lease": 2,
                             "renew": True}  # fmt: skip
