"""The server's Prometheus metrics: every RPC by method, status and tenant, and
its latency; plus, in an embedded server, the engine's (``common.metrics``).

Served on ``--metrics-port`` (off by default: the series name tenants). The
tenant label is the tenant id the caller's key resolved to, never the key; a
call without a valid key counts under tenant ``""``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from treadle.common.metrics import MetricsEndpoint, process_registry, serve_metrics

#: latency buckets (seconds): sub-millisecond reads to minutes-long training calls
LATENCY_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else process_registry()
        self.calls = Counter(
            "treadle_rpc_calls",
            "RPCs answered, by method, status code and tenant",
            ["rpc", "status", "tenant"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "treadle_rpc_latency_seconds",
            "Time from a request's arrival to its answer, by method",
            ["rpc"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "treadle_rpc_in_flight", "RPCs being answered now", registry=self.registry
        )
        self.endpoint: MetricsEndpoint | None = None

    def started(self) -> None:
        self.in_flight.inc()

    def observe(self, rpc: str, status: str, tenant: str, seconds: float) -> None:
        """One call answered (``started`` was called for it)."""
        self.in_flight.dec()
        self.calls.labels(rpc, status, tenant).inc()
        self.latency.labels(rpc).observe(seconds)

    def serve(self, host: str, port: int) -> int:
        """Start ``GET /metrics``; the port it listens on."""
        self.endpoint = serve_metrics(self.registry, host, port)
        return self.endpoint.port

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None


def rpc_name(method: str) -> str:
    """``/treadle.v1.TrainingService/ForwardBackward`` -> ``TrainingService/ForwardBackward``."""
    service, _, name = method.lstrip("/").rpartition("/")
    return f"{service.rpartition('.')[2]}/{name}" if service else name
