"""Memory that matches its check: the batched engine's worst step, measured on its device before
the KV pool takes what is left (vLLM's profile run).

On a GPU with a derived budget (``--kv-cache-tokens 0``) the pool is sized last, once the
engine has built everything else and run its worst step on a probe pool of a few blocks:

- the weights as the native pass holds them (the fused q/k/v and gate/up replace the model's
  layer by layer: that transient is over before anything is counted);
- the heaviest eager steps the scheduler can plan (``probe_plans``): an idle engine's prompt
  budget (``IDLE_PREFILL_TOKENS``, or ``--max-prefill-tokens`` if more) at the far end of the
  context, in one chunk and spread over ``--max-active`` rows, and ``--max-active`` - 1 rows
  decoding at the last column beside a chunk of ``--max-prefill-tokens``, every row's table as
  wide as the context (stock attention gathers each row's blocks to the widest row's width).
  Chunks score their prompt (a row of logits per token) and every row samples with everything
  that costs memory: top_p (a sort of the whole vocabulary per row), min_p, penalties and the
  most log-probabilities a request may ask for;
- the largest decode bucket at the widest table, through the fixed-shape step; with CUDA
  graphs, the memory the capture keeps in the graphs' pool (counted beside the eager peak:
  the pool is held while eager steps run).

``kv_budget_for_device`` then gives KV what ``--kv-cache-memory-fraction`` of the device leaves:
``fraction x total - (in use after the probe + worst step)``.

The worst step grows with the widest row it may hold: stock attention gathers every row's
blocks to the widest row's width, so 16 rows beside one of 131,072 tokens gather 16 x 131,072
columns per layer (an 8B shape: ~8 GiB for a moment). A pool too small for a row of the whole
context cannot hold such a row anyway: ``fit_columns`` then narrows the widest row to what the
pool left beside its own worst step holds, and the server publishes that as the context.

Measured with torch's allocator statistics on CUDA, and elsewhere (the ``meta`` device: the CPU
proof in tests/test_memory.py) by ``LiveBytes``, which counts the storages the step creates
while they live. Not counted: a constrained row's grammar mask (a bit per token per row), and
LoRA adapters' deltas (their weights are counted once loaded).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from ..domain import MAX_TOP_LOGPROBS, GenerationRequest, SamplingOptions
from ..model import ModelLoadError
from .blocks import BLOCK_SIZE, Lease, blocks_for
from .graphs import width_for
from .scheduler import IDLE_PREFILL_TOKENS, Part, Plan, Row

if TYPE_CHECKING:
    from .graphs import DecodeGraphs
    from .runner import ModelRunner

log = logging.getLogger(__name__)

# The probe pool: blocks every probe row's table cycles over (the step's shapes follow the tables'
# widths, not how many distinct blocks they name), besides the scratch block.
PROBE_BLOCKS = 4
# What the probe's rows ask for: everything that costs the sampler and the scorer memory.
WORST_SAMPLING = SamplingOptions(
    temperature=0.8, top_p=0.95, repetition_penalty=1.1, min_p=0.05, frequency_penalty=0.5, logit_bias=((0, 1.0),)
)
NAMED_LOGPROBS = 20  # RequestLimits.max_logprobs_of


class LiveBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's class is untyped
    """Bytes of the storages created inside it, while they live (``now``) and at most (``peak``):
    a device's allocations counted where torch keeps no statistics (``meta``, the CPU). A storage
    made before it, a view of one, or an in-place op's output counts nothing."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.now = 0
        self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def _forget(self, size: int) -> Callable[[Any], None]:
        """The weak reference's callback: the storage of ``size`` bytes is gone."""

        def gone(_ref: Any) -> None:
            self.now -= size

        return gone

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # An output on an input's storage (an in-place op, a view) allocated nothing.
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if storage._cdata not in inputs and storage not in self._seen:
                    size = storage.nbytes()
                    self._seen[storage] = weakref.ref(storage, self._forget(size))
                    self.now += size
                    self.peak = max(self.peak, self.now)
        return out


@contextlib.contextmanager
def peak_bytes(device: torch.device) -> Iterator[list[int]]:
    """The most bytes allocated on ``device`` above what was allocated on entry, while inside:
    ``[peak]`` once the block ends. CUDA: torch's allocator statistics; elsewhere ``LiveBytes``."""
    out = [0]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield out
        torch.cuda.synchronize(device)
        out[0] = torch.cuda.max_memory_allocated(device) - base
        return
    with LiveBytes() as live:
        yield out
    out[0] = live.peak


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """A device's memory as the KV budget reads it: ``read() -> (total, free)`` bytes for this
    process (``model.device_memory`` on CUDA; a simulated card in the tests), and the share of
    ``total`` the process may bring its use to (``--kv-cache-memory-fraction``)."""

    read: Callable[[], tuple[int, int]]
    fraction: float


@dataclasses.dataclass(frozen=True)
class WorstStep:
    """What the engine's worst step holds above its resting state, in bytes: ``eager``, the
    heaviest eager step (forward pass, scoring and sampling); ``graphs``, what the decode graphs'
    pool keeps (0 without CUDA graphs); ``decode``, the widest fixed-shape decode step's peak."""

    eager: int
    decode: int
    graphs: int
    rows: int
    chunk: int
    columns: int  # the widest row it was measured at

    @property
    def total(self) -> int:
        return max(self.eager, self.decode) + self.graphs


@dataclasses.dataclass
class ProbeSeq:
    """What a step reads of a request, for a probe row: no tokenizer, no stream."""

    request: GenerationRequest
    context_ids: list[int]
    adapter: Any = None
    constraint: Any = None
    seed: int = 0
    generated: list[int] = dataclasses.field(default_factory=list)
    eos_allowed: bool = False  # before min_new_tokens: EOS is blocked (one more indexed write)

    @property
    def context_len(self) -> int:
        return len(self.context_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def scores_prompt(self) -> bool:
        return self.request.prompt_logprobs

    def seen_ids(self) -> list[int]:
        return self.context_ids[-256:]

    def generated_counts(self) -> dict[int, int]:
        return dict.fromkeys(self.context_ids[-256:], 1)


def _row(context: int, pad_id: int, probe_blocks: int, name: str, scored: bool = True) -> Row:
    """A row at the far end of a ``context``-token context, its table cycling over the probe pool."""
    ids = [pad_id] * context
    request = GenerationRequest(
        name, ids, WORST_SAMPLING, 1, min_new_tokens=1, want_logprobs=True, top_logprobs=MAX_TOP_LOGPROBS,
        prompt_logprobs=scored, prompt_top_logprobs=MAX_TOP_LOGPROBS, logprobs_of=tuple(range(NAMED_LOGPROBS)),
    )  # fmt: skip
    table = [i % probe_blocks for i in range(blocks_for(context, BLOCK_SIZE))]
    return Row(ProbeSeq(request, ids), Lease(table, 0, 0), [])  # type: ignore[arg-type]


def probe_plans(
    max_rows: int, max_prefill: int, context: int, pad_id: int, probe_blocks: int = PROBE_BLOCKS
) -> list[Plan]:
    """The heaviest steps the scheduler can plan (the module's docstring), each chunk ending at the
    context's last column and each decoding row writing there:

    - an idle engine's prompt budget in one chunk that scores its prompt (a row of logits per token);
    - the same budget over ``max_rows`` chunks, one twice as long as the others: transformers'
      forward pads the chunks it reads together to their longest (``runner.chunk_groups``), here to
      nearly twice the budget;
    - ``max_rows`` - 1 decoding rows beside a scored chunk of ``max_prefill`` tokens."""

    def chunk(count: int, name: str, scored: bool = True) -> Part:
        return Part(_row(context, pad_id, probe_blocks, name, scored), context - count, count, False)

    idle = min(context, max(IDLE_PREFILL_TOKENS, max_prefill))
    plans = [Plan([chunk(idle, "probe-idle")], idle)]
    if max_rows > 1:
        half = max(1, idle // (max_rows + 1))  # one chunk of 2 x half, the others of half each
        counts = [idle - half * (max_rows - 1)] + [half] * (max_rows - 1)
        parts = [chunk(count, f"probe-rectangle-{i}", scored=False) for i, count in enumerate(counts)]
        plans.append(Plan(sorted(parts, key=lambda part: part.count > 1), idle))  # one-token parts first
        parts = []
        for index in range(max_rows - 1):
            row = _row(context, pad_id, probe_blocks, f"probe-decode-{index}")
            row.decoding, row.last = True, pad_id
            parts.append(Part(row, context - 1, 1, True))
        prefill = min(context, max_prefill)
        plans.append(Plan([*parts, chunk(prefill, "probe-chunk")], prefill))
    return plans


def measure_worst_step(
    runner: ModelRunner,
    graphs: DecodeGraphs | None,
    max_rows: int,
    max_prefill: int,
    context: int,
    pad_id: int,
) -> WorstStep:
    """Run the heaviest steps on the runner's (probe) pool and measure each (the module's
    docstring); nothing they write is read again."""
    device = runner.loaded.device
    plans = probe_plans(max_rows, max_prefill, context, pad_id)
    eager = 0
    for plan in plans:
        with peak_bytes(device) as peak:  # on CUDA it waits for the step's kernels
            launched = runner.launch(plan)
            del launched
        eager = max(eager, peak[0])
    decode = graph_bytes = 0
    if graphs is not None:
        rows, width = graphs.buckets[-1], width_for(blocks_for(context, BLOCK_SIZE), graphs.max_width)
        entry = graphs.buffers(rows, width)
        with peak_bytes(device) as peak, torch.inference_mode():
            graphs.step(*entry.views())
        decode = peak[0]
        if graphs.capture:  # pragma: no cover - needs a CUDA device (make test-gpu)
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_reserved(device)
            graphs.record(entry)
            torch.cuda.synchronize(device)
            graph_bytes = max(0, torch.cuda.memory_reserved(device) - before)
        del entry  # its graph and output: the pool goes with them
        graphs.release()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # the longest chunk: the idle engine's (the first plan), at least as long as --max-prefill-tokens' chunk
    return WorstStep(eager, decode, graph_bytes, max_rows, plans[0].prompt_tokens, context)


def fit_columns(measure: Callable[[int], WorstStep], room: int, per_token: int, context: int) -> WorstStep:
    """The worst step at the widest row the pool can hold beside it (the module's docstring):
    at ``context`` columns where the ``room`` (bytes for the worst step and KV together) left
    beside that step holds a row of the context; else at the widest ``columns`` whose step leaves
    ``columns`` tokens of KV. ``measure(columns)`` runs the worst step at that width. The step
    grows with the width, nearly in a line: a line through two widths aims at the fixed point,
    and a miss steps down to what the miss left (no wider than it: the step there is smaller). A
    width whose step runs out of device memory counts as one that leaves no room."""

    def tokens(step: WorstStep) -> int:
        return (room - step.total) // max(per_token, 1)

    def measured(columns: int) -> WorstStep:
        """``measure(columns)``; a step that ran out of device memory counts as taking all the room."""
        try:
            return measure(columns)
        except torch.OutOfMemoryError:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            return WorstStep(room, 0, 0, 0, 0, columns)

    widest = measured(context)
    if tokens(widest) >= context:
        return widest
    narrow_columns = max(BLOCK_SIZE, context // 8 // BLOCK_SIZE * BLOCK_SIZE)
    narrow = measured(narrow_columns) if narrow_columns < context else widest
    slope = (widest.total - narrow.total) / max(1, context - narrow_columns)
    guess = int((room - (narrow.total - slope * narrow_columns)) / (per_token + slope))
    for _ in range(3):
        columns = min(context, guess) // BLOCK_SIZE * BLOCK_SIZE
        if columns < BLOCK_SIZE:
            break
        step = measured(columns)
        if tokens(step) >= columns:
            return step
        guess = tokens(step)
    raise ModelLoadError(
        f"no room for a KV cache: beside the weights and the engine, {room / 2**30:.1f} GiB are left for the "
        f"KV cache and the worst step, which takes {narrow.total / 2**30:.1f} GiB at {narrow_columns} tokens of "
        f"context ({widest.total / 2**30:.1f} GiB at {context}); lower --max-active or --max-prefill-tokens, raise "
        "--kv-cache-memory-fraction, or use a smaller model or a larger device"
    )
