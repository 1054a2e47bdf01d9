"""Support code for the RQ suites: job functions that worker subprocesses import by name.

``rq_mutex`` is not in the installed package list yet: make the repo root importable.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
