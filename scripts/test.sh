#!/usr/bin/env bash
# Run the whole test suite on a fresh machine: creates a virtual environment (.venv in the
# repository, or $VENV), installs simple-mutex with its test extras, starts the services
# named in SIMPLE_MUTEX_SERVICES (e.g. "redis") if they do not answer, then runs pytest.
# Extra arguments go to pytest:  scripts/test.sh -k disk -x
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

setup_test_venv

# -- services: start what the enabled backend tiers test against -----------------------
ensure_services
ensure_chromium
ensure_openssl
ensure_etcd

# Lint first: it takes seconds and a style or type error fails the run like a test would.
# SIMPLE_MUTEX_LINT=0 skips it (for a quick local pytest pass).
if [[ "${SIMPLE_MUTEX_LINT:-1}" == 1 ]]; then
    say "ruff check"
    "$VENV/bin/ruff" check .
    say "mypy --strict simple_mutex celery_mutex rq_mutex"
    "$VENV/bin/mypy" --strict simple_mutex celery_mutex rq_mutex
fi

say "pytest $*"
if [[ $# -eq 0 ]]; then
    # The whole suite names its slowest tests: what to trim when CI nears its 30-minute aim.
    "$VENV/bin/python" -m pytest --durations=25
else
    "$VENV/bin/python" -m pytest "$@"
fi
if [[ $# -eq 0 ]]; then
    # A user's project, tested as its CI would: a pytest session of its own, on nothing but
    # the public testing kit (the plugin's fixtures, FaultyCache).
    say "pytest examples/sample_project (a separate session)"
    (cd examples/sample_project && "$VENV/bin/python" -m pytest -q)
fi
