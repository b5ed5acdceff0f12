"""The native pass's operations around its GEMMs, behind one interface per kind.

- ``TorchOps`` / ``CompiledOps``: Llama's RMSNorm (fp32), RoPE on q and k at once, the
  K/V write through the step's places, SiLU(gate)*up. ``CompiledOps`` runs the compiled
  CPU library (``kernels``, float32 on an AVX2+FMA CPU); ``TorchOps`` stock torch ops,
  anywhere.
- One-token rows' attention: ``PagedDecodeAttention`` (the compiled op: each row over its
  own columns through its block table, no mask, no padding) or ``GroupedAttention``
  (stock SDPA over rows gathered in groups of similar lengths, a length mask).
- Prompt chunks: ``ChunkAttention`` (stock SDPA over each chunk's gathered blocks,
  ``chunk_attention``), or, with ``--attention flex``, ``flex.FlexAttention``, which reads the
  decode rows too.

The native pass picks one of each at load (``NativeForward``) and calls them the same
way whichever it picked: a step never asks which is which.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from ..transfer import to_device
from .blocks import blocks_for
from .kv import flat_index, gather, table_tensor, write

# What one more attention call per layer costs, in row-columns (one row attending over one
# column) on a CPU: a call ~25 us, a row-column ~0.15-0.2 us (docs/architecture.md).
ATTENTION_CALL_COST = 128


@dataclasses.dataclass(frozen=True)
class Segment:
    """``count`` consecutive tokens of one request, the first at column ``start``; ``table``:
    the request's block table (at least up to column ``start + count``)."""

    table: tuple[int, ...]
    start: int
    count: int


@dataclasses.dataclass
class Places:
    """Where each token of a step writes: its block and its offset there (in token order)."""

    blocks: torch.Tensor
    offsets: torch.Tensor
    flat: torch.Tensor | None = None  # the flattened buffer's index (stock torch), built once per step


class TorchOps:
    """Stock torch ops, any device and dtype."""

    name = "torch"

    def __init__(self, eps: float, heads: int, kv_heads: int, head_dim: int, intermediate: int) -> None:
        self.eps, self.heads, self.kv_heads, self.head_dim, self.intermediate = (
            eps,
            heads,
            kv_heads,
            head_dim,
            intermediate,
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Llama's RMSNorm, computed in float32 whatever the weights' dtype (as transformers does)."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    def rope_tables(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary embedding's ``[1, tokens, dim]`` cos and sin, as ``rope`` takes them."""
        half = self.head_dim // 2
        # rotate_half(x) * sin == swap_halves(x) * (sin with its first half negated): the
        # same products, one op (a flip over the two halves) instead of slice, neg and cat.
        sin = sin[0].unsqueeze(1).clone()
        sin[..., :half] = -sin[..., :half]
        return cos[0].unsqueeze(1), sin

    def rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        tokens, heads, dim = qk.shape
        swapped = qk.view(tokens, heads, 2, dim // 2).flip(-2).flatten(-2)
        return qk * cos + swapped * sin

    def store_kv(
        self,
        qkv: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        places: Places,
    ) -> None:
        if places.flat is None:
            places.flat = to_device(
                flat_index(places.blocks, places.offsets, self.kv_heads, keys.shape[2]), keys.device
            )
        write(keys, values, places.flat, k, v)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :]


class CompiledOps(TorchOps):
    """The compiled CPU library's ops (``torch.ops.tokenwire``): one call each."""

    name = "compiled"

    def __init__(self, library: Any, eps: float, heads: int, kv_heads: int, head_dim: int, intermediate: int) -> None:
        super().__init__(eps, heads, kv_heads, head_dim, intermediate)
        self.library = library

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.library.rms_norm(x, weight, self.eps)
        return out

    def rope_tables(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return cos[0].contiguous(), sin[0].contiguous()  # [tokens, dim]

    def rope(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        self.library.rope_(qk, cos, sin)  # in place
        return qk

    def store_kv(
        self,
        qkv: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        places: Places,
    ) -> None:
        self.library.store_kv(qkv, keys, values, places.blocks, places.offsets, self.heads)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.library.silu_mul(gate_up, self.intermediate)
        return out


def single_groups(singles: list[Segment]) -> list[tuple[int, int]]:
    """Split the one-token rows into attention calls: ``(first row, rows)``.

    A call reads as many columns as its longest row. One long row among short ones
    would make every row read its length, so rows are cut into the groups that read
    the fewest row-columns, counting ATTENTION_CALL_COST per call (exact over the cuts
    of the rows in order, ``O(rows^2)``; rows of similar lengths stay one call).
    """
    n = len(singles)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        longest = 0
        for first in range(end - 1, -1, -1):
            longest = max(longest, singles[first].start + 1)
            cost = best[first] + (end - first) * longest + ATTENTION_CALL_COST
            if cost < best[end]:
                best[end], cut[end] = cost, first
    groups: list[tuple[int, int]] = []
    end = n
    while end > 0:
        first = cut[end]
        groups.append((first, end - first))
        end = first
    return groups[::-1]


class PagedDecodeAttention:
    """The compiled decode attention: each one-token row over its own columns, through its table."""

    name = "compiled"

    def __init__(self, library: Any, heads: int, kv_heads: int, scale: float) -> None:
        self.library, self.heads, self.kv_heads, self.scale = library, heads, kv_heads, scale

    def plan(self, singles: list[Segment], block_size: int, scratch: int, device: torch.device) -> Any:
        tables = table_tensor(
            [list(s.table) for s in singles], scratch, blocks_for(max(s.start for s in singles) + 1, block_size)
        )
        lengths = torch.tensor([s.start + 1 for s in singles], dtype=torch.long)
        return tables, lengths

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: Any) -> torch.Tensor:
        tables, lengths = plan
        out: torch.Tensor = self.library.decode_attention(q.contiguous(), keys, values, tables, lengths, self.scale)
        return out


class GroupedAttention:
    """Stock SDPA over the one-token rows, gathered in groups of similar lengths (``single_groups``),
    with a per-row length mask; the query heads that share a KV head go in as that head's query
    rows, so each row's keys and values are read once, not once per query head."""

    name = "torch"

    def __init__(self, heads: int, kv_heads: int, scale: float) -> None:
        self.heads, self.kv_heads, self.scale = heads, kv_heads, scale

    def plan(self, singles: list[Segment], block_size: int, scratch: int, device: torch.device) -> Any:
        groups = []
        for first, rows in single_groups(singles):
            group = singles[first : first + rows]
            columns = max(s.start for s in group) + 1
            tables = to_device(
                table_tensor([list(s.table) for s in group], scratch, blocks_for(columns, block_size)), device
            )
            starts = torch.tensor([s.start for s in group], dtype=torch.long)
            mask = to_device(
                (torch.arange(columns).view(1, columns) <= starts.view(-1, 1)).view(rows, 1, 1, columns), device
            )
            groups.append((first, rows, tables, to_device(starts + 1, device), mask))
        return groups

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: Any) -> torch.Tensor:
        heads, kv_heads, dim = self.heads, self.kv_heads, q.shape[-1]
        out = []
        for first, rows, tables, lengths, mask in plan:
            sk, sv = gather(keys, values, tables, int(mask.shape[-1]), lengths)
            grouped = q[first : first + rows].view(rows, kv_heads, heads // kv_heads, dim)
            attended = F.scaled_dot_product_attention(grouped, sk, sv, attn_mask=mask, scale=self.scale)
            out.append(attended.reshape(rows, heads, dim))
        return out[0] if len(out) == 1 else torch.cat(out)


def static_decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    tables: torch.Tensor,
    lengths: torch.Tensor,
    kv_heads: int,
    scale: float,
) -> torch.Tensor:
    """One-token rows over their tables in fixed shapes (the compiled decode step, ``graphs``):
    every row reads ``tables``' full width, columns from its own length on masked (and zeroed
    in the copy, so the scratch block's garbage cannot be NaN). Nothing here depends on a
    host value: a CUDA graph can hold it. ``q``: ``[rows, heads, dim]``; ``tables``:
    ``[rows, width]``; ``lengths``: ``[rows]``, all on the buffers' device."""
    rows, heads, dim = q.shape
    columns = int(tables.shape[1]) * int(keys.shape[2])
    sk, sv = gather(keys, values, tables, columns, lengths)
    mask = (torch.arange(columns, device=q.device).view(1, columns) < lengths.view(-1, 1)).view(rows, 1, 1, columns)
    grouped = q.view(rows, kv_heads, heads // kv_heads, dim)
    attended = F.scaled_dot_product_attention(grouped, sk, sv, attn_mask=mask, scale=scale)
    return attended.reshape(rows, heads, dim)


def chunk_plan(
    chunks: list[Segment], block_size: int, scratch: int, device: torch.device
) -> list[tuple[torch.Tensor, Any]]:
    """Each prompt chunk's table, and its causal mask: a chunk's queries are the last ``count`` of its
    ``start + count`` columns, so query ``i`` sees columns ``0 .. start + i``. On CUDA that is
    ``causal_lower_right``, a bias no mask is made of: flash attention takes it as it is (bf16/fp16,
    grouped heads included), where an explicit mask with ``enable_gqa`` runs SDPA's math backend
    (count x columns scores per head) and crosses from the host. Elsewhere the mask
    ``[1, 1, count, start + count]`` (the CPU's SDPA takes no bias, and a ``CausalBias``, a tensor
    subclass, cannot be made under the dispatch mode that counts memory on ``meta``: ``memory``)."""
    out: list[tuple[torch.Tensor, Any]] = []
    for segment in chunks:
        end = segment.start + segment.count
        table = to_device(table_tensor([list(segment.table)], scratch, blocks_for(end, block_size)), device)
        if device.type == "cuda":
            # Imported here: torch.nn.attention.bias imports torch._dynamo and sympy (~1 s of a CPU start).
            from torch.nn.attention.bias import causal_lower_right

            out.append((table, causal_lower_right(segment.count, end)))
            continue
        query = torch.arange(segment.start, end).view(-1, 1)
        mask = to_device((torch.arange(end).view(1, end) <= query).view(1, 1, segment.count, end), device)
        out.append((table, mask))
    return out


class ChunkAttention:
    """Prompt chunks through stock SDPA (``chunk_plan``, ``chunk_attention``): the chunk side of the
    one interface ``flex.FlexAttention`` also gives, picked once at load (``NativeForward``)."""

    name = "sdpa"

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def chunk_plans(self, chunks: list[Segment], block_size: int, scratch: int, device: torch.device) -> list[Any]:
        return chunk_plan(chunks, block_size, scratch, device)

    def chunk(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, segment: Segment, plan: Any
    ) -> torch.Tensor:
        return chunk_attention(q, keys, values, segment, plan, self.scale)


def chunk_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    segment: Segment,
    plan: tuple[torch.Tensor, Any],
    scale: float,
) -> torch.Tensor:
    """One prompt chunk, causally, over its gathered blocks: ``[count, heads, dim]``."""
    table, bias = plan
    ck, cv = gather(keys, values, table, segment.start + segment.count)
    cq = q.transpose(0, 1).unsqueeze(0)  # [1, heads, count, dim]
    out = F.scaled_dot_product_attention(cq, ck, cv, attn_mask=bias, scale=scale, enable_gqa=ck.shape[1] != cq.shape[1])
    return out[0].transpose(0, 1)
