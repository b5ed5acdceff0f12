"""The batched engine's KV cache: fixed slots, allocated once.

Every layer holds one key and one value buffer of shape
``[slots, kv_heads, capacity + 1, head_dim]`` on the device of that layer's
weights (several GPUs with ``device_map="auto"`` each hold their own layers'
slots). A request owns one slot from the moment it is admitted until it leaves:
it joins by writing its prompt's keys and values into the slot (chunk by chunk)
and leaves by giving the slot back; no other row is copied, nothing is
concatenated per step. The last column (index ``capacity``) is scratch: padding
queries and idle slots write there, so they never touch anyone's tokens.

Rows are at different lengths. The engine plans each forward pass (``StepPlan``):
which slots take part (a contiguous range ``[start, stop)``, read as a view, or a
list, gathered), where each query's key/value is written, and how many columns
are read. The attention mask (built by the engine) hides, for each row, every
column past its own length, so a row computes what it would alone.

Columns past a row's length hold whatever an earlier occupant left there, or
zeros: each slot is zeroed lazily, up to the longest length read from it so far
(``ensure_clean``), so masked columns are always finite (uninitialised memory
could hold NaN, and NaN times a zero attention weight is still NaN), and on a CPU
only the pages in use become resident. A reader that never goes past its own row's
written columns needs none of it: the native pass zeroes only for its grouped
one-token reads (stock torch ops), and otherwise just records what it wrote
(``written``), so a slot's pages become resident as its own row fills them, and
never because another row in the step is longer.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


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


def layer_placements(model: Any, count: int, default_device: torch.device, default_dtype: torch.dtype) -> list[tuple[torch.device, torch.dtype]]:
    """Device and dtype of each decoder layer's attention weights (where its KV cache must live).

    With ``device_map="auto"`` the layers are spread over several GPUs: each layer's
    slots go where its weights are. A layer whose weights cannot be found (or that
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


CLEAN_STEP = 128


def flat_index(rows: torch.Tensor, cols: torch.Tensor, heads: int, width: int) -> torch.Tensor:
    """Where each (row, query, head) vector goes in a layer's buffer flattened to
    ``[slots * heads * width, dim]``: ``rows`` ``[n, 1]`` is each row's slot, ``cols``
    ``[n, queries]`` each query's column; the order is row, query, head."""
    head = torch.arange(heads, dtype=torch.long).view(1, 1, heads)
    return ((rows.unsqueeze(-1) * heads + head) * width + cols.unsqueeze(-1)).reshape(-1)


def read_slots(
    keys: torch.Tensor, values: torch.Tensor, slots: tuple[int, int] | torch.Tensor, columns: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``columns`` columns of these slots: a view of a range ``(start, stop)``,
    or gathered for an index tensor."""
    if isinstance(slots, tuple):
        start, stop = slots
        return keys[start:stop, :, :columns], values[start:stop, :, :columns]
    return keys[:, :, :columns].index_select(0, slots), values[:, :, :columns].index_select(0, slots)


class StepPlan:
    """Where one forward pass reads and writes: set by the engine before each call."""

    def __init__(self) -> None:
        self.start = 0
        self.stop = 0
        self.index: torch.Tensor | None = None  # slots as a list (gathered); None: the range [start, stop)
        self.write_rows = torch.zeros((0, 1), dtype=torch.long)  # [batch, 1] slot of each row
        self.write_cols = torch.zeros((0, 1), dtype=torch.long)  # [batch, queries] column of each query
        self.columns = 0  # how many columns attention reads
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def set(self, slots: list[int], write_cols: torch.Tensor, columns: int) -> None:
        self.start, self.stop = slots[0], slots[0] + len(slots)
        contiguous = slots == list(range(self.start, self.stop))
        self.index = None if contiguous else torch.tensor(slots, dtype=torch.long)
        self.write_rows = torch.tensor(slots, dtype=torch.long).unsqueeze(1)
        self.write_cols = write_cols
        self.columns = columns
        self._on = {}

    def on(self, device: torch.device, heads: int, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The plan's indices on ``device`` (built once per step per device): where each
        (row, query, head) vector goes in the buffer flattened to ``[slots * heads * width, dim]``,
        and the slots to gather (None for a range)."""
        found = self._on.get(device)
        if found is None:
            flat = flat_index(self.write_rows, self.write_cols, heads, width)
            found = (flat.to(device), None if self.index is None else self.index.to(device))
            self._on[device] = found
        return found


class SlotLayer(CacheLayerMixin):  # type: ignore[misc]
    """One layer's slots. ``update`` writes this step's keys/values and returns what attention reads."""

    is_compileable = False
    is_sliding = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, plan: StepPlan) -> None:
        super().__init__()
        self.keys = keys
        self.values = values
        self.device = keys.device
        self.is_initialized = True
        self._plan = plan

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # allocated up front

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.keys is not None and self.values is not None
        plan = self._plan
        _, heads, width, dim = self.keys.shape
        flat, index = plan.on(self.keys.device, heads, width)
        # [batch, heads, queries, dim] -> [batch, queries, heads, dim]: one vector per flat index
        # (index_copy_ on the flattened buffer: far cheaper on a CPU than advanced-index assignment)
        self.keys.view(-1, dim).index_copy_(0, flat, key_states.transpose(1, 2).reshape(-1, dim).to(self.keys.dtype))
        self.values.view(-1, dim).index_copy_(0, flat, value_states.transpose(1, 2).reshape(-1, dim).to(self.values.dtype))
        return read_slots(self.keys, self.values, (plan.start, plan.stop) if index is None else index, plan.columns)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._plan.columns, 0

    def get_seq_length(self) -> int:
        return self._plan.columns

    def get_max_length(self) -> int:
        assert self.keys is not None
        return int(self.keys.shape[2]) - 1


class SlotCache(Cache):  # type: ignore[misc]
    """``max_active`` slots of ``capacity`` tokens in every layer, allocated once."""

    def __init__(
        self,
        slots: int,
        capacity: int,
        kv_heads: int,
        head_dim: int,
        placements: list[tuple[torch.device, torch.dtype]],
    ) -> None:
        self.plan = StepPlan()
        self.slots = slots
        self.capacity = capacity
        self.scratch = capacity  # the column that padding and idle slots write to
        self._clean = [0] * slots  # per slot: columns [0, clean) are zeroed or written
        layers: list[Any] = []
        for device, dtype in placements:
            shape = (slots, kv_heads, capacity + 1, head_dim)
            # torch.empty: on a CPU the pages stay virtual until ensure_clean touches them
            keys = torch.empty(shape, dtype=dtype, device=device)
            values = torch.empty(shape, dtype=dtype, device=device)
            keys[:, :, capacity].zero_()
            values[:, :, capacity].zero_()
            layers.append(SlotLayer(keys, values, self.plan))
        super().__init__(layers=layers)

    @property
    def devices(self) -> list[torch.device]:
        return [layer.device for layer in self.layers]

    def ensure_clean(self, slots: list[int], columns: int) -> None:
        """Zero these slots' columns up to ``columns`` before attention reads them.

        Per slot and in steps of ``CLEAN_STEP`` columns, so a long prompt read in chunks
        zeroes (and, on a CPU, first-touches) a little at a time instead of stalling one
        step. Only columns past the slot's frontier are zeroed: everything ever written
        lies below it (``written``).
        """
        upto = min(self.capacity, -(-columns // CLEAN_STEP) * CLEAN_STEP)
        for slot in slots:
            start = self._clean[slot]
            if start >= columns:
                continue
            for layer in self.layers:
                layer.keys[slot, :, start:upto].zero_()
                layer.values[slot, :, start:upto].zero_()
            self._clean[slot] = upto

    def written(self, slot: int, end: int) -> None:
        """This step writes the slot's columns up to ``end`` (a row writes its columns in
        order from 0): they are never zeroed later. For a reader that stays within its
        own rows' written columns, as the native pass's does, and so needs no zeroing."""
        if self._clean[slot] < end:
            self._clean[slot] = end

    def nbytes(self) -> int:
        return sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in self.layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.plan.columns
