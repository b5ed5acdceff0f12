"""A Llama checkpoint read as plain torch modules, without transformers' model code.

The native pass (engine/native.py) computes the forward pass itself; what it takes from the
loaded model is its config and its weights under transformers' names (``model.layers[i].
self_attn.q_proj.weight``, ...). Importing transformers' Llama code to hold them costs more than
a second of a server's start (``transformers.models.llama`` pulls in torch._dynamo, sympy and
torch.distributed.tensor), and ``--dtype bfloat16`` converts 135M float32 weights on every start.

So where the engine will run the model through the native pass only (the batched engine on a
CPU, ``load_model(native_only=True)``), a checkpoint this module can read exactly is read here:
the same tensors, under the same names, in the same dtype as ``AutoModelForCausalLM`` loads
them (tests/test_checkpoint.py compares every weight and the native pass's logits). A converted
copy in another dtype is kept in tokenwire's cache beside the default model, so a later start maps
it rather than converting again. Anything else (another architecture, a rope scaling, biases,
a quantized or GGUF checkpoint, an unexpected tensor name) is read by transformers, as before;
``refusal`` says why.

These modules have no ``forward``: ``PlainLlama.forward`` raises, and ``engine/options.resolve``
refuses transformers' forward for them.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("tokenwire.model")

ARCHITECTURE = "LlamaForCausalLM"
# A Llama decoder layer's projections, each with the sub-module that holds it (what a LoRA
# adapter may target too: ``adapters``).
PROJECTIONS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
_NORMS = ("input_layernorm", "post_attention_layernorm")
_LAYER_WEIGHTS = (*(f"{owner}.{name}" for name, owner in PROJECTIONS.items()), *_NORMS)


# LlamaConfig's defaults, for what a config.json leaves out (tests/test_checkpoint.py holds them to it).
LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "pad_token_id": None,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pretraining_tp": 1,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
}


def _config(folder: Path) -> dict[str, Any]:
    """config.json over LlamaConfig's defaults, with its derived head_dim and KV heads."""
    data: dict[str, Any] = {**LLAMA_DEFAULTS, **json.loads((folder / "config.json").read_text())}
    data["head_dim"] = data.get("head_dim") or int(data["hidden_size"]) // int(data["num_attention_heads"])
    data["num_key_value_heads"] = data.get("num_key_value_heads") or data["num_attention_heads"]
    return data


def _rope_type(config: dict[str, Any]) -> str | None:
    """The rope type config.json names: transformers 5 writes ``rope_parameters``, 4.x ``rope_scaling``."""
    parameters = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    return None if kind is None else str(kind)


def _rope_theta(config: dict[str, Any]) -> float:
    parameters = config.get("rope_parameters") or {}
    return float(parameters.get("rope_theta", config.get("rope_theta", 10000.0)))


def _index(folder: Path) -> dict[str, tuple[Path, tuple[int, ...]]] | None:
    """Each tensor's safetensors file (one file, or an index's shards) and shape, from the
    files' headers (no tensor is read); None: no safetensors."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted({folder / file for file in weight_map.values()})
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        return None
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in files:
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                found[name] = (file, tuple(handle.get_slice(name).get_shape()))
    return found


def projection_shapes(hidden: int, inner: int, heads: int, kv_heads: int, head_dim: int) -> dict[str, tuple[int, int]]:
    """``(out, in)`` of each of a Llama layer's projections (``PROJECTIONS``)."""
    queries, keys = heads * head_dim, kv_heads * head_dim
    return {
        "q_proj": (queries, hidden),
        "k_proj": (keys, hidden),
        "v_proj": (keys, hidden),
        "o_proj": (hidden, queries),
        "gate_proj": (inner, hidden),
        "up_proj": (inner, hidden),
        "down_proj": (hidden, inner),
    }


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The tensors a Llama checkpoint of this config holds, and their shapes (the head only when untied)."""
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    projections = projection_shapes(
        hidden, int(config["intermediate_size"]), int(config["num_attention_heads"]),
        int(config["num_key_value_heads"]), int(config["head_dim"]),
    )  # fmt: skip
    layer: dict[str, tuple[int, ...]] = {f"{PROJECTIONS[name]}.{name}": shape for name, shape in projections.items()}
    layer.update(dict.fromkeys(_NORMS, (hidden,)))
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for index in range(int(config["num_hidden_layers"])):
        shapes.update({f"model.layers.{index}.{weight}.weight": shape for weight, shape in layer.items()})
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def refusal(folder: Path) -> str | None:
    """Why this folder is left to transformers (None: ``load`` reads it exactly)."""
    try:
        config = _config(folder)
    except (OSError, ValueError) as exc:
        return f"config.json: {exc}"
    if config.get("architectures") != [ARCHITECTURE] or config.get("model_type") != "llama":
        return f"architectures {config.get('architectures')} (read here: {ARCHITECTURE})"
    if config.get("quantization_config"):
        return "a quantization_config"
    rope = _rope_type(config)
    if rope != "default":
        return f"rope type {rope!r} (read here: default)"
    if float((config.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)) != 1.0:
        return "a partial rotary factor"
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            return flag
    if config.get("hidden_act", "silu") != "silu" or int(config.get("pretraining_tp", 1) or 1) != 1:
        return "hidden_act or pretraining_tp"
    if (folder / "adapter_config.json").is_file() or config.get("auto_map"):
        return "an adapter or custom code"
    try:
        found = _index(folder)
    except (OSError, ValueError, KeyError) as exc:
        return f"the safetensors index: {exc}"
    if found is None:
        return "no model.safetensors"
    names = set(found)
    shapes = expected_shapes(config)
    expected = set(shapes)
    # A tied checkpoint may still carry the head's copy (transformers ignores it when tying).
    extra = names - expected - ({"lm_head.weight"} if config["tie_word_embeddings"] else set())
    if expected - names or extra:
        missing = sorted(expected - names)[:3]
        return f"tensor names: missing {missing}, unexpected {sorted(extra)[:3]}"
    wrong = [f"{name} {found[name][1]} (config: {shape})" for name, shape in shapes.items() if found[name][1] != shape]
    if wrong:
        return f"shapes that do not match config.json: {', '.join(wrong[:2])}"
    return None


class RotaryEmbedding(torch.nn.Module):
    """transformers' ``LlamaRotaryEmbedding`` for rope type "default", to the bit: (cos, sin) of
    ``position_ids × inv_freq`` in float32, returned in ``x``'s dtype."""

    def __init__(self, theta: float, dim: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.inv_freq: torch.Tensor
        self.attention_scaling = 1.0

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class Weight(torch.nn.Module):
    """A module that only holds a weight: an RMSNorm's or the embedding table (the native pass computes them)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    """A bias-free ``nn.Linear`` holding ``weight`` as it is: no copy, and no initialisation
    (even on the meta device, ``reset_parameters`` imports torch._dynamo, most of a second)."""
    linear = torch.nn.Linear.__new__(torch.nn.Linear)
    torch.nn.Module.__init__(linear)
    linear.in_features, linear.out_features = int(weight.shape[1]), int(weight.shape[0])
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    linear.register_parameter("bias", None)
    return linear


class Attention(torch.nn.Module):
    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.q_proj, self.k_proj = _linear(weights["q_proj"]), _linear(weights["k_proj"])
        self.v_proj, self.o_proj = _linear(weights["v_proj"]), _linear(weights["o_proj"])


class MLP(torch.nn.Module):
    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = _linear(weights["gate_proj"]), _linear(weights["up_proj"])
        self.down_proj = _linear(weights["down_proj"])


class DecoderLayer(torch.nn.Module):
    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.self_attn = Attention(weights)
        self.mlp = MLP(weights)
        self.input_layernorm = Weight(weights["input_layernorm"])
        self.post_attention_layernorm = Weight(weights["post_attention_layernorm"])


class Decoder(torch.nn.Module):
    def __init__(self, embed: torch.Tensor, layers: list[DecoderLayer], norm: torch.Tensor, rotary: RotaryEmbedding):
        super().__init__()
        self.embed_tokens = Weight(embed)
        self.layers = torch.nn.ModuleList(layers)
        self.norm = Weight(norm)
        self.rotary_emb = rotary


class PlainLlama(torch.nn.Module):
    """A Llama checkpoint's weights under transformers' names, its config and generation config."""

    def __init__(self, config: Any, generation_config: Any, decoder: Decoder, head: torch.Tensor | None) -> None:
        super().__init__()
        self.config = config
        self.generation_config = generation_config
        self.model = decoder
        # Tied: the head is the embedding table itself, as transformers ties it.
        self.lm_head = _linear(decoder.embed_tokens.weight if head is None else head)
        if head is None:
            self.lm_head.weight = decoder.embed_tokens.weight
        # Where the native pass may keep the GEMM panels it lays out from these weights, and the
        # weights' files' newest mtime (``load`` sets both; None: keep nothing).
        self.packed_stem: Path | None = None
        self.weights_mtime = 0.0

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.lm_head

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a checkpoint read by tokenwire_server.checkpoint runs through the native pass only")


def _converted_path(folder: Path, dtype: torch.dtype, cache_root: Path | None, kind: str = "converted") -> Path | None:
    """Where a copy of ``folder``'s weights in ``dtype`` is kept: beside it, in tokenwire's own
    cache only (a folder the operator named is not ours to write next to). ``kind``: "converted"
    (the checkpoint's tensors in ``dtype``) or "packed" (the stem of the native pass's GEMM
    panels laid out from them, ``engine/panel_store``)."""
    if cache_root is None or folder.resolve().parent != cache_root.resolve():
        return None
    stem = cache_root / kind / f"{folder.name}.{str(dtype).removeprefix('torch.')}"
    return stem if kind == "packed" else stem.with_name(stem.name + ".safetensors")


def _tensors(shards: dict[str, Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in sorted(set(shards.values())):
        with safe_open(str(file), "pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, handle.get_tensor(name)


def _weights(
    folder: Path, shards: dict[str, Path], newest: float, dtype: torch.dtype, cache_root: Path | None
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (``shards``: each tensor's file, the newest modified at
    ``newest``) in ``dtype``: mapped from the file where it is in that dtype (the checkpoint's,
    or the converted copy), else converted once and the copy kept."""
    kept = _converted_path(folder, dtype, cache_root)
    if kept is not None and kept.is_file() and kept.stat().st_mtime >= newest:
        return dict(_tensors(dict.fromkeys(shards, kept)))
    weights: dict[str, torch.Tensor] = {}
    converted = False
    for name, tensor in _tensors(shards):
        if tensor.dtype != dtype and tensor.is_floating_point():
            # copy_ converts with vector code on every thread; .to() took twice as long here.
            tensor = torch.empty(tensor.shape, dtype=dtype).copy_(tensor)
            converted = True
        weights[name] = tensor
    if converted and kept is not None:
        kept.parent.mkdir(parents=True, exist_ok=True)
        scratch = kept.with_suffix(f".{os.getpid()}.tmp")
        try:
            write_safetensors(scratch, weights)
            scratch.replace(kept)  # atomic: a server starting beside this one maps the whole copy or none
            log.info("kept a converted copy of the weights", extra={"path": str(kept), "dtype": str(dtype)})
        except OSError as exc:  # a full or read-only cache: convert again next time
            log.warning("could not keep a converted copy of the weights", extra={"path": str(kept), "error": str(exc)})
            scratch.unlink(missing_ok=True)
    return weights


def load(folder: Path, dtype: torch.dtype, cache_root: Path | None = None) -> PlainLlama:
    """The checkpoint in ``folder`` (``refusal(folder)`` is None) on the CPU in ``dtype``."""
    from transformers import GenerationConfig, PreTrainedConfig

    data = _config(folder)
    config = PreTrainedConfig(**{key: value for key, value in data.items() if key != "transformers_version"})
    if (folder / "generation_config.json").is_file():
        generation = GenerationConfig.from_pretrained(folder)
    else:  # what from_model_config takes from a config
        generation = GenerationConfig(
            **{key: data[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in data}
        )
    found = _index(folder)
    assert found is not None, "refusal() checks for safetensors first"
    shards = {name: file for name, (file, _) in found.items()}
    newest = max(file.stat().st_mtime for file in set(shards.values()))
    weights = _weights(folder, shards, newest, dtype, cache_root)
    layers = []
    for index in range(int(data["num_hidden_layers"])):
        prefix = f"model.layers.{index}."
        layers.append(
            DecoderLayer({weight.rsplit(".", 1)[-1]: weights[f"{prefix}{weight}.weight"] for weight in _LAYER_WEIGHTS})
        )
    decoder = Decoder(
        weights["model.embed_tokens.weight"],
        layers,
        weights["model.norm.weight"],
        RotaryEmbedding(_rope_theta(data), int(data["head_dim"])),
    )
    head = None if data["tie_word_embeddings"] else weights["lm_head.weight"]
    model = PlainLlama(config, generation, decoder, head).eval()
    model.packed_stem = _converted_path(folder, dtype, cache_root, "packed")
    model.weights_mtime = newest
    return model


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """``tensors`` (on the CPU) as a safetensors file, each written from its own memory: the
    library's ``save_file`` first copies every tensor to bytes, a second model's worth of peak
    memory at the start that keeps a converted copy or the GEMM panels."""
    import struct

    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        for tensor in tensors.values():
            out.write(tensor.contiguous().view(torch.uint8).numpy().data)
