"""Prometheus metrics, served on their own HTTP port (``--metrics-port``)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tokenwire_requests", "Finished calls by method and gRPC status code", ["method", "code"], registry=r
        )
        self.ttft = Histogram(
            "tokenwire_time_to_first_token_seconds", "Arrival to first streamed text", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "tokenwire_inter_token_latency_seconds", "Gap between streamed chunks", buckets=_ITL_BUCKETS, registry=r
        )
        self.latency = Histogram(
            "tokenwire_request_duration_seconds", "Arrival to end of call", ["method"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.generated_tokens = Counter("tokenwire_generated_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("tokenwire_prompt_tokens", "Prompt tokens read", registry=r)
        self.active = Gauge("tokenwire_active_streams", "Requests generating now", registry=r)
        self.queued = Gauge("tokenwire_queue_depth", "Requests waiting for a slot", registry=r)
        self.batch = Gauge("tokenwire_batch_size", "Sequences in the current decode batch", registry=r)
        self._http: object | None = None

    def watch(self, active: Callable[[], float], queued: Callable[[], float], batch: Callable[[], float]) -> None:
        self.active.set_function(active)
        self.queued.set_function(queued)
        self.batch.set_function(batch)

    def serve(self, port: int, host: str = "0.0.0.0") -> int:
        """Start the HTTP endpoint; return the bound port (port 0 picks a free one)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = server
        return int(server.server_port)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()  # type: ignore[attr-defined]
            self._http.server_close()  # type: ignore[attr-defined]
            self._http = None
