"""The two loops every backend's own flows run on (``simple_mutex._runtime.steps``, issue
22: MongoDB and PostgreSQL each had a blocking and an asyncio loop of their own): each
step goes to ``perform``, each pause sleeps, a mapped error is thrown into the flow, an
unmapped one reaches the caller as it is."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from simple_mutex._core.flows import Pause
from simple_mutex._runtime.steps import StepFlow, drive, drive_async
from simple_mutex.caches.mongo import AsyncMongoCache, MongoCache
from simple_mutex.caches.postgres import AsyncPostgresCache, PostgresCache

pytestmark = pytest.mark.fast


class Mapped(Exception):
    pass


def _failed(step: str, exc: Exception) -> Exception | None:
    return Mapped(f"{step}: {exc}") if isinstance(exc, KeyError) else None


def _flow() -> StepFlow[str, list[Any]]:
    seen: list[Any] = [(yield "first")]
    yield Pause(0.05)
    try:
        yield "missing"
    except Mapped as exc:
        seen.append(str(exc))
    seen.append((yield "last"))
    return seen


def _perform(step: str) -> str:
    if step == "missing":
        raise KeyError(step)
    return step.upper()


async def _perform_async(step: str) -> str:
    await asyncio.sleep(0)
    return _perform(step)


def _blocking(flow: StepFlow[str, Any], perform: Callable[[str], Any]) -> Any:
    return drive(flow, perform, _failed)


def _awaited(flow: StepFlow[str, Any], perform: Callable[[str], Any]) -> Any:
    async def performed(step: str) -> Any:
        return perform(step)

    return asyncio.run(drive_async(flow, performed, _failed))


DRIVERS = [_blocking, _awaited]


@pytest.mark.parametrize("run", DRIVERS, ids=["drive", "drive_async"])
def test_steps_are_performed_pauses_slept_and_a_mapped_error_thrown_into_the_flow(run):
    started = time.monotonic()
    assert run(_flow(), _perform) == ["FIRST", "missing: 'missing'", "LAST"]
    assert time.monotonic() - started >= 0.05


@pytest.mark.parametrize("run", DRIVERS, ids=["drive", "drive_async"])
def test_an_error_the_backend_does_not_map_reaches_the_caller_as_it_is(run):
    def perform(step: str) -> str:
        raise ValueError(step)  # a bug, a signal handler's exception: not the driver's

    with pytest.raises(ValueError, match="first"):
        run(_flow(), perform)


def test_drive_async_awaits_each_step():
    assert asyncio.run(drive_async(_flow(), _perform_async, _failed))[-1] == "LAST"


@pytest.mark.parametrize(
    "cls",
    [MongoCache, AsyncMongoCache, PostgresCache, AsyncPostgresCache],
    ids=lambda c: c.__name__,
)
def test_the_backends_keep_no_driver_loop_of_their_own(cls: type) -> None:
    """Their faces only perform one step; the loops are the shared ones."""
    assert not any(hasattr(cls, name) for name in ("_drive", "_run_once")), cls
    assert callable(getattr(cls, "_perform", None)), cls
