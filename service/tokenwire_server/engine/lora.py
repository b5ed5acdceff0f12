"""LoRA adapters in the native pass: each row's adapter, applied to its own tokens.

An adapter (``adapters.Adapter``) is packed once for the pass, per (layer, GEMM) ("site").
A step groups its tokens by adapter (``StepAdapters``); after each of a layer's GEMMs, each
token with an adapter gets ``s·(x·Aᵀ)·Bᵀ`` added to its own row of the output: the fused
q/k/v and gate/up outputs in each projection's columns, o and down on the residual sum they
write. A token without an adapter keeps the base model's bits, and an adapter token's delta
is computed from its own row alone, whatever shares the step: batch invariance holds as it
does for the base model. Two ways, picked when the adapter is packed:

- **Compiled** (``RowSite``, where the pass runs the compiled CPU ops in float32): one call
  per site, ``lora_add_`` (``kernels/cpu_ops.cpp``), for every token and adapter of the step
  at once: each token's low-rank vector from its adapter's A rows, then each output column's
  ``Σ_r h[r]·B[r][c]`` over its projection's rank rows alone, added in place. Rows of one
  adapter share each read of its weights; rows without one are not touched. The weights are
  held in bf16 where the base layers' are (a decode step reads every adapter weight of its
  rows once: half the bytes), else float32. Where the GEMM is the compiled panels (an
  AVX-512F CPU), the GEMM and the adapters' pass are one call, ``panel_linear_lora``
  (``linear``): the GEMM's threads run the adapters' pass too, each a share of the A rows
  before its panels and the B pass over its own columns after them, so one decode row's pass
  (~10^5 multiply-adds a site, too little to wake the threads for on its own) reads its
  weights, cold at every site, on every thread. Where the pass runs every layer
  in one compiled call (``NativeForward.fused_layers``), the step's lists ride in it
  (``layer_lists``) and each adapted GEMM there is that same call.
- **GEMMs** (``Site``, elsewhere: CUDA, bf16 activations, stock torch ops): per site and
  adapter, one A GEMM (the projections' A stacked: the fused q/k/v and gate/up read the same
  input) and one B GEMM (their B times the scaling, block by block in the projections'
  columns) whose add rides on it (oneDNN's post-op). Every token's A runs and the other
  tokens' low-rank rows are masked to zero, so a row outside the adapter gets ``+ 0.0``;
  oneDNN's packed GEMM gives a row the same bits at any row count, as the base layers rely on.
  Two calls per site and adapter (four adapters over every projection: ~1,000 small GEMMs a
  step), which is why the compiled way exists.

Each loaded adapter has a prefix-cache root of its own (``root``): its blocks' keys start from
it, so two adapters over the same prompt never share keys and values.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import itertools
import mmap
import typing
from typing import Any

import torch

from ..adapters import Adapter
from .native import Gemm, Linear, NativeForward, panel_weights
from .ops import CompiledOps

_SERIALS = itertools.count(1)


# The GEMM ("site") each projection's output comes from in the pass; the columns it writes
# there come from ``NativeForward.columns``, each GEMM's width from ``NativeForward.widths``.
SITES = {
    "q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o",
    "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Site:
    """One GEMM's adapter work in one layer, as two GEMMs: ``down``, the A of every projection
    it adapts stacked (``[Σ rank, in]``), and ``up``, their B times the scaling laid out block
    by block in the columns each projection writes (``[the GEMM's width, Σ rank]``, zeros
    elsewhere), so ``out + up(down(x))`` adds every projection's delta at once."""

    down: Linear
    up: Linear


@dataclasses.dataclass(frozen=True, eq=False)
class RowSite:
    """One GEMM's adapter work in one layer as the compiled ``lora_add_`` takes it, in the base
    weights' dtype where that is bf16 (as its GEMMs read them), else float32: ``down``, the A of
    every projection it adapts stacked (``[Σ rank, in]``); ``up``, per projection in turn, its B
    times the scaling as ``[rank, its columns]``, flat; ``spans``, per projection, (first column,
    end column, first rank row, end rank row)."""

    down: torch.Tensor
    up: torch.Tensor
    spans: torch.Tensor


@dataclasses.dataclass(frozen=True)
class PackedAdapter:
    """An adapter as the pass applies it: ``sites[(layer, site)]``; its rank and the projections
    it adapts (as ModelInfo lists them)."""

    name: str
    rank: int
    modules: tuple[str, ...]
    sites: dict[tuple[int, str], Site | RowSite]
    # The compiled ops (``torch.ops.tokenwire``) where its sites are RowSites, else None.
    library: Any | None
    # The first key of its rows' prefix-cache chains: its name and this load's serial, so a
    # reload under the same name starts afresh.
    root: bytes
    # The pass's layer count (``decoder_layers`` takes lists for every layer).
    layers: int

    @functools.cached_property
    def calls(self) -> dict[tuple[int, str], Call]:
        """``lora_add_``'s lists per site for a step with this adapter alone (RowSites; built once)."""
        return calls_of([self])

    @functools.cached_property
    def flat(self) -> FlatCalls:
        """``flat_calls`` of a step with this adapter alone (built once)."""
        return flat_calls(self.calls, 1, self.layers)


def pack(adapter: Adapter, native: NativeForward, batch_hint: int) -> PackedAdapter:
    """``adapter``'s weights as ``native`` applies them: RowSites where it runs the compiled CPU
    ops in float32, else pairs of GEMMs (oneDNN-packed where the base layers are)."""
    columns, widths = native.columns, native.widths
    library = native.ops.library if isinstance(native.ops, CompiledOps) and native.dtype == torch.float32 else None
    by_site: dict[tuple[int, str], list[str]] = {}
    for layer, module in adapter.weights:
        by_site.setdefault((layer, SITES[module]), []).append(module)
    sites: dict[tuple[int, str], Site | RowSite] = {}
    rows: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    for (layer, site), modules in by_site.items():
        modules.sort(key=lambda m: columns[m][0])
        down = torch.cat([adapter.weights[(layer, m)][0] for m in modules]).float().contiguous()
        blocks = [(columns[m], adapter.weights[(layer, m)][1].float() * adapter.scaling) for m in modules]
        if library is not None:
            ups, spans, low = [], [], 0
            for (first, end), up in blocks:
                ups.append(up.T.contiguous().flatten())  # [rank, columns]: a rank row's B column over its columns
                spans.append((first, end, low, low + up.shape[1]))
                low += up.shape[1]
            rows[(layer, site)] = (down, torch.cat(ups), torch.tensor(spans))
            continue
        dense = torch.zeros(widths[site], int(down.shape[0]), dtype=torch.float32)
        low = 0
        for (first, end), up in blocks:
            dense[first:end, low : low + up.shape[1]] = up
            low += up.shape[1]
        sites[(layer, site)] = Site(
            Linear(down.to(native.device), None, native.packed, batch_hint),
            Linear(dense.to(native.device), None, native.packed, batch_hint),
        )
    if rows:
        dtype = torch.bfloat16 if native.weight_dtype == torch.bfloat16 else torch.float32
        held = arena([t for down, up, _ in rows.values() for t in (down, up)], dtype)
        for index, (key, (_, _, segments)) in enumerate(rows.items()):
            sites[key] = RowSite(held[2 * index], held[2 * index + 1], segments)
    serial = next(_SERIALS)
    root = hashlib.blake2b(f"lora\0{adapter.name}\0{serial}".encode(), digest_size=16).digest()
    return PackedAdapter(adapter.name, adapter.rank, tuple(adapter.modules), sites, library, root, len(native.layers))


def arena(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """``tensors`` in ``dtype``, copied into one block of memory backed by huge pages where the
    kernel gives them (``MADV_HUGEPAGE``: the host's transparent huge pages are often "madvise").
    A decode step's GEMMs stream the base model's weights through the caches and the TLB between
    two ``lora_add_`` calls, so each call finds its adapter's pages cold: one 2 MB page covers
    what 512 small ones do (measured: ~10 % of the adapter's time on a decode step). The block
    lives as long as any tensor in it."""
    sizes = [t.numel() * dtype.itemsize for t in tensors]
    starts = list(itertools.accumulate((-(-size // 64) * 64 for size in sizes), initial=0))
    huge = 2 << 20
    block = mmap.mmap(-1, starts[-1] + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages: small pages
            block.madvise(mmap.MADV_HUGEPAGE)
    memory = torch.frombuffer(block, dtype=torch.uint8)
    skip = -memory.data_ptr() % huge  # start on a huge page's boundary
    out = []
    for tensor, start, size in zip(tensors, starts, sizes, strict=False):
        view = memory[skip + start : skip + start + size].view(dtype).view(tensor.shape)
        view.copy_(tensor)
        out.append(view)
    return out


_NONE = torch.empty(0)
# lora_add_'s lists at one site: each adapter's down, up and segments (empty: none at this site).
Call = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]


def calls_of(adapters: list[PackedAdapter]) -> dict[tuple[int, str], Call]:
    """``lora_add_``'s lists at each site an adapter of ``adapters`` adapts, for a step with those
    adapters (slot i: ``adapters[i]``; their sites RowSites)."""
    calls: dict[tuple[int, str], Call] = {}
    for key in {key for adapter in adapters for key in adapter.sites}:
        works = [typing.cast("RowSite | None", adapter.sites.get(key)) for adapter in adapters]
        calls[key] = (
            [_NONE if work is None else work.down for work in works],
            [_NONE if work is None else work.up for work in works],
            [_NONE if work is None else work.spans for work in works],
        )
    return calls


# A layer's GEMMs in the order ``decoder_layers`` (``kernels/cpu_ops.cpp``) takes their lists.
GEMM_ORDER = ("qkv", "o", "gate_up", "down")
FlatCalls = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]


def flat_calls(calls: dict[tuple[int, str], Call], adapters: int, layers: int) -> FlatCalls:
    """``calls`` as ``decoder_layers`` takes them: lora_add_'s three lists for every GEMM of every
    layer in turn (``GEMM_ORDER``), ``adapters`` entries each, empty where none adapts it."""
    none = [_NONE] * adapters
    downs: list[torch.Tensor] = []
    ups: list[torch.Tensor] = []
    spans: list[torch.Tensor] = []
    for layer in range(layers):
        for site in GEMM_ORDER:
            down, up, span = calls.get((layer, site), (none, none, none))
            downs += down
            ups += up
            spans += span
    return downs, ups, spans


class StepAdapters:
    """A step's tokens by adapter, applied after each GEMM (``add``): through the compiled op
    (``RowAdapters``) or masked GEMMs (``MaskedAdapters``), as the adapters were packed."""

    @staticmethod
    def of(per_token: list[PackedAdapter | None], device: torch.device) -> StepAdapters | None:
        """The step whose i-th token belongs to ``per_token[i]`` (None: the base model); None
        when no token has an adapter."""
        present: dict[int, PackedAdapter] = {id(a): a for a in per_token if a is not None}
        if not present:
            return None
        adapters = list(present.values())
        if all(adapter.library is not None for adapter in adapters):
            return RowAdapters(adapters, per_token)
        return MaskedAdapters(adapters, per_token, device)

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, site: str) -> torch.Tensor:
        """``out`` (the output of ``layer``'s ``site`` GEMM over ``x``) plus each token's adapter delta."""
        raise NotImplementedError

    def linear(
        self, gemm: Gemm, x: torch.Tensor, layer: int, site: str, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``layer``'s ``site`` GEMM over ``x`` (plus ``residual``), then each token's adapter delta."""
        out = gemm(x) if residual is None else gemm.plus(x, residual)
        return self.add(out, x, layer, site)

    def layer_lists(self) -> tuple[Any, ...] | None:
        """``decoder_layers``' LoRA arguments (slots, the flattened lists, the adapter count);
        None where the adapters are not applied through the compiled ops (the pass then runs its
        Python loop)."""
        return None


class RowAdapters(StepAdapters):
    """One ``lora_add_`` per site for all the step's tokens: ``slots``, each token's index in
    ``adapters`` (-1: none)."""

    def __init__(self, adapters: list[PackedAdapter], per_token: list[PackedAdapter | None]) -> None:
        self.adapters = adapters
        self.library: Any = adapters[0].library
        index = {id(adapter): slot for slot, adapter in enumerate(adapters)}
        self.slots = torch.tensor([-1 if a is None else index[id(a)] for a in per_token], dtype=torch.long)
        # Each site's lists for lora_add_: built once for the step, not at each of its ~120 calls.
        self.calls = adapters[0].calls if len(adapters) == 1 else calls_of(adapters)

    def layer_lists(self) -> tuple[Any, ...] | None:
        if len(self.adapters) == 1:
            flat = self.adapters[0].flat
        else:
            flat = flat_calls(self.calls, len(self.adapters), self.adapters[0].layers)
        return (self.slots, *flat, len(self.adapters))

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, site: str) -> torch.Tensor:
        call = self.calls.get((layer, site))
        if call is not None:
            self.library.lora_add_(out, x.contiguous(), self.slots, *call)
        return out

    def linear(
        self, gemm: Gemm, x: torch.Tensor, layer: int, site: str, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Where the GEMM runs the compiled panels, one call for both (``panel_linear_lora``): the
        adapters' pass runs on the GEMM's own threads, beside and after its panels."""
        call = self.calls.get((layer, site))
        weights = panel_weights(gemm)
        if call is None or weights is None:
            return super().linear(gemm, x, layer, site, residual)
        rows = x.float().contiguous()
        held = None if residual is None else residual.contiguous()
        out: torch.Tensor = self.library.panel_linear_lora(rows, weights, gemm.bias, held, self.slots, *call)
        return out


class MaskedAdapters(StepAdapters):
    """Per adapter, ``(adapter, mask)``: the mask ``[tokens, 1]`` 1.0 on its tokens and 0.0
    elsewhere (None: the adapter's tokens are every token)."""

    def __init__(self, adapters: list[PackedAdapter], per_token: list[PackedAdapter | None], device: torch.device):
        if len(adapters) == 1 and all(a is not None for a in per_token):
            self.groups: list[tuple[PackedAdapter, torch.Tensor | None]] = [(adapters[0], None)]
            return
        self.groups = []
        for adapter in adapters:
            mask = torch.tensor([[1.0 if a is adapter else 0.0] for a in per_token], dtype=torch.float32)
            self.groups.append((adapter, mask.to(device)))

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, site: str) -> torch.Tensor:
        """Every token's A runs, the others' low-rank rows are zeroed: a token outside the group
        gets ``+ 0.0`` (its bits unchanged), and a token's delta comes from its own row alone."""
        for adapter, mask in self.groups:
            work = adapter.sites.get((layer, site))
            if work is None:
                continue
            assert isinstance(work, Site)
            low = work.down(x)
            if mask is not None:
                low = low * mask
            out = work.up.plus(low, out)
        return out
