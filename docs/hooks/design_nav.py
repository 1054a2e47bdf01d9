"""MkDocs hook: a "Design" section in the navigation listing docs/design/*.md.

The design notes are written by whoever works on a backend; this hook lists whatever is
there (sorted by file name) so no one edits mkdocs.yml to add one. No folder, or an empty
one, means no section.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def on_config(config: Any) -> Any:
    design = Path(config["docs_dir"]) / "design"
    pages = sorted(design.glob("*.md")) if design.is_dir() else []
    if pages and config["nav"] is not None:
        config["nav"].append({"Design": [f"design/{page.name}" for page in pages]})
    return config
