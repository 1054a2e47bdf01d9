"""``simple_mutex.contrib.prometheus``: the metrics, scraped over prometheus-client's own
HTTP exposition endpoint, equal what the callers of a contention run saw; labels never
carry the key. (A real prefork Celery worker in multiprocess mode: test_observe_workers.)"""

from __future__ import annotations

import socket
import time
import urllib.request
import uuid
from collections.abc import Iterator

import pytest
from contention import contend
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families
from workers import spin, wait_until

from simple_mutex import ConstraintError, InMemoryCache, Mutex, SimpleMutexLeaseExpiredError
from simple_mutex.contrib import _common, prometheus

pytestmark = pytest.mark.fast

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def scrape(port: int) -> Samples:
    """Every sample the endpoint serves, by (sample name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.fixture
def endpoint() -> Iterator[tuple[CollectorRegistry, int]]:
    """A fresh registry, instrumented, served on a free port."""
    registry = CollectorRegistry()
    uninstrument = prometheus.instrument(registry)
    port = free_port()
    started = start_http_server(port, addr="127.0.0.1", registry=registry)
    yield registry, port
    if started is not None:  # (server, thread) in newer releases; 0.17 returns None
        server, thread = started
        server.shutdown()
        server.server_close()
        thread.join(5)
    uninstrument()


@pytest.mark.backends
def test_scraped_counts_equal_what_the_contention_run_saw(endpoint):
    """N acquired, M busy, one timed out, K lost: acquires_total by outcome, lost_total,
    the wait histogram's count (every acquire) and the hold histogram's count (every
    release and loss) say exactly that, and nothing is held at the end."""
    _, port = endpoint
    name = f"orders-{uuid.uuid4().hex[:6]}"
    seen = contend(InMemoryCache(), name, "order.7")
    lost = ("simple_mutex_lost_total", (("name", name),))
    # A loss is reported from the keeper thread, which may finish a moment after the
    # block it interrupted has exited.
    wait_until(lambda: scrape(port).get(lost) == seen.lost, 5, "every loss reported")
    got = scrape(port)

    def value(sample: str, **labels: str) -> float:
        return got[(sample, tuple(sorted({"name": name, **labels}.items())))]

    assert value("simple_mutex_acquires_total", outcome="acquired") == seen.acquired
    assert value("simple_mutex_acquires_total", outcome="busy") == seen.busy
    assert value("simple_mutex_acquires_total", outcome="timed_out") == seen.timed_out
    assert value("simple_mutex_lost_total") == seen.lost
    assert value("simple_mutex_wait_seconds_count") == seen.acquired + seen.busy + seen.timed_out
    assert value("simple_mutex_hold_seconds_count") == seen.acquired
    assert value("simple_mutex_hold_seconds_sum") >= seen.lost * 0.15  # lost: ~0.2 s held
    assert value("simple_mutex_held") == 0
    keys = {v for (_, labels) in got for (_, v) in labels}
    assert not any("order.7" in v for v in keys)  # the key is never a label


def test_the_held_gauge_follows_leases_and_ignores_ones_granted_before():
    """held counts the leases granted while instrumented; a lease granted before
    instrument() and lost after it counts as lost but does not take held below its true
    value."""
    name = f"held-{uuid.uuid4().hex[:6]}"
    cache = InMemoryCache()
    before = Mutex(cache, name=name, lease=0.2).acquire("early")
    registry = CollectorRegistry()
    uninstrument = prometheus.instrument(registry)
    try:
        mutex = Mutex(cache, name=name)

        def sample(metric: str) -> float | None:
            return registry.get_sample_value(metric, {"name": name})

        first, second = mutex.acquire("b"), mutex.acquire("c")
        assert sample("simple_mutex_held") == 2
        first.release()
        assert sample("simple_mutex_held") == 1
        with pytest.raises(SimpleMutexLeaseExpiredError), before:
            spin(5)
        wait_until(lambda: sample("simple_mutex_lost_total") == 1, 5, "the loss reported")
        assert sample("simple_mutex_held") == 1
        second.release()
        assert sample("simple_mutex_held") == 0
    finally:
        uninstrument()


def test_instrument_twice_on_one_registry_names_the_fix():
    """A second instrument() on the same registry is a ConstraintError naming the fix and
    leaves the first one working; after uninstrument it can be called again."""
    registry = CollectorRegistry()
    uninstrument = prometheus.instrument(registry)
    with pytest.raises(ConstraintError, match="earlier instrument"):
        prometheus.instrument(registry)
    Mutex(InMemoryCache(), name="twice").acquire("k").release()
    counted = registry.get_sample_value(
        "simple_mutex_acquires_total", {"name": "twice", "outcome": "acquired"}
    )
    assert counted == 1
    uninstrument()
    uninstrument()  # idempotent
    assert registry.get_sample_value("simple_mutex_held", {"name": "twice"}) is None
    again = prometheus.instrument(registry)
    again()


def test_a_lease_left_to_lapse_unreported_stops_counting_as_held(monkeypatch):
    """A lease nobody releases or watches (a throttle left to lapse) reports no end: once
    it has been expired for the grace period, the next grant forgets it, so held is
    right again and the process keeps nothing for it."""
    monkeypatch.setattr(_common, "SWEEP_GRACE", 0.0)
    monkeypatch.setattr(_common, "SWEEP_EVERY", 0.0)
    registry = CollectorRegistry()
    uninstrument = prometheus.instrument(registry)
    try:
        name = f"throttle-{uuid.uuid4().hex[:6]}"
        mutex = Mutex(InMemoryCache(), name=name, lease=0.1)
        throttle = mutex.try_acquire("daily-report")  # never released: lapses by design
        assert throttle is not None
        assert registry.get_sample_value("simple_mutex_held", {"name": name}) == 1
        time.sleep(0.2)
        mutex.acquire("other").release()  # any later grant sweeps
        assert registry.get_sample_value("simple_mutex_held", {"name": name}) == 0
    finally:
        uninstrument()
