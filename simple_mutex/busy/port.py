"""The port: what the per-call driver (``simple_mutex.busy.line.driver``) needs from a
task queue, as typed protocols. Celery (``celery_mutex``) and RQ (``rq_mutex``) each
implement it; a third task queue implements it too, and writes no loop of its own.

``Publisher`` is what a sweep needs (one per queue and key space): send a parked call
again. ``Call`` is one delivery of one call, and what an arrival needs of it besides.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from .line.collapse import Superseded
    from .line.decisions import Publish
    from .line.record import Message, Ticket
    from .line.store import Lines
    from .policy import QueuePolicy

# What a publish did: "sent" (the call is on its way to a worker), "not now" (nothing to
# send yet, or it is on its way already: a later sweep looks again), "gone" (the call
# will never run: deleted, or ended without its turn; the line steps over it).
Published = Literal["sent", "not now", "gone"]


class Publisher(Protocol):
    """How a task queue sends a parked call again, for its turn."""

    @property
    def name(self) -> str:
        """Whose line it is, in events (the task's or job function's name)."""

    @property
    def log(self) -> logging.Logger:
        """The integration's logger."""

    def publish(self, key: str, what: Publish, *, by: str) -> Published:
        """Send ``what.message`` again, same call id and ticket; ``by`` names the step
        that hands it its turn ("end", "sweep", "revoke", "parent")."""


class Call(Publisher, Protocol):
    """One delivery of one call to a worker, in the line of its key."""

    @property
    def id(self) -> str:
        """The call's id (Celery's task id, RQ's job id): the same on every delivery."""

    @property
    def who(self) -> str:
        """The call in a log line."""

    @property
    def bounds(self) -> QueuePolicy:
        """The line's bounds its sweeps apply (``promote_grace``, ``gap_for``)."""

    @property
    def keeps_parked(self) -> bool:
        """Whether the queue itself keeps a parked call (RQ's scheduled registry), so
        that a turn handed to it while it parks is taken by this delivery, and a
        delivery of it still parked is that call woken, not a copy. False when the line
        keeps the call (Celery's message is acknowledged and published again)."""

    def ticket(self) -> Ticket | None:
        """The place in the line the call carries (taken at its send), if any."""

    def take(self, lines: Lines, key: str) -> Ticket:
        """Take a place in ``key``'s line as the call arrives, kept with the call so that
        its next delivery carries it."""

    def message(self, ticket: Ticket) -> Message:
        """What the line keeps of the call while it is parked: enough to publish it."""

    def attempt(self) -> int | None:
        """Which attempt of the call this delivery is (Celery's ``retries``), so that a
        copy of an attempt before its retry is known for a duplicate; None when the
        queue's retries carry no such number the line can trust (RQ's)."""

    def redelivers(self) -> bool:
        """Whether the queue delivers the call again if its worker dies mid-run (the
        line then waits for that copy rather than stepping over the turn)."""

    def ran_and_failed(self) -> bool:
        """Whether the call, its turn over, ran before and did not succeed: delivered
        again, it is run again (in a new place), not dropped as a copy."""

    def resolve(self, key: str, gone: tuple[Superseded, ...]) -> None:
        """Give each call a newer one took the place of its superseded answer."""

    def parked(self, key: str, ticket: Ticket) -> None:
        """The call was parked (for the queue's own signals)."""

    def started(self, key: str, ticket: Ticket) -> None:
        """The call's turn came and the line says it runs."""
