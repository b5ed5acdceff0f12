"""The batched engine's KV cache on the device: a pool of blocks, allocated once.

Every layer holds one key and one value buffer of shape
``[num_blocks + 1, kv_heads, block_size, head_dim]`` on the device of that layer's
weights (several GPUs with ``device_map="auto"`` each hold their own layers' blocks).
Which request holds which block is the scheduler's business (``blocks.BlockPool``):
here a request is only its *block table*, the blocks of its columns in order. The
last block (index ``num_blocks``) is scratch: padding queries write there and short
tables are padded with it, so nobody's tokens are ever touched by them.

The buffers are ``torch.empty``: what is committed for KV is exactly ``nbytes()``,
the pool the start-up check sized (``kv_budget``), plus the one scratch block per
layer. On a CPU the pages become resident as requests fill them.

A reader that gathers a table's blocks into one ``[rows, kv_heads, columns, dim]``
tensor (stock torch attention, transformers' forward) sees, past each row's own
length, whatever an earlier holder of the block left, or uninitialised memory,
which could be NaN (and NaN times a zero attention weight is still NaN): ``gather``
zeroes those columns in its copy. The compiled decode attention reads each row's own
columns and no more, through its table, and needs nothing of the kind.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..transfer import to_device
from .blocks import blocks_for


def decoder_layers(model: Any) -> list[Any]:
    """The model's decoder layers (``model.model.layers`` for Llama-like models)."""
    for path in ("get_decoder", "model"):
        try:
            owner = getattr(model, path)
            owner = owner() if callable(owner) and path == "get_decoder" else owner
            layers = list(owner.layers)
        except (AttributeError, TypeError, ValueError):
            continue
        if layers:
            return layers
    return []


def layer_placements(
    model: Any, count: int, default_device: torch.device, default_dtype: torch.dtype
) -> list[tuple[torch.device, torch.dtype]]:
    """Device and dtype of each decoder layer's attention weights (where its KV cache must live).

    With ``device_map="auto"`` the layers are spread over several GPUs: each layer's
    blocks go where its weights are. A layer whose weights cannot be found (or that
    has none) takes the model's device and dtype.
    """
    layers = decoder_layers(model)
    placements: list[tuple[torch.device, torch.dtype]] = []
    for index in range(count):
        device, dtype = default_device, default_dtype
        if index < len(layers):
            module = layers[index]
            attention = getattr(module, "self_attn", module)
            projection = getattr(attention, "k_proj", None)
            weight = getattr(projection, "weight", None)
            if weight is None:
                weight = next(iter(module.parameters()), None)
            if weight is not None:
                device = weight.device
                if weight.dtype.is_floating_point:
                    dtype = weight.dtype
        placements.append((torch.device(device), dtype))
    return placements


def table_tensor(tables: list[list[int]], scratch: int, blocks: int | None = None) -> torch.Tensor:
    """``[rows, blocks]`` int64: each row's block table, padded with the scratch block."""
    width = max(1, blocks if blocks is not None else max((len(t) for t in tables), default=1))
    out = torch.full((len(tables), width), scratch, dtype=torch.long)
    for row, table in enumerate(tables):
        count = min(len(table), width)
        if count:
            out[row, :count] = torch.tensor(table[:count], dtype=torch.long)
    return out


def places(
    tables: list[list[int]], starts: list[int], counts: list[int], block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block and the offset in it of every token of the step, in token order (segment
    ``i`` writes columns ``starts[i] .. starts[i] + counts[i]`` of table ``tables[i]``)."""
    blocks: list[int] = []
    offsets: list[int] = []
    for table, start, count in zip(tables, starts, counts, strict=True):
        for column in range(start, start + count):
            blocks.append(table[column // block_size])
            offsets.append(column % block_size)
    return torch.tensor(blocks, dtype=torch.long), torch.tensor(offsets, dtype=torch.long)


def flat_index(blocks: torch.Tensor, offsets: torch.Tensor, heads: int, block_size: int) -> torch.Tensor:
    """Where each (token, kv head) vector goes in a layer's buffer flattened to
    ``[(num_blocks + 1) * heads * block_size, dim]``; the order is token, head."""
    head = torch.arange(heads, dtype=torch.long, device=blocks.device).view(1, heads)
    return ((blocks.view(-1, 1) * heads + head) * block_size + offsets.view(-1, 1)).reshape(-1)


def write(keys: torch.Tensor, values: torch.Tensor, flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store vectors ``k``/``v`` (``[..., dim]``, in ``flat``'s order) at ``flat`` (``flat_index``):
    ``index_copy_`` on the flattened buffers, far cheaper on a CPU than advanced-index assignment."""
    dim = keys.shape[-1]
    keys.view(-1, dim).index_copy_(0, flat, k.reshape(-1, dim).to(keys.dtype))
    values.view(-1, dim).index_copy_(0, flat, v.reshape(-1, dim).to(values.dtype))


def gather(
    keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor, columns: int, lengths: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' first ``columns`` columns, ``[rows, kv_heads, columns, dim]`` each, copied out of
    their tables' blocks. With ``lengths`` (``[rows]``, on the buffers' device), each row's
    columns from its length on are zeroed in the copy (they are masked, but must be finite)."""
    rows, width = tables.shape
    _, heads, block_size, dim = keys.shape
    needed = min(width, blocks_for(columns, block_size))
    index = tables[:, :needed].reshape(-1)
    out = []
    for buffer in (keys, values):
        taken = buffer.index_select(0, index).view(rows, needed, heads, block_size, dim)
        taken = taken.transpose(1, 2).reshape(rows, heads, needed * block_size, dim)[:, :, :columns]
        if lengths is not None:
            past = torch.arange(columns, device=buffer.device).view(1, 1, columns, 1) >= lengths.view(-1, 1, 1, 1)
            taken = taken.masked_fill(past, 0)
        out.append(taken)
    return out[0], out[1]


class CachePlan:
    """Where one transformers forward pass reads and writes: set by the runner before each call."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """No pass planned: empty tables and write places, and no copy of them on any device."""
        self.tables = torch.zeros((0, 1), dtype=torch.long)  # [rows, blocks]
        self.write_blocks = torch.zeros((0, 1), dtype=torch.long)  # [rows, queries]
        self.write_offsets = torch.zeros((0, 1), dtype=torch.long)
        self.lengths = torch.zeros(0, dtype=torch.long)  # [rows] columns each row may read after this pass
        self.columns = 0  # how many columns attention reads
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def set(
        self,
        tables: torch.Tensor,
        write_blocks: torch.Tensor,
        write_offsets: torch.Tensor,
        lengths: torch.Tensor,
        columns: int,
    ) -> None:
        self.tables, self.write_blocks, self.write_offsets = tables, write_blocks, write_offsets
        self.lengths, self.columns = lengths, columns
        self._on = {}

    def on(self, device: torch.device, heads: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The plan's write index, tables and lengths on ``device`` (once per step per device)."""
        found = self._on.get(device)
        if found is None:
            flat = flat_index(self.write_blocks.reshape(-1), self.write_offsets.reshape(-1), heads, block_size)
            found = (to_device(flat, device), to_device(self.tables, device), to_device(self.lengths, device))
            self._on[device] = found
        return found


class BlockLayer(CacheLayerMixin):  # type: ignore[misc]
    """One layer's blocks for transformers' forward: ``update`` writes this pass's keys and
    values and returns the rows' columns, gathered."""

    is_compileable = False
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, plan: CachePlan) -> None:
        super().__init__()
        self.keys = keys
        self.values = values
        self.device = keys.device
        self.is_initialized = True
        self._plan = plan

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # allocated up front

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.keys is not None and self.values is not None
        _, heads, block_size, _ = self.keys.shape
        flat, tables, lengths = self._plan.on(self.keys.device, heads, block_size)
        # [rows, heads, queries, dim] -> [rows, queries, heads, dim]: one vector per flat index
        write(self.keys, self.values, flat, key_states.transpose(1, 2), value_states.transpose(1, 2))
        return gather(self.keys, self.values, tables, self._plan.columns, lengths)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._plan.columns, 0

    def get_seq_length(self) -> int:
        return self._plan.columns

    def get_max_length(self) -> int:
        return -1


class PagedCache(Cache):  # type: ignore[misc]
    """``num_blocks`` blocks of ``block_size`` tokens (and one scratch block) in every layer."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        placements: list[tuple[torch.device, torch.dtype]],
    ) -> None:
        self.plan = CachePlan()
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch = num_blocks  # the block that padding writes to and short tables point at
        # Whether the blocks start zeroed (``finite_from_start``), not as uninitialised memory.
        self.zeroed = False
        layers: list[Any] = []
        for device, dtype in placements:
            shape = (num_blocks + 1, kv_heads, block_size, head_dim)
            keys = torch.empty(shape, dtype=dtype, device=device)
            values = torch.empty(shape, dtype=dtype, device=device)
            layers.append(BlockLayer(keys, values, self.plan))
        super().__init__(layers=layers)

    def finite_from_start(self) -> None:
        """Zero every block now and in every later pool (``reallocate``), for a reader that reads
        columns past a row's length through a mask (FlexAttention, ``flex``): a masked column's
        weight is 0, but 0 times a NaN that uninitialised memory held is NaN. After this, every
        column holds zeros or K/V a row once wrote. On a CPU it makes the whole pool resident."""
        self.zeroed = True
        for layer in self.layers:
            layer.keys.zero_()
            layer.values.zero_()

    @property
    def devices(self) -> list[torch.device]:
        return [layer.device for layer in self.layers]

    def nbytes(self) -> int:
        """Bytes committed for keys and values over all layers (the scratch block included)."""
        return sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in self.layers)

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of one token over all layers."""
        return sum(2 * layer.keys[0, :, 0].numel() * layer.keys.element_size() for layer in self.layers)

    def reallocate(self, num_blocks: int) -> None:
        """Every layer's keys and values anew, for ``num_blocks`` blocks and the scratch block,
        the old ones given back first: the KV pool sized once the engine's worst step has run on a
        probe pool (``memory``). Whoever kept a layer's old tensors must take them again."""
        self.release()
        if torch.cuda.is_available() and any(layer.device.type == "cuda" for layer in self.layers):
            torch.cuda.empty_cache()  # the old pool's memory goes back to the device, not kept beside the new one
        self.plan.clear()  # the last step's tables and write places went with the pool
        self.num_blocks = self.scratch = num_blocks
        for layer in self.layers:
            shape = (num_blocks + 1, *layer.keys.shape[1:])
            make = torch.zeros if self.zeroed else torch.empty
            layer.keys = make(shape, dtype=layer.keys.dtype, device=layer.device)
            layer.values = make(shape, dtype=layer.values.dtype, device=layer.device)

    def release(self) -> None:
        """Give every layer's keys and values back to the allocator, through every view of them
        (their storage shrinks to nothing): for an engine that has stopped. What still refers
        to the tensors (a frozen reference cycle, a graph's capture) holds no memory any more."""
        for layer in self.layers:
            for tensor in (layer.keys, layer.values):
                tensor.untyped_storage().resize_(0)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.plan.columns
