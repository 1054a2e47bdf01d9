#!/usr/bin/env bash
# Build the documentation site: mkdocs build --strict into site/, offline (nothing in
# mkdocs.yml fetches). `bash scripts/docs.sh serve` serves it on 127.0.0.1:8000 instead.
# Its own environment (DOCS_VENV, default .venv-docs): the docs extra and the package.
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

export NO_MKDOCS_2_WARNING=1  # Material's notice about its successor, printed on every build
VENV="${DOCS_VENV:-$REPO_ROOT/.venv-docs}"
setup_venv docs
if [[ "${1:-}" == serve ]]; then
    exec "$VENV/bin/mkdocs" serve --strict -a 127.0.0.1:8000
fi
say "mkdocs build --strict"
"$VENV/bin/mkdocs" build --strict --clean
say "site built in $REPO_ROOT/site"
