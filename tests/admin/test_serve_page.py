"""``simple-mutex serve`` as an operator uses it: real ``rq worker -w rq_mutex.Worker``
processes run an ``on_busy="queue"`` line on Redis, the page is opened in Chromium
(Playwright), and the operator steps over a parked job and frees the stuck holder from it.

The page shows the held key with its job, the three jobs parked behind it in order; the
last is stepped over, and once the holder is released (each confirmed in the browser's
dialog, with the token the server printed) the other two run in order, the stepped-over
one never, and the holder's job fails with its lost lease.
Without the token, or from another Host, the server refuses. A screenshot is kept
(``SIMPLE_MUTEX_SCREENSHOT`` names where, for the docs).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from browser import chromium_page
from rq.job import Job, JobStatus
from rq_support import jobs
from workers import ENV, ROOT, start, stop, wait_until

# isort: split
from rq_mutex import Queue

pytestmark = pytest.mark.system


@pytest.fixture
def line() -> Iterator[tuple[redis.Redis, Queue, str]]:
    """A queue of its own on the RQ tests' Redis (db 12) and two real RQ workers."""
    conn = redis.Redis.from_url(jobs.REDIS_URL, socket_connect_timeout=2)
    conn.ping()
    run = uuid.uuid4().hex[:10]
    queue = Queue(f"rqt-{run}", connection=conn)
    workers = [
        start(["rq", "worker", "-u", jobs.REDIS_URL, "-w", "rq_mutex.Worker", queue.name])
        for _ in range(2)
    ]
    try:
        yield conn, queue, run
    finally:
        stop(workers)


# A token of the operator's own, with characters a URL would misread unquoted.
TOKEN = "s3cr+t&x=1"


@pytest.fixture
def served() -> Iterator[tuple[str, str]]:
    """``simple-mutex serve`` on the RQ tests' Redis, releasing on with ``TOKEN``:
    (address, the token as the printed address carries it)."""
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("simple-mutex")), "serve", jobs.REDIS_URL,
         "--port", "0", "--actions", "--interval", "0.5"],
        env={**ENV, "SIMPLE_MUTEX_PAGE_TOKEN": TOKEN}, cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        first = server.stdout.readline()
        found = re.search(r"at (http://\S+/)#token=(\S+)", first)
        assert found, first
        yield found[1], found[2]
    finally:
        server.terminate()
        server.wait(timeout=10)


def _post(url: str, body: dict[str, object], **headers: str) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers=headers
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


def test_an_operator_frees_a_stuck_holder_from_the_live_page(line, served) -> None:
    conn, queue, run = line
    address, token = served
    key = f"line.{run}.e"
    # Stuck: the holder's section waits while the flag is set (a Python loop, which its
    # lost lease can interrupt, where one long sleep would end only when it returns).
    conn.set(jobs.held(run), 1, ex=120)
    holder = queue.enqueue(jobs.in_line, run, "e", 0)
    wait_until(lambda: holder.get_status(refresh=True) == JobStatus.STARTED, 60, "the holder")
    behind = [queue.enqueue(jobs.in_line, run, "e", item) for item in (1, 2, 3)]

    # Refused without the token, and for a Host that is not the server's.
    assert token == "s3cr%2Bt%26x%3D1"  # printed quoted: the page reads it back whole
    status, said = _post(address + "release", {"key": key, "slot": 0, "fence": 1})
    assert status == 403, said
    request = urllib.request.Request(address + "state", headers={"Host": "evil.example:80"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 421

    with chromium_page(1280, 760) as (page, problems):
        page.goto(f"{address}#token={token}")
        row = page.locator(f'#locks tr[data-key="{key}"]')
        row.wait_for(timeout=20_000)
        assert f"rq:{holder.id}" in row.inner_text()
        parked = page.locator(f'.line[data-key="{key}"] .call[data-state="parked"]')
        wait_until(lambda: parked.count() == 3, 20, "three parked calls on the page")
        texts = parked.all_inner_texts()
        assert [t.split()[0] for t in texts] == ["#2", "#3", "#4"], texts
        for job, text in zip(behind, texts, strict=True):
            assert f"job {job.id}" in text, (job.id, text)
        shot = os.environ.get("SIMPLE_MUTEX_SCREENSHOT")
        if shot:
            page.screenshot(path=shot, full_page=True)
        page.on("dialog", lambda dialog: dialog.accept())
        # The last parked job must not run after all: stepped over from its line.
        parked.nth(2).locator("button").click()
        page.locator("#said").filter(has_text="stepped over").wait_for(timeout=10_000)
        assert f"job {behind[2].id}" in page.locator("#said").inner_text()
        wait_until(lambda: parked.count() == 2, 20, "two parked calls left on the page")
        page.locator('#events li[data-kind="stepped over"]').wait_for(timeout=10_000)
        row.locator("button").click()
        page.locator("#said").filter(has_text="freed").wait_for(timeout=10_000)
        assert key in page.locator("#said").inner_text()
        page.locator('#events li[data-kind="released"]').wait_for(timeout=10_000)
    assert problems == []

    wait_until(lambda: holder.get_status(refresh=True) == JobStatus.FAILED, 30, "the holder")
    error = Job.fetch(holder.id, connection=conn).latest_result()
    assert error is not None
    assert "freed or taken while it still had time" in (error.exc_string or "")
    conn.delete(jobs.held(run))
    wait_until(lambda: all(j.get_status(refresh=True) == JobStatus.FINISHED for j in behind[:2]),
               60, "the parked jobs to run")  # fmt: skip
    assert [j.return_value() for j in behind[:2]] == [1, 2]
    time.sleep(6)  # a sweep (every 5 s) would have sent the stepped-over job by now
    started = [json.loads(r) for r in conn.lrange(f"rqt:{run}:log", 0, -1)]
    assert [r["item"] for r in sorted(started, key=lambda r: r["start"])] == [1, 2]
    assert behind[2].get_status(refresh=True) != JobStatus.FINISHED
