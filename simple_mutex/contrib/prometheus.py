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

The lines of ``on_busy="queue"``, from a collector that reads them at each scrape
(``instrument_lines(cache)``, in the one process that serves the metrics):

* ``simple_mutex_parked{prefix, key}``: gauge, calls parked in each key's line now

Here the key is a label: only keys with a line now are reported (a line expires with its
last parked call), and nothing stays in the client once a line is gone. Read, not fed by
events: a call parks in the sending process (``apply_async``) or a worker, is promoted
by whichever worker ends the turn, and expires in whichever sweeps it, so a gauge
counted up and down from events would be split over processes that share no
``PROMETHEUS_MULTIPROC_DIR``, and would miss expiries; the record holds the truth.

Multiprocess (a Celery prefork worker, gunicorn): set ``PROMETHEUS_MULTIPROC_DIR`` before
the process starts and call ``instrument()`` in the parent, before it forks; every child
writes its own files, and the held gauge is a ``livesum`` (the sum over live processes).
Serve them from a registry holding ``prometheus_client.multiprocess.MultiProcessCollector``
(``docs/guides/observability.md`` shows it for Celery).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from simple_mutex import events
from simple_mutex.admin import DEFAULT_PREFIX, parked_by_key
from simple_mutex.errors import ConstraintValueError, SimpleMutexError

from ._common import ACQUIRE_OUTCOMES, HOLD_BUCKETS, WAIT_BUCKETS, Granted

log = logging.getLogger("simple_mutex")


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


class ParkedCollector(Collector):
    """``simple_mutex_parked{prefix, key}``: the parked calls of each line beside the
    locks under ``prefix``, read from ``cache`` at each scrape (one scan, one read per
    line). A cache that fails is a warning and an empty family, never a failed scrape."""

    def __init__(self, cache: object, prefix: str = DEFAULT_PREFIX) -> None:
        self.cache = cache
        self.prefix = prefix

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "simple_mutex_parked",
            "Calls parked in each key's line now (on_busy='queue')",
            labels=["prefix", "key"],
        )

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield self._family()  # so that registering it reads no cache

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        try:
            parked = parked_by_key(self.cache, self.prefix)
        except SimpleMutexError as exc:
            log.warning("simple_mutex_parked: the lines under %r could not be read: %s",
                        self.prefix, exc)  # fmt: skip
            parked = {}
        for key, count in sorted(parked.items()):
            family.add_metric([self.prefix, key], count)
        yield family


def instrument_lines(
    cache: object, *, prefix: str = DEFAULT_PREFIX, registry: CollectorRegistry | None = None
) -> Callable[[], None]:
    """Register ``ParkedCollector(cache, prefix)`` in ``registry`` (default: the global
    one); returns the function that unregisters it. ``cache`` is the lock cache (a
    blocking one that can ``scan``: every cache of ``simple_mutex.caches``)."""
    target = REGISTRY if registry is None else registry
    collector = ParkedCollector(cache, prefix)
    try:
        target.register(collector)
    except ValueError as exc:
        raise ConstraintValueError(
            f"simple_mutex_parked is already registered in this registry ({exc})"
        ) from exc

    def uninstrument() -> None:
        with contextlib.suppress(KeyError):
            target.unregister(collector)

    return uninstrument
