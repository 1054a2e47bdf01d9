#!/usr/bin/env bash
# Run the demo on a fresh machine: creates a virtual environment (.venv in the repository,
# or $VENV), installs simple-mutex, then runs examples/demo.py (extra arguments go to it)
# and examples/celery_demo.py.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

setup_venv demo
# Part 1: processes contending through DiskCache. Part 2: a Celery prefork worker.
# Neither needs a server; the Celery part uses Redis when REDIS_URL is set.
"$VENV/bin/python" examples/demo.py "$@"
echo
exec "$VENV/bin/python" examples/celery_demo.py
