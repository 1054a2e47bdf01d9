"""Fenced writes to S3: the fence in the object's metadata (``x-amz-meta-fence``), the
write conditional on the ETag just read.

One attempt: HEAD the object (its ETag and fence; a 404 is a new object), refuse if the
fence is larger than ours, then ``PUT If-Match: <etag>`` (``If-None-Match: *`` for a new
object). A 412 or 409 means another writer came between the two: read again, and judge
its fence. An object without the metadata (written before fences) counts as fence 0.

Limit: an ETag is a digest of the body alone. Should a later holder write bytes identical
to the ones we read, between our HEAD and our PUT, the ETag is unchanged and our write
lands. If holders can write identical bodies, put the fence (or a nonce) in the body.
"""

from __future__ import annotations

import random
import time
from typing import Any

from simple_mutex.errors import ConstraintTypeError, FencedOutError, MalfunctionError

from ._common import check_fence

ATTEMPTS = 10  # lost races before giving up: each one means another writer just wrote
_LOST_RACE = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}
_MISSING = {"404", "NoSuchKey", "NotFound"}


def _code(exc: Any) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def fenced_put(s3_client: Any, bucket: str, key: str, body: object, *, fence: int) -> None:
    """Write ``body`` to ``bucket``/``key`` unless the object holds a larger fence than
    ``fence`` (an equal one is accepted); raise ``FencedOutError`` if it does."""
    fence = check_fence(fence)
    if isinstance(body, str):
        body = body.encode()
    if not isinstance(body, (bytes, bytearray)):
        # A stream cannot be sent twice, and a lost race sends it again.
        raise ConstraintTypeError(
            f"body must be bytes or str (read a file into bytes first), got {type(body).__name__}"
        )
    from botocore.exceptions import (  # type: ignore[import-untyped, unused-ignore]
        BotoCoreError,
        ClientError,
    )

    where = f"object {bucket}/{key}"
    for attempt in range(ATTEMPTS):
        try:
            head = s3_client.head_object(Bucket=bucket, Key=key)
            condition = {"IfMatch": head["ETag"]}
            current = int(head.get("Metadata", {}).get("fence", "0"))
        except ClientError as exc:
            if _code(exc) not in _MISSING:
                raise MalfunctionError(f"s3 fenced_put: HEAD of {where} failed: {exc!r}") from exc
            condition, current = {"IfNoneMatch": "*"}, 0
        except (BotoCoreError, ValueError) as exc:
            raise MalfunctionError(f"s3 fenced_put: HEAD of {where} failed: {exc!r}") from exc
        if current > fence:
            raise FencedOutError.refused("s3", where, fence, current)
        try:
            s3_client.put_object(
                Bucket=bucket, Key=key, Body=bytes(body), Metadata={"fence": str(fence)},
                **condition,
            )  # fmt: skip
            return
        except ClientError as exc:
            if _code(exc) not in _LOST_RACE:
                raise MalfunctionError(f"s3 fenced_put: PUT of {where} failed: {exc!r}") from exc
        except BotoCoreError as exc:
            raise MalfunctionError(f"s3 fenced_put: PUT of {where} failed: {exc!r}") from exc
        time.sleep(random.uniform(0, 0.005 * 2**attempt))  # let the other writer finish
    raise MalfunctionError(
        f"s3 fenced_put: {where} changed under each of {ATTEMPTS} conditional writes in a row"
    )
