"""The `batched` engine: continuous batching in one loop that owns the model.

The loop is the scheduler (``scheduler.Scheduler``: admission, block tables, each
step's plan, the delivery of tokens; no torch) and the model runner
(``runner.ModelRunner``: inputs, forward pass, sampling) taking turns:

1. Finished, cancelled and expired requests leave (their blocks go back to the pool
   at once), and waiting requests are admitted while the block pool can promise each
   its worst case (prompt + ``max_new_tokens``); a prompt's longest cached prefix is
   shared, not read again (``--prefix-cache``).
2. ``schedule()`` plans one step: every decoding row's next token and, while anyone
   decodes, up to ``max_prefill_tokens`` tokens of waiting prompts (chunked prefill),
   so a long prompt slows the others a little at each step instead of freezing them.
3. ``run(plan)``: the forward pass and the sampled tokens. ``postprocess`` commits them.

With ``--overlap`` (CUDA's default) step 3 is split: the step's picks are collected and
*taken* (what the next step's sampler reads), the next step is launched, and only then
is the step's text *delivered*, while the device computes (``_overlapped_step``).

The KV cache is a pool of fixed-size blocks (``kv.PagedCache``), sized to the budget
that start-up checks (``--kv-cache-tokens``, or on a GPU ``--kv-cache-memory-fraction``
of its memory), and nothing more: concurrency is bounded by the blocks in use, and any
request up to the context is admissible.

Why not transformers' ``ContinuousBatchingManager``: it samples with one
generation config for the whole batch (no per-request seed, top_k/top_p,
repetition penalty or min_new_tokens) and reports no log-probabilities.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from .. import handoff
from ..adapters import Adapter
from ..domain import EngineObserver, EngineStats, ErrorKind, GenerationRequest, NotSupported, UnknownAdapter
from ..model import LoadedModel, attention_shape, kv_budget_for_device
from . import lora
from .base import Engine, EngineLimits
from .blocks import BLOCK_SIZE, BlockPool, blocks_for
from .graphs import DecodeGraphs
from .kv import PagedCache, layer_placements
from .memory import PROBE_BLOCKS, DeviceMemory, WorstStep, fit_columns, measure_worst_step
from .native import NativeForward, activation_dtype
from .options import EngineOptions, resolve
from .runner import Launched, ModelRunner
from .scheduler import Plan, Scheduler
from .threads import ThreadLayout, results_depend_on_threads

log = logging.getLogger(__name__)

# How many times more a FLOP of attention costs than a FLOP of the linear layers, for a
# prompt chunk read beside decoding rows, on a CPU (the measurement: docs/architecture.md,
# "Chunked prefill").
ATTENTION_FLOP_COST = 2.3


def prefill_span_columns(config: Any) -> float:
    """The column at which a prompt token's attention costs as much as its linear layers.

    While rows decode, a prompt token read at column ``c`` counts ``1 + c / span`` against
    ``--max-prefill-tokens``: its attention reads the ``c`` columns before it, so a chunk
    deep into a long prompt gets fewer tokens and a step costs about the same multiple of
    a decode step at any depth (default model: 1,336 columns; the default 20-token budget
    reads 20 tokens at column 0, 9 at 1,500).
    """
    hidden = int(config.hidden_size)
    heads, kv_heads, head_dim = attention_shape(config)
    intermediate = int(getattr(config, "intermediate_size", None) or 4 * hidden)
    linear = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * intermediate
    per_column = 4 * heads * head_dim  # q·k and p·v, per layer
    return 2 * linear / per_column / ATTENTION_FLOP_COST


def kv_blocks(kv_cache_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks in the pool for a budget of ``kv_cache_tokens``: enough to hold them (the server
    rounds its budget to whole blocks, so there it is exact), at least one."""
    return max(1, blocks_for(kv_cache_tokens, block_size))


class BatchedEngine(Engine):
    name = "batched"

    def __init__(
        self,
        loaded: LoadedModel,
        limits: EngineLimits,
        observer: EngineObserver | None = None,
        options: EngineOptions | None = None,
    ) -> None:
        super().__init__(loaded, limits, observer)
        resolved = resolve(options or EngineOptions(), loaded)
        options = resolved.options
        self.resolved = resolved
        # Deliver a step's tokens while the device runs the next (see _overlapped_step).
        self.overlap = resolved.overlap
        self._flight: Launched | None = None  # the step launched and not yet collected (overlap)
        self._collected_at: float | None = None  # when the last overlapped step's picks came back
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.steps = 0  # steps that decoded
        self.prefill_steps = 0  # steps that read prompt tokens
        self._in_step: Plan | None = None  # the plan being run (for _until_it_fits)
        config = loaded.model.config
        layers = int(config.num_hidden_layers)
        _, kv_heads, head_dim = attention_shape(config)
        placements = layer_placements(loaded.model, layers, loaded.device, loaded.model.dtype)
        if resolved.native:  # the native pass keeps K/V in the dtype it computes in (float32 on a CPU)
            placements = [(device, activation_dtype(dtype, device)) for device, dtype in placements]
        # A budget from the device's memory: the pool is sized last, after the worst step has run
        # on a probe pool of a few blocks (``memory``; ``_size_kv``).
        memory = limits.kv_memory if limits.kv_cache_tokens <= 0 else None
        blocks = PROBE_BLOCKS if memory is not None else kv_blocks(limits.kv_cache_tokens)
        self._cache = PagedCache(blocks, BLOCK_SIZE, kv_heads, head_dim, placements)
        context_blocks = blocks_for(loaded.context_length)
        native: NativeForward | None = None
        if resolved.native:
            native = NativeForward(
                loaded.model, self._cache, limits.max_active, release_weights=options.own_weights,
                kernel_choice=options.kernels, pack_weights=resolved.pack_weights, attention_choice=options.attention,
            )  # fmt: skip
        graphs: DecodeGraphs | None = None
        if resolved.step_graphs != "off":
            assert native is not None
            graphs = DecodeGraphs(
                native.decode_step,
                loaded.device,
                BLOCK_SIZE,
                self._cache.scratch,
                limits.max_active,
                context_blocks if memory is not None else min(blocks, context_blocks),
                loaded.pad_token_id,
                capture=resolved.step_graphs == "cuda",
                compile_step=options.compile_step,
            )
        self.runner = ModelRunner(loaded, self._cache, native, graphs)
        self.worst_step: WorstStep | None = None
        if memory is not None:
            self.limits = dataclasses.replace(limits, kv_cache_tokens=self._size_kv(memory))
            if graphs is not None:
                graphs.resize(self._cache.scratch, min(self._cache.num_blocks, context_blocks))
        self.pool = BlockPool(
            self._cache.num_blocks,
            BLOCK_SIZE,
            prefix_cache=options.prefix_cache,
            fresh_limit=None if resolved.resident_kv_tokens is None else blocks_for(resolved.resident_kv_tokens),
        )
        self.scheduler = Scheduler(
            self.queue,
            self.pool,
            limits.max_active,
            limits.max_prefill_tokens,
            prefill_span_columns(config),
            limits.batch_window_s,
            on_admit=self._admit,
            on_preempt=self._preempted,
            on_park=self._parked,
            behind=self.queue.behind,
        )
        # LoRA adapters by name, as the native pass applies them (replaced whole on a change:
        # the loop and submit read it without a lock).
        self._adapters: dict[str, lora.PackedAdapter] = {}
        threads, why_threads = resolved.threads, resolved.why_threads
        if len(threads) > 1 and native is not None and not native.compiled:
            # Stock torch ops may split one row's sums (a norm's mean) over the threads.
            threads, why_threads = threads[:1], f"pinned at {threads[0]}: the pass runs stock torch ops"
        if len(threads) > 1 and native is not None:
            first = native.layers[0]
            varies = results_depend_on_threads(
                [first.qkv, first.out, first.gate_up, first.down, native.lm_head], threads
            )
            if varies is not None:
                threads, why_threads = threads[:1], f"pinned at {threads[0]}: {varies}"
        self.layout = ThreadLayout(threads, torch.set_num_threads, on_change=self._threads_changed)
        self._graph_context = options.step_graphs_context
        self.step_graphs = resolved.step_graphs
        self.forward = resolved.forward
        # What the native pass runs around its GEMMs (None: transformers' forward).
        self.kernels = None if native is None else "compiled" if native.compiled else "torch"
        log.info(
            "batched engine forward pass",
            extra={
                **resolved.log_fields(),
                "onednn_packed": native is not None and native.gemm == "onednn",
                "gemm": native.gemm if native is not None else None,
                "fused_layers": native.fused_layers if native is not None else False,
                "kernels": self.kernels,
                "attention": native.decode_attention.name if native is not None else None,
                "why_not_compiled": native.ops_reason if native is not None else None,
                "compiled_ops_on_torch": native.ops_fallbacks if native is not None else None,
                "compiled_step": options.compile_step and graphs is not None,
                "kv_blocks": self.pool.num_blocks,
                "kv_block_tokens": BLOCK_SIZE,
                "kv_cache_bytes": self._cache.nbytes(),
                "threads": list(threads),
                "why_threads": why_threads,
            },
        )

    def _size_kv(self, memory: DeviceMemory) -> int:
        """The KV pool from the device's memory (``memory``'s docstring): the worst step measured on
        the probe pool at the widest row the pool can hold (``fit_columns``; that width becomes
        ``context_limit``), the probe pool given back, then what ``memory.fraction`` of the device
        leaves, in whole blocks, one of them for the scratch block, and no more than ``max_active``
        rows of that context. Returns the budget in tokens."""
        limits, loaded = self.limits, self.loaded
        per_token = self._cache.bytes_per_token
        probe = self._cache.nbytes()

        def measure(columns: int) -> WorstStep:
            return measure_worst_step(
                self.runner, self.runner.graphs, limits.max_active, limits.max_prefill_tokens,
                columns, loaded.pad_token_id,
            )  # fmt: skip

        if loaded.device.type == "cuda":  # what building the engine freed (the fused weights' transient)
            torch.cuda.empty_cache()
        total, free = memory.read()
        in_use = total - free - probe  # the weights, the engine, the CUDA context; not the probe pool
        worst = fit_columns(measure, int(total * memory.fraction) - in_use, per_token, loaded.context_length)
        self.worst_step, self.context_limit = worst, worst.columns
        room = kv_budget_for_device(total, in_use + worst.total, memory.fraction, per_token)
        fits = max(1, room // BLOCK_SIZE - 1)  # the scratch block comes out of the room too
        # No more than admission could ever hold: --max-active rows of the context served. A small
        # model on a large card would otherwise take tens of millions of blocks it cannot fill;
        # what is left of the card stays free (raise --max-active to use it).
        usable = limits.max_active * blocks_for(worst.columns)
        blocks = min(fits, usable)
        self._cache.reallocate(blocks)  # the probe pool given back first
        if self.runner.native is not None:
            self.runner.native.cache_reallocated()
        log.info(
            "kv cache sized from device memory",
            extra={
                "total_bytes": total,
                "in_use_bytes": in_use,
                "worst_step_bytes": worst.total,
                "worst_eager_step_bytes": worst.eager,
                "worst_decode_step_bytes": worst.decode,
                "graph_pool_bytes": worst.graphs,
                "worst_step_rows": worst.rows,
                "worst_step_chunk_tokens": worst.chunk,
                "context_limit": worst.columns,
                "fraction": memory.fraction,
                "kv_cache_tokens": blocks * BLOCK_SIZE,
                "room_tokens": fits * BLOCK_SIZE,
                "capped_at_admission": blocks < fits,
            },
        )
        if worst.columns < loaded.context_length:
            log.warning(
                f"context narrowed from {loaded.context_length} to {worst.columns} tokens: a pool that held a row of "
                f"the whole context could not sit beside the step {limits.max_active} such rows would take (stock "
                "attention gathers every row to the widest); lower --max-active or --max-prefill-tokens for a longer "
                "context, or set --kv-cache-tokens",
                extra={"context_length": loaded.context_length, "context_limit": worst.columns},
            )
        return blocks * BLOCK_SIZE

    # -- LoRA adapters ---------------------------------------------------------------

    def add_adapter(self, adapter: Adapter) -> None:
        """Apply ``adapter`` to the requests that name it from now on (``adapters.read_adapter``
        checked it against this model)."""
        native = self.runner.native
        if native is None:
            raise NotSupported(f"LoRA adapters run in the native pass; this engine runs {self.forward}'s forward")
        packed = lora.pack(adapter, native, self.limits.max_active)
        self._adapters = {**self._adapters, adapter.name: packed}

    def remove_adapter(self, name: str) -> int:
        """New requests may no longer name ``name`` (UnknownAdapter); those admitted already keep
        it (their ``Generation`` holds it) and finish with it, and it is freed after the last.
        Its prefix-cache blocks are keyed under its own root: no later request finds them, and
        they go as the cache reuses blocks. Returns the streams running with it now."""
        if name not in self._adapters:
            raise UnknownAdapter(name, sorted(self._adapters))
        self._adapters = {key: value for key, value in self._adapters.items() if key != name}
        return sum(1 for request, _ in self.scheduler.running() if request.adapter == name)

    def adapter_of(self, request: GenerationRequest) -> lora.PackedAdapter | None:
        if not request.adapter:
            return None
        adapter = self._adapters.get(request.adapter)
        if adapter is None:
            raise UnknownAdapter(request.adapter, sorted(self._adapters))
        return adapter

    @property
    def applies_adapters(self) -> bool:
        return self.runner.native is not None  # the native pass applies them

    def adapters(self) -> list[lora.PackedAdapter]:
        return [self._adapters[name] for name in sorted(self._adapters)]

    def _threads_changed(self, before: int, after: int, figures: dict[str, Any]) -> None:
        log.info("cpu step threads", extra={"threads_before": before, "threads": after, **figures})

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        graphs = self.runner.graphs
        if graphs is not None and graphs.capture:
            # Every CUDA graph a context up to --step-graphs-context needs, before serving:
            # a capture synchronises the device and empties the allocator's cache, which
            # mid-run would stall every stream (and land inside a benchmark's measure).
            graphs.prepare(min(self._graph_context, self.loaded.context_length))
        self._thread = threading.Thread(target=self._run, name="tokenwire-batched", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        self.queue.close()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._fail_waiting()
        if self._thread is None or not self._thread.is_alive():  # no step can touch the pool any more
            self._release_memory()

    def _release_memory(self) -> None:
        """The KV pool and the decode graphs back to the device. The server's ``gc.freeze``
        keeps the engine's reference cycles alive after it stops, so a server started after
        it in the same process (the GPU tests' in-process servers) would find the card full."""
        if self.runner.graphs is not None:
            self.runner.graphs.release()
        self._cache.release()
        if self.loaded.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def _rows(self) -> list[Any]:
        return self.scheduler.rows

    def stats(self) -> EngineStats:
        return EngineStats(
            self.queue.active,
            self.queue.queued,
            len(self._rows),
            self.kv_tokens_reserved(),
            self.limits.kv_cache_tokens,
            tuple(self.queue.by_tenant()),
            self.queue.parked,
        )

    def running(self) -> list[tuple[GenerationRequest, int]]:
        return self.scheduler.running()

    def kv_tokens_reserved(self) -> int:
        """Tokens' worth of KV blocks held or promised by admitted requests."""
        return self.pool.tokens_committed()

    # -- the loop ------------------------------------------------------------------

    def _run(self) -> None:
        scheduler = self.scheduler
        while not self._stop.is_set() and self.fault is None:
            try:
                scheduler.retire(expire=True)
                # NOTE: with a step in flight and no row left (a stop sequence ended the last one
                # after its next step was launched) admission must not block: the loop collects
                # that step first, or it would stay in flight until the next request came.
                scheduler.admit(wait=self._flight is None)
                if not scheduler.rows and self._flight is None:
                    self._collected_at = None
                    continue
                if self.overlap:
                    self._overlapped_step()
                else:
                    self._until_it_fits(self._step)
                self._step_worked()
            except Exception as exc:  # a failed step fails its batch, never the loop (engine.faults)
                # Nothing of the step in flight was taken: the rows that stay plan it again.
                self._flight, self._collected_at = None, None
                with handoff.gathered():
                    ended = {id(seq) for seq in self._step_failed([row.seq for row in scheduler.rows], exc)}
                scheduler.leave([row for row in scheduler.rows if id(row.seq) in ended])
        torch.set_num_threads(self.layout.choices[0])  # the process's count as it was given
        if self.fault is not None:
            for row in scheduler.rows:
                row.seq.fail(ErrorKind.INTERNAL, self._fault_message())
        for row in scheduler.rows:
            row.seq.fail(ErrorKind.SHUTDOWN, "the server stopped before this request finished")
        scheduler.leave(list(scheduler.rows))

    def _step(self) -> None:
        """schedule → run → postprocess; the step's time (and, for a decode step, the host's own
        part of it) reported to the metrics."""
        started = time.perf_counter()
        plan = self.scheduler.schedule()
        if plan is None:
            return
        self._in_step = plan
        rows = plan.decodes if plan.decodes and not plan.prompt_tokens else None  # decode-only steps are compared
        threads = self.layout.pick(rows)
        computing = time.perf_counter()
        result = self.runner.run(plan)
        # with the columns its rows attended over: a step's time grows with its rows' contexts
        columns = (
            sum(part.start + part.count for part in plan.parts) if rows is not None and self.layout.adaptive else None
        )
        self.layout.record(rows, threads, time.perf_counter() - computing, columns)
        # Nothing is committed before here: a step that ran out of memory runs again as it was.
        self._count(plan, time.perf_counter() - started)
        with handoff.gathered():  # every row's events reach the event loop in one hand-off
            self.scheduler.postprocess(plan, result.picks, result.scores)
        if plan.decodes and not plan.prompt_tokens:
            # The host's own time in the step, delivery included: on a GPU, what the device waits through.
            self.observer.step_host(max(0.0, time.perf_counter() - started - result.compute_s))

    def _count(self, plan: Plan, elapsed: float) -> None:
        """Count a step that ran and report its time to the metrics and the deadline estimator."""
        decodes = plan.decodes
        if plan.prompt_tokens:
            self.prefill_steps += 1
            # A step that also decoded counts all its tokens, so the prefill rate the
            # deadline estimator takes stays optimistic (a lower bound on the time).
            self.observer.prefill_step(elapsed, plan.prompt_tokens + decodes)
        elif decodes:
            self.observer.decode_step(elapsed)
        if decodes:
            self.steps += 1

    def _overlapped_step(self) -> None:
        """One step with the next one in flight (``--overlap``): collect step N's picks (the one
        host synchronisation), take them (the state step N+1's sampler reads; rows that ended by
        end of sequence or length leave), plan and launch step N+1, and only then deliver step
        N's text, which on CUDA runs while the device computes N+1. A row that a stop sequence
        ends in that delivery has already been launched into N+1: that pick is dropped (one
        wasted row-step, within its promised blocks). Same tokens as the plain loop: the sampler
        draws from (seed, step), and reads each row's state after its last token is taken."""
        scheduler = self.scheduler
        if self._flight is None:
            self._until_it_fits(self._launch)
            if self._flight is None:
                return
        launched, self._flight = self._flight, None
        result = self.runner.collect(launched)
        collected = time.perf_counter()
        plan = result.plan
        self._count(plan, collected - launched.started)
        # The rows that end on their token deliver as they take it: their events go before the launch.
        with handoff.gathered():
            waiting = scheduler.take(plan, result.picks, result.scores)
        scheduler.retire(expire=False)
        try:
            self._until_it_fits(self._launch)
        finally:  # step N's text goes out even when step N+1 fails to launch
            with handoff.gathered():  # every row's events reach the event loop in one hand-off
                scheduler.deliver(waiting)
        scheduler.retire(expire=False)
        if plan.decodes and not plan.prompt_tokens and self._collected_at is not None:
            # The host's own time in a step period (collect to collect), less its compute or wait.
            self.observer.step_host(max(0.0, collected - self._collected_at - result.compute_s))
        self._collected_at = collected

    def _launch(self) -> None:
        """Plan the next step and launch it (``_flight``); nothing to run leaves it None."""
        plan = self.scheduler.schedule()
        if plan is None:
            return
        self._in_step = plan
        self.layout.pick(None)
        self._flight = self.runner.launch(plan)

    def _until_it_fits(self, step: Callable[[], None]) -> None:
        """Run ``step``; when it runs out of device memory, the newest row in it gives way
        (``Engine._out_of_memory``, the one policy) and the step is planned and run again
        without it, until it fits."""
        while True:
            self._in_step = None
            try:
                step()
                return
            except torch.OutOfMemoryError:
                if self._in_step is None:
                    raise
                in_step = {id(row) for row in self._in_step.rows}
                rows = [row for row in self._rows if id(row) in in_step]  # admission order
                ended = {id(seq) for seq in self._out_of_memory([row.seq for row in rows])}
                self.scheduler.leave([row for row in rows if id(row.seq) in ended])
                if not self._rows:
                    return
