"""The batched engine's model runner: a plan's inputs, the forward pass, the sampled tokens.

Two forward passes run a plan, both over the paged KV cache (``kv.PagedCache``):

- ``native`` (``native.NativeForward``; ``--forward auto`` takes it for Llama-shaped
  models on a CPU): the whole plan in one pass, decode rows and prompt chunks together,
  each as a segment of its block table.
- ``transformers`` (``--forward transformers``, or a model the native pass does not know,
  or a GPU under ``auto``): the model's own forward, which takes a rectangle, so a plan
  runs as several passes: one token per decoding row, then the prompt chunks in groups of
  like length (``chunk_groups``), each row's tokens at the rectangle's end (padding queries
  first, writing to the scratch block) so that only the last position's logits are kept,
  and a chunk whose row scores its prompt alone. Each layer's ``kv.BlockLayer`` writes the
  pass's keys and values into the rows' blocks and gathers their columns for attention,
  and a 4D mask hides, per row, every column past its own position.

A step of decode rows alone may instead go through ``graphs.DecodeGraphs`` (``--step-graphs``):
the native pass's fixed-shape ``decode_step``, padded to a batch bucket and replayed as a
CUDA graph on a GPU.

Rows are at different lengths: each has its own position ids and reads only its own
columns, so a row computes what it would alone. Tokens are picked for all the rows that
emit at once by the shared ``Sampler``.

A row that scores its prompt (``OutputOptions.prompt_logprobs``) has the logits of its prompt
chunks' positions computed too (``Part.scored``: the native pass's ``emit`` list grows by them;
transformers' forward keeps every position of that step's chunks) and scored at once
(``scoring.score``): only those rows and positions, a few numbers each back to the host.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from typing import Any

import torch

from ..model import LoadedModel
from ..transfer import to_device
from .blocks import blocks_for
from .graphs import DecodeGraphs
from .kv import PagedCache, places, table_tensor
from .lora import PackedAdapter, StepAdapters
from .native import NativeForward
from .ops import Segment
from .sampling import Drawn, Sampler
from .scheduler import Part, Plan
from .scoring import score, token_infos


def cache_argument(model: object) -> str:
    """transformers 5.x renamed ``past_key_values`` to ``cache``; use what this version takes."""
    params = inspect.signature(model.forward).parameters  # type: ignore[attr-defined]
    return "cache" if "cache" in params else "past_key_values"


@dataclasses.dataclass(frozen=True)
class Launched:
    """A step whose picks are on their way: its plan, the picks (None: no row emits) and the
    time its forward pass took to run (CPU) or to be queued (CUDA)."""

    plan: Plan
    drawn: Drawn | None
    forward_s: float
    started: float  # time.perf_counter() when the launch began
    # Per part index (a prompt chunk whose row scores its prompt): the prompt tokens its ``Part.scored``
    # positions score, and ``scoring.score``'s values for them, still on the device.
    scores: dict[int, tuple[list[int], torch.Tensor]] = dataclasses.field(default_factory=dict)


Pick = tuple[int, float | None, Any, Any]  # a row's token, its log-probability, its alternatives, its logprobs_of


@dataclasses.dataclass(frozen=True)
class StepResult:
    """A step's picks on the host (one per emitting row, in plan order) and how long the
    device computed it as seen from the host: on a CPU the forward pass the host ran itself;
    on CUDA the wait in the sampler's one device -> host copy. The engine takes it from the
    step's wall time to count the host's own part."""

    plan: Plan
    picks: list[Pick]
    compute_s: float
    scores: dict[int, list[Any]] = dataclasses.field(default_factory=dict)  # per part: its TokenInfos


class ModelRunner:
    """Runs plans over one model and its cache; ``native`` is None for transformers' forward;
    ``graphs`` (native pass only) runs the steps of one-token rows in fixed-shape buckets."""

    def __init__(
        self, loaded: LoadedModel, cache: PagedCache, native: NativeForward | None, graphs: DecodeGraphs | None = None
    ) -> None:
        self.loaded = loaded
        self.cache = cache
        self.native = native
        self.graphs = graphs
        # The sampler's passes over the rows take the compiled CPU ops where the native pass does.
        self.sampler = Sampler(loaded.eos_token_ids, getattr(native.ops, "library", None) if native else None)
        # transformers' forward only (a checkpoint read for the native pass has none).
        self._cache_arg = cache_argument(loaded.model) if native is None else ""
        self._mask_dtype = loaded.model.dtype if loaded.model.dtype.is_floating_point else torch.float32
        # On a CPU the host computes the forward pass itself; on CUDA the host only launches
        # it and waits in the sampler's one device -> host copy (StepResult.compute_s).
        self._waits_on_device = loaded.device.type == "cuda"

    def run(self, plan: Plan) -> StepResult:
        """Run the plan's forward pass(es) and pick a token for each row that emits, in plan order."""
        return self.collect(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: Plan) -> Launched:
        """The plan's forward pass(es) and its picks as device work, not yet read: on CUDA this
        returns once the work is queued; on a CPU it has been computed."""
        started = time.perf_counter()
        scoring: dict[int, torch.Tensor] = {}
        logits = self._graphed(plan)
        if logits is None:
            logits = self._native(plan, scoring) if self.native is not None else self._transformers(plan, scoring)
        scores = {index: self._score(plan.parts[index], rows) for index, rows in scoring.items()}
        forward_s = time.perf_counter() - started
        emitters = plan.emitters
        drawn = self.sampler.launch(logits, [row.seq for row in emitters]) if emitters else None
        return Launched(plan, drawn, forward_s, started, scores)

    def collect(self, launched: Launched) -> StepResult:
        """The launched step's picks on the host (on CUDA: waits for the step to finish)."""
        picks = self.sampler.collect(launched.drawn) if launched.drawn is not None else []
        compute_s = self.sampler.wait_s if self._waits_on_device else launched.forward_s
        scores = {}
        for index, (targets, values) in launched.scores.items():
            seq = launched.plan.parts[index].row.seq
            request = seq.request
            scores[index] = token_infos(
                values, targets, request.prompt_top_logprobs, request.logprobs_of, seq.token_text
            )
        return StepResult(launched.plan, picks, compute_s, scores)

    @staticmethod
    def _score(part: Part, logits: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """The prompt tokens ``part``'s scored positions score (each the one after its position), and their scores."""
        request, context = part.row.seq.request, part.row.seq.context_ids
        targets = [context[p + 1] for p in part.scored]
        return targets, score(logits, targets, request.prompt_top_logprobs, request.logprobs_of)

    def _graphed(self, plan: Plan) -> torch.Tensor | None:
        """A step of decode rows alone through ``graphs`` (None: no graphs, a prompt chunk in the
        step, a row with a LoRA adapter, or more rows than the largest bucket)."""
        parts = plan.parts
        if self.graphs is None or not parts or not all(part.decodes for part in parts):
            return None
        if any(part.row.seq.adapter is not None for part in parts):  # the fixed-shape step applies none
            return None
        return self.graphs.run(
            [part.row.last for part in parts], [part.start for part in parts], [part.row.table for part in parts]
        )

    def _native(self, plan: Plan, scoring: dict[int, torch.Tensor]) -> torch.Tensor:
        """The emitting rows' logits; the scored positions' go into ``scoring`` (per part index)."""
        assert self.native is not None
        ids: list[int] = []
        positions: list[int] = []
        segments: list[Segment] = []
        emit: list[int] = []
        scored: list[tuple[int, int, int]] = []  # (part index, first token index, count)
        extra: list[int] = []
        adapters: list[PackedAdapter | None] = []
        for index, part in enumerate(plan.parts):
            segments.append(Segment(tuple(part.row.table), part.start, part.count))
            base = len(ids)
            ids.extend(part.ids)
            adapters.extend([part.row.seq.adapter] * part.count)
            positions.extend(range(part.start, part.start + part.count))
            if part.emits:
                emit.append(len(ids) - 1)
            if part.scored:
                scored.append((index, len(extra), len(part.scored)))
                extra.extend(base + p - part.start for p in part.scored)
        step = (torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), segments, emit + extra)
        lora = StepAdapters.of(adapters, self.loaded.device)
        logits = self.native(*step) if lora is None else self.native(*step, lora=lora)
        if not extra:
            return logits
        rows = len(emit)
        for index, first, count in scored:
            scoring[index] = logits[rows + first : rows + first + count]
        return logits[:rows]

    # -- transformers' forward: prompt chunks, then decode rows ------------------------

    def _transformers(self, plan: Plan, scoring: dict[int, torch.Tensor]) -> torch.Tensor:
        """The emitting rows' logits, in plan order; the scored positions' go into ``scoring`` (per
        part index). Decode rows go in one pass; prompt chunks in passes of rows of like length
        (``chunk_groups``: a rectangle pads every row to its longest); a chunk whose row scores its
        prompt alone, keeping every position's logits (a row of the vocabulary each)."""
        decodes = [part for part in plan.parts if part.decodes]
        chunks = [part for part in plan.parts if not part.decodes]
        out: list[torch.Tensor] = []
        if decodes:
            out.append(self._pass(decodes))
        last: dict[int, torch.Tensor] = {}  # id(part) -> its last token's logits, for the chunks that emit
        for group in chunk_groups([part for part in chunks if not part.scored]):
            for part, logits in zip(group, self._pass(group), strict=True):
                last[id(part)] = logits
        at = {id(part): index for index, part in enumerate(plan.parts)}
        for part in chunks:
            if part.scored:
                every = self._pass([part], every=True)[0]
                scoring[at[id(part)]] = every[part.scored.start - part.start : part.scored.stop - part.start]
                last[id(part)] = every[-1]
        emitted = [last[id(part)] for part in chunks if part.emits]
        if emitted:
            out.append(torch.stack(emitted))
        if not out:
            return torch.empty((0, 0))
        return out[0] if len(out) == 1 else torch.cat(out)

    def _pass(self, parts: list[Part], every: bool = False) -> torch.Tensor:
        """One rectangular pass over ``parts``: ``[rows, vocab]``, each row's logits at its last
        token; with ``every``, ``[rows, width, vocab]``, every position's. Each row's tokens end
        the rectangle (its padding queries come first, attend like its first token and write to
        the scratch block), so its last token is the rectangle's last position, which
        ``logits_to_keep=1`` keeps alone on any transformers version."""
        rows = len(parts)
        width = max(part.count for part in parts)
        block_size, scratch = self.cache.block_size, self.cache.scratch
        ids = torch.full((rows, width), self.loaded.pad_token_id, dtype=torch.long)
        positions = torch.zeros((rows, width), dtype=torch.long)
        write_blocks = torch.full((rows, width), scratch, dtype=torch.long)
        write_offsets = torch.zeros((rows, width), dtype=torch.long)
        for b, part in enumerate(parts):
            pad = width - part.count
            ids[b, pad:] = torch.tensor(part.ids, dtype=torch.long)
            positions[b, pad:] = torch.arange(part.start, part.start + part.count)
            positions[b, :pad] = part.start  # padding queries: attend like the first real one
            blocks, offsets = places([part.row.table], [part.start], [part.count], block_size)
            write_blocks[b, pad:], write_offsets[b, pad:] = blocks, offsets
        columns = max(part.start + part.count for part in parts)
        lengths = torch.tensor([part.start + part.count for part in parts], dtype=torch.long)
        tables = table_tensor([part.row.table for part in parts], scratch, blocks_for(columns, block_size))
        self.cache.plan.set(tables, write_blocks, write_offsets, lengths, columns)
        device = self.loaded.device
        device_positions = to_device(positions, device)
        output = self.loaded.model(
            input_ids=to_device(ids, device),
            attention_mask=self._mask(device_positions, columns),
            position_ids=device_positions,
            **{self._cache_arg: self.cache},
            use_cache=True,
            logits_to_keep=0 if every else 1,
        )
        logits: torch.Tensor = output.logits
        return logits if every else logits[:, -1, :]

    def _mask(self, positions: torch.Tensor, columns: int) -> torch.Tensor:
        """The additive 4D mask ``[rows, 1, queries, columns]``: query at position p sees columns
        0..p. Made where ``positions`` are (the device): only the positions cross, not the mask
        (a 2,048-token chunk at column 131,072 has a 512 MiB one)."""
        device = positions.device
        allowed = torch.arange(columns, device=device).view(1, 1, columns) <= positions.unsqueeze(-1)
        blocked = torch.finfo(self._mask_dtype).min
        mask = torch.zeros(allowed.shape, dtype=self._mask_dtype, device=device).masked_fill_(~allowed, blocked)
        return mask.unsqueeze(1)


def chunk_groups(parts: list[Part]) -> list[list[Part]]:
    """Prompt chunks in groups that share one rectangular pass of transformers' forward: longest
    first, a row joining while the rectangle (rows x the group's longest) stays within twice the
    tokens it holds, so padding never more than doubles a pass (a long chunk beside fifteen
    one-token ones would otherwise pad them all to its length)."""
    groups: list[list[Part]] = []
    tokens = 0
    for part in sorted(parts, key=lambda p: -p.count):
        if groups and (len(groups[-1]) + 1) * groups[-1][0].count <= 2 * (tokens + part.count):
            groups[-1].append(part)
            tokens += part.count
        else:
            groups.append([part])
            tokens = part.count
    return groups
