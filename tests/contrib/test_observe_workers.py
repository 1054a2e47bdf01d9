"""What operators see of real worker processes: a prefork ``celery worker -E`` in
prometheus-client's multiprocess mode serves metrics equal to what its runs did, and
sends a ``task-mutex-skipped`` task event per skipped run (as Flower receives it); an
``rq worker`` flags a skipped job in its ``meta``.

Needs Redis at 127.0.0.1:6379 (broker, results, locks) and RabbitMQ at 127.0.0.1:5672
(the other broker). A missing server fails the tests; it never skips them.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.events.state import State
from celery_support.processes import REDIS_URL, Processes
from rq.job import JobStatus
from rq_support import jobs
from test_prometheus import free_port, scrape
from workers import start, stop, wait_until

# isort: split
from celery_mutex.acquire import SKIPPED_EVENT
from rq_mutex import Queue, is_skipped
from simple_mutex import Mutex
from simple_mutex.caches import RedisCache

pytestmark = pytest.mark.integrations

APP = "celery_support.metrics_app"
AMQP_URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")


class EventsSeen:
    """An ``app.events.Receiver`` in a thread of its own, keeping the events of one type
    and feeding every event to a ``celery.events.state.State``, the model Flower keeps.
    Only the events of workers whose hostname holds ``run`` count: the event exchange is
    the broker's, and other suites' workers may send on it at the same time."""

    def __init__(self, app: Any, event_type: str, run: str) -> None:
        self.events: list[dict[str, Any]] = []
        self.state = State()
        self.ready = threading.Event()
        self._connection = app.connection_for_read()

        def on_event(event: dict[str, Any]) -> None:
            if run not in str(event.get("hostname", "")):
                return
            self.state.event(event)
            if event["type"] == event_type:
                self.events.append(event)

        self.receiver = app.events.Receiver(self._connection, handlers={"*": on_event})
        consume_ready = self.receiver.on_consume_ready

        def on_consume_ready(*args: Any, **kwargs: Any) -> None:
            consume_ready(*args, **kwargs)
            self.ready.set()

        self.receiver.on_consume_ready = on_consume_ready
        self.thread = threading.Thread(
            target=self.receiver.capture, kwargs={"wakeup": False}, daemon=True
        )
        self.thread.start()
        assert self.ready.wait(20), "the event receiver never started consuming"

    def close(self) -> None:
        self.receiver.should_stop = True
        self.thread.join(10)
        self._connection.release()


@pytest.fixture(params=["redis", "amqp"])
def worker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Processes, int]]:
    """One ``celery worker -P prefork -c 4 -E`` of metrics_app, in multiprocess mode,
    serving its metrics on a free port; on Redis or RabbitMQ as the broker (task events
    travel differently on each)."""
    metrics_dir = tmp_path / "prometheus"
    metrics_dir.mkdir()
    port = free_port()
    procs = Processes(APP, tmp_path, REDIS_URL if request.param == "redis" else AMQP_URL)
    procs.start(
        "w",
        [
            *("worker", "-P", "prefork", "-c", "4", "-E", "-Q", procs.queue),
            *("-n", f"w-{procs.run}@%h", "--without-gossip", "--without-mingle"),
        ],
        PROMETHEUS_MULTIPROC_DIR=str(metrics_dir),
        CM_METRICS_PORT=str(port),
    )
    try:
        wait_until(lambda: _answers(port), 30, "the worker's metrics endpoint")
        yield procs, port
    finally:
        procs.stop()


def _answers(port: int) -> bool:
    try:
        scrape(port)
    except OSError:
        return False
    return True


def test_prefork_metrics_and_skipped_events_equal_what_ran(worker):
    """12 runs of one key at once on 4 processes (on_busy="skip") and 2 runs that outlive
    their lease: the endpoint's counts equal the results (N ran, M skipped, K lost), the
    held gauge is back to 0, and each skipped run sent one task-mutex-skipped event
    naming its key and the holder in the way."""
    procs, port = worker
    seen = EventsSeen(procs.app, SKIPPED_EVENT, procs.run)
    try:
        holds = [procs.app.send_task(f"{APP}.hold", args=(n,)) for n in range(12)]
        lapses = [procs.app.send_task(f"{APP}.lapse", args=(n,)) for n in range(2)]
        outcomes = [r.get(timeout=60) for r in holds]
        for result in lapses:
            with pytest.raises(Exception, match="lost while the work ran"):
                result.get(timeout=60)
        ran = [o for o in outcomes if isinstance(o, int)]
        skipped = {r.id for r, o in zip(holds, outcomes, strict=True) if isinstance(o, dict)}
        assert len(ran) + len(skipped) == 12
        assert skipped, "no run found the key held: the test did not contend"
        wait_until(lambda: len(seen.events) >= len(skipped), 20, "the skipped events")

        def succeeded() -> bool:
            tasks = [seen.state.tasks.get(task_id) for task_id in skipped]
            return all(t is not None and t.state == "SUCCESS" for t in tasks)

        wait_until(succeeded, 20, "task-succeeded of the skipped runs")
    finally:
        seen.close()

    lost = ("simple_mutex_lost_total", (("name", f"{APP}.lapse"),))
    wait_until(lambda: scrape(port).get(lost) == 2, 10, "both losses reported")  # keeper thread
    got = scrape(port)

    def value(sample: str, task: str, **labels: str) -> float:
        key = (sample, tuple(sorted({"name": f"{APP}.{task}", **labels}.items())))
        return got.get(key, 0.0)

    assert value("simple_mutex_acquires_total", "hold", outcome="acquired") == len(ran)
    assert value("simple_mutex_acquires_total", "hold", outcome="busy") == len(skipped)
    assert value("simple_mutex_acquires_total", "lapse", outcome="acquired") == 2
    assert value("simple_mutex_lost_total", "lapse") == 2
    assert value("simple_mutex_lost_total", "hold") == 0
    assert value("simple_mutex_hold_seconds_count", "hold") == len(ran)
    assert value("simple_mutex_held", "hold") == 0
    assert value("simple_mutex_held", "lapse") == 0
    assert {e["uuid"] for e in seen.events} == skipped
    # The holder is read after the busy try: on a loaded machine it may have ended by
    # then (None, "nobody holds it now"), never someone else.
    for event in seen.events:
        assert event["key"] == "hold"
        assert event["reason"] == "busy"
        assert event["holder"] is None or event["holder"].startswith(f"{APP}.hold[")
    assert any(e["holder"] is not None for e in seen.events), "no event named the holder"
    assert Counter(e["uuid"] for e in seen.events).most_common(1)[0][1] == 1
    for task_id in skipped:  # what a monitor's model of the task shows: SUCCESS, and why
        task = seen.state.tasks[task_id]
        assert (task.state, task.key, task.reason) == ("SUCCESS", "hold", "busy")
        assert task.holder is None or task.holder.startswith(f"{APP}.hold[")


# RQ's own worker, but a shutdown never waits a minute for its pubsub thread (rq_support).
QUICK = "rq_support.workers.Worker"


def _burst(queue: Queue) -> None:
    """A real ``rq worker --burst`` runs what ``queue`` holds, then exits cleanly."""
    worker = start(["rq", "worker", "--burst", "-w", QUICK, "-u", jobs.REDIS_URL, queue.name])
    try:
        assert worker.wait(timeout=60) == 0
    finally:
        stop([worker])


def test_rq_worker_flags_a_skipped_job_in_its_meta():
    """A job skipped by a real ``rq worker`` (its key held elsewhere) finishes with the
    skip marker and ``meta`` saying so, with who held it; a job that ran has no flag."""
    conn = redis.Redis.from_url(jobs.REDIS_URL, socket_connect_timeout=2)
    run = uuid.uuid4().hex[:10]
    queue = Queue(f"rqt-{run}", connection=conn)
    held = Mutex(RedisCache(conn), lease=30).acquire(f"skip.{run}", label="the-test")
    skipped = queue.enqueue(jobs.skipper, run)
    _burst(queue)
    held.release()
    ran = queue.enqueue(jobs.skipper, run)
    _burst(queue)
    skipped.refresh()
    ran.refresh()
    assert skipped.get_status() == JobStatus.FINISHED
    assert is_skipped(skipped.return_value())
    assert skipped.meta["rq_mutex_skipped"] is True
    assert skipped.meta["rq_mutex_skip_reason"] == "busy"
    assert skipped.meta["rq_mutex_holder"] == "the-test"
    assert ran.return_value() == "ran"
    assert "rq_mutex_skipped" not in ran.meta
