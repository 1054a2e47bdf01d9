"""S3Cache: every machine that reaches one S3 bucket (AWS S3, or a compatible server with
atomic conditional writes: SeaweedFS...).

One object per cache key, ``prefix + key``, whose JSON body is
``{"value": str | null, "fence": int, "expires_at": float, "nonce": str}``.

* Only ``PUT If-None-Match: *`` (create) and ``PUT If-Match: <etag>`` (replace exactly that
  object) write, so every step is atomic on the server. The version is
  ``"<fence>:<expires_at>:<etag>"``; the random ``nonce`` makes every body's ETag unique.
* A release writes a tombstone (value null, fence kept). A grant's fence is max(fence + 1,
  this client's clock in µs), so a deleted object never restarts it: a bucket lifecycle
  rule may expire objects under the prefix after 30 days or more (docs/guides/s3.md).
  A grant that replaced an object still holding a value (expired: its holder never
  freed it) says it took over (``Entry.took_over``); one over a tombstone, or a new
  object, does not.
* Expiry is the writer's wall clock plus the ttl, judged by the reader's clock: the clocks
  of every machine sharing a bucket must agree far better than a lease (``clock_skew``
  makes takers wait that much longer past every expiry).
* ``verify()`` proves that a server honours the conditions. ``wait`` sleeps: the engine's
  jittered poll finds releases. A forked child drops the client's pooled connections.
* Every botocore error is a ``MalfunctionError`` naming s3, the operation and the key; a
  conditional write that failed is read back and recognised as ours by its nonce.

Rationale: docs/design/s3.md.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple
from urllib.parse import parse_qsl, unquote, urlsplit

from simple_mutex.contract import Entry
from simple_mutex.errors import (
    ConstraintError,
    ConstraintTypeError,
    ConstraintValueError,
    MalfunctionError,
    SimpleCacheConditionError,
)

from ._base import (
    CacheBase,
    SleepingWait,
    clock_fence,
    driver_imports,
    fault,
    malformed,
    new_version,
    ttl_ms,
)

with driver_imports("s3"):
    # No stubs ship with boto3: Any at this boundary (and no complaint if stubs appear).
    import boto3  # type: ignore[import-untyped, unused-ignore]
    from botocore.config import Config  # type: ignore[import-untyped, unused-ignore]
    from botocore.exceptions import (  # type: ignore[import-untyped, unused-ignore]
        BotoCoreError,
        ClientError,
    )

# Bucket names as S3 allows them (lowercase, digits, dots, hyphens; 3-63 characters).
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")
# A prefix is "/"-separated segments of safe characters, e.g. "locks/" or "app/locks.":
# no empty, "." or ".." segment, so no key name can step outside it.
_SEGMENT_RE = re.compile(r"[A-Za-z0-9._:\-]+")
_MAX_PREFIX = 256
_ATTEMPTS = 5  # conditional writes per put_if_absent before calling the key contended
_CONFLICT_RETRIES = 3  # 409 ConditionalRequestConflict: retried, briefly
_MAX_HINTS = 4096
# Refusals that do not pass by itself (no rights, bad credentials, no bucket): a waiter
# raises them at once, and rides out any other fault (a timeout, SlowDown, a 503).
_DENIED = frozenset(
    {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "NoSuchBucket",
     "AllAccessDisabled"}
)  # fmt: skip
# A create that lands this long after its clock was read re-floors its fence. The
# assumption: nothing deletes a lock object within a minute of its last write (a
# lifecycle rule counts days).
_STALE_AFTER = 60.0
_CONTENT_TYPE = "application/json"


class _Object(NamedTuple):
    """A lock object as read or written."""

    etag: str
    value: str | None
    fence: int
    expires_at: float
    nonce: str


class _Hint(NamedTuple):
    etag: str
    fence: int
    lapsed: bool
    """The object still held a value (expired, never freed); else a tombstone."""


_UNFREED = ""
"""The value of a lapsed object known from a hint: there, but not kept (never a lock
record, which is JSON, and never live: its expiry is unknown, so 0)."""


class _Miss(Exception):
    """A conditional write that did not happen: ``gone`` if the object was missing."""

    def __init__(self, gone: bool) -> None:
        super().__init__()
        self.gone = gone


class S3Cache(SleepingWait, CacheBase):
    """A ConditionalCache over a boto3 S3 client. Lock objects are ``prefix + key`` in
    ``bucket``; see the module docstring for the layout and the clock assumption."""

    name = "s3"
    driver_errors: tuple[type[Exception], ...] = (BotoCoreError, ClientError)

    def __init__(
        self,
        client: Any,
        bucket: str,
        prefix: str = "",
        *,
        clock_skew: float = 0.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not callable(getattr(client, "put_object", None)) or not callable(
            getattr(client, "get_object", None)
        ):
            raise ConstraintTypeError(
                f"S3Cache needs a boto3 S3 client (boto3.client('s3')), got {type(client).__name__}"
            )
        if not isinstance(bucket, str) or not _BUCKET_RE.fullmatch(bucket):
            raise ConstraintValueError(
                f"S3Cache needs a bucket name (3-63 characters from a-z 0-9 . -), got {bucket!r}"
            )
        _check_model(client)
        self.client = client
        self.bucket = bucket
        self.prefix = check_s3_prefix(prefix)
        if (
            isinstance(clock_skew, bool)
            or not isinstance(clock_skew, (int, float))
            or not 0 <= clock_skew < math.inf
        ):
            raise ConstraintValueError(f"clock_skew must be seconds >= 0, got {clock_skew!r}")
        self.clock_skew = float(clock_skew)
        self._clock = clock
        self._hints: OrderedDict[str, _Hint] = OrderedDict()
        super().__init__()

    def _after_fork(self) -> None:
        # The child inherits the client's pooled keep-alive connections: used by parent
        # and child at once, one process reads the other's replies (measured: wrong
        # values and bogus errors). Drop the child's copies; it opens its own. Closing a
        # copied descriptor sends nothing (the parent still holds the socket open), and
        # a TLS socket's close() sends no close_notify.
        _drop_connections(self.client)

    def __repr__(self) -> str:
        return f"S3Cache(bucket={self.bucket!r}, prefix={self.prefix!r})"

    # -- the contract ---------------------------------------------------------------------

    def get(self, key: str) -> Entry | None:
        obj = self._read("get", key)
        if obj is None or not self._live(obj, taker=False):
            return None
        return _entry(obj)

    def scan(self, prefix: str) -> Iterator[tuple[str, Entry]]:
        """ListObjectsV2 with ``Prefix`` (literal: S3 has no pattern language), then each
        object read as ``get`` reads it: tombstones and lapsed leases are skipped. Names
        with a ``/`` after ours belong to a cache with a longer prefix."""
        if "/" in prefix:
            return
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix + prefix
        )
        with self._request("scan", prefix):
            names = [item["Key"] for page in pages for item in page.get("Contents", ())]
        for name in names:
            key = name[len(self.prefix) :]
            if "/" in key or key in (".", ".."):
                continue
            entry = self.get(key)
            if entry is not None:
                yield key, entry

    def put_if_absent(self, key: str, value: str, *, ttl: float) -> Entry:
        now = self._clock()
        expires_at = _expiry(now, ttl)
        floor = clock_fence(now)  # the first fence of a new object; a floor for the next
        hint = self._take_hint(key)
        current: _Object | None = None
        create = hint is None
        for _ in range(_ATTEMPTS):
            if create:
                nonce = _nonce()
                try:
                    etag = self._write("put_if_absent", key, value, floor, expires_at, nonce, None)
                    return self._refloored(key, _Object(etag, value, floor, expires_at, nonce), now)
                except _Miss:
                    pass
                current = self._read("put_if_absent", key)
                if current is None:
                    continue  # deleted meanwhile: create again
                if current.nonce == nonce:  # a retried request: our first attempt landed
                    return self._refloored(key, current, now)
            elif current is None:
                # First try the hint: the freed or expired object we saw last.
                assert hint is not None
                current = _Object(hint.etag, _UNFREED if hint.lapsed else None, hint.fence, 0.0, "")
            if self._live(current, taker=True, now=now):
                if current.value == value:
                    return _entry(current)  # our own earlier write whose reply was lost
                raise SimpleCacheConditionError(f"s3: {key!r} is held")
            nonce = _nonce()
            fence = max(current.fence + 1, floor)
            try:
                etag = self._write(
                    "put_if_absent", key, value, fence, expires_at, nonce, current.etag
                )
                granted = _Object(etag, value, fence, expires_at, nonce)
                return _entry(granted, took_over=current.value is not None)
            except _Miss as miss:
                create = miss.gone
            current = self._read("put_if_absent", key)
            if current is None:
                create = True
            elif current.nonce == nonce:
                return _entry(current)
            else:
                create = False
        raise SimpleCacheConditionError(f"s3: {key!r} is contended; every write lost a race")

    def _refloored(self, key: str, created: _Object, read_at: float) -> Entry:
        """A grant that created the key's object, its fence floored at the clock read at
        ``read_at``, before the PUT was sent. S3 cannot compute a floor itself, so where
        the create landed ``_STALE_AFTER`` or more after that read (a paused VM, a PUT
        held up), an object granted meanwhile with a larger fence could have been
        deleted (a lifecycle rule): the fence is raised to the clock read now, after the
        create landed, by a PUT If-Match on our own object, before the grant counts
        (lifecycle rule 16: no floor older than the write that assigns it)."""
        now = self._clock()
        fence = clock_fence(now)
        if now - read_at < _STALE_AFTER or fence <= created.fence:
            return _entry(created)
        assert created.value is not None
        nonce = _nonce()
        try:
            try:
                etag = self._write(
                    "put_if_absent", key, created.value, fence, created.expires_at, nonce,
                    created.etag,
                )  # fmt: skip
            except _Miss:
                etag = self._ours("put_if_absent", key, nonce, _version(created))
        except MalfunctionError as exc:
            exc.withheld = True  # its fence may still be the stale one: never read back
            raise
        return _entry(_Object(etag, created.value, fence, created.expires_at, nonce))

    def compare_and_set(self, key: str, value: str, *, ttl: float, version: str) -> Entry:
        fence, old_expiry, etag = _parse_version(key, version)
        now = self._clock()
        if now >= old_expiry:
            raise SimpleCacheConditionError(f"s3: {key!r} at version {version} has expired")
        expires_at = _expiry(now, ttl)
        nonce = _nonce()
        try:
            new_etag = self._write("compare_and_set", key, value, fence, expires_at, nonce, etag)
        except _Miss:
            new_etag = self._ours("compare_and_set", key, nonce, version)
        return _entry(_Object(new_etag, value, fence, expires_at, nonce))

    def compare_and_delete(self, key: str, *, version: str) -> None:
        fence, expires_at, etag = _parse_version(key, version)
        now = self._clock()
        if now >= expires_at:
            raise SimpleCacheConditionError(f"s3: {key!r} at version {version} has expired")
        nonce = _nonce()
        try:
            new_etag = self._write("compare_and_delete", key, None, fence, now, nonce, etag)
        except _Miss:
            new_etag = self._ours("compare_and_delete", key, nonce, version)
        self._put_hint(key, _Hint(new_etag, fence, lapsed=False))
        # S3 cannot tell whether anyone waits: None lets the engine re-acquire at once.

    def verify(self) -> None:
        """Prove that the server honours conditional writes, or raise ``MalfunctionError``.

        A server that ignores ``If-None-Match`` / ``If-Match`` (rclone's ``serve s3``
        does, silently) would grant every lock to everyone. Call this once at start-up,
        as a health check: three PUTs on a probe object ``<prefix>simple-mutex.probe.*``,
        then a plain DELETE of it (skipped quietly where the role may not delete)."""
        key = f"simple-mutex.probe.{_nonce()}"
        try:
            etag = self._write("verify", key, None, 0, 0.0, _nonce(), None)
        except _Miss:
            raise MalfunctionError(
                f"s3 cache (s3://{self.bucket}/{self.prefix}): a PUT If-None-Match on a "
                "fresh probe object failed"
            ) from None
        try:
            ignored = []
            for condition in (None, "0" * 32 if etag != "0" * 32 else "1" * 32):
                try:
                    self._write("verify", key, None, 0, 0.0, _nonce(), condition)
                    ignored.append("If-None-Match" if condition is None else "If-Match")
                except _Miss:
                    pass
        finally:
            with contextlib.suppress(ClientError, BotoCoreError):
                self.client.delete_object(Bucket=self.bucket, Key=self._name(key))
        if ignored:
            raise MalfunctionError(
                f"the S3 server behind s3://{self.bucket}/{self.prefix} ignores "
                f"{' and '.join(ignored)}: it cannot hold locks (it would grant every "
                "lock to everyone); use AWS S3 or a server with conditional writes"
            )

    # -- requests -------------------------------------------------------------------------

    def _name(self, key: str) -> str:
        if "/" in key or key in (".", ".."):
            raise ConstraintValueError(f"s3: cache key {key!r} must not contain '/' or be a dot")
        return self.prefix + key

    def _live(self, obj: _Object, *, taker: bool, now: float | None = None) -> bool:
        if obj.value is None:
            return False
        when = self._clock() if now is None else now
        return when < obj.expires_at + (self.clock_skew if taker else 0.0)

    def _read(self, operation: str, key: str) -> _Object | None:
        name = self._name(key)
        with self._request(operation, key):
            try:
                reply = self.client.get_object(Bucket=self.bucket, Key=name)
                body = reply["Body"].read()
                etag = _strip(reply["ETag"])
            except ClientError as exc:
                if _code(exc) != "NoSuchKey":
                    raise
                self._drop_hint(key)
                return None
        try:
            record = json.loads(body)
            value, fence = record["value"], record["fence"]
            expires_at, nonce = float(record["expires_at"]), record["nonce"]
            if not (value is None or isinstance(value, str)) or type(fence) is not int:
                raise TypeError("bad field types")
            obj = _Object(etag, value, fence, expires_at, str(nonce))
        except (ValueError, TypeError, KeyError) as exc:
            detail = f"object s3://{self.bucket}/{name}: {exc!r}"
            raise malformed(self.name, operation, key, detail) from None
        if not self._live(obj, taker=True):
            self._put_hint(key, _Hint(etag, fence, lapsed=value is not None))
        return obj

    def _write(
        self,
        operation: str,
        key: str,
        value: str | None,
        fence: int,
        expires_at: float,
        nonce: str,
        if_match: str | None,
    ) -> str:
        """One conditional PUT; its new ETag, or ``_Miss`` when the condition failed."""
        name = self._name(key)
        body = json.dumps(
            {"value": value, "fence": fence, "expires_at": expires_at, "nonce": nonce},
            separators=(",", ":"),
        ).encode()
        condition = {"IfNoneMatch": "*"} if if_match is None else {"IfMatch": if_match}
        for attempt in range(_CONFLICT_RETRIES + 1):
            with self._request(operation, key):
                try:
                    reply = self.client.put_object(
                        Bucket=self.bucket, Key=name, Body=body, ContentType=_CONTENT_TYPE,
                        **condition,
                    )  # fmt: skip
                    return _strip(reply["ETag"])
                except ClientError as exc:
                    code = _code(exc)
                    if code == "PreconditionFailed":
                        raise _Miss(gone=False) from None
                    if code == "NoSuchKey" and if_match is not None:
                        raise _Miss(gone=True) from None
                    if code != "ConditionalRequestConflict" or attempt == _CONFLICT_RETRIES:
                        raise
            time.sleep(0.01 * (attempt + 1))  # a 409 conflict: retried, briefly
        raise AssertionError("unreachable")  # pragma: no cover

    def _ours(self, operation: str, key: str, nonce: str, version: str) -> str:
        """After a failed If-Match PUT: was it ours all the same (a retried request whose
        first attempt landed)? Its ETag if so; else the miss is raised."""
        current = self._read(operation, key)
        if current is None or current.nonce != nonce:
            raise SimpleCacheConditionError(f"s3: {key!r} is not at version {version}")
        return current.etag

    @contextlib.contextmanager
    def _request(self, operation: str, key: str) -> Iterator[None]:
        """Around every request: the one place a botocore error becomes the
        MalfunctionError users see (a condition the caller handles is caught inside)."""
        try:
            yield
        except (ClientError, BotoCoreError) as exc:
            where = f" at s3://{self.bucket}/{self.prefix}"
            denied = isinstance(exc, ClientError) and _code(exc) in _DENIED
            raise fault(self.name, operation, key, exc, where, lasting=denied) from exc

    # -- takeover hints -------------------------------------------------------------------

    def _put_hint(self, key: str, hint: _Hint) -> None:
        with self._guard:
            self._hints[key] = hint
            self._hints.move_to_end(key)
            while len(self._hints) > _MAX_HINTS:
                self._hints.popitem(last=False)

    def _take_hint(self, key: str) -> _Hint | None:
        with self._guard:
            return self._hints.pop(key, None)

    def _drop_hint(self, key: str) -> None:
        with self._guard:
            self._hints.pop(key, None)


def _check_model(client: Any) -> None:
    """Fail early when botocore is too old to send ``If-Match`` on PutObject (its model
    gained it in late 2024); silently dropped, the condition would make every write blind."""
    try:
        members = client.meta.service_model.operation_model("PutObject").input_shape.members
    except (AttributeError, TypeError, LookupError, BotoCoreError):  # a wrapper: trust it
        return
    missing = {"IfNoneMatch", "IfMatch"} - set(members)
    if missing:
        raise ConstraintError(
            f"this botocore cannot send {' and '.join(sorted(missing))} on PutObject; "
            "upgrade: pip install -U 'simple-mutex[s3]' boto3"
        )


def _drop_connections(client: Any) -> None:
    """Empty a botocore client's connection pools (in a forked child): its public
    ``close()`` clears the pools, and the client opens new
    connections on its next request. A client without one (a wrapper) is left alone."""
    close = getattr(client, "close", None)
    if callable(close):
        close()


def check_s3_prefix(prefix: object) -> str:
    """A prefix of "/"-separated safe segments ("locks/", "app/locks."), or ""."""
    if not isinstance(prefix, str) or len(prefix) > _MAX_PREFIX:
        raise ConstraintValueError(
            f"S3Cache prefix must be a str of at most {_MAX_PREFIX} characters, got {prefix!r}"
        )
    segments = prefix.split("/")
    if segments[-1] == "":
        segments.pop()  # a trailing "/" is the usual folder style
    if prefix and (
        not segments or any(not _SEGMENT_RE.fullmatch(s) or s in (".", "..") for s in segments)
    ):
        raise ConstraintValueError(
            f"S3Cache prefix must be '/'-separated segments of A-Z a-z 0-9 . _ : - (no "
            f"empty, '.' or '..' segment, no leading '/'), like 'locks/', got {prefix!r}"
        )
    return prefix


def _entry(obj: _Object, took_over: bool = False) -> Entry:
    assert obj.value is not None
    return Entry(obj.value, _version(obj), obj.fence, obj.expires_at, took_over)


def _version(obj: _Object) -> str:
    return f"{obj.fence}:{obj.expires_at!r}:{obj.etag}"


def _parse_version(key: str, version: str) -> tuple[int, float, str]:
    try:
        fence, expires_at, etag = version.split(":", 2)
        return int(fence), float(expires_at), etag
    except (ValueError, AttributeError):
        raise SimpleCacheConditionError(f"s3: {key!r} is not at version {version!r}") from None


def _expiry(now: float, ttl: float) -> float:
    # Whole milliseconds, rounded up: never before the holder's own deadline.
    return math.ceil(now * 1000 + ttl_ms(ttl)) / 1000


def _nonce() -> str:
    return new_version()


def _strip(etag: str) -> str:
    return etag.strip('"')


def _code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def client_config(**overrides: Any) -> Any:
    """The botocore ``Config`` for clients this module builds: bounded waits, few retries."""
    settings: dict[str, Any] = {
        "connect_timeout": 5,
        "read_timeout": 10,
        # Two attempts in all: standard mode backs off up to 2**n s before retry n, and
        # botocore 1.35 retries a refused connection too, so its default (3) held a
        # timed acquire for 5 s on a dead endpoint (measured); the engine retries itself.
        "retries": {"total_max_attempts": 2, "mode": "standard"},
    }
    settings.update(overrides)
    return Config(**settings)


_URL_OPTIONS = ("endpoint_url", "region", "addressing_style", "clock_skew")


def from_url(url: str) -> S3Cache:
    """An S3Cache from ``s3://bucket[/prefix][?endpoint_url=...&region=...]``.

    Credentials, region and endpoint come from the environment and boto3's usual sources
    (``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``, ``AWS_ENDPOINT_URL_S3``, instance roles...);
    ``endpoint_url`` (an S3-compatible server), ``region``, ``addressing_style``
    (``path`` or ``virtual``) and ``clock_skew`` (seconds) may be given in the query.
    The prefix is everything after the bucket, kept verbatim: ``s3://b/locks/`` puts
    objects in the folder ``locks/``, while ``s3://b/locks`` names them ``locks<key>``."""
    parts = urlsplit(url)
    if parts.scheme.lower() != "s3":
        raise ConstraintValueError(
            f"unknown S3 URL scheme {parts.scheme!r}; use s3://bucket/prefix"
        )
    if parts.username or parts.password:
        raise ConstraintValueError(
            "an s3:// URL must not carry credentials; set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or a profile / role) instead"
        )
    options: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in _URL_OPTIONS:
            raise ConstraintValueError(
                f"unknown s3:// URL option {name!r}; known: {', '.join(_URL_OPTIONS)}"
            )
        options[name] = value
    bucket = parts.netloc  # verbatim: hostname would lowercase it silently
    prefix = unquote(parts.path.removeprefix("/"))
    config_overrides: dict[str, Any] = {}
    if "addressing_style" in options:
        if options["addressing_style"] not in ("path", "virtual", "auto"):
            raise ConstraintValueError("addressing_style must be path, virtual or auto")
        config_overrides["s3"] = {"addressing_style": options["addressing_style"]}
    try:
        skew = float(options.get("clock_skew", "0"))
    except ValueError:
        raise ConstraintValueError("clock_skew in an s3:// URL must be seconds") from None
    client = boto3.client(
        "s3",
        endpoint_url=options.get("endpoint_url") or None,
        region_name=options.get("region") or None,
        config=client_config(**config_overrides),
    )
    return S3Cache(client, bucket, prefix, clock_skew=skew)
