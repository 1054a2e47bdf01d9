#!/usr/bin/env bash
# Run the demo on a fresh machine: creates a virtual environment (.venv in the repository,
# or $VENV), installs simple-mutex, then runs examples/demo.py (extra arguments go to it)
# then examples/celery_demo.py, examples/beat_demo.py and examples/rq_demo.py (the last two
# need a Redis: one is started if none answers).
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

setup_venv demo
# Part 1: processes contending through DiskCache. Part 2: a Celery prefork worker.
# Neither needs a server; the Celery part uses Redis when REDIS_URL is set.
"$VENV/bin/python" examples/demo.py "$@"
echo
# Parts 1 and 2 need no server; with REDIS_URL set, part 2 runs on that Redis, so start
# it now if it does not answer (not only before part 3).
if [[ -n "${REDIS_URL:-}" ]]; then ensure_redis; fi
"$VENV/bin/python" examples/celery_demo.py
echo
# Parts 3 and 4 need a Redis (REDIS_URL, default redis://127.0.0.1:6379/0).
ensure_redis
# Part 3: two celery beat processes side by side, each tick run once.
"$VENV/bin/python" examples/beat_demo.py
echo
# Part 4: RQ workers.
exec "$VENV/bin/python" examples/rq_demo.py
