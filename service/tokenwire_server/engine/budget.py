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
