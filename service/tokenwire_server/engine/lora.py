"""LoRA adapters in the native pass: each row's adapter, applied to its own tokens.

An adapter (``adapters.Adapter``) is packed once into the pass's ``Linear`` layers, A and B per
(layer, projection). A step groups its tokens by adapter (``StepAdapters``); after each of a
layer's GEMMs, the tokens of each group get ``s·(x·Aᵀ)·Bᵀ`` added to their own rows of its
output: the fused q/k/v and gate/up outputs in each projection's columns, o and down on the
residual sum they write. Rows without an adapter are not touched, so the base model's rows keep
their bits whatever adapters share the step, and an adapter row's delta is computed from that
row alone through the same packed GEMMs as the base (one row runs as the pass runs one row), so
batch invariance holds as it does for the base layers.

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


@dataclasses.dataclass(frozen=True)
class PackedAdapter:
    """An adapter as the pass applies it: ``layers[(layer, module)] = (A, B)`` as ``Linear`` layers."""

    name: str
    rank: int
    scaling: float
    layers: dict[tuple[int, str], tuple[Linear, Linear]]
    # The first key of its rows' prefix-cache chains: its name and this load's serial, so a
    # reload under the same name starts afresh.
    root: bytes


def pack(adapter: Adapter, packed: bool, batch_hint: int, device: torch.device) -> PackedAdapter:
    """``adapter``'s weights as the pass's layers (oneDNN-packed where the base layers are)."""
    layers = {
        place: (
            Linear(a.to(device), None, packed, batch_hint),
            Linear(b.to(device), None, packed, batch_hint),
        )
        for place, (a, b) in adapter.weights.items()
    }
    serial = next(_SERIALS)
    root = hashlib.blake2b(f"lora\0{adapter.name}\0{serial}".encode(), digest_size=16).digest()
    return PackedAdapter(adapter.name, adapter.rank, adapter.scaling, layers, root)


class StepAdapters:
    """A step's tokens grouped by adapter: ``(adapter, token indices)`` per adapter present."""

    def __init__(self, groups: list[tuple[PackedAdapter, torch.Tensor]]) -> None:
        self.groups = groups

    @classmethod
    def of(cls, per_token: list[PackedAdapter | None], device: torch.device) -> StepAdapters | None:
        """The groups of a step whose i-th token belongs to ``per_token[i]`` (None: the base
        model); None when no token has an adapter."""
        members: dict[int, tuple[PackedAdapter, list[int]]] = {}
        for index, adapter in enumerate(per_token):
            if adapter is not None:
                members.setdefault(id(adapter), (adapter, []))[1].append(index)
        if not members:
            return None
        return cls([(a, torch.tensor(rows, dtype=torch.long, device=device)) for a, rows in members.values()])

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, columns: tuple[tuple[str, int, int], ...]) -> None:
        """Add each group's ``s·(x·Aᵀ)·Bᵀ`` to its rows of ``out``, per ``(module, first, end)``
        column range of ``out`` that module wrote."""
        for adapter, rows in self.groups:
            picked: torch.Tensor | None = None
            for module, first, end in columns:
                pair = adapter.layers.get((layer, module))
                if pair is None:
                    continue
                if picked is None:
                    picked = x.index_select(0, rows)
                down, up = pair
                delta = up(down(picked)) * adapter.scaling
                out[:, first:end].index_add_(0, rows, delta.to(out.dtype))
