#!/usr/bin/env bash
# Run the whole test suite on a fresh machine: creates a virtual environment (.venv in the
# repository, or $VENV), installs simple-mutex with its test extras, starts the services
# the tests talk to if they do not answer, lints, then runs the four tiers in order, each
# failing the run at once:
#
#   fast          no socket, no subprocess (checked)          2 pytest-xdist workers
#   backends      each cache and store on its real server      4 workers
#   integrations  real celery / rq worker, beat, cron          4 workers
#   system        nemesis, failovers, docs, browser, CLI       4 workers
#
# (tests/tiers.py says which test is in which tier.) Coverage of the three packages is
# measured throughout and printed at the end; below the floor in pyproject.toml
# ([tool.coverage.report] fail_under) the run fails. Then examples/sample_project runs as a
# user's project would, in a pytest session of its own.
#
# Extra arguments run one pytest instead, with them:  scripts/test.sh -k disk -x
#                                                     scripts/test.sh --tier fast
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

if [[ $# -gt 0 ]]; then
    say "pytest $*"
    exec "$VENV/bin/python" -m pytest "$@"
fi

# -- the tiers, in order ------------------------------------------------------------------
# Workers per tier: past the fast tier, tests mostly wait on servers and processes, so
# more workers than cores. Tests go to whichever worker is free (a module's fixtures are
# made once on each worker that runs one of its tests), but a module that shares one
# costly thing among its tests keeps them on one worker (pytest.mark.xdist_group). Tests
# with time bounds carry bounds that hold with a second suite beside them (contributing
# guide: "The tiers").
# Coverage: on Python 3.12 and later (CI's). CPython 3.11 under a tracer can stall a thread
# that an asynchronous exception (the lease interrupt) is sent to, for good
# (coveragepy#1626), so there the tests run unmeasured.
# (--cov-fail-under=0: pytest-cov would hold each tier alone to the floor; the floor is
# for the four together, checked by the coverage report at the end.)
coverage=(--cov --cov-append --cov-report= --cov-fail-under=0)
if "$VENV/bin/python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    say "coverage is not measured on Python 3.11 (coveragepy#1626): use PYTHON=python3.12"
    coverage=()
fi
declare -A WORKERS=([fast]=2 [backends]=4 [integrations]=4 [system]=4)
export COVERAGE_FILE="$REPO_ROOT/.coverage"
rm -f "$COVERAGE_FILE" "$COVERAGE_FILE".*
timings=()
for tier in fast backends integrations system; do
    say "pytest --tier $tier (${WORKERS[$tier]} workers)"
    started=$SECONDS
    "$VENV/bin/python" -m pytest --tier "$tier" -n "${WORKERS[$tier]}" --dist loadgroup \
        "${coverage[@]}" --durations=10 -p no:cacheprovider
    timings+=("$(printf '%5d s  %s' $((SECONDS - started)) "$tier")")
done
say "tier durations"
printf '    %s\n' "${timings[@]}" >&2

if ((${#coverage[@]})); then
    say "coverage (simple_mutex, celery_mutex, rq_mutex; lines and branches, in the test processes)"
    "$VENV/bin/python" -m coverage report
fi

# A user's project, tested as its CI would: a pytest session of its own, on nothing but
# the public testing kit (the plugin's fixtures, FaultyCache).
say "pytest examples/sample_project (a separate session)"
(cd examples/sample_project && "$VENV/bin/python" -m pytest -q -p no:cacheprovider)
