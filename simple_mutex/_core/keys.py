"""Lock keys: the user's key kept verbatim, the cache key made safe and bounded.

The cache key is ``prefix + encoded(key)``. Encoding keeps letters, digits and ``._-~:``
and percent-encodes every other byte of the UTF-8 form, so no key can carry a glob
(``* ? [ ]``: Redis patterns), a path step (``/``: files and S3 names), a hash-tag brace
(``{ }``: Redis Cluster) or the ``#`` that separates semaphore slots. Past
``MAX_KEY_CHARS`` the tail is replaced by a SHA-256 of the whole key, so keys stay bounded
for every backend while distinct keys stay distinct.
"""

from __future__ import annotations

import hashlib
import re
import string
from collections.abc import Iterable
from typing import Any
from urllib.parse import unquote

from simple_mutex.errors import ConstraintValueError, bad_input, shown

MAX_KEY_CHARS = 200
MAX_USER_KEY = 1024
"""The longest lock key taken, in characters: each record carries the user's key whole
(so ``list`` and ``show`` can name a hashed one), and a lock costs its key's length in
every record, event and log line. Longer: hash the identifier into the key."""
_HEAD_CHARS = MAX_KEY_CHARS - 64  # 1 + 64 + this > MAX_KEY_CHARS: never equal to an unhashed key
_SAFE = frozenset(string.ascii_letters + string.digits + "._-~:")
_SAFE_RE = re.compile(r"[A-Za-z0-9._~:-]*")
_PREFIX_RE = re.compile(r"[A-Za-z0-9._:-]{0,64}")


def check_prefix(prefix: object) -> str:
    if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
        raise bad_input(
            prefix, str,
            f"prefix must be at most 64 characters from A-Z a-z 0-9 . _ : -, got {prefix!r}",
        )  # fmt: skip
    return prefix


def check_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise bad_input(
            key, str,
            f"a lock key must be a non-empty str, got {shown(key)}; "
            "build it from your arguments, e.g. key='order.{order_id}'",
        )  # fmt: skip
    if len(key) > MAX_USER_KEY:
        raise ConstraintValueError(
            f"a lock key must be at most {MAX_USER_KEY} characters, got {len(key)} "
            f"({shown(key)}); put a digest of a long identifier in the key, e.g. "
            "hashlib.sha256(text.encode()).hexdigest()"
        )
    return key


def encode_key(key: str) -> str:
    if _SAFE_RE.fullmatch(key):
        encoded = key
    else:
        encoded = "".join(
            c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode("utf-8", "surrogatepass"))
            for c in key
        )
    if len(encoded) <= MAX_KEY_CHARS:
        return encoded
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{encoded[:_HEAD_CHARS]}~{digest}"


def is_hashed(encoded: str) -> bool:
    """Was this encoded key too long, its tail replaced by a digest? (Only those are
    longer than MAX_KEY_CHARS.)"""
    return len(encoded) > MAX_KEY_CHARS


def decode_key(encoded: str) -> str | None:
    """The user's key that ``encode_key`` turned into ``encoded``, exactly; None when the
    key was hashed (its record carries it) or ``encode_key`` could not have made it."""
    if is_hashed(encoded) or not encoded:
        return None
    try:
        key = unquote(encoded, errors="surrogatepass") if "%" in encoded else encoded
    except UnicodeDecodeError:
        return None
    return key if encode_key(key) == encoded else None


def split_slot(cache_key: str) -> tuple[str, int] | None:
    """``base#N`` as (base, N), a plain base as (base, 0); None for a malformed slot."""
    base, sep, slot = cache_key.partition("#")
    if not sep:
        return base, 0
    if not slot.isdigit() or slot != str(int(slot)) or int(slot) == 0:
        return None
    return base, int(slot)


def slot_key(base: str, slot: int) -> str:
    """The cache key of one permit slot. A mutex is a semaphore of one slot."""
    return base if slot == 0 else f"{base}#{slot}"


def template_fields(template: str) -> list[str]:
    """The argument names a key template such as ``"order.{order.id}.{n}"`` refers to."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ConstraintValueError(f"key template {template!r} is malformed: {exc}") from None
    names: list[str] = []
    for _, field, _, _ in parsed:
        if field is None:
            continue
        root = re.split(r"[.\[]", field, maxsplit=1)[0]
        if not root or root.isdigit():
            raise ConstraintValueError(
                f"key template {template!r} must name arguments, like 'order.{{order_id}}'"
            )
        names.append(root)
    return names


def check_template(template: str, parameters: Iterable[str], accepts_any: bool) -> None:
    """Fail at decoration time when a template names an argument the function lacks."""
    known = set(parameters)
    missing = [name for name in template_fields(template) if name not in known]
    if missing and not accepts_any:
        raise ConstraintValueError(
            f"key template {template!r} names {', '.join(missing)}, which the function "
            f"does not take; its arguments are: {', '.join(sorted(known)) or '(none)'}"
        )


def render_template(template: str, arguments: dict[str, Any]) -> str:
    try:
        return template.format_map(arguments)
    except (KeyError, AttributeError, IndexError, ValueError) as exc:
        raise ConstraintValueError(
            f"key template {template!r} could not be filled from {sorted(arguments)}: {exc!r}"
        ) from None
