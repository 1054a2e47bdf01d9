# shellcheck shell=bash
# Shared set-up for scripts/demo.sh and scripts/test.sh. Source it; do not run it.
#
# Everything here works on a fresh machine: it finds a Python >= 3.10, creates a virtual
# environment (reused when present) and installs this repository into it, editable.
#
# Environment knobs:
#   VENV=/path        where the virtual environment lives (default: <repo>/.venv)
#   PYTHON=python3.x  the interpreter to build it from (default: first python3 >= 3.10)
#   SIMPLE_MUTEX_REINSTALL=1   reinstall even if pyproject.toml has not changed

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO_ROOT/.venv}"

say() { printf '==> %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# Run a command as root: directly, through sudo, or not at all.
as_root() {
    if [[ "$(id -u)" == 0 ]]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        return 1
    fi
}

# apt-get install, refreshing the package lists once if the package is unknown. Another
# install under way (a second suite setting itself up) holds dpkg's lock: wait for it.
apt_install() {
    command -v apt-get >/dev/null 2>&1 || return 1
    export DEBIAN_FRONTEND=noninteractive
    local wait=(-o DPkg::Lock::Timeout=600)
    as_root apt-get "${wait[@]}" install -y -q "$@" || {
        as_root apt-get "${wait[@]}" update -q && as_root apt-get "${wait[@]}" install -y -q "$@"
    }
}

python_ok() {  # is "$1" a runnable Python >= 3.10?
    "$1" -c 'import sys; sys.exit(sys.version_info < (3, 10))' >/dev/null 2>&1
}

find_python() {
    local candidate
    for candidate in ${PYTHON:-} python3 python3.13 python3.12 python3.11 python3.10; do
        if command -v "$candidate" >/dev/null 2>&1 && python_ok "$candidate"; then
            command -v "$candidate"
            return 0
        fi
    done
    return 1
}

# An interpreter of Python version $1 (e.g. 3.10): python3.10 on PATH if it runs, else one
# that pyenv installed (its shims refuse versions that are not selected). .ci/run uses it to
# run each step on a different supported version; fails when there is none.
python_for() {
    local version="$1" candidate root
    root="$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"
    for candidate in "python$version" "$root/versions/$version".*/bin/"python$version" \
        "/usr/bin/python$version" "/usr/local/bin/python$version"; do
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c \
            "import sys; sys.exit(f'{sys.version_info[0]}.{sys.version_info[1]}' != '$version')" \
            >/dev/null 2>&1; then
            command -v "$candidate"
            return 0
        fi
    done
    return 1
}

# pip install ARGS into the virtual environment $1, quietly. pip's notes about index folders
# that a machine's pip configuration names but does not have are dropped: they are noise.
pip_install() {
    local venv="$1"
    shift
    pip_run "$venv" install --quiet "$@"
}

# The pip of virtual environment $1 with ARGS (a subcommand and its options), the same
# notes dropped.
pip_run() {
    local venv="$1"
    shift
    "$venv/bin/python" -m pip "$@" \
        2> >(grep -v "^WARNING: Location '.*' is ignored: it is neither a file nor a directory" >&2)
}

# A new, empty virtual environment at $1 built from interpreter $2 (default: find_python);
# whatever was there is removed. For checks that must see only what they install.
fresh_venv() {
    local dir="$1" python="${2:-}"
    [[ -n "$python" ]] || python="$(find_python)" || die "no Python >= 3.10 found"
    rm -rf "$dir"
    "$python" -m venv "$dir" || die "cannot create a virtual environment at $dir with $python"
    pip_install "$dir" --upgrade pip || die "cannot upgrade pip in $dir"
}

# Create $VENV if needed and install the repository into it with the given extras
# (comma-separated, e.g. "test"). Reinstalls only when pyproject.toml or the extras change.
same_python() {  # do "$1" and "$2" run the same Python version (major.minor)?
    local version='import sys; print(sys.version_info[:2])'
    [[ "$("$1" -c "$version" 2>/dev/null)" == "$("$2" -c "$version" 2>/dev/null)" ]]
}

setup_venv() {
    local extras="$1" python stamp want
    # An environment another command built on another Python (the demo's, on 3.11) is
    # rebuilt when PYTHON names a different one: .ci/run's tests must run where asked
    # (coverage is measured on 3.12 only).
    if [[ -n "${PYTHON:-}" ]] && python_ok "$VENV/bin/python" \
        && ! same_python "$VENV/bin/python" "$PYTHON"; then
        say "$VENV runs another Python than $PYTHON: rebuilding it"
        rm -rf "$VENV"
    fi
    if ! python_ok "$VENV/bin/python"; then
        python="$(find_python)" || die "no Python >= 3.10 found; install one or set PYTHON=/path/to/python3"
        say "creating virtual environment $VENV with $python"
        rm -rf "$VENV"
        if ! "$python" -m venv "$VENV"; then
            # Debian and Ubuntu ship venv's pip bootstrap as a separate package.
            rm -rf "$VENV"
            local minor
            minor="$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
            say "python -m venv failed; installing python$minor-venv"
            apt_install "python$minor-venv" || apt_install python3-venv \
                || die "cannot create a virtual environment: install the venv module for $python"
            "$python" -m venv "$VENV" || die "cannot create a virtual environment at $VENV"
        fi
    fi
    stamp="$VENV/.simple-mutex-install"
    want="$(cd "$REPO_ROOT" && "$VENV/bin/python" - "$extras" <<'PY'
import hashlib, os, sys
digest = hashlib.sha256(open("pyproject.toml", "rb").read()).hexdigest()
print(f"{os.getcwd()} [{sys.argv[1]}] {digest}")
PY
)"
    if [[ "${SIMPLE_MUTEX_REINSTALL:-0}" == 1 || ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
        say "installing simple-mutex[$extras] (editable) into $VENV"
        (cd "$REPO_ROOT" && pip_install "$VENV" -e ".[$extras]") \
            || die "pip install failed"
        printf '%s\n' "$want" >"$stamp"
    fi
}

# The test environment: $VENV with simple-mutex[test,dev] (editable) and the test-only
# servers (a MongoDB wire-protocol server, ...), never package dependencies.
setup_test_venv() {
    setup_venv "test,dev"
    pip_install "$VENV" --pre -r "$REPO_ROOT/scripts/test-servers.txt" \
        || die "pip install of the test servers failed"
}

# -- services ------------------------------------------------------------------------
# Backend tiers test against real servers on loopback. test.sh starts the ones named in
# SIMPLE_MUTEX_SERVICES (e.g. "redis" or "redis,postgres") when they do not answer.

# ensure_service NAME CHECK_CMD START_CMD
#   Run CHECK_CMD (a shell command string); if it fails, run START_CMD and wait up to
#   SERVICE_WAIT seconds (default 20) for CHECK_CMD to succeed.
ensure_service() {
    local name="$1" check="$2" start="$3" waited=0 limit="${SERVICE_WAIT:-20}"
    if eval "$check" >/dev/null 2>&1; then
        say "$name is answering"
        return 0
    fi
    say "$name is not answering; starting it"
    eval "$start" || die "could not start $name"
    until eval "$check" >/dev/null 2>&1; do
        ((waited++ < limit * 10)) || die "$name did not answer within ${limit} s of starting"
        sleep 0.1
    done
    say "$name is up"
}

# Host and port of a URL, as "host port" (defaults: 127.0.0.1 and $2).
url_host_port() {
    "$VENV/bin/python" - "$1" "$2" <<'PY'
import sys
from urllib.parse import urlsplit
url = urlsplit(sys.argv[1])
print(url.hostname or "127.0.0.1", url.port or int(sys.argv[2]))
PY
}

redis_ping() {  # PING the server at REDIS_URL; succeeds on +PONG
    if command -v redis-cli >/dev/null 2>&1; then
        [[ "$(redis-cli -u "$REDIS_URL" ping 2>/dev/null)" == PONG ]]
    else
        "$VENV/bin/python" - "$REDIS_URL" <<'PY'
import socket, sys
from urllib.parse import unquote, urlsplit

def command(*args: str) -> bytes:
    return (f"*{len(args)}\r\n" + "".join(f"${len(a)}\r\n{a}\r\n" for a in args)).encode()

url = urlsplit(sys.argv[1])
with socket.create_connection((url.hostname or "127.0.0.1", url.port or 6379), 2) as s:
    if url.password:
        user = [unquote(url.username)] if url.username else []
        s.sendall(command("AUTH", *user, unquote(url.password)))
        s.recv(64)
    s.sendall(command("PING"))
    sys.exit(0 if s.recv(64).startswith(b"+PONG") else 1)
PY
    fi
}

redis_start() {
    local host port dir log
    read -r host port < <(url_host_port "$REDIS_URL" 6379)
    case "$host" in
        127.0.0.1 | localhost | ::1) ;;
        *) die "REDIS_URL points at $host: start that Redis yourself (only loopback ones are started here)" ;;
    esac
    if ! command -v redis-server >/dev/null 2>&1; then
        say "redis-server is missing; installing it with apt-get"
        apt_install redis-server || die "cannot install redis-server (no apt-get or no root); install it by hand"
    fi
    dir="${REDIS_DIR:-/var/lib/redis}"
    log="${REDIS_LOG:-/var/log/redis/ci.log}"
    if ! mkdir -p "$dir" "$(dirname "$log")" 2>/dev/null || [[ ! -w "$dir" || ! -w "$(dirname "$log")" ]]; then
        dir="${TMPDIR:-/tmp}/simple-mutex-redis"   # not root: keep it in a scratch directory
        log="$dir/ci.log"
        mkdir -p "$dir"
    fi
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port "$port" --save "" \
        --appendonly no --dir "$dir" --logfile "$log"
}

ensure_redis() {
    export REDIS_URL="${REDIS_URL:-redis://127.0.0.1:6379/0}"
    ensure_service "redis ($REDIS_URL)" redis_ping redis_start
}

postgres_ping() {  # is the server at POSTGRES_URL accepting connections?
    pg_isready -q -t 2 -d "$POSTGRES_URL"
}

postgres_start() {
    local host port version
    read -r host port < <(url_host_port "$POSTGRES_URL" 5432)
    case "$host" in
        127.0.0.1 | localhost | ::1) ;;
        *) die "POSTGRES_URL points at $host: start that PostgreSQL yourself (only a loopback one is started here)" ;;
    esac
    version="$(ls /etc/postgresql 2>/dev/null | sort -V | tail -n 1)"
    if [[ -z "$version" ]]; then
        # A fresh machine: install a cluster for loopback tests (trust auth, database test).
        say "PostgreSQL is missing; installing it with apt-get"
        apt_install postgresql || die "could not install PostgreSQL"
        version="$(ls /etc/postgresql | sort -V | tail -n 1)"
        local hba="/etc/postgresql/$version/main/pg_hba.conf"
        as_root sed -i -E 's/^(host\s+all\s+all\s+(127\.0\.0\.1\/32|::1\/128)\s+)\S+/\1trust/' "$hba"
        as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
        as_root pg_ctlcluster --skip-systemctl-redirect "$version" main reload
        as_root su postgres -c "createdb test" 2>/dev/null || true
        return 0
    fi
    as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start
}

ensure_postgres() {
    export POSTGRES_URL="${POSTGRES_URL:-postgresql://postgres@127.0.0.1:5432/test}"
    ensure_service "postgres ($POSTGRES_URL)" postgres_ping postgres_start
}

rabbitmq_ping() {  # does an AMQP broker answer the protocol header at AMQP_URL?
    "$VENV/bin/python" - "$AMQP_URL" <<'PY'
import socket, sys
from urllib.parse import urlsplit
url = urlsplit(sys.argv[1])
with socket.create_connection((url.hostname or "127.0.0.1", url.port or 5672), 2) as s:
    s.settimeout(5)
    s.sendall(b"AMQP\x00\x00\x09\x01")
    sys.exit(0 if s.recv(1) == b"\x01" else 1)  # a method frame: Connection.Start
PY
}

rabbitmq_start() {
    command -v rabbitmq-server >/dev/null 2>&1 || {
        say "rabbitmq-server is missing; installing it with apt-get"
        apt_install rabbitmq-server || die "could not install RabbitMQ"
    }
    as_root rabbitmq-server -detached
}

ensure_rabbitmq() {  # the Celery tests run their prefork workers on RabbitMQ too
    export AMQP_URL="${AMQP_URL:-amqp://guest:guest@127.0.0.1:5672//}"
    SERVICE_WAIT="${SERVICE_WAIT:-60}" ensure_service "rabbitmq ($AMQP_URL)" rabbitmq_ping rabbitmq_start
}

# The timeline page is tested in a real browser: Debian's Chromium at /usr/bin/chromium
# (Playwright drives it; its own browser download cannot be relied on).
CHROMIUM="${CHROMIUM:-/usr/bin/chromium}"
ensure_chromium() {
    if [[ -x "$CHROMIUM" ]]; then
        return 0
    fi
    say "chromium is missing; installing it with apt-get"
    apt_install chromium || die "cannot install chromium (no apt-get or no root): install it by hand at $CHROMIUM"
}

# The TLS tests make a private CA with the openssl command (tests/tls.py).
ensure_openssl() {
    if command -v openssl >/dev/null 2>&1; then
        return 0
    fi
    say "openssl is missing; installing it with apt-get"
    apt_install openssl || die "cannot install openssl (no apt-get or no root): install it by hand"
}

# The etcd tests start clusters of their own (tests/servers.py): only the binary is needed,
# Debian's etcd-server (etcd 3.4).
ensure_etcd() {
    if command -v etcd >/dev/null 2>&1; then
        return 0
    fi
    say "etcd is missing; installing etcd-server with apt-get"
    apt_install etcd-server || die "cannot install etcd-server (no apt-get or no root): install etcd >= 3.4 by hand"
}

# Start every service named in SIMPLE_MUTEX_SERVICES (comma or space separated).
ensure_services() {
    # Every tier's tests run by default; SIMPLE_MUTEX_SERVICES="" starts none.
    local wanted=",${SIMPLE_MUTEX_SERVICES-redis,postgres,rabbitmq},"
    wanted="${wanted// /,}"
    if [[ "$wanted" == *,redis,* ]]; then ensure_redis; fi
    if [[ "$wanted" == *,postgres,* ]]; then ensure_postgres; fi
    if [[ "$wanted" == *,rabbitmq,* ]]; then ensure_rabbitmq; fi
}
