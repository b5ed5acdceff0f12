"""The KV-cache budget: one function from the configuration and the device to the tokens
of KV cache the engine commits at start-up (``kv_cache_budget``), for every engine.

- ``--kv-cache-tokens N``: N, and on a GPU a refusal to start where N does not fit the
  memory left after loading (the operator asked for it: serving less would break their sizing).
- ``--kv-cache-tokens 0`` (derived):
  - the batched engine on a GPU: what ``--kv-cache-memory-fraction`` of the device leaves
    once the weights, the engine and its worst step are counted (as vLLM's
    gpu_memory_utilization); the engine sizes it itself, last (``KvBudget.memory``; ``memory``);
  - elsewhere: ``max_active × min(context, 2048)``, and never less than one full context, so
    that any request the context admits fits (an engine that checks this at start, as vLLM
    does, would otherwise refuse to start with a small ``--max-active``); on a GPU lowered,
    with a warning, to what fits the free memory.
- The batched engine holds whole blocks: its budget is rounded down to them (one at least).
"""

from __future__ import annotations

import dataclasses
import logging

from ..model import LoadedModel, device_memory, fit_kv_budget, free_device_memory
from .blocks import BLOCK_SIZE, blocks_for
from .memory import DeviceMemory

log = logging.getLogger(__name__)

# A derived budget lets each active stream hold this many tokens (or its context, if less).
TOKENS_PER_STREAM = 2048
# ``--max-active 0``: this many streams, except where the batched engine sizes its pool from a
# GPU's memory (``active_streams``), which takes up to the largest batch bucket.
DEFAULT_MAX_ACTIVE = 16
AUTO_BUCKETS = (16, 32, 64, 128)


@dataclasses.dataclass(frozen=True)
class KvBudget:
    tokens: int
    how: str  # where the figure came from, for the start-up log
    warning: str = ""  # set where a derived budget was lowered to fit the device
    # Set where the engine sizes the pool from this device's memory after its worst step
    # (``tokens`` is then 0 until it has: ``EngineLimits.kv_memory``).
    memory: DeviceMemory | None = None


# vLLM keeps one block of its pool for itself (the null block) and refuses to start unless the
# rest holds one full context: a derived budget for it adds one of its largest blocks.
VLLM_RESERVED_TOKENS = 128


def derived_tokens(max_active: int, context_length: int, reserved: int = 0) -> int:
    """``max_active × min(context, 2048)``, and at least one full context (plus ``reserved``,
    what the engine keeps for itself)."""
    return max(max_active * min(context_length, TOKENS_PER_STREAM), context_length + reserved)


def kv_cache_budget(
    requested: int,
    max_active: int,
    context_length: int,
    bytes_per_token: int,
    *,
    loaded: LoadedModel | None = None,
    memory_fraction: float = 0.9,
    blocks: bool = True,
    reserved: int = 0,
) -> KvBudget:
    """The KV budget in tokens (module docstring). ``requested``: ``--kv-cache-tokens`` (0:
    derive it); ``reserved``: tokens of its pool the engine keeps for itself; ``loaded``: the
    model, when it is loaded here (its device's memory is read on CUDA); ``blocks``: the
    batched engine (a paged cache: whole blocks, and on a GPU a derived budget from the
    device's memory)."""
    derived = requested == 0
    tokens = derived_tokens(max_active, context_length, reserved) if derived else requested
    how = "max_active x min(context, 2048), at least one context" if derived else "--kv-cache-tokens"
    warning = ""
    free = free_device_memory(loaded) if loaded is not None else None
    if loaded is not None and free is not None:
        if blocks and derived:
            # The paged cache commits its whole budget at start: the engine sizes it from the
            # device once it has measured its worst step.
            device = loaded.device
            memory = DeviceMemory(lambda: device_memory(device), memory_fraction)
            how = f"{memory_fraction:g} of the device's memory, after the engine's worst step"
            return KvBudget(0, how, memory=memory)
        else:
            tokens, warning = fit_kv_budget(tokens, derived, bytes_per_token, free)
    if blocks:  # the paged cache holds whole blocks: the budget is what they hold
        # A derived budget rounds up (it is at least one context); one given or read off
        # the device's memory rounds down (it must fit).
        up = derived and how.startswith("max_active") and not warning
        tokens = max(
            BLOCK_SIZE, blocks_for(tokens, BLOCK_SIZE) * BLOCK_SIZE if up else tokens // BLOCK_SIZE * BLOCK_SIZE
        )
    return KvBudget(tokens, how, warning)


def active_streams(
    requested: int,
    *,
    memory: DeviceMemory | None,
    context_length: int,
    bytes_per_token: int,
    layers: int,
) -> tuple[int, str]:
    """``--max-active``, and why: as given, or (0) from the KV a GPU's memory leaves.

    Off a GPU, or where the pool is not sized from the device (``memory`` None: another engine,
    or ``--kv-cache-tokens`` given), ``DEFAULT_MAX_ACTIVE``. Sized from the device: the largest
    of ``AUTO_BUCKETS`` (the batch buckets a graphed step pads to) such that

    - half the room (``fraction`` of the device less what the weights and the engine hold) holds
      that many streams of min(context, 2048) tokens: the other half is left to longer rows and
      the worst step;
    - a quarter of the room holds the worst decode step's gather: every row's keys and values of
      one layer at the widest table, the whole context (stock attention gathers each row to the
      widest, ``engine.memory``), so that more rows never narrow the context;

    and at least the default, where the room holds one row of the whole context twice (else the
    context is narrowed already, and every row more would narrow it further: the default)."""
    if requested > 0:
        return requested, "--max-active"
    if memory is None:
        return DEFAULT_MAX_ACTIVE, f"auto: {DEFAULT_MAX_ACTIVE} (the KV pool is not sized from a GPU's memory)"
    total, free = memory.read()
    room = int(total * memory.fraction) - (total - free)
    per_stream = bytes_per_token * min(context_length, TOKENS_PER_STREAM)
    gather = bytes_per_token * context_length // max(layers, 1)  # one row's K/V of one layer at the whole context
    if room < 2 * bytes_per_token * context_length:
        why = (
            f"auto: {DEFAULT_MAX_ACTIVE} (the room, {room >> 20} MiB, holds a row of the whole context less than twice)"
        )
        return DEFAULT_MAX_ACTIVE, why
    fits = [rows for rows in AUTO_BUCKETS if rows * per_stream <= room // 2 and rows * gather <= room // 4]
    rows = max([DEFAULT_MAX_ACTIVE, *fits])
    return rows, (
        f"auto: {rows} on the room {room >> 20} MiB leaves (streams of {min(context_length, TOKENS_PER_STREAM)} "
        f"tokens in half of it, the widest step's gather in a quarter; at most {AUTO_BUCKETS[-1]})"
    )
