"""The `batched` engine: continuous batching in one loop that owns the model.

Every step advances all active sequences with one forward pass. Between steps,
finished, cancelled and expired sequences leave the batch (their KV-cache rows
are dropped at once) and waiting requests join: they are prefilled together and
their caches are merged into the batch's. Generations are left-padded to a common
length; the attention mask hides the padding and each row keeps its own
position ids, so a row computes what it would alone.

Why not transformers' ``ContinuousBatchingManager``: it samples with one
generation config for the whole batch (no per-request seed, top_k/top_p,
repetition penalty or min_new_tokens), reports no log-probabilities, and sizes
its paged cache from free memory. Here every request keeps its own parameters
(the shared ``Sampler``) and the KV budget is an admission limit
(``--kv-cache-tokens``): a request waits until its worst case fits.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ..domain import EngineObserver, EngineStats, ErrorKind, FinishReason, GenerationRequest
from ..model import LoadedModel
from .base import Engine, EngineLimits
from .generation import Generation
from .sampling import Sampler

log = logging.getLogger(__name__)


def cache_argument(model: object) -> str:
    """transformers 5.x renamed ``past_key_values`` to ``cache``; use what this version takes."""
    params = inspect.signature(model.forward).parameters  # type: ignore[attr-defined]
    return "cache" if "cache" in params else "past_key_values"


class BatchCache:
    """The batch's KV cache: one row per active sequence, left-padded to a common length."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=device)  # [batch, length]

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        assert self.cache is not None
        return [(layer.keys, layer.values) for layer in self.cache.layers]

    def append(self, cache: DynamicCache, mask: torch.Tensor) -> None:
        """Add the rows of a freshly prefilled group."""
        new_layers = [(layer.keys, layer.values) for layer in cache.layers]
        if self.cache is None or self.rows == 0:
            self.cache = DynamicCache(ddp_cache_data=new_layers)
            self.mask = mask
            return
        length = max(self.length, int(mask.shape[1]))

        def pad(t: torch.Tensor, to: int) -> torch.Tensor:
            extra = to - t.shape[-2]
            return F.pad(t, (0, 0, extra, 0)) if extra else t

        merged = [
            (torch.cat([pad(k, length), pad(nk, length)]), torch.cat([pad(v, length), pad(nv, length)]))
            for (k, v), (nk, nv) in zip(self.layers(), new_layers, strict=True)
        ]
        self.cache = DynamicCache(ddp_cache_data=merged)
        self.mask = torch.cat(
            [F.pad(self.mask, (length - self.length, 0)), F.pad(mask, (length - int(mask.shape[1]), 0))]
        )

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows (in this order), then drop columns that are padding everywhere."""
        if not rows:
            self.cache = None
            self.mask = torch.zeros((0, 0), dtype=torch.long, device=self._device)
            return
        index = torch.tensor(rows, dtype=torch.long, device=self._device)
        mask = self.mask.index_select(0, index)
        used = mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else mask.shape[1]
        layers = [
            (k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:]) for k, v in self.layers()
        ]
        self.cache = DynamicCache(ddp_cache_data=layers)
        self.mask = mask[:, start:]

    def grow(self) -> torch.Tensor:
        """Extend the mask by the column the next decode step writes; return the step's mask."""
        self.mask = F.pad(self.mask, (0, 1), value=1)
        return self.mask


class BatchedEngine(Engine):
    name = "batched"

    def __init__(self, loaded: LoadedModel, limits: EngineLimits, observer: EngineObserver | None = None) -> None:
        super().__init__(loaded, limits, observer)
        self._sampler = Sampler(loaded.eos_token_ids)
        self._seqs: list[Generation] = []
        self._kv = BatchCache(loaded.device)
        self._next = torch.zeros((0, 1), dtype=torch.long, device=loaded.device)  # last token per row
        self._positions = torch.zeros((0,), dtype=torch.long, device=loaded.device)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.steps = 0
        self._last_busy_rows = 0  # most rows in the batch since it was last empty
        self._cache_arg = cache_argument(loaded.model)

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
            self.queue.active, self.queue.queued, len(self._seqs), self.kv_tokens_reserved(), self.limits.kv_cache_tokens
        )

    def running(self) -> list[tuple[GenerationRequest, int]]:
        return [(seq.request, len(seq.generated)) for seq in list(self._seqs)]

    def kv_tokens_reserved(self) -> int:
        return sum(seq.budget_tokens for seq in self._seqs)

    # -- the loop ------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._join()
                self._retire(expire=True)
                if self._seqs:
                    self._decode()
            except Exception as exc:  # a failed step fails its batch, never the loop
                self._fail_batch(exc)
            self._mark_progress()
        for seq in self._seqs:
            seq.fail(ErrorKind.SHUTDOWN, "the server stopped before this request finished")
        self._release(list(range(len(self._seqs))))

    def _join(self) -> None:
        reserved = self.kv_tokens_reserved()
        budget = self.limits.kv_cache_tokens
        room = self.limits.max_active - len(self._seqs)
        if room <= 0:
            return
        # While others decode, a join costs them a stall as long as its prefill: read at
        # most max_prefill_tokens of prompt per step (always at least one request).
        prefill_limit = self.limits.max_prefill_tokens if self._seqs else None
        prefill = 0
        taken = 0

        def fits(seq: Generation) -> bool:
            nonlocal reserved, prefill, taken
            if taken or self._seqs:
                if reserved + seq.budget_tokens > budget:
                    return False
                if taken and prefill_limit is not None and prefill + seq.prompt_len > prefill_limit:
                    return False
            reserved += seq.budget_tokens
            prefill += seq.prompt_len
            taken += 1
            return True

        group = self.queue.take(fits, block=not self._seqs, max_count=room)
        if not group:
            return
        if not self._seqs and (self._last_busy_rows > 1 or len(group) > 1):
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
        started = time.perf_counter()
        try:
            self._prefill(group)
            self.observer.prefill_step(time.perf_counter() - started, sum(seq.prompt_len for seq in group))
        except torch.cuda.OutOfMemoryError:
            self._free_device_memory()
            for seq in group:
                seq.fail(ErrorKind.OUT_OF_MEMORY, "the device ran out of memory while reading the prompt")
            self.queue.release(len(group))
        except Exception as exc:
            log.exception("prefill failed")
            for seq in group:
                seq.fail(ErrorKind.INTERNAL, f"generation failed: {type(exc).__name__}: {exc}")
            self.queue.release(len(group))

    @torch.inference_mode()
    def _prefill(self, group: list[Generation]) -> None:
        device = self.loaded.device
        length = max(seq.prompt_len for seq in group)
        pad = self.loaded.pad_token_id
        ids = torch.full((len(group), length), pad, dtype=torch.long)
        mask = torch.zeros((len(group), length), dtype=torch.long)
        for row, seq in enumerate(group):
            ids[row, length - seq.prompt_len :] = torch.tensor(seq.request.prompt_ids)
            mask[row, length - seq.prompt_len :] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.loaded.model.config)
        out = self.loaded.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            **{self._cache_arg: cache},
            use_cache=True,
            logits_to_keep=1,
        )
        picks = self._sampler(out.logits[:, -1, :], group)
        keep: list[int] = []
        for row, (seq, (token, logprob, top)) in enumerate(zip(group, picks, strict=True)):
            if seq.handle.cancelled:
                seq.abandon()
            elif not seq.add_token(token, logprob, top):
                keep.append(row)
        finished = len(group) - len(keep)
        if finished:
            self.queue.release(finished)
        if not keep:
            return
        if len(keep) < len(group):  # rows that finished on their first token never join
            joining = BatchCache(device)
            joining.append(cache, mask)
            joining.keep(keep)
            assert joining.cache is not None
            cache, mask = joining.cache, joining.mask
        kept = [group[row] for row in keep]
        self._kv.append(cache, mask)
        if not self._seqs:
            self._last_busy_rows = 0
        self._seqs.extend(kept)
        self._last_busy_rows = max(self._last_busy_rows, len(self._seqs))
        self._next = torch.cat([self._next, torch.tensor([[seq.generated[-1]] for seq in kept], device=device)])
        self._positions = torch.cat(
            [self._positions, torch.tensor([seq.prompt_len for seq in kept], dtype=torch.long, device=device)]
        )

    @torch.inference_mode()
    def _decode(self) -> None:
        started = time.perf_counter()
        mask = self._kv.grow()
        assert self._kv.cache is not None
        out = self.loaded.model(
            input_ids=self._next,
            attention_mask=mask,
            position_ids=self._positions.unsqueeze(1),
            **{self._cache_arg: self._kv.cache},
            use_cache=True,
        )
        self.steps += 1
        picks = self._sampler(out.logits[:, -1, :], self._seqs)
        self.observer.decode_step(time.perf_counter() - started)
        self._positions = self._positions + 1
        self._next = torch.tensor([[token] for token, _, _ in picks], device=self.loaded.device)
        for seq, (token, logprob, top) in zip(self._seqs, picks, strict=True):
            if not seq.finished and not seq.handle.cancelled:
                seq.add_token(token, logprob, top)
        self._retire(expire=False)

    def _retire(self, expire: bool) -> None:
        """Drop finished, cancelled and (between steps) expired sequences from the batch."""
        now = time.monotonic()
        keep: list[int] = []
        for row, seq in enumerate(self._seqs):
            if not seq.finished and seq.handle.cancelled:
                seq.abandon()
            elif not seq.finished and expire:
                expired = seq.expired(now)
                if expired is ErrorKind.DEADLINE:
                    seq.fail(ErrorKind.DEADLINE, "the call's deadline passed during generation")
                elif expired is FinishReason.TIME_LIMIT:
                    seq.finish(FinishReason.TIME_LIMIT)
            if not seq.finished:
                keep.append(row)
        if len(keep) == len(self._seqs):
            return
        gone = [row for row in range(len(self._seqs)) if row not in set(keep)]
        self._release(gone)
        self._seqs = [self._seqs[row] for row in keep]
        self._kv.keep(keep)
        index = torch.tensor(keep, dtype=torch.long, device=self.loaded.device)
        self._next = self._next.index_select(0, index)
        self._positions = self._positions.index_select(0, index)

    def _release(self, rows: list[int]) -> None:
        if rows:
            self.queue.release(len(rows))

    def _fail_batch(self, exc: Exception) -> None:
        oom = isinstance(exc, torch.cuda.OutOfMemoryError)
        if oom:
            self._free_device_memory()
            message, kind = "the device ran out of memory during generation", ErrorKind.OUT_OF_MEMORY
        else:
            log.exception("decode step failed")
            message, kind = f"generation failed: {type(exc).__name__}: {exc}", ErrorKind.INTERNAL
        for seq in self._seqs:
            seq.fail(kind, message)
        self._release(list(range(len(self._seqs))))
        self._seqs = []
        self._kv.keep([])
        self._next = self._next[:0]
        self._positions = self._positions[:0]

    def _free_device_memory(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
