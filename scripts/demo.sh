#!/usr/bin/env bash
# Run the demo on a fresh machine: creates a virtual environment (.venv in the repository,
# or $VENV), installs simple-mutex, then runs examples/demo.py (extra arguments go to it).
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

setup_venv test
exec "$VENV/bin/python" examples/demo.py "$@"
