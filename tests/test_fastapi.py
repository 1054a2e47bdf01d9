"""The FastAPI example (examples/fastapi_app.py) under a real uvicorn with two worker
processes, hit by concurrent HTTP requests: each order's charges serialize across both
processes (exact balances, no overlapping critical sections, fences in order), while
different orders run side by side."""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis
from servers import free_port

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[1]
ORDERS = 5
PER_ORDER = 30


@pytest.fixture
def service():
    """uvicorn --workers 2 on a free port; yields (base URL, ledger key)."""
    port, ledger = free_port(), f"fastapi-test-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, LEDGER_KEY=ledger, REDIS_URL="redis://127.0.0.1:6379/0")
    proc = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "examples.fastapi_app:app", "--workers", "2",
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        cwd=ROOT, env=env,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(base + "/docs", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, "uvicorn exited"
            assert time.monotonic() < deadline, "uvicorn never answered"
            time.sleep(0.1)
        yield base, ledger
    finally:
        proc.terminate()
        proc.wait(10)
        store = redis.Redis()
        for key in store.scan_iter(match=f"{ledger}:*"):
            store.delete(key)


def test_concurrent_requests_for_one_order_never_overlap(service):
    """150 requests over 5 orders at once: every order's balance is exact, its critical
    sections never overlap, and each one's fence is larger than the one before."""
    base, ledger = service

    async def hammer() -> list[int]:
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            calls = [
                http.post(f"/orders/{order}/charge")
                for _ in range(PER_ORDER)
                for order in range(ORDERS)
            ]
            return [r.status_code for r in await asyncio.gather(*calls)]

    assert set(asyncio.run(hammer())) == {200}
    store = redis.Redis(decode_responses=True)
    for order in range(ORDERS):
        assert int(store.get(f"{ledger}:{order}:balance")) == PER_ORDER
        spans = sorted(
            (float(a), float(b), int(f))
            for a, b, f in (line.split() for line in store.lrange(f"{ledger}:{order}:spans", 0, -1))
        )
        assert len(spans) == PER_ORDER
        for before, after in itertools.pairwise(spans):
            assert after[0] >= before[1], f"order {order}: two charges overlapped"
            assert after[2] > before[2], f"order {order}: fences out of order"
