"""``simple_mutex.contrib.opentelemetry`` with the real OpenTelemetry SDK: spans in an
in-memory exporter and metrics in an in-memory reader equal what the callers of a
contention run saw; spans nest under the caller's span; a lost lease is an ERROR."""

from __future__ import annotations

import inspect
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from contention import contend
from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from workers import wait_until

from simple_mutex import InMemoryCache, Mutex
from simple_mutex.contrib import _common, opentelemetry
from simple_mutex.contrib._common import WAIT_BUCKETS

pytestmark = pytest.mark.fast


@dataclass
class Telemetry:
    spans: InMemorySpanExporter
    reader: InMemoryMetricReader
    tracer_provider: TracerProvider

    def finished(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.spans.get_finished_spans() if s.name == name]

    def points(self, metric: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        assert data is not None
        return [
            point
            for resource in data.resource_metrics
            for scope in resource.scope_metrics
            for found in scope.metrics
            if found.name == metric
            for point in found.data.data_points
        ]


@pytest.fixture
def telemetry() -> Iterator[Telemetry]:
    """SDK providers of our own (the global ones untouched), instrumented."""
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    uninstrument = opentelemetry.instrument(tracer_provider, meter_provider)
    yield Telemetry(spans, reader, tracer_provider)
    uninstrument()
    meter_provider.shutdown()
    tracer_provider.shutdown()


def test_spans_and_metrics_equal_what_the_contention_run_saw(telemetry):
    """One mutex.acquire span per acquire, by outcome; one mutex.hold span per grant,
    released or lost (lost: status ERROR with the reason); every span a child of the
    caller's span; the metrics count the same."""
    name = f"orders-{uuid.uuid4().hex[:6]}"
    tracer = telemetry.tracer_provider.get_tracer("test")
    with tracer.start_as_current_span("job") as job:
        seen = contend(InMemoryCache(), name, "order.7")
    # A loss is reported from the keeper thread, which may finish a moment after the
    # block it interrupted has exited.
    wait_until(lambda: len(telemetry.finished("mutex.hold")) == seen.acquired, 5, "hold spans")
    acquires = telemetry.finished("mutex.acquire")
    holds = telemetry.finished("mutex.hold")
    outcomes = Counter(s.attributes["mutex.outcome"] for s in acquires)
    assert outcomes == {"acquired": seen.acquired, "busy": seen.busy, "timed_out": seen.timed_out}
    assert Counter(s.attributes["mutex.outcome"] for s in holds) == {
        "released": seen.released, "lost": seen.lost
    }  # fmt: skip
    # The caller's thread nests under its span; the racing threads were started without
    # a copy of its context (threading does not copy contextvars), so theirs are roots.
    job_id = job.get_span_context().span_id
    parents = {s.parent.span_id for s in acquires + holds if s.parent is not None}
    assert parents == {job_id}
    in_caller = [
        s for s in acquires + holds if s.attributes["mutex.outcome"] in ("timed_out", "lost")
    ]
    assert len(in_caller) == seen.timed_out + seen.lost
    assert all(s.parent is not None and s.parent.span_id == job_id for s in in_caller)
    for span in holds:
        assert span.attributes["mutex.name"] == name
        assert span.attributes["mutex.key"].startswith("order.7")
        assert isinstance(span.attributes["mutex.fence"], int)
        assert span.end_time >= span.start_time
        if span.attributes["mutex.outcome"] == "lost":
            assert span.status.status_code is StatusCode.ERROR
            assert "lapsed" in span.status.description
            assert span.attributes["mutex.held"] >= 0.15  # a 0.2 s lease, less its margin
        else:
            assert span.status.status_code is StatusCode.UNSET
    timed_out = next(s for s in acquires if s.attributes["mutex.outcome"] == "timed_out")
    assert timed_out.status.status_code is StatusCode.ERROR
    assert timed_out.attributes["mutex.waited"] >= 0.05
    assert (timed_out.end_time - timed_out.start_time) / 1e9 == pytest.approx(
        timed_out.attributes["mutex.waited"], abs=0.01
    )  # the span covers the wait, though recorded when it ended

    def total(metric: str, **attributes: str) -> float:
        wanted = {"mutex.name": name, **attributes}
        return sum(
            getattr(p, "value", getattr(p, "count", 0))
            for p in telemetry.points(metric)
            if dict(p.attributes) == wanted
        )

    assert total("simple_mutex.acquires", **{"mutex.outcome": "acquired"}) == seen.acquired
    assert total("simple_mutex.acquires", **{"mutex.outcome": "busy"}) == seen.busy
    assert total("simple_mutex.acquires", **{"mutex.outcome": "timed_out"}) == seen.timed_out
    assert total("simple_mutex.lost") == seen.lost
    assert total("simple_mutex.wait") == seen.acquired + seen.busy + seen.timed_out
    assert total("simple_mutex.hold") == seen.acquired
    assert total("simple_mutex.held") == 0
    for point in telemetry.points("simple_mutex.acquires"):
        assert "mutex.key" not in point.attributes  # no key in metric attributes
    advises = (
        "explicit_bucket_boundaries_advisory"
        in inspect.signature(metrics.Meter.create_histogram).parameters
    )  # opentelemetry-api 1.30 on
    if advises:  # seconds-scale buckets, not the SDK's millisecond defaults
        (wait,) = [
            p for p in telemetry.points("simple_mutex.wait") if p.attributes == {"mutex.name": name}
        ]
        assert tuple(wait.explicit_bounds) == WAIT_BUCKETS


def test_spans_without_a_caller_span_are_roots_and_hold_ends_at_release(telemetry):
    """With no current span the acquire and hold spans are roots; the hold span runs from
    the grant to the release (it is not the current span inside the block)."""
    mutex = Mutex(InMemoryCache(), name="plain")
    with mutex.acquire("k") as lease:
        assert telemetry.finished("mutex.hold") == []  # still open while held
    (acquire,) = telemetry.finished("mutex.acquire")
    (hold,) = telemetry.finished("mutex.hold")
    assert acquire.parent is None
    assert hold.parent is None
    assert hold.attributes["mutex.fence"] == lease.fence
    assert hold.start_time >= acquire.end_time - 1_000_000  # within a millisecond


def test_uninstrument_ends_open_hold_spans_and_stops_reporting():
    """After uninstrument nothing more is recorded, and a hold span still open is ended
    (outcome "held"), so it is exported rather than lost."""
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    uninstrument = opentelemetry.instrument(provider, MeterProvider())
    mutex = Mutex(InMemoryCache(), name="open")
    lease = mutex.acquire("k")
    uninstrument()
    mutex.acquire("other").release()
    lease.release()
    names = [(s.name, s.attributes["mutex.key"], s.attributes["mutex.outcome"])
             for s in spans.get_finished_spans()]  # fmt: skip
    assert names == [("mutex.acquire", "k", "acquired"), ("mutex.hold", "k", "held")]


def test_a_hold_span_of_a_lease_left_to_lapse_ends_at_its_expiry(telemetry, monkeypatch):
    """A lease nobody releases or watches has no end event: its hold span is ended at the
    lease's expiry, outcome "expired", when a later grant finds it long lapsed; a grant
    that waited out a lapsed holder says it took over."""
    monkeypatch.setattr(_common, "SWEEP_GRACE", 0.0)
    monkeypatch.setattr(_common, "SWEEP_EVERY", 0.0)
    mutex = Mutex(InMemoryCache(), name="throttle", lease=0.1)
    throttle = mutex.try_acquire("daily-report")  # never released: lapses by design
    assert throttle is not None
    time.sleep(0.2)
    mutex.acquire("other").release()
    (expired,) = [
        s for s in telemetry.finished("mutex.hold") if s.attributes["mutex.key"] == "daily-report"
    ]
    assert expired.attributes["mutex.outcome"] == "expired"
    mutex.acquire("crashed")  # never released; a waiter gets it once it lapses
    mutex.acquire("crashed", timeout=2, interval=0.02).release()
    grants = [
        s for s in telemetry.finished("mutex.acquire") if s.attributes["mutex.key"] == "crashed"
    ]
    assert [s.attributes.get("mutex.took_over", False) for s in grants] == [False, True]
    assert expired.end_time == pytest.approx(throttle.expires_at.timestamp() * 1e9, abs=60e6)
    assert total_held(telemetry, "throttle") == 0


def total_held(telemetry: Telemetry, name: str) -> float:
    return sum(
        p.value
        for p in telemetry.points("simple_mutex.held")
        if p.attributes == {"mutex.name": name}
    )


def test_with_the_celery_instrumentation_spans_nest_under_the_task_span(telemetry):
    """opentelemetry-instrumentation-celery starts the task's span at task_prerun, which
    Celery sends before before_start: the lock's spans are its children."""
    from celery import Celery
    from opentelemetry.instrumentation.celery import CeleryInstrumentor

    from celery_mutex import MutexTask

    app = Celery("otel_nesting", set_as_current=False)
    app.conf.mutex_cache = InMemoryCache()

    @app.task(base=MutexTask, mutex={"key": "order.{order_id}"}, name="shop.charge")
    def charge(order_id: int) -> int:
        return order_id

    instrumentor = CeleryInstrumentor()
    instrumentor.instrument(tracer_provider=telemetry.tracer_provider)
    try:
        assert charge.apply((7,)).get() == 7
    finally:
        instrumentor.uninstrument()
    (task,) = [s for s in telemetry.spans.get_finished_spans() if "shop.charge" in s.name]
    (acquire,) = telemetry.finished("mutex.acquire")
    (hold,) = telemetry.finished("mutex.hold")
    assert acquire.parent.span_id == hold.parent.span_id == task.context.span_id
    assert (acquire.attributes["mutex.name"], acquire.attributes["mutex.key"]) == (
        "shop.charge", "order.7"
    )  # fmt: skip
