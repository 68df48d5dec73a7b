"""Prometheus text metrics, read from the service's status on every scrape."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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


def serve_metrics(service: Synchronizer, port: int, host: str = "127.0.0.1"):
    """Start an HTTP metrics endpoint; returns (server, thread) so callers can shut it down."""
    registry = CollectorRegistry()
    registry.register(SynchronizerCollector(service))
    return start_http_server(port, addr=host, registry=registry)
