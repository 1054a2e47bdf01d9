"""``python -m simple_mutex``: the ``simple-mutex`` command (simple_mutex.cli)."""

import sys

from .cli import main

sys.exit(main())
