"""What every fenced store checks the same way: the fence, and the names of columns."""

from __future__ import annotations

from collections.abc import Mapping

from simple_mutex.errors import ConstraintTypeError, ConstraintValueError

# A BIGINT column holds it, and the Redis script compares decimal strings of it exactly.
MAX_FENCE = 2**63 - 1


def check_fence(fence: object) -> int:
    """``fence`` as an int in [0, 2**63 - 1], else a ConstraintError naming the fix."""
    if isinstance(fence, bool) or not isinstance(fence, int):
        raise ConstraintTypeError(
            f"fence must be an int (pass lease.fence or current_lease().fence), got {fence!r}"
        )
    if not 0 <= fence <= MAX_FENCE:
        raise ConstraintValueError(
            f"fence must lie in [0, 2**63 - 1] (pass lease.fence), got {fence!r}"
        )
    return fence


def check_name(name: object, what: str) -> str:
    """A column (or table part) name: a non-empty str without NUL. Anything else in it is
    quoted by the store's own identifier quoting, never formatted raw into SQL."""
    if not isinstance(name, str):
        raise ConstraintTypeError(f"{what} must be a str, got {type(name).__name__}")
    if not name or "\0" in name:
        raise ConstraintValueError(f"{what} must be a non-empty name without NUL, got {name!r}")
    return name


def check_columns(
    what: str, columns: object, fence_column: str, *, empty_ok: bool
) -> dict[str, object]:
    """``columns`` (a mapping of column name to value) as a dict; the fence column may not
    be among them, since the guard alone writes it."""
    if not isinstance(columns, Mapping):
        raise ConstraintTypeError(
            f"{what} must be a mapping of column name to value, got {type(columns).__name__}"
        )
    if not columns and not empty_ok:
        raise ConstraintValueError(
            f"{what} is empty: name the row(s) to write, e.g. {{'id': 7}} (a fenced write "
            "never writes a whole table by accident)"
        )
    checked = {check_name(n, f"a column name in {what}"): v for n, v in columns.items()}
    if fence_column in checked:
        raise ConstraintValueError(
            f"{what} names the fence column {fence_column!r}: leave it out, the fence= "
            "argument writes it (or pass fence_column= if your column has another name)"
        )
    return checked
