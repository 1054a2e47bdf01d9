#!/usr/bin/env bash
# Release-ready packaging: `python -m build` (an sdist, then a wheel built from that sdist,
# so a file missing from the sdist breaks the wheel too) in a fresh environment, then
# scripts/check_dist.py on both: LICENSE, py.typed and metadata in, tests and bench out.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

work="$(mktemp -d -t simple-mutex-build.XXXXXX)"
trap 'rm -rf "$work"' EXIT
fresh_venv "$work/venv"
pip_install "$work/venv" build || die "pip install build failed"
say "python -m build"
"$work/venv/bin/python" -m build --outdir "$work/dist" . >"$work/build.log" 2>&1 \
    || { cat "$work/build.log" >&2; die "python -m build failed"; }
say "check the sdist and the wheel"
"$work/venv/bin/python" scripts/check_dist.py "$work/dist" || die "the distributions are not release-ready"
