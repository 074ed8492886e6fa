"""Prometheus metrics of `tandem router` (`--metrics-port`, at /metrics).

Families (all prefixed `tandem_router_`):

    requests_total                      Generate calls received
    requests_running                    gauge: Generate calls under way
    legs_total{leg}                     calls sent to pods: prefill, decode,
                                        colocated (a whole request to the decode pool)
    errors_total{code}                  calls that ended with an error, by gRPC code
    cancelled_total                     Generate calls the client cancelled
    prefill_fallbacks_total             requests sent colocated to a decode pod
                                        because no prefill pod answered
    kv_releases_total                   prefill pods told to free KV no decode
                                        leg will read (Abort of the prefill leg)
    pod_transitions_total{pool,state}   pods seen going up or down
    pods{pool}, pods_healthy{pool}      gauges, as of the last poll

The router's own registry, so several routers (tests) in one process do
not collide. The counts that GetServerStatus reports are kept here too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("tandem_router_requests", "Generate calls received", registry=r)
        self.running = Gauge(
            "tandem_router_requests_running", "Generate calls under way", registry=r
        )
        self.legs = Counter(
            "tandem_router_legs",
            "Calls sent to pods, by leg (prefill, decode, colocated)",
            ["leg"],
            registry=r,
        )
        self.errors = Counter(
            "tandem_router_errors",
            "Calls that ended with an error, by gRPC code",
            ["code"],
            registry=r,
        )
        self.cancelled = Counter(
            "tandem_router_cancelled", "Generate calls the client cancelled", registry=r
        )
        self.fallbacks = Counter(
            "tandem_router_prefill_fallbacks",
            "Requests sent whole to a decode pod because no prefill pod answered",
            registry=r,
        )
        self.releases = Counter(
            "tandem_router_kv_releases",
            "Prefill pods told to free KV blocks no decode leg will read",
            registry=r,
        )
        self.transitions = Counter(
            "tandem_router_pod_transitions",
            "Pods seen going up or down",
            ["pool", "state"],
            registry=r,
        )
        self.num_prefill_fallbacks = 0

    def serve(self, port: int, host: str) -> None:
        """Starts the HTTP endpoint (a daemon thread). Raises OSError if the
        port cannot be had."""
        start_http_server(port, addr=host, registry=self.registry)

    def fallback(self) -> None:
        self.fallbacks.inc()
        self.num_prefill_fallbacks += 1

    def pod_transition(self, pool: str, up: bool) -> None:
        self.transitions.labels(pool=pool, state="up" if up else "down").inc()

    def watch_pools(self, sizes: Callable[[], list[tuple[str, int, int]]]) -> None:
        """`sizes()`: (pool, pods, healthy pods) per pool, read at each scrape."""
        self.registry.register(_PoolSizes(sizes))


class _PoolSizes(Collector):
    def __init__(self, sizes: Callable[[], list[tuple[str, int, int]]]) -> None:
        self._sizes = sizes

    def collect(self) -> Iterator[GaugeMetricFamily]:
        pods = GaugeMetricFamily("tandem_router_pods", "Pods routed to", labels=["pool"])
        healthy = GaugeMetricFamily(
            "tandem_router_pods_healthy", "Pods answering and not draining", labels=["pool"]
        )
        for pool, num_pods, num_healthy in self._sizes():
            pods.add_metric([pool], num_pods)
            healthy.add_metric([pool], num_healthy)
        yield pods
        yield healthy
