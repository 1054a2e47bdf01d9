"""Prometheus metrics from the lock event stream (``pip install 'simple-mutex[prometheus]'``).

::

    from simple_mutex.contrib import prometheus

    uninstrument = prometheus.instrument()  # the default registry, or instrument(registry)

* ``simple_mutex_acquires_total{name, outcome}``: counter; outcome = acquired, busy,
  timed_out
* ``simple_mutex_wait_seconds{name}``: histogram of every acquire's duration, any outcome
  (its ``_count`` is the sum of acquires_total)
* ``simple_mutex_hold_seconds{name}``: histogram, grant to release or loss
* ``simple_mutex_lost_total{name}``: counter
* ``simple_mutex_held{name}``: gauge, leases held now

``name`` is the event's low-cardinality name (a ``with_simple_mutex`` template, a task or
job name, ``Mutex(name=...)``); labels never carry the key, whose values are unbounded.

Multiprocess (a Celery prefork worker, gunicorn): set ``PROMETHEUS_MULTIPROC_DIR`` before
the process starts and call ``instrument()`` in the parent, before it forks; every child
writes its own files, and the held gauge is a ``livesum`` (the sum over live processes).
Serve them from a registry holding ``prometheus_client.multiprocess.MultiProcessCollector``
(``docs/guides/observability.md`` shows it for Celery).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from simple_mutex import events
from simple_mutex.errors import ConstraintValueError

from ._common import ACQUIRE_OUTCOMES, HOLD_BUCKETS, WAIT_BUCKETS, Granted


class _Metrics:
    """The five metrics in one registry, fed by one subscriber."""

    def __init__(self) -> None:
        # Made unregistered, then registered together (``register``): all or none.
        self.acquires = Counter(
            "simple_mutex_acquires_total",
            "Lock acquires by outcome: acquired, busy (a try-once found it held), timed_out",
            ["name", "outcome"],
            registry=None,
        )
        self.wait = Histogram(
            "simple_mutex_wait_seconds",
            "Seconds each acquire took, whatever its outcome",
            ["name"],
            registry=None,
            buckets=WAIT_BUCKETS,
        )
        self.hold = Histogram(
            "simple_mutex_hold_seconds",
            "Seconds each lease was held, from grant to release or loss",
            ["name"],
            registry=None,
            buckets=HOLD_BUCKETS,
        )
        self.lost = Counter(
            "simple_mutex_lost_total",
            "Leases lost while held (lapsed, taken over, or not renewable)",
            ["name"],
            registry=None,
        )
        self.held = Gauge(
            "simple_mutex_held",
            "Leases held now (multiprocess: the sum over live processes)",
            ["name"],
            registry=None,
            multiprocess_mode="livesum",
        )
        self.collectors = (self.acquires, self.wait, self.hold, self.lost, self.held)
        self._granted: Granted[str] = Granted()  # the name of each lease counted held

    def register(self, registry: CollectorRegistry) -> None:
        done = []
        try:
            for collector in self.collectors:
                registry.register(collector)
                done.append(collector)
        except ValueError as exc:  # "Duplicated timeseries in CollectorRegistry"
            for collector in done:
                registry.unregister(collector)
            raise ConstraintValueError(
                "simple_mutex metrics are already registered in this registry: call the "
                "function an earlier instrument() returned first, or pass another registry "
                f"({exc})"
            ) from exc

    def __call__(self, event: events.LockEvent) -> None:
        kind, name = event.kind, event.name
        if kind in ACQUIRE_OUTCOMES:
            self.acquires.labels(name, kind).inc()
            if event.waited is not None:
                self.wait.labels(name).observe(event.waited)
            if kind == "acquired":
                self.held.labels(name).inc()
                for lapsed, _ in self._granted.add(event, name):  # never released nor lost
                    self.held.labels(lapsed).dec()
        elif kind == "renewed":
            self._granted.renew(event)
        elif kind in ("released", "lost"):
            if kind == "lost":
                self.lost.labels(name).inc()
            if event.held is not None:
                self.hold.labels(name).observe(event.held)
            if self._granted.pop(event) is not None:  # not granted before instrument()
                self.held.labels(name).dec()


def instrument(registry: CollectorRegistry | None = None) -> Callable[[], None]:
    """Register the metrics in ``registry`` (default: prometheus-client's global one) and
    feed them from every lock event in this process. Returns the function that stops
    feeding them and unregisters them, so ``instrument`` can be called again."""
    target = REGISTRY if registry is None else registry
    metrics = _Metrics()
    metrics.register(target)
    unsubscribe = events.subscribe(metrics)

    def uninstrument() -> None:
        unsubscribe()
        for collector in metrics.collectors:
            with contextlib.suppress(KeyError):  # uninstrument called twice
                target.unregister(collector)

    return uninstrument
