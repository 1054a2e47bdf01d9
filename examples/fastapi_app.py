"""A FastAPI service that charges each order at most once at a time, across processes.

    uvicorn examples.fastapi_app:app --workers 2

Every request for one order waits its turn on a lock in Redis (``redis.asyncio``: no
thread per waiting request); requests for other orders run in parallel. The lock is held
for the length of the call and renewed while it runs, so a worker that dies frees its
orders within one lease. ``REDIS_URL`` (default ``redis://127.0.0.1:6379/0``) names the
server; ``LEDGER_KEY`` where the demo ledger lives in it (what the test reads back).
"""

from __future__ import annotations

import asyncio
import os
import time

import redis.asyncio
from fastapi import FastAPI

from simple_mutex import Mutex

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
LEDGER_KEY = os.environ.get("LEDGER_KEY", "fastapi-demo")

app = FastAPI()
client = redis.asyncio.Redis.from_url(REDIS_URL)
orders = Mutex(client, lease=10, prefix="orders.")  # an asyncio cache: awaited, no threads


@app.post("/orders/{order_id}/charge")
async def charge(order_id: int, amount: int = 1) -> dict[str, int]:
    async with orders.acquire_async(str(order_id), timeout=30, renew=True) as lease:
        # The critical section: read-modify-write of the order's balance, with a pause
        # that would let a second request in if the lock did not hold.
        key = f"{LEDGER_KEY}:{order_id}"
        started = time.time()
        balance = int(await client.get(key + ":balance") or 0)
        await asyncio.sleep(0.01)
        await client.set(key + ":balance", balance + amount)
        await client.rpush(key + ":spans", f"{started} {time.time()} {lease.fence}")
        return {"order": order_id, "balance": balance + amount, "fence": lease.fence}
