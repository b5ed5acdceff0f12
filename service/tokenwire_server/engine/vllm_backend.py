"""``VllmBackend``: vLLM's async engine, in-process, behind the backend seam (``--engine vllm``).

vLLM schedules, batches (PagedAttention, prefix caching, CUDA graphs) and samples;
tokenwire keeps the contract around it:

- **Text.** vLLM runs with ``detokenize=False`` and streams token ids. Each request's
  ids go through the same ``Generation`` as on the batched engine (detokenizer, stop
  matcher, finish rules), so the text rules are byte-for-byte the same on both
  engines: no half characters, no leaked stop fragments, text == decode(ids). Stop
  sequences are matched here, and the vLLM request is aborted when one matches.
- **Admission.** ``--max-active`` is vLLM's ``max_num_seqs``; at most ``--max-queue``
  more wait (in vLLM's queue); past that ``submit`` raises ``EngineOverloaded`` before
  any work, as the batched engine does.
- **Cancellation.** A cancelled submission, a passed time limit or a matched stop
  sequence aborts the vLLM request at once (``AsyncLLM.abort``).
- **A reader that stops reading.** The stream is pulled: while the transport waits for the
  client to take a chunk, nothing more is taken from vLLM (whose own output collector merges
  what comes meanwhile, at most the request's tokens). A chunk left unread for
  ``--stalled-reader-timeout`` aborts the vLLM request and ends the call STALLED_READER
  (``VllmSubmission``); vLLM has no way to set a request aside, so it is not parked.
- **Health.** ``stalled()`` is true once vLLM's engine has died (``errored``), which
  turns liveness NOT_SERVING.

Differences from the batched engine are listed in docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from ..domain import (
    EngineClosed,
    EngineObserver,
    EngineOverloaded,
    EngineStats,
    GenerationRequest,
    ModelDescription,
    NoObserver,
    NotSupported,
    RequestLimits,
    ResponseFormat,
    SamplingOptions,
)
from ..intake import Intake, IntakeBackend
from ..structured import Grammars, choice_grammar
from ..text import PromptEncoder, SharedTokenizer
from .vllm_submission import VllmSubmission

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class VllmSettings:
    max_active: int
    max_queue: int
    retry_after_s: float
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enforce_eager: bool = False
    dtype: str = "auto"
    kv_cache_bytes: int = 0  # CPU: the KV cache's size (vLLM would take most of the RAM)
    max_model_len: int = 0  # 0: the model's context
    prefix_cache: bool = True  # --prefix-cache: vLLM's automatic prefix caching
    # --stalled-reader-timeout: a chunk left unread this long ends the call STALLED_READER (0: never).
    stalled_reader_timeout_s: float = 30.0


def vllm_model_folder(folder: Path) -> Path:
    """A folder vLLM can load: ``folder`` itself, or, where its config.json still carries a GGUF
    ``quantization_config`` (a folder converted from GGUF elsewhere: vLLM would load it as GGUF),
    a sibling folder of links with the marker dropped (``model.unmarked_view``)."""
    from ..model import gguf_marked, unmarked_view  # torch: imported where vLLM is

    if not gguf_marked(folder):
        return folder
    return unmarked_view(folder, folder.with_name(folder.name + "-vllm"))


class _VllmStats:
    """KV-cache usage and prefix-cache hits, as vLLM's scheduler reports them each step."""

    def __init__(self) -> None:
        self.kv_cache_usage = 0.0
        self.running = 0
        self.waiting = 0
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def prefix_hit_ratio(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def factory(self, vllm_config: Any, engine_index: int = 0) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        owner = self

        class Logger(StatLoggerBase):  # type: ignore[misc]
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats: Any, iteration_stats: Any, *args: Any, **kwargs: Any) -> None:
                if scheduler_stats is None:
                    return
                owner.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
                owner.running = int(scheduler_stats.num_running_reqs)
                owner.waiting = int(scheduler_stats.num_waiting_reqs)
                prefix = scheduler_stats.prefix_cache_stats
                if getattr(prefix, "reset", False):
                    owner.prefix_queries = owner.prefix_hits = 0
                owner.prefix_queries += int(prefix.queries)
                owner.prefix_hits += int(prefix.hits)

            def log_engine_initialized(self) -> None:
                pass

        return Logger(vllm_config, engine_index)


class VllmBackend(IntakeBackend):
    name = "vllm"

    def __init__(
        self,
        folder: Path,
        display_name: str,
        settings: VllmSettings,
        request_limits_for: Any,
        device: str = "auto",
        observer: EngineObserver | None = None,
    ) -> None:
        from transformers import AutoTokenizer, GenerationConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from ..model import default_sampling

        self._settings = settings
        self.observer: EngineObserver = observer or NoObserver()  # the metrics (stalled readers)
        self._folder = vllm_model_folder(folder)
        tokenizer = AutoTokenizer.from_pretrained(self._folder)
        self.tokenizer = SharedTokenizer(tokenizer)
        self.encoder = PromptEncoder(self.tokenizer)
        self._stats = _VllmStats()
        kwargs: dict[str, Any] = {
            "model": str(self._folder),
            "tokenizer": str(self._folder),
            "dtype": settings.dtype,
            "enforce_eager": settings.enforce_eager,
            "max_num_seqs": settings.max_active,
            "tensor_parallel_size": settings.tensor_parallel_size,
            "pipeline_parallel_size": settings.pipeline_parallel_size,
            "enable_prefix_caching": settings.prefix_cache,
            "disable_log_stats": False,
            "seed": 0,
            # Response formats go to xgrammar, the library the batched engine uses, with compact
            # JSON: the same formats, errors and whitespace on both engines.
            "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
        }
        if settings.max_model_len:
            kwargs["max_model_len"] = settings.max_model_len
        if settings.kv_cache_bytes:
            kwargs["kv_cache_memory_bytes"] = settings.kv_cache_bytes
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs), stat_loggers=[self._stats.factory])
        model_config = self.engine.model_config
        cache_config = self.engine.vllm_config.cache_config
        self._kv_tokens = int(cache_config.num_gpu_blocks or 0) * int(cache_config.block_size or 0)
        self._context = int(model_config.max_model_len)
        self._vocab = int(model_config.get_vocab_size())
        try:
            generation_config = GenerationConfig.from_pretrained(self._folder)
        except OSError:
            generation_config = None
        eos: set[int] = set()
        for source in (getattr(generation_config, "eos_token_id", None), tokenizer.eos_token_id):
            if isinstance(source, int):
                eos.add(source)
            elif source:
                eos.update(int(x) for x in source)
        self._eos = tuple(sorted(eos))
        self._description = ModelDescription(
            name=display_name,
            engine=self.name,
            dtype=str(model_config.dtype).removeprefix("torch."),
            device=_device_name(),
            vocab_size=self._vocab,
            eos_token_ids=self._eos,
            bos_token_id=tokenizer.bos_token_id,
            has_chat_template=self.encoder.has_chat_template,
            default_sampling=default_sampling(generation_config),
            limits=self._limits_for(request_limits_for(self._context, self._vocab)),
            max_active=settings.max_active,
            max_queue=settings.max_queue,
            quantization=str(getattr(model_config, "quantization", None) or "none"),
            notes=(
                "vllm: a request's tokens may differ alone and in a batch (vLLM does not promise batch invariance)",
                "vllm: usage.queue_time_ms ends when the request is handed to vLLM; "
                "vLLM's own queue counts in the time to first token",
                "vllm: a resumed seeded stream (GenerateRequest.resume) does not give the uncut stream's tokens "
                "(vLLM's generator restarts from the seed); greedy ones matched where measured",
                "vllm: a stream with a response_format cannot be resumed (vLLM's grammar would start again "
                "at the cut): FAILED_PRECONDITION",
                "vllm: a logit_bias of -100 is added like any other bias (the batched and simple engines ban "
                "the token); presence, frequency and repetition penalties and min_p are vLLM's own",
                "vllm: prompt_logprobs are vLLM's; OutputOptions.logprobs_of is not served (FAILED_PRECONDITION); "
                "a scoring call (max_new_tokens 0) has vLLM generate one token, which is not sent",
                "vllm: the n samples of a call (GenerateRequest.n) are n vLLM requests with seeds seed + i, "
                "sent at once; their prompt is shared as vLLM's prefix cache finds it",
            ),
        )
        # Response formats are checked here, with the same library and options vLLM compiles
        # them with, so a bad one is INVALID_ARGUMENT with the same message on both engines.
        self.grammars = Grammars(tokenizer, self._vocab, self._eos)
        limits = self._description.limits
        self.intake = Intake(
            self.encoder,
            lambda fmt: self.grammars.compile(fmt)[1],
            timeout_s=limits.format_compile_timeout_s,
            prepare=self.grammars.prepare,
        )
        self._in_flight = 0
        self._closed = False
        self.last_progress = time.monotonic()

    # -- the seam -------------------------------------------------------------------

    def describe(self) -> ModelDescription:
        return self._description

    def _limits_for(self, limits: RequestLimits) -> RequestLimits:
        """The limits with what a prompt that fits may be long, in characters, on this tokenizer."""
        return dataclasses.replace(limits, max_prompt_chars=self.encoder.max_chars(limits.max_request_tokens))

    def submit(self, request: GenerationRequest) -> VllmSubmission:
        settings = self._settings
        if request.adapter:
            raise NotSupported(
                "the vllm engine does not apply LoRA adapters here yet (GenerateRequest.adapter); "
                "serve them with --engine batched"
            )
        if request.logprobs_of:
            raise NotSupported(
                "the vllm engine does not report the log-probabilities of named tokens (OutputOptions.logprobs_of: "
                "vLLM returns only the top alternatives); ask for top_logprobs, or serve it with --engine batched"
            )
        if request.response_format is not None and request.resume_ids:
            raise NotSupported(
                "the vllm engine cannot resume a stream with a response_format (vLLM's grammar would start "
                "again at the cut); send the request again without resume, or serve it with --engine batched"
            )
        if self._closed or self.engine.errored:
            raise EngineClosed("the engine is shutting down")
        if self._in_flight >= settings.max_active + settings.max_queue:
            raise EngineOverloaded(
                f"server is full: {self._in_flight} requests in flight "
                f"(limits {settings.max_active} + {settings.max_queue}); retry later or on another replica",
                settings.retry_after_s,
            )
        self._in_flight += 1
        return VllmSubmission(self, request)

    def stats(self) -> EngineStats:
        active = min(self._in_flight, self._settings.max_active)
        return EngineStats(
            active=active,
            queued=self._in_flight - active,
            batch_size=self._stats.running,
            # vLLM's KV cache in tokens, and the share of its blocks in use (blocks held,
            # not worst cases reserved as the batched engine counts them).
            kv_tokens_reserved=round(self._stats.kv_cache_usage * self._kv_tokens),
            kv_tokens_budget=self._kv_tokens,
        )

    def extra_gauges(self) -> dict[str, tuple[str, Any]]:
        """vLLM's own KV-cache usage and prefix-cache hit ratio, exported as tokenwire gauges."""
        return {
            "tokenwire_vllm_kv_cache_usage_ratio": (
                "Fraction of vLLM's KV-cache blocks in use",
                lambda: self._stats.kv_cache_usage,
            ),
            "tokenwire_vllm_prefix_cache_hit_ratio": (
                "Prompt tokens found in vLLM's prefix cache, of those looked up",
                lambda: self._stats.prefix_hit_ratio,
            ),
        }

    def stalled(self, timeout_s: float) -> bool:
        return bool(self.engine.errored)

    def failure(self) -> str | None:
        return None  # vLLM's own engine core reports a dead device as ``errored``: stalled() above

    def stop_admission(self) -> None:
        self._closed = True

    async def close(self) -> None:
        self._closed = True
        self.engine.shutdown()
        self.intake.close()

    # -- per request ------------------------------------------------------------------

    def _done(self) -> None:
        self._in_flight -= 1
        self.last_progress = time.monotonic()

    def sampling_params(self, request: GenerationRequest) -> Any:
        """Every GenerateRequest field vLLM should know, as its SamplingParams."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        options: SamplingOptions = request.sampling
        logprobs: int | None = None
        if request.top_logprobs:
            logprobs = request.top_logprobs
        elif request.want_logprobs:
            logprobs = 0
        fmt = request.response_format
        constrained = fmt is not None
        return SamplingParams(
            structured_outputs=structured_outputs(fmt) if fmt is not None else None,
            temperature=0.0 if options.greedy else options.temperature,
            top_k=options.top_k if options.top_k > 0 else 0,
            top_p=options.top_p,
            repetition_penalty=options.repetition_penalty,
            presence_penalty=options.presence_penalty,
            frequency_penalty=options.frequency_penalty,
            min_p=options.min_p,
            # vLLM adds -100 like any bias (tokenwire bans the token: ModelInfo.notes says so).
            logit_bias=dict(options.logit_bias) or None,
            seed=None if options.seed is None else options.seed & 0x7FFF_FFFF_FFFF_FFFF,
            # A resumed stream counts from its original start: what is left of both. A scoring call
            # (max_new_tokens 0) has vLLM make one token, which tokenwire does not send (Generation.take).
            max_tokens=max(1, request.max_new_tokens - len(request.resume_ids)),
            prompt_logprobs=request.prompt_top_logprobs if request.prompt_logprobs else None,
            # A constrained answer ends when its grammar is complete, as on the batched engine.
            min_tokens=0
            if constrained
            else max(0, min(request.min_new_tokens, request.max_new_tokens) - len(request.resume_ids)),
            ignore_eos=request.ignore_eos and not constrained,
            # vLLM stops there too (after min_tokens, whatever ignore_eos says), as tokenwire does.
            stop_token_ids=sorted(request.stop_token_ids),
            logprobs=logprobs,
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA,
        )


def structured_outputs(fmt: ResponseFormat) -> Any:
    """A response format as vLLM's StructuredOutputsParams."""
    from vllm.sampling_params import StructuredOutputsParams

    compact = {"disable_any_whitespace": True}
    if fmt.kind == "json_schema":
        return StructuredOutputsParams(json=fmt.spec, **compact)
    if fmt.kind == "json_object":
        return StructuredOutputsParams(json_object=True, **compact)
    if fmt.kind == "regex":
        return StructuredOutputsParams(regex=fmt.spec)
    if fmt.kind == "choice":
        return StructuredOutputsParams(grammar=choice_grammar(fmt.options))  # the batched engine's grammar for it
    return StructuredOutputsParams(grammar=fmt.spec)


def _device_name() -> str:
    try:
        import torch

        return "cuda:0" if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover - vLLM always brings torch
        return "cpu"
