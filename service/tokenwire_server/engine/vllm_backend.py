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
- **LoRA adapters.** With ``--lora`` or ``--lora-dir``, vLLM starts with its LoRA layers
  (``enable_lora``, ``max_loras`` = ``max_cpu_loras`` = ``--max-loras``, ``max_lora_rank``:
  ``--max-lora-rank`` rounded up to a rank vLLM reserves slots for). A folder is checked as on the
  batched engine (``adapters.admit``: the same refusals), then handed to vLLM as a
  ``LoRARequest`` (``add_lora``, awaited when LoadAdapter loads it); each call naming it carries
  the request. Unloading stops new calls at once and calls ``remove_lora`` after its last stream.

Differences from the batched engine are listed in docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from pathlib import Path
from typing import Any

from ..domain import (
    AdapterDescription,
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
    UnknownAdapter,
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
    # LoRA: most adapters loaded (--max-loras; 0: vLLM starts without LoRA) and the highest rank.
    max_loras: int = 0
    max_lora_rank: int = 64


# The ranks vLLM reserves LoRA slots for (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# How long LoadAdapter waits for vLLM to load an adapter's weights.
ADD_LORA_TIMEOUT_S = 120.0


def vllm_lora_rank(rank: int) -> int:
    """``--max-lora-rank`` as vLLM takes it: the smallest rank it reserves slots for that holds it."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"--max-lora-rank {rank}: vLLM takes ranks up to {VLLM_LORA_RANKS[-1]}")


@dataclasses.dataclass
class VllmLora:
    """An adapter handed to vLLM: its ``LoRARequest``, how ModelInfo lists it, the streams using it."""

    request: Any
    description: AdapterDescription
    streams: int = 0
    unloaded: bool = False


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
        loop: asyncio.AbstractEventLoop | None = None,
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
        if settings.max_loras:
            kwargs.update(
                enable_lora=True,
                max_loras=settings.max_loras,
                max_cpu_loras=settings.max_loras,
                max_lora_rank=vllm_lora_rank(settings.max_lora_rank),
            )
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
        # LoRA adapters by name (those loaded; one unloaded with streams left is only in their hands).
        self._loras: dict[str, VllmLora] = {}
        self._lora_ids = itertools.count(1)  # vLLM's lora_int_id: one per load, never reused
        self._lora_lock = threading.Lock()
        self._loading: set[str] = set()  # names being loaded now
        self._hf_config = model_config.hf_config
        self._loop = loop  # the serving loop, where vLLM's coroutines run
        lora_notes = (
            (
                "vllm: LoRA adapters run in vLLM's own LoRA layers, in the model's dtype; an adapter row's tokens "
                "may differ alone and in a batch",
                f"vllm: LoRA slots are reserved for rank {vllm_lora_rank(settings.max_lora_rank)} "
                f"(--max-lora-rank {settings.max_lora_rank}, rounded up to a rank vLLM takes)",
            )
            if settings.max_loras
            else ()
        )
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
                *lora_notes,
            ),
            applies_adapters=bool(settings.max_loras),
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
        adapters = tuple(self._loras[name].description for name in sorted(self._loras))
        return dataclasses.replace(self._description, adapters=adapters)

    # -- LoRA adapters (the Adapters service's host) ---------------------------------------

    def load_adapter(self, name: str, folder: Path) -> AdapterDescription:
        """Check ``folder`` as the batched engine does, then have vLLM load it (waited for where
        called off the serving loop, as LoadAdapter does; at start vLLM loads it as it starts or
        on the first call naming it)."""
        from vllm.lora.request import LoRARequest

        from ..adapters import admit
        from ..domain import InvalidAdapter

        if not self._settings.max_loras:
            raise self._no_lora()
        limits = self._description.limits
        with self._lora_lock:  # the name and the limit hold across loads: the name is held while vLLM loads it
            taken = [*self._loras, *self._loading]
            adapter = admit(name, folder, taken, limits.max_loras, self._hf_config, limits.max_lora_rank)
            self._loading.add(name)
        try:
            request = LoRARequest(name, next(self._lora_ids), str(Path(folder).resolve()))
            try:  # not under the lock: the loop, which vLLM's load runs on, takes it as streams end
                added = self._on_loop(lambda: self.engine.add_lora(request), wait=True)
            except Exception as exc:  # vLLM's own reading of it failed, or took past ADD_LORA_TIMEOUT_S
                self._on_loop(lambda: self.engine.remove_lora(request.lora_int_id), wait=False)  # none left behind
                raise InvalidAdapter(f"{folder}: vLLM could not load it: {type(exc).__name__}: {exc}") from exc
            if added is False:
                raise InvalidAdapter(f"{folder}: vLLM did not load it (add_lora returned False)")
            description = AdapterDescription(adapter.name, adapter.rank, tuple(adapter.modules))
            with self._lora_lock:
                self._loras[name] = VllmLora(request, description)
        finally:
            with self._lora_lock:
                self._loading.discard(name)
        return description

    def unload_adapter(self, name: str) -> int:
        """New calls naming ``name`` are NOT_FOUND from now on; its streams finish with it, and
        vLLM frees it after the last (``remove_lora``). Returns the streams running with it."""
        with self._lora_lock:
            lora = self._loras.pop(name, None)
            if lora is None:
                raise UnknownAdapter(name, sorted(self._loras))
            lora.unloaded = True
            if lora.streams == 0:
                self._remove(lora)
            return lora.streams

    def _remove(self, lora: VllmLora) -> None:
        lora_id = lora.request.lora_int_id
        self._on_loop(lambda: self.engine.remove_lora(lora_id), wait=False)

    def _no_lora(self) -> NotSupported:
        return NotSupported(
            "this vllm engine was started without LoRA adapters: vLLM reserves its LoRA slots as it starts, "
            "so start the server with --lora NAME=PATH or --lora-dir DIR"
        )

    def _on_loop(self, make: Any, wait: bool) -> Any:
        """Run the coroutine ``make()`` on the serving loop: waited for (its result) from another
        thread when ``wait``; from the loop itself, or without a loop yet, not waited for (vLLM
        loads an adapter named by a call as the call starts, and a failed removal is logged)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return None
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False

        def logged(future: Any) -> None:
            if not future.cancelled() and future.exception() is not None:
                log.warning("vllm lora call failed", extra={"error": repr(future.exception())})

        if on_loop:
            loop.create_task(make()).add_done_callback(logged)
            return None
        future = asyncio.run_coroutine_threadsafe(make(), loop)
        if not wait:
            future.add_done_callback(logged)
            return None
        return future.result(ADD_LORA_TIMEOUT_S)

    def _limits_for(self, limits: RequestLimits) -> RequestLimits:
        """The limits with what a prompt that fits may be long, in characters, on this tokenizer."""
        return dataclasses.replace(limits, max_prompt_chars=self.encoder.max_chars(limits.max_request_tokens))

    def submit(self, request: GenerationRequest) -> VllmSubmission:
        settings = self._settings
        lora: VllmLora | None = None
        if request.adapter:
            if not settings.max_loras:
                raise self._no_lora()
            lora = self._loras.get(request.adapter)
            if lora is None:
                raise UnknownAdapter(request.adapter, sorted(self._loras))
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
        if lora is not None:
            lora.streams += 1
        return VllmSubmission(self, request, lora)

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

    def _done(self, lora: VllmLora | None = None) -> None:
        self._in_flight -= 1
        self.last_progress = time.monotonic()
        if lora is not None:
            with self._lora_lock:
                lora.streams -= 1
                if lora.unloaded and lora.streams == 0:  # its last stream: vLLM may free it now
                    self._remove(lora)

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
