"""Fenced writes across OS processes: a holder SIGSTOPped past its lease, and many
processes racing with different fences. Real Mutex over RedisCache for the lock; real
PostgreSQL, Redis and S3 (SeaweedFS) for the store."""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from fenced_support import (
    POSTGRES_URL,
    REDIS_URL,
    S3_BUCKET,
    drop_table,
    final_state,
    new_table,
    s3_client,
    writer,
)
from procs import FORK, hold_with_writer, taken_from_paused
from servers import s3_bucket

from simple_mutex import FencedOutError, Lease, Mutex, cache_from_url
from simple_mutex.fenced import fenced_put, fenced_set, fenced_update

pytestmark = pytest.mark.backends


@pytest.fixture(scope="module")
def s3_endpoint(seaweed: str) -> str:
    """The session's SeaweedFS, with the fenced suites' bucket."""
    s3_bucket(seaweed, S3_BUCKET)
    return seaweed


def target_for(kind: str, request: pytest.FixtureRequest) -> str:
    """A fresh table, Redis key or S3 object for ``kind``; removed at teardown."""
    if kind.startswith(("psycopg", "sqlalchemy", "django")):
        table = new_table()
        request.addfinalizer(lambda: drop_table(table))
        return table
    if kind.startswith("redis"):
        key = f"fenced.{uuid.uuid4().hex[:10]}"
        request.addfinalizer(lambda: redis.Redis.from_url(REDIS_URL).delete(key))
        return key
    return f"{request.getfixturevalue('s3_endpoint')}#paused/{uuid.uuid4().hex}"


# -- a holder paused past its lease --------------------------------------------------------


HOLDER_LEASE = 2.5  # renewed every third: a holder starved for 1.6 s still keeps it


def _paused_holder(kind: str, target: str, lock_key: str, report: str, writing: Any) -> None:
    """Holds ``lock_key`` (lease ``HOLDER_LEASE``, renewed) while a helper thread writes under its
    fence every 10 ms, logging "<monotonic start> <1 accepted | 0 refused | error>"; once
    the lease is lost the helper writes once more, as a worker pool's thread would.
    ``writing.value`` is 1 while a write is under way (the parent pauses it between two)."""
    write = writer(kind, target)
    log = open(report + ".attempts", "a", buffering=1)  # noqa: SIM115 (lives with the thread)

    def write_until(lease: Lease, stop: threading.Event) -> None:
        def attempt() -> None:
            writing.value = 1
            started = time.monotonic()
            try:
                verdict = "1" if write(lease.fence, "paused") else "0"
            except Exception as exc:  # reported, so the test fails on it
                verdict = f"error:{exc!r}".replace(" ", "_")
            finally:
                writing.value = 0
            log.write(f"{started} {verdict}\n")

        while not stop.is_set():
            time.sleep(0.01)  # paused in here, it writes again when resumed
            attempt()
        attempt()  # once more after the loss: begun after the takeover, surely

    mutex = Mutex(cache_from_url(REDIS_URL), lease=HOLDER_LEASE)
    hold_with_writer(mutex, lock_key, report, write_until)


def paused_holder_scenario(kind: str, target: str, tmp_path: Path) -> tuple[list[str], int]:
    """Run the scenario; returns the verdicts of the writes the paused holder began after
    the taker's write landed, and the taker's fence."""
    lock_key, report = f"fenced.lock.{uuid.uuid4().hex[:8]}", str(tmp_path / "holder")
    writing = FORK.RawValue("b", 0)  # shared with the forked holder
    holder = FORK.Process(target=_paused_holder, args=(kind, target, lock_key, report, writing))

    def held_at() -> int:
        deadline = time.monotonic() + 10
        attempts = Path(report + ".attempts")
        # Both files may exist before they are written: wait for their content.
        while not (attempts.exists() and " 1" in attempts.read_text()):
            assert time.monotonic() < deadline, "the holder never took the lock and wrote"
            time.sleep(0.01)  # the rightful holder's writes land first
        return int(Path(report).read_text())

    paused = taken_from_paused(
        holder, REDIS_URL, lock_key, held_at, join=15, writing=lambda: bool(writing.value)
    )
    with paused as lease:
        # A holder starved of the CPU past its lease before the pause (two suites on two
        # cores) lost it then, and wrote nothing after the takeover: say so, plainly.
        assert not Path(report + ".done").exists(), "the holder lost its lease before the pause"
        assert writer(kind, target)(lease.fence, "taker"), "the new holder was refused"
        taken_at = time.monotonic()
    assert Path(report + ".done").read_text() == "interrupted"
    attempts = [line.split() for line in Path(report + ".attempts").read_text().splitlines()]
    errors = [verdict for _, verdict in attempts if verdict.startswith("error")]
    assert not errors, f"writes failed otherwise than by their fence: {errors}"
    assert any(v == "1" for s, v in attempts if float(s) < taken_at), "the holder never wrote"
    late = [verdict for started, verdict in attempts if float(started) > taken_at]
    # Every run so far had late writes; if one has none, what the holder did says why.
    assert late, f"no write after the takeover at {taken_at}: the last ones {attempts[-4:]}"
    return late, lease.fence


GUARDS = ["psycopg", "sqlalchemy-core", "sqlalchemy-orm", "django", "redis", "s3"]
PLAIN = ["psycopg-plain", "redis-plain", "s3-plain"]


@pytest.mark.parametrize("kind", GUARDS)
def test_a_paused_holders_late_writes_are_refused_by_the_guard(kind, tmp_path, request):
    """SIGSTOPped past its lease, taken over, resumed: every write the old holder starts
    after the new holder's is refused (FencedOutError), and the store keeps the new one."""
    target = target_for(kind, request)
    late, taker_fence = paused_holder_scenario(kind, target, tmp_path)
    assert late.count("1") == 0, f"{late.count('1')} stale write(s) accepted"
    assert final_state(kind, target) == ("taker", taker_fence)
    print(f"{kind}: {len(late)} late write(s) of the paused holder refused, 0 accepted")


@pytest.mark.parametrize("kind", PLAIN)
def test_without_the_guard_the_paused_holders_write_lands(kind, tmp_path, request):
    """The same scenario with a plain write (UPDATE, HSET, PUT): the stale write lands and
    overwrites the new holder's; what the guard test refuses is real."""
    target = target_for(kind, request)
    late, taker_fence = paused_holder_scenario(kind, target, tmp_path)
    assert late.count("1") >= 1
    writer_now, fence_now = final_state(kind, target)
    assert writer_now == "paused"
    assert fence_now is not None
    assert fence_now < taker_fence


# -- many processes racing with different fences --------------------------------------------


def _racer(kind: str, target: str, fence: int, rounds: int, out: multiprocessing.Queue) -> None:
    """Write ``rounds`` times with ``fence``; report each outcome, never swallow one."""
    if kind == "psycopg":
        conn = psycopg.connect(POSTGRES_URL, autocommit=True)

        def write() -> object:
            return fenced_update(conn, target, {"id": 1}, {"writer": f"w{fence}"}, fence=fence)
    elif kind == "redis":
        client = redis.Redis.from_url(REDIS_URL)

        def write() -> object:
            return fenced_set(client, target, f"w{fence}", fence=fence)
    else:
        endpoint, key = target.split("#", 1)
        s3 = s3_client(endpoint)

        def write() -> object:
            return fenced_put(s3, S3_BUCKET, key, f"w{fence}", fence=fence)

    outcomes = []
    for _ in range(rounds):
        try:
            result = write()
            outcomes.append(("ok", result))
        except FencedOutError as exc:
            outcomes.append(("fenced", (exc.fence, exc.current)))
        except Exception as exc:
            outcomes.append(("error", repr(exc)))
    out.put((fence, outcomes))


@pytest.mark.parametrize("kind", ["psycopg", "redis", "s3"])
def test_racing_writers_end_with_the_largest_fence_and_every_refusal_is_fenced(kind, request):
    """5 processes write the same row / key / object with fences 1..5, 30 times each:
    the store ends with fence 5's value; every outcome is a write or a FencedOutError
    whose stored fence is larger than ours; none is lost, failed or silent (psycopg: an
    accepted write always reports 1 row). On PostgreSQL a trigger logs every accepted
    write: its fences never go down."""
    target = target_for(kind, request)
    if kind == "psycopg":
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f'CREATE TABLE "{target}_log" (n bigserial, fence bigint)')
            request.addfinalizer(lambda: drop_table(f"{target}_log"))
            conn.execute(f"""
                CREATE FUNCTION "{target}_f"() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN INSERT INTO "{target}_log" (fence) VALUES (NEW.fence); RETURN NEW; END $$;
                CREATE TRIGGER t AFTER UPDATE ON "{target}" FOR EACH ROW
                EXECUTE FUNCTION "{target}_f"();
            """)  # fmt: skip
    rounds, out = 30, FORK.Queue()
    procs = [FORK.Process(target=_racer, args=(kind, target, f, rounds, out)) for f in range(1, 6)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(10)
    assert sorted(results) == [1, 2, 3, 4, 5]
    for fence, outcomes in results.items():
        assert len(outcomes) == rounds
        for verdict, detail in outcomes:
            assert verdict in ("ok", "fenced"), f"fence {fence}: {detail}"
            if verdict == "fenced":
                assert detail[0] == fence
                assert detail[1] > fence
            elif kind == "psycopg":
                assert detail == 1, "an accepted write must report its row"
    assert all(v == "ok" for v, _ in results[5]), "the largest fence is never refused"
    assert final_state(kind, target) == ("w5", 5)
    if kind == "psycopg":
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            log = [f for (f,) in conn.execute(f'SELECT fence FROM "{target}_log" ORDER BY n')]
            conn.execute(f'DROP FUNCTION "{target}_f"() CASCADE')
        assert log == sorted(log), "an accepted write carried a lower fence than one before"
        accepted = sum(v == "ok" for outcomes in results.values() for v, _ in outcomes)
        assert len(log) == accepted
    refused = sum(v == "fenced" for outcomes in results.values() for v, _ in outcomes)
    print(f"{kind}: {5 * rounds - refused} accepted, {refused} refused")
