"""What the checklist tests share (tests/test_checklist.py for "Adding a backend",
tests/test_task_queues.py for "Adding a task queue"): a registry of checks, each naming
the files its row of docs/contributing.md must name, and that table's rows."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, TypeVar

CONTRIBUTING = Path(__file__).resolve().parent.parent / "docs" / "contributing.md"
T = TypeVar("T")


def missing(**wanted: bool) -> list[str]:
    """The names of what does not hold (empty: everything does)."""
    return [what for what, holds in wanted.items() if not holds]


class Checks(Generic[T]):
    """Checks by name: the files their row names, and what is missing for a subject."""

    def __init__(self) -> None:
        self.checks: dict[str, tuple[tuple[str, ...], Callable[[T], list[str]]]] = {}

    def __call__(self, name: str, *files: str) -> Callable[[Any], Any]:
        def register(function: Callable[[T], list[str]]) -> Callable[[T], list[str]]:
            self.checks[name] = (files, function)
            return function

        return register


def table_rows(section: str) -> dict[str, str]:
    """The rows of the table under ``## section``: check name -> the row's file(s) cell."""
    parts = CONTRIBUTING.read_text(encoding="utf-8").split(f"\n## {section}\n", 1)
    assert len(parts) == 2, f"docs/contributing.md has no '{section}'"
    body = parts[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `(\w+)` \| ([^|]*) \|", body, re.MULTILINE))
