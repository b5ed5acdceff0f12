"""LoRA adapters: PEFT folders read with safetensors and checked against the base model.

A PEFT LoRA folder holds ``adapter_config.json`` and ``adapter_model.safetensors``, whose
tensors are named ``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight``:
A is ``[rank, in]``, B ``[out, rank]``, and the adapted layer computes
``y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ`` with ``s = lora_alpha / rank`` (``/ √rank`` with ``use_rslora``).
``read_adapter`` reads one and checks it against the base model's config: the target modules,
every tensor's shape, the rank against ``--max-lora-rank``; anything this server would not apply
exactly as PEFT does (DoRA, biases, per-module ranks, modules saved whole, embedding or head
adapters) is refused with the file and the reason. ``admit`` adds the server's rules for a load
(a name loaded once, at most ``--max-loras``), the same on every engine that applies adapters.
Applying them is the engine's (``engine/lora.py``; vLLM's own LoRA layers on ``--engine vllm``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from . import checkpoint
from .model import attention_shape

# The projections an adapter may target, and the sub-module each sits in.
TARGETS = checkpoint.PROJECTIONS
_TENSOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# adapter_config.json fields that change what the adapter computes; refused unless at these values.
_REFUSED = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "rank_pattern": {},
    "alpha_pattern": {},
    "modules_to_save": None,
    "layer_replication": None,
}


class AdapterError(ValueError):
    """A folder that is not an adapter this server can apply to its model; the message names
    the file and what does not match."""


@dataclasses.dataclass(frozen=True)
class Adapter:
    """One LoRA adapter's weights, float32 on the CPU: ``weights[(layer, module)] = (A, B)``."""

    name: str
    path: Path
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def modules(self) -> list[str]:
        return sorted({module for _, module in self.weights})


def projection_shapes(config: Any) -> dict[str, tuple[int, int]]:
    """``(out, in)`` of each projection an adapter may target, from the base model's config."""
    heads, kv_heads, head_dim = attention_shape(config)
    return checkpoint.projection_shapes(
        int(config.hidden_size), int(config.intermediate_size), heads, kv_heads, head_dim
    )


def _settings(folder: Path) -> dict[str, Any]:
    file = folder / "adapter_config.json"
    try:
        settings: dict[str, Any] = json.loads(file.read_text())
    except FileNotFoundError as exc:
        raise AdapterError(f"{file}: no such file (a PEFT LoRA folder has adapter_config.json)") from exc
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{file}: {exc}") from exc
    if settings.get("peft_type") != "LORA":
        raise AdapterError(f"{file}: peft_type {settings.get('peft_type')!r}; only LORA adapters are applied")
    for key, expected in _REFUSED.items():
        value = settings.get(key, expected)
        if value != expected and (value or expected):  # an empty list or dict counts as unset
            raise AdapterError(f"{file}: {key} = {value!r} is not applied by this server (expected {expected!r})")
    return settings


def read_adapter(name: str, folder: Path, config: Any, max_rank: int) -> Adapter:
    """The adapter in ``folder`` for a base model of ``config``; AdapterError when it is not one
    this server can apply exactly."""
    folder = Path(folder)
    settings = _settings(folder)
    file = folder / "adapter_config.json"
    rank = int(settings.get("r", 0))
    if rank < 1:
        raise AdapterError(f"{file}: r = {rank}; a LoRA rank is at least 1")
    if rank > max_rank:
        raise AdapterError(f"{file}: rank {rank} is over --max-lora-rank {max_rank}")
    alpha = float(settings.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    targets = settings.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise AdapterError(f"{file}: target_modules {unknown} are not projections of this model ({sorted(TARGETS)})")
    tensors_file = folder / "adapter_model.safetensors"
    if not tensors_file.is_file():
        raise AdapterError(f"{tensors_file}: no such file (read with safetensors; .bin adapters are not read)")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(tensors_file))
    except (OSError, SafetensorError) as exc:
        raise AdapterError(f"{tensors_file}: {exc}") from exc
    shapes = projection_shapes(config)
    layers = int(config.num_hidden_layers)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR.match(key)
        if match is None:
            raise AdapterError(f"{tensors_file}: tensor {key!r} is not a LoRA A/B of a decoder projection")
        layer, owner, module, half = int(match[1]), match[2], match[3], match[4]
        if module not in TARGETS or TARGETS[module] != owner or module not in targets:
            raise AdapterError(f"{tensors_file}: tensor {key!r}: {owner}.{module} is not among target_modules")
        if layer >= layers:
            raise AdapterError(f"{tensors_file}: tensor {key!r}: layer {layer}, the model has {layers}")
        out_features, in_features = shapes[module]
        expected = (rank, in_features) if half == "A" else (out_features, rank)
        if tuple(tensor.shape) != expected:
            raise AdapterError(
                f"{tensors_file}: tensor {key!r} is {tuple(tensor.shape)}, the model's {module} "
                f"with rank {rank} takes {expected}"
            )
        halves.setdefault((layer, module), {})[half] = tensor.detach().to(torch.float32).contiguous()
    weights = {}
    for place, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{tensors_file}: layer {place[0]} {place[1]} has lora_{''.join(pair)} alone")
        weights[place] = (pair["A"], pair["B"])
    if not weights:
        raise AdapterError(f"{tensors_file}: no LoRA tensors")
    return Adapter(name=name, path=folder, rank=rank, scaling=scaling, weights=weights)


def admit(name: str, folder: Path, loaded: list[str], max_loras: int, config: Any, max_rank: int) -> Adapter:
    """The adapter ``folder`` holds, once a load of it under ``name`` may go ahead beside the
    adapters ``loaded`` (hold the caller's lock across this and the load): AdapterExists,
    AdapterLimit, or InvalidAdapter naming the file and why."""
    from .domain import AdapterExists, AdapterLimit, InvalidAdapter

    if name in loaded:
        raise AdapterExists(f"adapter {name!r} is loaded already; unload it first (UnloadAdapter)")
    if len(loaded) >= max_loras:
        raise AdapterLimit(
            f"{len(loaded)} adapters are loaded, the server's most (--max-loras {max_loras}); unload one first"
        )
    try:
        return read_adapter(name, folder, config, max_rank)
    except AdapterError as exc:
        raise InvalidAdapter(str(exc)) from exc
