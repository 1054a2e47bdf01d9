"""The two loops that run a backend's own flows: ``drive`` blocks, ``drive_async`` awaits.

A backend that speaks to its server in more than one request per operation (MongoDB's
collection calls, PostgreSQL's statements) writes each operation once, as a generator
that yields its *steps* (the backend's own type) and ``Pause``, and is sent each step's
reply. Its two faces differ only in ``perform``: a function that runs one step, blocking
or awaited. What ``perform`` raises goes to the backend's one mapping function
(``failed``): the error it returns is thrown into the flow (which may handle it: a
duplicate key, a session to retry on); None lets the original propagate as it is (a
signal handler's exception, a bug). The engine's flows have drivers of their own
(``drivers.py``), which ask the contract's methods instead.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Generator, Iterator
from typing import Any, Generic, TypeVar

from simple_mutex._core.flows import Pause

S = TypeVar("S")
T = TypeVar("T")

StepFlow = Generator[S | Pause, Any, T]
Failed = Callable[[S, Exception], Exception | None]


class _Stepping(Generic[S, T]):
    """What the two loops share: the flow, resumed with each step's reply or with the error
    ``failed`` mapped its failure to, until it returns. The loops only perform the steps
    (setting ``reply``) and sleep the pauses, each in its own way."""

    def __init__(self, flow: StepFlow[S, T], failed: Failed[S]) -> None:
        self._flow = flow
        self._failed = failed
        self._error: Exception | None = None
        self.reply: Any = None
        self.result: T  # set once the flow returns

    def __iter__(self) -> Iterator[S | Pause]:
        while True:
            reply, error = self.reply, self._error
            self.reply, self._error = None, None
            try:
                step = self._flow.send(reply) if error is None else self._flow.throw(error)
            except StopIteration as stop:
                self.result = stop.value
                return
            yield step

    def thrown(self, step: S, exc: Exception) -> bool:
        """Map what performing ``step`` raised: True if the mapped error is to be thrown
        into the flow, False if ``exc`` is to propagate as it is."""
        self._error = self._failed(step, exc)
        return self._error is not None


def drive(flow: StepFlow[S, T], perform: Callable[[S], Any], failed: Failed[S]) -> T:
    """Run ``flow``: each step by ``perform``, each pause a sleep."""
    stepping = _Stepping(flow, failed)
    for step in stepping:
        if isinstance(step, Pause):
            time.sleep(step.seconds)
            continue
        try:
            stepping.reply = perform(step)
        except Exception as exc:
            if not stepping.thrown(step, exc):
                raise
    return stepping.result


async def drive_async(
    flow: StepFlow[S, T], perform: Callable[[S], Awaitable[Any]], failed: Failed[S]
) -> T:
    """Run ``flow`` on the loop: each step's ``perform`` awaited, each pause too."""
    stepping = _Stepping(flow, failed)
    for step in stepping:
        if isinstance(step, Pause):
            await asyncio.sleep(step.seconds)
            continue
        try:
            stepping.reply = await perform(step)
        except Exception as exc:
            if not stepping.thrown(step, exc):
                raise
    return stepping.result
