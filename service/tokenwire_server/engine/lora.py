"""LoRA adapters in the native pass: each row's adapter, applied to its own tokens.

An adapter (``adapters.Adapter``) is packed once into the pass's ``Linear`` layers, per
(layer, GEMM). A step groups its tokens by adapter (``StepAdapters``); after each of a
layer's GEMMs, the tokens of each group get ``s·(x·Aᵀ)·Bᵀ`` added to their own rows of its
output: the fused q/k/v and gate/up outputs in each projection's columns, o and down on the
residual sum they write. A row without the group's adapter gets ``+ 0.0`` (its low-rank row
is masked to zero), so the base model's rows keep their bits whatever adapters share the step,
and an adapter row's delta is computed from that row alone through oneDNN's packed GEMMs,
which give a row the same bits at any row count (as the base layers rely on): batch
invariance holds as it does for the base model.

A GEMM's adapted projections share one A GEMM (their A stacked: the fused q/k/v and
gate/up read the same input) and one B GEMM (their B times the scaling, block by block in the
projections' columns), whose add rides on the GEMM (oneDNN's post-op): two calls per GEMM
and adapter. The step's other tokens are masked to zero before B rather than gathered out.

Each loaded adapter has a prefix-cache root of its own (``root``): its blocks' keys start from
it, so two adapters over the same prompt never share keys and values.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools

import torch

from ..adapters import Adapter
from .native import Linear

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


@dataclasses.dataclass(frozen=True)
class PackedAdapter:
    """An adapter as the pass applies it: ``sites[(layer, site)]``; its rank and the projections
    it adapts (as ModelInfo lists them)."""

    name: str
    rank: int
    modules: tuple[str, ...]
    sites: dict[tuple[int, str], Site]
    # The first key of its rows' prefix-cache chains: its name and this load's serial, so a
    # reload under the same name starts afresh.
    root: bytes


def pack(
    adapter: Adapter,
    columns: dict[str, tuple[int, int]],
    widths: dict[str, int],
    packed: bool,
    batch_hint: int,
    device: torch.device,
) -> PackedAdapter:
    """``adapter``'s weights as the pass's layers (oneDNN-packed where the base layers are);
    ``columns``: each projection's columns of its GEMM's output, ``widths``: each GEMM's
    output width (``NativeForward.columns`` / ``widths``)."""
    by_site: dict[tuple[int, str], list[str]] = {}
    for layer, module in adapter.weights:
        by_site.setdefault((layer, SITES[module]), []).append(module)
    sites = {}
    for (layer, site), modules in by_site.items():
        modules.sort(key=lambda m: columns[m][0])
        ranks = [adapter.weights[(layer, m)][0].shape[0] for m in modules]
        down = torch.cat([adapter.weights[(layer, m)][0] for m in modules])
        up = torch.zeros(widths[site], sum(ranks), dtype=torch.float32)
        low = 0
        for module, rank in zip(modules, ranks, strict=True):
            first, end = columns[module]
            up[first:end, low : low + rank] = adapter.weights[(layer, module)][1] * adapter.scaling
            low += rank
        sites[(layer, site)] = Site(
            Linear(down.to(device), None, packed, batch_hint), Linear(up.to(device), None, packed, batch_hint)
        )
    serial = next(_SERIALS)
    root = hashlib.blake2b(f"lora\0{adapter.name}\0{serial}".encode(), digest_size=16).digest()
    return PackedAdapter(adapter.name, adapter.rank, tuple(adapter.modules), sites, root)


class StepAdapters:
    """A step's tokens by adapter: ``(adapter, mask)`` per adapter present, the mask ``[tokens, 1]``
    1.0 on its tokens and 0.0 elsewhere (None: the adapter's tokens are every token)."""

    def __init__(self, groups: list[tuple[PackedAdapter, torch.Tensor | None]]) -> None:
        self.groups = groups

    @classmethod
    def of(cls, per_token: list[PackedAdapter | None], device: torch.device) -> StepAdapters | None:
        """The groups of a step whose i-th token belongs to ``per_token[i]`` (None: the base
        model); None when no token has an adapter."""
        members: dict[int, PackedAdapter] = {id(a): a for a in per_token if a is not None}
        if not members:
            return None
        if len(members) == 1 and all(a is not None for a in per_token):
            return cls([(next(iter(members.values())), None)])
        groups: list[tuple[PackedAdapter, torch.Tensor | None]] = []
        for adapter in members.values():
            mask = torch.tensor([[1.0 if a is adapter else 0.0] for a in per_token], dtype=torch.float32)
            groups.append((adapter, mask.to(device)))
        return cls(groups)

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, site: str) -> torch.Tensor:
        """``out`` (the output of ``layer``'s ``site`` GEMM over ``x``) plus each group's
        ``s·(x·Aᵀ)·Bᵀ`` on its tokens. Every token's A runs, the others' low-rank rows are
        zeroed: a token outside the group gets ``+ 0.0`` (its bits unchanged), and a token's
        delta comes from its own row alone, whatever shares the step."""
        for adapter, mask in self.groups:
            work = adapter.sites.get((layer, site))
            if work is None:
                continue
            low = work.down(x)
            if mask is not None:
                low = low * mask
            out = work.up.plus(low, out)
        return out
