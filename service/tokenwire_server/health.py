"""Health: liveness (service "") and readiness (service tokenwire.v1.TextGeneration).

The same two statuses are exported as the ``tokenwire_live`` and ``tokenwire_ready``
gauges, so alerts see what Kubernetes' probes see.
"""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2  # type: ignore[import-untyped]

from .metrics import Metrics

LIVENESS_SERVICE = ""
READINESS_SERVICE = "tokenwire.v1.TextGeneration"

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Health:
    """Holds the two statuses Kubernetes probes; the bootstrap flips them."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self.servicer = health.aio.HealthServicer()
        self._metrics = metrics
        self.live = True
        self.ready = False

    async def start(self) -> None:
        await self.servicer.set(LIVENESS_SERVICE, SERVING)
        await self.servicer.set(READINESS_SERVICE, NOT_SERVING)
        self._export()

    async def set_ready(self, ready: bool) -> None:
        self.ready = ready
        await self.servicer.set(READINESS_SERVICE, SERVING if ready else NOT_SERVING)
        self._export()

    async def set_live(self, live: bool) -> None:
        if live != self.live:
            self.live = live
            await self.servicer.set(LIVENESS_SERVICE, SERVING if live else NOT_SERVING)
        self._export()

    def _export(self) -> None:
        if self._metrics is not None:
            self._metrics.live.set(1 if self.live else 0)
            self._metrics.ready.set(1 if self.ready else 0)
