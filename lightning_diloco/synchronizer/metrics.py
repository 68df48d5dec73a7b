"""Prometheus text metrics, read from the service's status on every scrape.

Served by prometheus_client's WSGI app on a server of our own rather than its
``start_http_server``, whose connections had no timeout and no cap: the port answers without the
token, so it is bounded as the status page is (http_limits.py).
"""

from __future__ import annotations

from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from lightning_diloco.synchronizer.http_limits import (
    IDLE_TIMEOUT_S,
    MAX_CONNECTIONS,
    BoundedServer,
    limited_handler,
    serve_in_background,
)
from lightning_diloco.synchronizer.service import Synchronizer


class SynchronizerCollector:
    def __init__(self, service: Synchronizer) -> None:
        self.service = service

    def collect(self):
        st = self.service.status()
        yield GaugeMetricFamily("diloco_live_islands", "Islands within the liveness timeout", value=len(st.live_islands))
        yield CounterMetricFamily("diloco_outer_steps", "Outer steps applied by this shard", value=st.outer_steps)
        yield CounterMetricFamily("diloco_bytes_in", "Payload bytes received", value=st.bytes_in)
        yield CounterMetricFamily("diloco_bytes_out", "Payload bytes sent", value=st.bytes_out)
        accepted = CounterMetricFamily("diloco_contributions_accepted", "Contributions accepted", labels=["kind"])
        for kind, n in st.accepted.items():
            accepted.add_metric([kind], n)
        yield accepted
        refused = CounterMetricFamily("diloco_contributions_refused", "Requests refused", labels=["reason"])
        for reason, n in st.refused.items():
            refused.add_metric([reason], n)
        yield refused
        version = GaugeMetricFamily("diloco_fragment_version", "Global fragment version", labels=["fragment"])
        for p, v in st.versions.items():
            version.add_metric([str(p)], v)
        yield version


class MetricsServer(BoundedServer, WSGIServer):
    pass


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, *args) -> None:  # a scrape every few seconds would flood the synchronizer's log
        pass


def serve_metrics(service: Synchronizer, port: int, host: str = "127.0.0.1", *, idle_timeout: float = IDLE_TIMEOUT_S,
                  max_connections: int = MAX_CONNECTIONS):
    """Start an HTTP metrics endpoint (at ``/metrics``, as every path); returns (server, thread)
    so callers can shut it down."""
    registry = CollectorRegistry()
    registry.register(SynchronizerCollector(service))
    server = make_server(host, port, make_wsgi_app(registry), lambda *a: MetricsServer(*a, max_connections=max_connections),  # type: ignore[call-overload]  # a factory as server_class: make_server only calls it
                         handler_class=limited_handler(_QuietHandler, idle_timeout))
    return server, serve_in_background(server, "diloco-metrics")
