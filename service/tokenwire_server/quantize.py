"""Weight quantization (model loading's room): ``--quantization none|int8|int4|fp8``.

Weight-only: activations keep the model's dtype, so a layer's output is close to
the full-precision one (``make bench-quality`` measures how close). The scales come
from torchao's quantizer (``choose_qparams_affine`` / ``quantize_affine``); tokenwire
does not write its own.

- **int8** (CPU and CUDA): every linear layer, the vocabulary projection included,
  takes 8-bit weights. The embedding table stays in full precision: a lookup reads a
  few rows, not the table, so it costs memory, not speed. Two schemes (``int8_scheme``):
  - ``groups`` (a CPU with AVX-512BW and AVX512-VNNI, where the compiled CPU ops load):
    asymmetric, an unsigned byte per weight with a scale and a zero point per output
    channel and group of ``INT8_GROUP`` inputs, held as the compiled ops' 8-bit panels
    (``Int8GroupLinear``; ``panel_linear``: each weight read once per step for all its
    rows, each row's inputs rounded to int16 on its own scale, exact integer sums per
    group). 1.19 bytes a weight with its float16 scales and zero points (groups of 16): a step
    reads under a third of float32's bytes.
  - ``channel`` (any other device): symmetric int8 with one scale per output channel
    (``Int8Linear``). On a CPU the product is PyTorch's own weight-only kernel
    (``torch._weight_int8pack_mm``, bf16 activations in); elsewhere it dequantizes the
    weight in the step (correct, not tuned).
  The native pass and transformers' forward both run these layers (``NativeForward``
  fuses them as it fuses full-precision ones). Each scheme's quality is measured apart
  (``quality.json``: ``int8`` is the groups, ``int8-channel`` the other).
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


def quality_host(device_type: str) -> str:
    """The kind of host ``quality.json`` keeps figures for: on a CPU, whether its bf16 GEMMs round
    their inputs (AVX512-BF16, AMX, oneDNN: ``engine.native.bf16_rounding``), since the bar counts
    from bf16's answers and bf16 that rounds its inputs parts from float32 more often (16 prompts:
    13 kept on an AMD EPYC with AVX512-BF16, 16 on an Intel Xeon without it)."""
    if device_type != "cpu":
        return device_type
    from .engine.native import bf16_rounding

    return "cpu-bf16-rounded" if bf16_rounding()[0] else "cpu-bf16-exact"


def quality_verdict(
    mode: str, device_type: str, path: Path | None = None, host: str | None = None
) -> tuple[bool | None, str]:
    """``(meets the bar, what was measured)`` for ``mode`` on ``device_type`` and this kind of host
    (``host``: ``quality_host``'s); None: not measured there, or (int8) on another layout."""
    path = path or QUALITY_FILE
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return None, f"no quality figures ({path.name} unreadable)"
    bar = table.get("bar", {})
    host = host or quality_host(device_type)
    entry = table.get("modes", {}).get(mode, {}).get(host)
    if not entry:
        return None, f"{mode} is not measured on {host} yet (make bench-quality)"
    if mode == "int8" and entry.get("layout") != INT8_LAYOUT:
        return None, f"{mode} was measured on {host} with other panels ({entry.get('layout', 'float32 scales')})"
    figures = (
        f"{mode} on {host} ({entry.get('host', '?')}, {entry.get('measured', '?')}): "
        f"KL {entry['kl']:.4f} nats/token, "
        f"{entry['identical']}/{entry['of']} greedy answers identical over {bar.get('greedy_tokens', '?')} tokens; "
        f"the bar is KL <= {bar.get('kl')} and >= {entry.get('bar_identical', '?')}/{bar.get('of')} (bf16's count "
        f"there less {bar.get('below_bf16', '?')})"
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
                "(make bench-kernels); use --quantization int8 (8-bit weights)"
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


# Inputs per scale and zero point of the ``groups`` scheme (#38: at most 32 on the default model).
# ``make bench-quality`` on the default model (AMD EPYC, 2026-12-07, float32 scales): groups of 32
# kept 11 of 16 greedy answers, exactly bf16's 13 less 2; groups of 16 keep 12 (KL 0.0008). On an
# Intel Xeon (2026-12-08, float16 scales) groups of 8 cut KL to 0.00056 yet kept 9 of 16 against
# 16's 11: which answers part follows near-ties more than KL. The compiled panels take any even group.
INT8_GROUP = 16
# What the quality figures of ``groups`` were measured on (quality.json's int8 entries): figures of
# another layout are not this one's.
INT8_LAYOUT = f"groups of {INT8_GROUP}, float16 scales"
PANEL_COLUMNS = 16  # output columns per panel (cpu_ops.cpp: kPanel)
QUANTIZE_ROWS = 1024  # output channels quantized at a time (a whole number of panels)
PANEL_META = PANEL_COLUMNS + 2 * PANEL_COLUMNS  # per panel and group: 16 u8 zero points, 16 f16 scales
# The smallest scale: float16's smallest normal number, so that every scale keeps float16's 11 bits
# (a group of weights narrower than 255 of it is quantized on this step: it errs by 3e-5 at most).
SMALLEST_SCALE = 2.0**-14


def quantize_int8_groups(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(uint8 weights [out, in], zero points [out, in / group] (uint8), float16 scales [out,
    in / group])``: asymmetric, per output channel and group of ``group`` inputs, by torchao's
    quantizer; ``weight ≈ (q - zero) * scale`` group by group. The scales are rounded up to
    float16 (as the panels hold them) before the weights are quantized on them: on the default
    model the weights' RMS error stays 0.000799, as with float32 scales."""
    mapping, choose, quantize = _torchao_quantizer()
    w = weight.detach().float()
    block = (1, group)
    scale, zero = choose(
        w,
        mapping.ASYMMETRIC,
        block,
        torch.uint8,
        quant_min=0,
        quant_max=255,
        eps=SMALLEST_SCALE,
        scale_dtype=torch.float32,
        zero_point_dtype=torch.int32,
    )
    # Rounded up to float16, so that the group's widest weight still falls inside the range.
    rounded = scale.clamp(max=torch.finfo(torch.float16).max).half()
    scale = torch.where(rounded.float() < scale, torch.nextafter(rounded, rounded.new_tensor(torch.inf)), rounded)
    q = quantize(w, block, scale.float(), zero, torch.uint8, quant_min=0, quant_max=255)
    groups = w.shape[1] // group
    return q.contiguous(), zero.reshape(-1, groups).to(torch.uint8), scale.reshape(-1, groups).contiguous()


def pack_int8_panels(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """The compiled ops' 8-bit panels, ``[out / 16, groups, 16 · group + 48]`` bytes: per panel
    of 16 output columns and group, the weights as int16 pairs' bytes (input pair k2, column c:
    q[c][2k2], q[c][2k2 + 1]), then the 16 columns' zero points, then their float16 scales
    (cpu_ops.cpp, "panel_linear on 8-bit weights")."""
    out, inputs = q.shape
    panels, groups = out // PANEL_COLUMNS, inputs // group
    weights = q.view(panels, PANEL_COLUMNS, groups, group // 2, 2).permute(0, 2, 3, 1, 4)
    zeros = zero.view(panels, PANEL_COLUMNS, groups).permute(0, 2, 1)
    scales = scale.half().view(panels, PANEL_COLUMNS, groups).permute(0, 2, 1).contiguous().view(torch.uint8)
    return torch.cat([weights.reshape(panels, groups, PANEL_COLUMNS * group), zeros, scales], 2).contiguous()


def unpack_int8_panels(panels: torch.Tensor) -> torch.Tensor:
    """The float32 weight ``[out, in]`` that ``pack_int8_panels``' panels stand for, (q - zero) * scale."""
    count, groups, width = panels.shape
    group = (width - PANEL_META) // PANEL_COLUMNS
    body = PANEL_COLUMNS * group
    q = panels[:, :, :body].reshape(count, groups, group // 2, PANEL_COLUMNS, 2).permute(0, 3, 1, 2, 4).float()
    zero = panels[:, :, body : body + PANEL_COLUMNS].permute(0, 2, 1).float()
    scale = panels[:, :, body + PANEL_COLUMNS :].contiguous().view(torch.float16).float().permute(0, 2, 1)
    weight = (q.reshape(count, PANEL_COLUMNS, groups, group) - zero[..., None]) * scale[..., None]
    return weight.reshape(count * PANEL_COLUMNS, groups * group)


def int8_panel_library() -> Any | None:
    """The compiled CPU ops where this CPU runs their 8-bit panels (AVX-512BW and AVX512-VNNI), else None."""
    from .engine import kernels

    ops = kernels.load().ops
    if ops is None or not hasattr(ops, "cpu_has_avx512vnni") or not ops.cpu_has_avx512vnni():
        return None
    return ops


def int8_scheme(device: torch.device) -> str:
    """Which int8 scheme ``--quantization int8`` takes on ``device``: ``groups`` (the compiled
    8-bit panels, on a CPU that runs them) or ``channel``."""
    return "groups" if device.type == "cpu" and int8_panel_library() is not None else "channel"


def quality_mode(mode: str, device: torch.device) -> str:
    """The mode's name in ``quality.json``: int8's two schemes are measured apart."""
    return "int8-channel" if mode == "int8" and int8_scheme(device) == "channel" else mode


class Int8GroupLinear(torch.nn.Module):
    """A linear layer with 8-bit weights in groups (the ``groups`` scheme), held as the compiled
    ops' 8-bit panels (``pack_int8_panels``) and multiplied by their ``panel_linear`` in float32:
    a row's output is the same alone and beside other rows, bit for bit."""

    panels: torch.Tensor
    bias: torch.Tensor | None
    kernel = "groups"

    def __init__(self, panels: torch.Tensor, bias: torch.Tensor | None, library: Any) -> None:
        super().__init__()
        count, groups, width = panels.shape
        self.group = (width - PANEL_META) // PANEL_COLUMNS
        self.in_features = int(groups * self.group)
        self.out_features = int(count * PANEL_COLUMNS)
        self.library = library
        self.register_buffer("panels", panels)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    @staticmethod
    def fits(linear: torch.nn.Linear, group: int) -> bool:
        """Whether ``linear`` takes the panels: whole panels of output columns, whole groups of inputs."""
        return linear.out_features % PANEL_COLUMNS == 0 and linear.in_features % group == 0

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, library: Any, group: int = INT8_GROUP) -> Int8GroupLinear:
        return cls.from_weight(linear.weight, linear.bias, library, group)

    @classmethod
    def from_weight(
        cls, weight: torch.Tensor, bias: torch.Tensor | None, library: Any, group: int = INT8_GROUP
    ) -> Int8GroupLinear:
        # A block of rows at a time: the quantizer's float32 temporaries stay a few MB, where a
        # whole vocabulary projection's are ~100 MB each (the default model's server: peak RSS
        # 0.88 -> 0.87 GB).
        rows = QUANTIZE_ROWS
        blocks = [
            pack_int8_panels(*quantize_int8_groups(weight[first : first + rows], group), group)
            for first in range(0, weight.shape[0], rows)
        ]
        return cls(blocks[0] if len(blocks) == 1 else torch.cat(blocks), bias, library)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.plus(x, None)

    def plus(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """``residual + self(x)``, the add riding on the GEMM (as ``native.Linear.plus``)."""
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float().contiguous()
        res = None if residual is None else residual.reshape(-1, self.out_features).float().contiguous()
        out: torch.Tensor = self.library.panel_linear(rows, self.panels, self.bias, res)
        return out.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}, kernel=groups"


# The int8 layers of either scheme.
INT8_LAYERS = (Int8Linear, Int8GroupLinear)


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
    model: torch.nn.Module,
    mode: str,
    device: torch.device,
    capability: tuple[int, int] | None = None,
    scheme: str | None = None,
) -> dict[str, Any]:
    """Quantize ``model``'s linear layers in place; returns what was done, for the log.
    ``scheme``: int8's, ``channel`` to take it where ``groups`` would run (``make bench-quality``
    measures both); None: ``int8_scheme``'s.

    Raises ``QuantizationError`` when ``mode`` is not offered on ``device``.
    """
    reason = offered(mode, device, capability)
    if reason:
        raise QuantizationError(f"--quantization {mode}: {reason}")
    if mode == "none":
        return {"quantization": "none"}
    before = weight_bytes(model)
    if mode == "int8":
        library = int8_panel_library() if device.type == "cpu" and scheme != "channel" else None
        linears = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
        # One scheme for the whole model, so fused layers (q/k/v, gate/up) share one.
        if library is not None and not all(Int8GroupLinear.fits(linear, INT8_GROUP) for linear in linears):
            log.warning(
                "int8 in groups needs every linear layer in whole panels and groups; per-channel int8 instead",
                extra={"group": INT8_GROUP, "panel_columns": PANEL_COLUMNS},
            )
            library = None
        # The full-precision weights are usually pages of the mmapped checkpoint, read once here
        # and never again: their pages go back as each layer is quantized, or they stay resident
        # until the file is unmapped (measured: 1.12 GB after loading the default model, not 0.6).
        from .engine.native import Mappings, page_out

        mappings = Mappings.of_this_process() if device.type == "cpu" else None

        def make(linear: torch.nn.Linear) -> torch.nn.Module:
            layer = Int8Linear.from_linear(linear) if library is None else Int8GroupLinear.from_linear(linear, library)
            if mappings is not None:
                page_out(linear.weight, mappings)
            return layer

        with torch.no_grad():
            layers = _replace_linears(model, make)
        # A head tied to the embedding table is a copy now; the table stays for lookups.
        config = getattr(model, "config", None)
        if config is not None:
            config.tie_word_embeddings = False
        kernel = "groups" if library is not None else Int8Linear.default_kernel(device)
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
