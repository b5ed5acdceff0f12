"""Health: liveness (service "") and readiness (service tokenwire.v1.TextGeneration)."""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2

LIVENESS_SERVICE = ""
READINESS_SERVICE = "tokenwire.v1.TextGeneration"

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Health:
    """Holds the two statuses Kubernetes probes; the bootstrap flips them."""

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()
        self.live = True
        self.ready = False

    async def start(self) -> None:
        await self.servicer.set(LIVENESS_SERVICE, SERVING)
        await self.servicer.set(READINESS_SERVICE, NOT_SERVING)

    async def set_ready(self, ready: bool) -> None:
        self.ready = ready
        await self.servicer.set(READINESS_SERVICE, SERVING if ready else NOT_SERVING)

    async def set_live(self, live: bool) -> None:
        if live != self.live:
            self.live = live
            await self.servicer.set(LIVENESS_SERVICE, SERVING if live else NOT_SERVING)
