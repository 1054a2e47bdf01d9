"""Where a lease stands, as one value, and the one function that moves it on.

::

    Held ──release()──► Releasing ──the delete landed──► Released(in_time=True)
      │                   │   └─ a fault: stays Releasing (a retry must reach the record)
      │                   │
      └────────┬──────────┘
               ▼  lapsed / taken over / not renewable
         Lost(reason) ──release()──► Released(in_time=False, loss=reason)

A release that came too late ends ``Released(in_time=False, loss=...)`` from Releasing
too; a forked child's copy, or a release cut short by an interrupt (its record abandoned),
ends ``Released(in_time=False)`` from any live state. A release whose delete was sent in
time keeps ``in_time=True`` if the keeper found the deadline passed while that delete was
in flight; the loss is kept beside it.

A lease ends in exactly one of three ways: released by its holder, lapsed, or lost at
renewal (its record gone or another owner's). Once it has ended it never becomes live
again, and the first loss is the one reported: a move the lifecycle does not allow (a
loss found after the release, a second loss) leaves the state as it is. ``step`` is the
only place that decides this; ``Lease`` keeps the value under its lock and asks ``step``
for every change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class Held:
    """Ours: renewed in the background if asked, interrupted at its deadline."""

    live: ClassVar[bool] = True
    loss: ClassVar[None] = None


@dataclass(frozen=True)
class Releasing:
    """The holder is letting go: its delete is in flight, or failed on a fault (the record
    may still be ours, so a retry of ``release()`` must reach it). Not renewed in the
    background: if nobody retries, it lapses."""

    live: ClassVar[bool] = True
    loss: ClassVar[None] = None


@dataclass(frozen=True)
class Lost:
    """Known gone before its holder let go: lapsed, taken over, or not renewable."""

    reason: str
    record_gone: bool = False  # known freed or another owner's: nothing left to delete

    live: ClassVar[bool] = False

    @property
    def loss(self) -> str:
        return self.reason


@dataclass(frozen=True)
class Released:
    """Let go by its holder: final. ``in_time`` is what ``release()`` returned (the
    record was freed before the deadline); ``loss`` says why not, if it was lost first."""

    in_time: bool
    loss: str | None = None

    live: ClassVar[bool] = False


State = Held | Releasing | Lost | Released

HELD = Held()
RELEASING = Releasing()
# The two endings without a loss, built once (a release takes one on every cycle).
RELEASED = Released(in_time=True)
LET_GO = Released(in_time=False)

# Which states each state may move to: a lease never goes back to being held, and once
# released it stays so.
_MOVES: dict[type[State], tuple[type[State], ...]] = {
    Held: (Releasing, Lost, Released),
    Releasing: (Lost, Released),
    Lost: (Lost, Released),
    Released: (),
}


def step(state: State, to: State) -> State:
    """The state after ``state`` meets ``to``: ``to`` where ``_MOVES`` allows it, else
    ``state`` unchanged. A loss already known stays the reason: a second loss only adds
    that the record is gone, and a release after a loss carries the first loss."""
    if not isinstance(to, _MOVES[type(state)]):
        return state
    if isinstance(state, Lost) and isinstance(to, Lost):
        return state if state.record_gone or not to.record_gone else Lost(state.reason, True)
    if isinstance(state, Lost) and isinstance(to, Released):
        return Released(to.in_time, state.reason)
    return to
