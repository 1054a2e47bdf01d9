"""``python -m simple_mutex``: the ``simple-mutex`` command (simple_mutex.admin.cli)."""

import sys

from .admin.cli import main

sys.exit(main())
