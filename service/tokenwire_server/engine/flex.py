"""Attention that reads the paged KV pool in place, through PyTorch's FlexAttention (``--attention flex``).

Stock attention (``ops.GroupedAttention``, ``ops.chunk_attention``) copies each row's blocks
out of the pool, pads them to the widest row of the call and masks the padding: a decode
layer moves several times its rows' K/V bytes, and one long row makes every row of its
group pay its length. Here nothing is copied. A layer's buffer ``[blocks + 1, kv_heads,
block_size, dim]`` is contiguous, so it is viewed, as it lies, as one sequence of
``(blocks + 1) * kv_heads * block_size`` vectors of one KV "head": *page* ``block * kv_heads
+ head`` is that block's ``block_size`` vectors of KV head ``head``. A FlexAttention block
mask whose KV block is a page then names, for every (row, KV head), exactly the pages of
that row's table for that head, and the kernel reads those and no others.

The shapes handed to ``flex_attention``:

- queries ``[segments * kv_heads, group, count, dim]``: batch entry ``b`` is segment
  ``b // kv_heads``'s queries for KV head ``b % kv_heads``, its ``group`` query heads as
  FlexAttention's query heads over the one KV head (``enable_gqa``);
- keys and values ``[1, 1, pool, dim]``, the pool broadcast over the batch.

One-token rows (decode) go in one call, all rows as the batch (``count`` 1); each prompt
chunk in a call of its own (batch ``kv_heads``), causally. The block mask says which pages
each batch entry's query block reads: *full* pages (every column at or before every query
of the block, no mask evaluated) and *partial* ones (the row's last page, a chunk's
diagonal), where ``mask`` decides column by column. ``mask`` is the whole truth on its own
(the page is the row's, of its KV head, and the column is at or before the query), so a
reader that ignores the sparsity (FlexAttention without ``torch.compile`` evaluates it
densely) still gets the same answer. The column of a page's first token is
``logical[block] * block_size``: ``logical`` maps each block of the step's tables to its
index in its table, which is the same in every table that holds it (a shared block is a
cached prefix, at the same place in each; ``blocks``).

The kernel comes from ``torch.compile``: on CUDA Triton's, with dynamic shapes (one kernel for
every row count and chunk length); on a CPU a C++ template, once per shape (it fails to build
with a dynamic query length). The CPU template asks that the block mask cover the whole KV
sequence, so there the page lists and the tables are as wide as the pool (``full_width``: a
step's shapes then depend on its row count alone); CUDA's kernels read only the counted pages,
and the lists are as wide as the step's longest table.
Triton's tiles must divide the block mask's blocks: ``kernel_options`` sets them on CUDA
(``CUDA_KERNEL_OPTIONS``), the KV tile to one page.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

import torch

from ..transfer import to_device
from .blocks import blocks_for
from .ops import Segment

# Query positions one row of a block mask covers (FlexAttention's Q block), for a chunk and for
# the one-token rows' call alike: a multiple of every tile of queries Triton's kernel may pick
# (it skips a tile size that does not divide it, and fails when none is left).
QUERY_BLOCK = 128
# On CUDA: query tiles of 64 (they divide QUERY_BLOCK) and key tiles of one block (the block mask's
# KV block is a page, which the tile must divide: Triton's own choices, 32 to 128, do not); the
# main kernel always (the decoding kernel indexes the block mask by KV head, and picks itself only
# for a static batch).
CUDA_KERNEL_OPTIONS = {"BLOCK_M": 64, "FORCE_USE_FLEX_ATTENTION": True}


def paged_mask(
    logical: torch.Tensor, tables: torch.Tensor, starts: torch.Tensor, kv_heads: int, block_size: int
) -> Callable[..., torch.Tensor]:
    """FlexAttention's ``mask_mod`` over the pool viewed as pages (module docstring): batch
    entry ``b`` (segment ``b // kv_heads``, KV head ``b % kv_heads``), its query ``q`` at column
    ``starts[segment] + q``, may read pool vector ``kv`` iff ``kv``'s block is in the segment's
    table, its page is that KV head's, and its column is at or before the query's."""
    last = tables.shape[1] - 1

    def mask(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        segment = b // kv_heads
        page = kv // block_size
        block = page // kv_heads
        index = logical[block]
        held = (index >= 0) & (tables[segment, index.clamp(0, last)] == block) & (page % kv_heads == b % kv_heads)
        return held & (index * block_size + kv % block_size <= starts[segment] + q)

    return mask


class FlexAttention:
    """One-token rows and prompt chunks attending over the pool in place (module docstring).
    Same interface as ``ops.GroupedAttention`` for the one-token rows (``plan``, ``__call__``),
    plus ``chunk_plans`` and ``chunk`` for prompt chunks."""

    name = "flex"

    def __init__(self, heads: int, kv_heads: int, scale: float, compiled: bool = True, dynamic: bool = True) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        self.heads, self.kv_heads, self.group, self.scale = heads, kv_heads, heads // kv_heads, scale
        self.compiled = compiled
        # NOTE: uncompiled, FlexAttention scores every query against the whole pool (a test's
        # reference, far too slow to serve): the engine always compiles. ``dynamic``: one kernel
        # for every row count and chunk length (CUDA). torch 2.13's CPU template does not build
        # with a dynamic query length (a C++ compile error), so a CPU compiles per shape.
        kernel: Any = torch.compile(flex_attention, dynamic=dynamic) if compiled else flex_attention
        self._flex: Callable[..., Any] = kernel

    def _pages(
        self, segments: list[Segment], queries: list[tuple[int, int]], block_size: int, scratch: int
    ) -> tuple[torch.Tensor, ...]:
        """The block mask's page lists for ``segments`` (host tensors): per batch entry (segment,
        KV head) and per query block (its first and last column, ``queries``, the same for every
        segment), how many full and partial pages it reads and which, in table order; and the
        step's ``logical`` map, tables and starts for ``paged_mask``."""
        heads = self.kv_heads
        width = max(blocks_for(s.start + s.count, block_size) for s in segments)
        tables = torch.full((len(segments), width), scratch, dtype=torch.long)
        for row, segment in enumerate(segments):
            table = segment.table[: blocks_for(segment.start + segment.count, block_size)]
            tables[row, : len(table)] = torch.tensor(table, dtype=torch.long)
        logical = torch.full((scratch + 1,), -1, dtype=torch.long)
        # A padded column's scratch block gets an index too: harmless, as every column there is
        # past its row's length, where ``paged_mask`` reads nothing.
        logical[tables.reshape(-1)] = torch.arange(width).repeat(len(segments))
        pages_of = tables.view(-1, 1, width) * heads + torch.arange(heads).view(1, heads, 1)
        pages_of = pages_of.reshape(-1, 1, 1, width).expand(-1, 1, len(queries), width)
        full_counts, counts = [], []
        for segment in segments:
            full_row, count_row = [], []
            for first, last in queries:
                full = (segment.start + first + 1) // block_size  # every column <= the block's first query
                full_row.append(full)
                count_row.append(blocks_for(segment.start + last + 1, block_size) - full)
            full_counts += [full_row] * heads
            counts += [count_row] * heads
        full_count = torch.tensor(full_counts, dtype=torch.int32).view(-1, 1, len(queries))
        count = torch.tensor(counts, dtype=torch.int32).view(-1, 1, len(queries))
        column = torch.arange(width).view(1, 1, 1, width)
        full_pages = torch.where(column < full_count.unsqueeze(-1), pages_of, 0)
        shifted = torch.gather(
            pages_of, 3, (column + full_count.unsqueeze(-1)).clamp(max=width - 1).expand_as(pages_of)
        )
        partial = torch.where(column < count.unsqueeze(-1), shifted, 0)
        starts = torch.tensor([s.start for s in segments], dtype=torch.long)
        return count, partial.to(torch.int32), full_count, full_pages.to(torch.int32), logical, tables, starts

    def _block_mask(
        self, segments: list[Segment], queries: list[tuple[int, int]], query_block: int, block_size: int,
        scratch: int, device: torch.device,
    ) -> Any:  # fmt: skip
        from torch.nn.attention.flex_attention import BlockMask

        count, partial, full_count, full_pages, logical, tables, starts = (
            to_device(t, device) for t in self._pages(segments, queries, block_size, scratch)
        )
        pool = (scratch + 1) * self.kv_heads * block_size
        if self.full_width(device):
            # The CPU template asks that the page lists cover the whole pool; the tables as wide
            # as the pool too, so that a step's shapes (which a CPU compiles for) do not change
            # as its rows grow: one kernel per row count, not one per row count and width.
            pad = (scratch + 1) * self.kv_heads - partial.shape[-1]
            partial = torch.nn.functional.pad(partial, (0, pad))
            full_pages = torch.nn.functional.pad(full_pages, (0, pad))
            tables = torch.nn.functional.pad(tables, (0, scratch + 1 - tables.shape[1]), value=scratch)
        return BlockMask.from_kv_blocks(
            count, partial, full_count, full_pages,
            BLOCK_SIZE=(query_block, block_size),
            mask_mod=paged_mask(logical, tables, starts, self.kv_heads, block_size),
            seq_lengths=(queries[-1][1] + 1, pool),
            compute_q_blocks=False,
        )  # fmt: skip

    def full_width(self, device: torch.device) -> bool:
        return self.compiled and device.type == "cpu"

    def _options(self, device: torch.device, block_size: int) -> dict[str, Any] | None:
        return {**CUDA_KERNEL_OPTIONS, "BLOCK_N": block_size} if device.type == "cuda" else None

    def plan(self, singles: list[Segment], block_size: int, scratch: int, device: torch.device) -> Any:
        """The one-token rows' block mask (one call for all of them)."""
        return self._block_mask(singles, [(0, 0)], QUERY_BLOCK, block_size, scratch, device), block_size

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: Any) -> torch.Tensor:
        """``q``: ``[rows, heads, dim]``, one token a row; returns the same shape."""
        rows, heads, dim = q.shape
        grouped = q.contiguous().view(rows * self.kv_heads, self.group, 1, dim)
        return self._attend(grouped, keys, values, plan).view(rows, heads, dim)

    def chunk_plans(self, chunks: list[Segment], block_size: int, scratch: int, device: torch.device) -> list[Any]:
        """Each prompt chunk's block mask, its queries in blocks of ``QUERY_BLOCK``."""
        plans = []
        for segment in chunks:
            step = QUERY_BLOCK
            queries = [(first, min(first + step, segment.count) - 1) for first in range(0, segment.count, step)]
            plans.append((self._block_mask([segment], queries, step, block_size, scratch, device), block_size))
        return plans

    def chunk(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, segment: Segment, plan: Any
    ) -> torch.Tensor:
        """One prompt chunk, causally: ``q`` ``[count, heads, dim]``; returns the same shape
        (``segment``: the chunk, whose columns ``plan`` already holds)."""
        count, heads, dim = q.shape
        grouped = q.view(count, self.kv_heads, self.group, dim).permute(1, 2, 0, 3)
        return self._attend(grouped, keys, values, plan).permute(2, 0, 1, 3).reshape(count, heads, dim)

    def _attend(self, grouped: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: Any) -> torch.Tensor:
        """FlexAttention over the pool viewed as one KV head's pages (module docstring)."""
        block_mask, block_size = plan
        dim = grouped.shape[-1]
        out = self._flex(
            grouped, keys.view(1, 1, -1, dim), values.view(1, 1, -1, dim), block_mask=block_mask,
            scale=self.scale, enable_gqa=self.group > 1, kernel_options=self._options(grouped.device, block_size),
        )  # fmt: skip
        return typing.cast("torch.Tensor", out)
