"""Server bootstrap: configuration, model, engine, health, reflection, metrics, TLS/auth,
signals and drain.

Start-up order matters to Kubernetes: the gRPC port opens first with liveness
SERVING and readiness NOT_SERVING, so a startupProbe sees the process alive while
the model loads; readiness turns SERVING only after a warm-up generation.
On SIGTERM or SIGINT: readiness NOT_SERVING at once, new calls UNAVAILABLE,
streams in flight run on for up to ``--grace-period``, then the process exits 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import threading
import time
from typing import Any

import grpc
from grpc_reflection.v1alpha import reflection
from tokenwire.v1 import generation_pb2 as pb

from .config import ServerConfig
from .health import Health
from .metrics import Metrics
from .security import BearerTokenInterceptor, read_token, server_credentials
from .servicer import ServingState, TextGenerationServicer

log = logging.getLogger("tokenwire.server")

WATCHDOG_INTERVAL_S = 1.0


class TokenwireServer:
    """One server process: call ``start()``, then ``wait()``; ``drain()`` ends it."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.state = ServingState()
        self.metrics = Metrics()
        self.health = Health()
        self.port = 0
        self.metrics_port = 0
        self._servicer = TextGenerationServicer(config, self.state, self.metrics)
        self._server: grpc.aio.Server | None = None
        self._stopped = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self.exit_code = 0

    async def start(self) -> None:
        config = self.config
        interceptors = []
        if config.auth_token_file:
            interceptors.append(BearerTokenInterceptor(read_token(config.auth_token_file)))
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
            # Idle clients that vanish without a FIN are noticed and their streams cancelled.
            ("grpc.keepalive_time_ms", 60_000),
            ("grpc.keepalive_timeout_ms", 20_000),
        ]
        server = grpc.aio.server(interceptors=interceptors, options=options)
        self._servicer.add_to_server(server)
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, server)
        reflection.enable_server_reflection(
            (
                pb.DESCRIPTOR.services_by_name["TextGeneration"].full_name,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        address = f"{config.host}:{config.port}"
        if config.tls_cert:
            self.port = server.add_secure_port(
                address, server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
            )
        else:
            self.port = server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot listen on {address}")
        await self.health.start()
        await server.start()
        self._server = server
        log.info(
            "listening",
            extra={"port": self.port, "host": config.host, "tls": bool(config.tls_cert), "mtls": bool(config.tls_client_ca)},
        )

    def start_metrics(self) -> None:
        port = self.config.metrics_port
        if port:
            # Same interface as gRPC: 0.0.0.0 in a pod, 127.0.0.1 in tests. -1 picks a free port.
            self.metrics_port = self.metrics.serve(max(port, 0), self.config.host)
            log.info("metrics", extra={"metrics_port": self.metrics_port})

    async def load(self) -> None:
        """Load the model, start the engine, warm it up, then report ready."""
        from .engine import EngineLimits, create_engine
        from .model import load_model
        from .text import PromptEncoder

        config = self.config
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        loaded = await loop.run_in_executor(
            None, lambda: load_model(config.model, device=config.device, dtype=config.dtype, cache_dir=config.cache_dir)
        )
        limits = EngineLimits(
            max_active=config.max_active,
            max_queue=config.max_queue,
            kv_cache_tokens=config.effective_kv_cache_tokens(loaded.context_length),
            retry_after_s=config.retry_after_ms / 1000,
            max_prefill_tokens=config.max_prefill_tokens,
            batch_window_s=config.batch_window_ms / 1000,
        )
        engine = create_engine(config.engine, loaded, limits, config.workers)
        engine.start()
        gen_config = loaded.model.generation_config
        self.state.default_temperature = float(gen_config.temperature or 1.0) if gen_config.do_sample else 0.0
        self.state.encoder = PromptEncoder(loaded.tokenizer)
        self.state.loaded = loaded
        self.state.engine = engine
        self.metrics.watch(
            lambda: engine.stats().active, lambda: engine.stats().queued, lambda: engine.stats().batch_size
        )
        log.info(
            "model loaded",
            extra={
                "model": loaded.name,
                "device": str(loaded.device),
                "dtype": loaded.dtype_name,
                "engine": engine.name,
                "context_length": loaded.context_length,
                "kv_cache_tokens": limits.kv_cache_tokens,
                "seconds": round(time.monotonic() - started, 2),
            },
        )
        if config.warmup:
            await loop.run_in_executor(None, self._warm_up)
        await self.health.set_ready(True)
        log.info("ready", extra={"seconds": round(time.monotonic() - started, 2)})

    def _warm_up(self) -> None:
        from .engine import ErrorEvent, FinishEvent, GenerationRequest, SamplingOptions

        loaded, engine = self.state.loaded, self.state.engine
        assert loaded is not None and engine is not None
        done = threading.Event()
        outcome: list[Any] = []

        def sink(event: Any) -> None:
            if isinstance(event, FinishEvent | ErrorEvent):
                outcome.append(event)
                done.set()

        # A prompt of typical length, so the first real request finds kernels and buffers warm.
        encoder = self.state.encoder
        assert encoder is not None
        text = "Hello! In one sentence, what is a language model?"
        prompt = encoder.encode(encoder.render_chat([("user", text)]), templated=True) if encoder.has_chat_template else encoder.encode(text)
        request = GenerationRequest("warm-up", prompt, SamplingOptions(temperature=0.0), max_new_tokens=4, ignore_eos=True)
        engine.submit(request, sink)
        if not done.wait(300) or isinstance(outcome[0], ErrorEvent):
            raise RuntimeError(f"warm-up generation failed: {outcome[0] if outcome else 'timed out'}")

    async def watchdog(self) -> None:
        """Liveness follows the engine loop: no progress while work is pending means wedged."""
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            engine = self.state.engine
            if engine is None:
                continue
            stalled = engine.stalled(self.config.stall_timeout)
            if stalled and self.health.live:
                log.error("engine loop made no progress; liveness NOT_SERVING", extra={"timeout_s": self.config.stall_timeout})
            await self.health.set_live(not stalled)

    async def drain(self, reason: str = "signal") -> None:
        """Stop taking work, let the calls in flight finish (up to the grace period), then stop.

        The gRPC port stays open while calls finish, so probes read readiness
        NOT_SERVING (not a refused connection) and new calls get a clear
        UNAVAILABLE from the servicer. grpc's own ``stop(grace)`` is only the
        backstop for what is still running when the grace period ends.
        """
        if self.state.draining:
            return
        grace = self.config.grace_period
        log.info("draining", extra={"reason": reason, "grace_period_s": grace})
        started = time.monotonic()
        self.state.draining = True
        await self.health.set_ready(False)
        engine = self.state.engine
        if engine is not None:
            engine.queue.close()  # waiting requests still run; nothing new is admitted
        idle = await self._servicer.wait_idle(grace)
        if not idle:
            log.warning("grace period over; cancelling calls in flight", extra={"calls": self._servicer.in_flight})
        if self._server is not None:
            # What is left are health checks and reflection: a second at most for those.
            await self._server.stop(min(1.0, max(0.0, grace - (time.monotonic() - started))) if idle else 0)
        if engine is not None:
            await asyncio.get_running_loop().run_in_executor(None, engine.close)
        self._servicer.close()
        self.metrics.close()
        log.info("stopped")
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()


async def serve(config: ServerConfig) -> int:
    server = TokenwireServer(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: asyncio.ensure_future(server.drain(signal.Signals(s).name)))
    await server.start()
    server.start_metrics()
    watchdog = asyncio.ensure_future(server.watchdog())
    try:
        await server.load()
    except Exception as exc:
        from .model import ModelLoadError

        if isinstance(exc, ModelLoadError):
            log.error("cannot start: %s", exc)
        else:
            log.exception("cannot start")
        await server.drain("start-up failed")
        watchdog.cancel()
        return 2
    await server.wait()
    watchdog.cancel()
    return server.exit_code


def print_config(config: ServerConfig) -> None:
    print("tokenwire-server configuration: " + json.dumps(config.public(), sort_keys=True), file=sys.stderr, flush=True)
