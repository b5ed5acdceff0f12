"""Weight quantization (model loading's room): ``--quantization none|int8|int4|fp8``.

Weight-only: activations keep the model's dtype, so a layer's output is close to
the full-precision one (``make bench-levers`` measures how close). The scales come
from torchao's quantizer (``choose_qparams_affine`` / ``quantize_affine``, symmetric,
one scale per output channel); tokenwire does not write its own.

- **int8** (CPU and CUDA): every linear layer, the vocabulary projection included,
  becomes an ``Int8Linear``: int8 weights and per-channel scales replace the
  full-precision ones. On a CPU the product is PyTorch's own weight-only kernel
  (``torch._weight_int8pack_mm``, bf16 activations in, the model's dtype out; it
  dispatches by instruction set itself). Elsewhere it dequantizes the weight in
  the step (correct, not tuned). The native pass and transformers' forward both
  run these layers (``NativeForward`` fuses them as it fuses full-precision ones).
  The embedding table stays in full precision: a lookup reads a few rows, not the
  table, so it costs memory, not speed.
- **int4** (CUDA): torchao's ``Int4WeightOnlyConfig`` (groups of 128, the tinygemm
  kernel in PyTorch), through transformers' forward. Not offered on a CPU: PyTorch's
  int4 CPU kernel ran at 0.29x float32 on this project's bench (``make bench-kernels``).
- **fp8** (CUDA, compute capability 8.9 and up): torchao's ``Float8WeightOnlyConfig``,
  through transformers' forward. No CPU has fp8 arithmetic.

A checkpoint that is already quantized (bitsandbytes, GPTQ, AWQ, ...: its config has
a ``quantization_config``) loads through transformers' own integration on CUDA; on a
CPU it is refused at start-up, naming what is supported.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
# transformers imports torchao whenever it is installed (its torchao quantizer), even for a
# model that is not quantized. torchao then warns of the CUDA-only extensions it skips on a
# CPU host, and torch's pytree of an enum torchao registers, in torch's own log format (not
# the server's JSON lines): nothing an operator can act on.
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)

QUANTIZATION_CHOICES = ("none", "int8", "int4", "fp8")
# Pre-quantized checkpoints transformers loads natively on CUDA (config.json's
# ``quantization_config.quant_method``) when their kernels' package is installed.
PREQUANTIZED_ON_CUDA = ("bitsandbytes", "gptq", "awq", "fp8", "compressed-tensors", "torchao")


# What ``make bench-quality`` measured of each mode on the default model, per device kind;
# written by that bench, read here at start-up.
QUALITY_FILE = Path(__file__).with_name("quality.json")


def quality_verdict(mode: str, device_type: str, path: Path | None = None) -> tuple[bool | None, str]:
    """``(meets the bar, what was measured)`` for ``mode`` on ``device_type``; None: not measured there."""
    path = path or QUALITY_FILE
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return None, f"no quality figures ({path.name} unreadable)"
    bar = table.get("bar", {})
    entry = table.get("modes", {}).get(mode, {}).get(device_type)
    if not entry:
        return None, f"{mode} is not measured on {device_type} yet (make bench-quality)"
    figures = (
        f"{mode} on {device_type} ({entry.get('host', '?')}, {entry.get('measured', '?')}): "
        f"KL {entry['kl']:.4f} nats/token, "
        f"{entry['identical']}/{entry['of']} greedy answers identical over {bar.get('greedy_tokens', '?')} tokens; "
        f"the bar is KL <= {bar.get('kl')} and >= {bar.get('identical')}/{bar.get('of')}"
    )
    return bool(entry.get("meets_bar")), figures


class QuantizationError(ValueError):
    """The asked-for quantization is not offered here; the message says why and what is."""


def offered(mode: str, device: torch.device, capability: tuple[int, int] | None = None) -> str | None:
    """Why ``mode`` is not offered on ``device`` (None: it is)."""
    if mode not in QUANTIZATION_CHOICES:
        return f"unknown quantization {mode!r}; expected one of {', '.join(QUANTIZATION_CHOICES)}"
    if mode in ("none", "int8"):
        return None
    if device.type != "cuda":
        if mode == "int4":
            return (
                "int4 is not offered on a CPU: PyTorch's int4 CPU kernel computes at a third of float32's speed "
                "(make bench-kernels); use --quantization int8 (per-channel int8 weights)"
            )
        return (
            "fp8 needs a CUDA device of compute capability 8.9 or newer (no CPU computes in fp8); "
            "use --quantization int8"
        )
    if mode == "fp8" and (capability is None or capability < (8, 9)):
        return f"fp8 needs compute capability 8.9 or newer (Ada, Hopper); this GPU is {capability}; use int8 or int4"
    return None


def prequantized_method(config: Any) -> str | None:
    """The checkpoint's own quantization (``quantization_config.quant_method``), or None;
    ``config`` is config.json read as a dict, or a transformers config."""
    qc = config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config", None)
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    method = str(getattr(method, "value", method) or "unknown")  # transformers' QuantizationMethod enum
    # GGUF is dequantized as transformers loads it, and a folder converted from a GGUF (the
    # default model's) keeps the marker over full-precision weights.
    return None if method == "gguf" else method


def prequantized_refusal(method: str, device: str) -> str | None:
    """Why a checkpoint quantized by ``method`` cannot load on ``device`` (None: it can)."""
    if device == "cuda":
        return None
    return (
        f"the checkpoint is already quantized ({method}); its kernels need a CUDA device. On a CPU tokenwire serves "
        f"full-precision checkpoints (float32, bfloat16, float16 or GGUF), "
        f"quantized at start-up with --quantization int8. "
        f"Pre-quantized checkpoints load on CUDA: {', '.join(PREQUANTIZED_ON_CUDA)}"
    )


def _torchao_quantizer() -> tuple[Any, Any, Any]:
    """torchao's affine quantization primitives."""
    from torchao.quantization.quant_primitives import MappingType, choose_qparams_affine, quantize_affine

    return MappingType, choose_qparams_affine, quantize_affine


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 weights [out, in], float32 scales [out])``: symmetric, one scale per output
    channel, by torchao's quantizer; ``weight ≈ qdata * scale[:, None]``."""
    mapping, choose, quantize = _torchao_quantizer()
    w = weight.detach().float()
    block = (1, w.shape[1])
    scale, zero = choose(
        w,
        mapping.SYMMETRIC,
        block,
        torch.int8,
        quant_min=-128,
        quant_max=127,
        eps=torch.finfo(torch.float32).eps,
        scale_dtype=torch.float32,
        zero_point_dtype=torch.int8,
    )
    qdata = quantize(w, block, scale, zero, torch.int8, quant_min=-128, quant_max=127)
    return qdata.contiguous(), scale.reshape(-1).float().contiguous()


class Int8Linear(torch.nn.Module):
    """A linear layer with int8 weights and a scale per output channel (weight-only).

    ``kernel``: ``int8pack`` (PyTorch's CPU kernel, bf16 activations) or ``dequant``
    (the weight dequantized in the step, any device). ``int8pack`` computes each row on its
    own, so a row's output does not depend on the rows beside it, bit for bit; ``dequant``
    is a float GEMM, as row-invariant as ``F.linear`` (to float rounding).
    """

    qdata: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self, qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, kernel: str | None = None
    ) -> None:
        super().__init__()
        self.in_features = int(qdata.shape[1])
        self.out_features = int(qdata.shape[0])
        self.kernel = kernel or self.default_kernel(qdata.device)
        if self.kernel not in ("int8pack", "dequant"):
            raise ValueError(f"unknown int8 kernel {self.kernel!r}")
        self.register_buffer("qdata", qdata)
        # The CPU kernel takes its scales in the activations' dtype (bf16).
        self.register_buffer("scale", scale.to(torch.bfloat16) if self.kernel == "int8pack" else scale.float())
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    @staticmethod
    def default_kernel(device: torch.device) -> str:
        """PyTorch's int8 kernel on a CPU; the dequantizing GEMM elsewhere."""
        return "int8pack" if device.type == "cpu" else "dequant"

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, kernel: str | None = None) -> Int8Linear:
        qdata, scale = quantize_int8(linear.weight)
        return cls(qdata.to(linear.weight.device), scale.to(linear.weight.device), linear.bias, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        if self.kernel == "int8pack":
            out = torch._weight_int8pack_mm(rows.to(torch.bfloat16).contiguous(), self.qdata, self.scale).to(x.dtype)
        else:
            out = F.linear(rows, self.qdata.to(x.dtype)) * self.scale.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*shape[:-1], self.out_features)

    def plus(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``, as ``native.Linear.plus``."""
        out: torch.Tensor = residual + self.forward(x)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"


def _replace_linears(model: torch.nn.Module, make: Any) -> int:
    """Swap every ``nn.Linear`` for ``make(linear)``; the old weight is dropped as each goes,
    so the peak holds one layer twice at most. Returns how many were swapped."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, make(child))
                count += 1
    return count


def _tensor_bytes(tensor: torch.Tensor, seen: set[int]) -> int:
    """Bytes behind ``tensor``; a tensor subclass (torchao's) counts the tensors it holds."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) and hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(tensor, name), seen) for name in names)
    if tensor.device.type == "meta":
        return 0
    key = tensor.untyped_storage().data_ptr()
    if key in seen:
        return 0
    seen.add(key)
    return int(tensor.untyped_storage().nbytes())


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once."""
    seen: set[int] = set()
    return sum(_tensor_bytes(t, seen) for t in [*model.parameters(), *model.buffers()] if t is not None)


def quantize_model(
    model: torch.nn.Module, mode: str, device: torch.device, capability: tuple[int, int] | None = None
) -> dict[str, Any]:
    """Quantize ``model``'s linear layers in place; returns what was done, for the log.

    Raises ``QuantizationError`` when ``mode`` is not offered on ``device``.
    """
    reason = offered(mode, device, capability)
    if reason:
        raise QuantizationError(f"--quantization {mode}: {reason}")
    if mode == "none":
        return {"quantization": "none"}
    before = weight_bytes(model)
    if mode == "int8":
        with torch.no_grad():
            layers = _replace_linears(model, Int8Linear.from_linear)
        # A head tied to the embedding table is a copy now; the table stays for lookups.
        config = getattr(model, "config", None)
        if config is not None:
            config.tie_word_embeddings = False
        kernel = Int8Linear.default_kernel(device)
    else:  # int4 / fp8 on CUDA: torchao's configs over transformers' forward
        from torchao.quantization import Float8WeightOnlyConfig, Int4WeightOnlyConfig, quantize_

        ao_config = (
            Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d", set_inductor_config=False)
            if mode == "int4"
            else Float8WeightOnlyConfig(set_inductor_config=False)
        )
        layers = sum(1 for module in model.modules() if isinstance(module, torch.nn.Linear))
        quantize_(model, ao_config)
        kernel = "torchao"
    after = weight_bytes(model)
    return {
        "quantization": mode,
        "linear_layers": layers,
        "kernel": kernel,
        "weight_bytes_before": before,
        "weight_bytes_after": after,
    }
