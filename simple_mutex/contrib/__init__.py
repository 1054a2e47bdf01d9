"""Sinks for ``simple_mutex.events`` that need a third-party package (an install extra each):

* ``simple_mutex.contrib.prometheus`` (``simple-mutex[prometheus]``): prometheus-client metrics
* ``simple_mutex.contrib.opentelemetry`` (``simple-mutex[otel]``): spans and metrics

Nothing here is imported by ``import simple_mutex``.
"""
