"""Prometheus metrics of an engine, and the HTTP endpoint a process serves them on.

``EngineCollector`` reads the engine's own stats at each scrape (nothing is
counted twice, and the engine's hot path never touches a Prometheus object):
tokens sampled and trained, training passes and the calls they held (batch
occupancy = calls / passes), sampler slots in use (the KV cache's rows), models
hosted, calls waiting and their waits per tenant, checkpoints written. The
server of an embedded deployment and every ``treadle worker`` register one;
the server adds its RPC metrics (``treadle.server.metrics``).

Counters are totals since the process started: a rate is a query
(``rate(treadle_tokens_sampled_total[1m])``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.process_collector import ProcessCollector

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer


def process_registry() -> CollectorRegistry:
    """A registry of its own (several servers may share a test process) with the
    process's memory, CPU and open file descriptors."""
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    return registry


@dataclass
class MetricsEndpoint:
    """``GET /metrics`` on ``host:port`` (port 0: any free one), on a thread."""

    port: int
    _server: WSGIServer
    _thread: threading.Thread

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> MetricsEndpoint:
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsEndpoint(server.server_port, server, thread)
