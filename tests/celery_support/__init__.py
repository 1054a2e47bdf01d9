"""Support code for the Celery suites (apps and tasks shared with worker subprocesses)."""

from __future__ import annotations
