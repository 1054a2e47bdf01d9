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
from collections.abc import Awaitable, Callable, Generator
from typing import Any, TypeVar

from simple_mutex._core.flows import Pause

S = TypeVar("S")
T = TypeVar("T")

StepFlow = Generator[S | Pause, Any, T]
Failed = Callable[[S, Exception], Exception | None]


def drive(flow: StepFlow[S, T], perform: Callable[[S], Any], failed: Failed[S]) -> T:
    """Run ``flow``: each step by ``perform``, each pause a sleep."""
    reply: Any = None
    error: Exception | None = None
    while True:
        try:
            step = flow.send(reply) if error is None else flow.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        reply, error = None, None
        if isinstance(step, Pause):
            time.sleep(step.seconds)
            continue
        try:
            reply = perform(step)
        except Exception as exc:
            error = failed(step, exc)
            if error is None:
                raise


async def drive_async(
    flow: StepFlow[S, T], perform: Callable[[S], Awaitable[Any]], failed: Failed[S]
) -> T:
    """Run ``flow`` on the loop: each step's ``perform`` awaited, each pause too."""
    reply: Any = None
    error: Exception | None = None
    while True:
        try:
            step = flow.send(reply) if error is None else flow.throw(error)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        reply, error = None, None
        if isinstance(step, Pause):
            await asyncio.sleep(step.seconds)
            continue
        try:
            reply = await perform(step)
        except Exception as exc:
            error = failed(step, exc)
            if error is None:
                raise
