#!/usr/bin/env bash
# The oldest versions pyproject.toml claims, tested together: a second virtual environment
# on the oldest supported Python gets every lower bound of the user-facing extras pinned
# exactly (redis>=4.6 becomes redis==4.6, ...) plus the test tools, then the integration
# tests run in it against the real servers. Where one fails, raise the bound in
# pyproject.toml; never leave a claim untested.
#
#   bash scripts/check_lower_bounds.sh            # the integration subset below
#   bash scripts/check_lower_bounds.sh -k redis   # extra arguments go to pytest instead
#
# Knobs: PYTHON (default: Python 3.10, the oldest requires-python admits),
# LOWER_VENV (default: a temporary directory, removed afterwards).
set -euo pipefail
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

USER_EXTRAS="redis,postgres,mongo,etcd,s3,sqlalchemy,django,celery,rq,prometheus,otel"
# A smoke run, each backend and integration once on its oldest claimed driver: the full
# contract once per cache and face (its construction variants make the same driver calls
# and run in the main tests), and each integration's suites that reach into the host
# library (Celery's signals, prefork pool and date arithmetic: the beat guard's slots,
# Kolkata's +05:30 among them, through Celery's own is_due; RQ's worker, its retries and
# the dead horses it reaps; the metrics and spans a real worker reports; the fenced
# writes of every driver and ORM). The slowest process tests stay in the main run. Not
# here: AsyncMongoCache, which needs pymongo's AsyncMongoClient (4.13, as its guide says),
# above the mongo extra's bound; the main tests run it on the newest pymongo.
LOWER_TESTS=(
    tests/caches/test_redis.py::TestRedisCacheContract
    tests/caches/test_redis_async.py::TestAsyncRedisCacheContract
    tests/caches/test_postgres.py::TestPostgresCacheContract
    tests/caches/test_postgres_async.py::TestAsyncPostgresContract
    tests/caches/test_mongo.py::TestMongoContractServerClock
    tests/caches/test_etcd.py::TestEtcdCacheContract
    tests/caches/test_etcd_async.py::TestAsyncEtcdContract
    tests/caches/test_s3.py::TestS3CacheContractSeaweedFS
    tests/celery_mutex/test_celery_inproc.py tests/celery_mutex/test_celery_prefork.py
    tests/celery_mutex/test_celery_enqueue.py tests/celery_mutex/test_beat_slots.py
    tests/rq_mutex/test_rq.py tests/rq_mutex/test_rq_dead_horse.py tests/rq_mutex/test_rq_host.py
    tests/contrib/test_prometheus.py tests/contrib/test_opentelemetry.py
    tests/contrib/test_observe_workers.py
    tests/fenced/test_fenced.py tests/fenced/test_fenced_django.py
    # The lease interrupt on a CPython before 3.12 (a thread being started carries its
    # parent's id there): the main tests run on 3.12.
    tests/test_lease.py::test_a_lost_lease_interrupts_a_holder_that_is_starting_threads
)

python="${PYTHON:-$(python_for 3.10)}" \
    || die "no Python 3.10 (the oldest requires-python admits): set PYTHON=/path/to/python3.10"
VENV="${LOWER_VENV:-$(mktemp -d -t simple-mutex-lower.XXXXXX)/venv}"
[[ -n "${LOWER_VENV:-}" ]] || trap 'rm -rf "$(dirname "$VENV")"' EXIT

fresh_venv "$VENV" "$python"
# name==version for every name>=version in the user-facing extras.
constraints="$(dirname "$VENV")/lower-bounds.txt"
"$VENV/bin/python" - "$USER_EXTRAS" >"$constraints" <<'PY'
import re, sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the copy pip carries
    from pip._vendor import tomli as tomllib

extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
pins = {}
for extra in sys.argv[1].split(","):
    for requirement in extras[extra]:
        found = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?>=([0-9][^,;\s]*)", requirement)
        if found:
            pins[found[1].lower()] = found[2]
print("\n".join(f"{name}=={version}" for name, version in sorted(pins.items())))
PY
say "lower bounds, pinned together on $("$python" -V 2>&1): $(paste -sd' ' "$constraints")"

# The test extra brings the test tools; the constraints hold every driver at its bound.
pip_install "$VENV" -e ".[test,$USER_EXTRAS]" -c "$constraints" \
    || die "the lower bounds do not install together"
pip_install "$VENV" --pre -r scripts/test-servers.txt -c "$constraints" \
    || die "pip install of the test servers failed"
say "installed: $("$VENV/bin/python" -m pip list --format=freeze 2>/dev/null \
    | grep -iE '^(celery|kombu|redis|rq|psycopg|psycopg-pool|pymongo|etcd3gw|aetcd|grpcio|protobuf|boto3|botocore|prometheus.client|opentelemetry-(api|sdk))==' \
    | paste -sd' ')"

ensure_services
ensure_etcd
if [[ $# -eq 0 ]]; then set -- -n 3 --dist loadfile "${LOWER_TESTS[@]}"; fi
say "pytest $* (on the lower bounds)"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
