"""OpenTelemetry spans and metrics from the lock event stream
(``pip install 'simple-mutex[otel]'``: opentelemetry-api; bring your SDK and exporter).

::

    from simple_mutex.contrib import opentelemetry

    uninstrument = opentelemetry.instrument()  # the global providers, or pass your own

Spans, both children of the span current where the lock was acquired (a Celery task's
span when its instrumentation is on):

* ``mutex.acquire``: from the start of an acquire to its outcome. The stream reports an
  acquire once it is over, with how long it took (``waited``), so the span is recorded
  then, with its start set back by that much: no hook on the acquire path. A timed-out
  acquire has status ERROR.
* ``mutex.hold``: from the grant to the release or loss; a lost lease sets status ERROR
  with the reason.

Attributes: ``mutex.key``, ``mutex.name``, ``mutex.outcome`` (acquired, busy, timed_out;
released, lost), ``mutex.fence``, ``mutex.waited`` (seconds), and ``mutex.cache``,
``mutex.slot``, ``mutex.held`` (seconds, on hold spans), ``mutex.holder`` (the label of
the holder in the way, on busy and timed-out acquires; never a token), ``mutex.took_over``
(on a grant over a holder that had lapsed). A hold span of a lease nobody released or saw
lost (left to lapse) ends at its expiry, outcome "expired", once a later grant finds it.

Metrics, the Prometheus sink's under OpenTelemetry names (an OTel Prometheus exporter
shows them as ``simple_mutex_acquires_total``, ``simple_mutex_wait_seconds``, ...):
counters ``simple_mutex.acquires`` {mutex.name, mutex.outcome} and ``simple_mutex.lost``
{mutex.name}, histograms ``simple_mutex.wait`` and ``simple_mutex.hold`` (s) {mutex.name},
up-down counter ``simple_mutex.held`` {mutex.name}. Metric attributes never carry the key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.trace import Span, Status, StatusCode

from simple_mutex import __version__, events

from ._common import ACQUIRE_OUTCOMES, HOLD_BUCKETS, WAIT_BUCKETS, Granted

SCOPE = "simple_mutex"


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def _attributes(event: events.LockEvent, outcome: str) -> dict[str, Any]:
    found = {
        "mutex.key": event.key,
        "mutex.name": event.name,
        "mutex.cache": event.cache,
        "mutex.outcome": outcome,
        "mutex.fence": event.fence,
        "mutex.slot": event.slot,
        "mutex.waited": event.waited,
    }
    return {name: value for name, value in found.items() if value is not None}


def _histogram(
    meter: metrics.Meter, name: str, description: str, buckets: tuple[float, ...]
) -> metrics.Histogram:
    """A histogram in seconds that advises second-scale buckets (the SDK's defaults suit
    milliseconds). The advice arrived in opentelemetry-api 1.30; before, a View sets them."""
    try:
        return meter.create_histogram(
            name, "s", description, explicit_bucket_boundaries_advisory=list(buckets)
        )
    except TypeError:  # opentelemetry-api < 1.30: no advisory parameter
        return meter.create_histogram(name, "s", description)


class _Sink:
    """One subscriber: spans from a tracer, the five metrics from a meter."""

    def __init__(self, tracer: trace.Tracer, meter: metrics.Meter) -> None:
        self.tracer = tracer
        self.acquires = meter.create_counter(
            "simple_mutex.acquires", "{acquire}", "Lock acquires by outcome"
        )
        self.lost = meter.create_counter("simple_mutex.lost", "{lease}", "Leases lost while held")
        self.wait = _histogram(
            meter, "simple_mutex.wait", "Seconds each acquire took, whatever its outcome",
            WAIT_BUCKETS,
        )  # fmt: skip
        self.hold = _histogram(
            meter, "simple_mutex.hold", "Seconds each lease was held, grant to release or loss",
            HOLD_BUCKETS,
        )  # fmt: skip
        self.held = meter.create_up_down_counter("simple_mutex.held", "{lease}", "Leases held now")
        self.holding: Granted[tuple[Span, str]] = Granted()  # each hold span, its name

    def __call__(self, event: events.LockEvent) -> None:
        kind = event.kind
        if kind in ACQUIRE_OUTCOMES:
            self._acquire(event)
        elif kind == "renewed":
            self.holding.renew(event)
        elif kind in ("released", "lost"):
            self._end(event)

    def _acquire(self, event: events.LockEvent) -> None:
        name = {"mutex.name": event.name}
        at = event.at.timestamp()
        self.acquires.add(1, {**name, "mutex.outcome": event.kind})
        if event.waited is not None:
            self.wait.record(event.waited, name)
        self._acquire_span(event, start=at - (event.waited or 0.0), end=at)
        if event.kind != "acquired":
            return
        self.held.add(1, name)
        hold = self._hold_span(event, start=at)
        for (span, was), expiry in self.holding.add(event, (hold, event.name)):
            # Never released nor reported lost: it lapsed with nobody looking.
            span.set_attribute("mutex.outcome", "expired")
            span.end(end_time=_ns(expiry))
            self.held.add(-1, {"mutex.name": was})

    def _end(self, event: events.LockEvent) -> None:
        name = {"mutex.name": event.name}
        at = event.at.timestamp()
        if event.kind == "lost":
            self.lost.add(1, name)
        if event.held is not None:
            self.hold.record(event.held, name)
        kept = self.holding.pop(event)
        if kept is not None:
            self.held.add(-1, name)
            self._end_hold(kept[0], event, at)
        elif event.kind == "lost" and event.held is not None:
            # Granted before instrument(): a loss is worth a span all the same.
            self._end_hold(self._hold_span(event, start=at - event.held), event, at)

    def _hold_span(self, event: events.LockEvent, start: float) -> Span:
        attributes = _attributes(event, "held")
        return self.tracer.start_span("mutex.hold", start_time=_ns(start), attributes=attributes)

    def _acquire_span(self, event: events.LockEvent, start: float, end: float) -> None:
        attributes = _attributes(event, event.kind)
        if event.kind != "acquired" and event.holder is not None and event.holder.label:
            attributes["mutex.holder"] = event.holder.label
        if event.took_over:  # granted over a holder that had lapsed: a crash, a stall
            attributes["mutex.took_over"] = True
        span = self.tracer.start_span("mutex.acquire", start_time=_ns(start), attributes=attributes)
        if event.kind == "timed_out":
            span.set_status(Status(StatusCode.ERROR, "timed out waiting for the lock"))
        span.end(end_time=_ns(end))

    def _end_hold(self, span: Span, event: events.LockEvent, at: float) -> None:
        span.set_attribute("mutex.outcome", event.kind)
        if event.held is not None:
            span.set_attribute("mutex.held", event.held)
        if event.kind == "lost":
            span.set_status(Status(StatusCode.ERROR, f"lease lost: {event.reason}"))
        span.end(end_time=_ns(at))

    def close(self) -> None:
        """End the hold spans still open: a span never ended is never exported."""
        for span, _ in self.holding.drain():
            span.end()


def instrument(
    tracer_provider: trace.TracerProvider | None = None,
    meter_provider: metrics.MeterProvider | None = None,
) -> Callable[[], None]:
    """Record spans and metrics for every lock event in this process, through the given
    providers (default: the global ones, also when they are set later). Returns the
    function that stops it (hold spans still open end then, outcome "held")."""
    sink = _Sink(
        trace.get_tracer(SCOPE, __version__, tracer_provider=tracer_provider),
        metrics.get_meter(SCOPE, __version__, meter_provider=meter_provider),
    )
    unsubscribe = events.subscribe(sink)

    def uninstrument() -> None:
        unsubscribe()
        sink.close()

    return uninstrument
