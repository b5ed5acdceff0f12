"""The batched engine's own forward pass for Llama-shaped models, over the paged KV cache.

``transformers``' forward takes a rectangular ``[batch, length]`` input, so a step
that mixes one-token decode rows with a chunk of somebody's prompt has to pad or
run twice. This pass takes the step as it is: a ragged list of *segments* (a request's
block table, the column its first token goes to, how many tokens), all tokens of the step in one
flat ``[tokens, hidden]`` tensor. Every linear layer therefore runs once per step
over all of them (decode rows and prompt chunks together: prefill rides along with
decoding instead of stopping it), and only the rows that must pick a token go
through the final norm and the vocabulary projection.

The work around the GEMMs goes through one interface (``ops``), picked once at load:
on an AVX2+FMA CPU in float32 the compiled library (``kernels``, ``--kernels``) does
RMSNorm, RoPE (in place), SiLU(gate)*up, the K/V write and the one-token rows' attention
(each row over its own columns, through its block table) in one call each; elsewhere
stock torch ops, the one-token rows attending in SDPA calls over their gathered blocks
(``ops.GroupedAttention``). Each prompt chunk attends alone, causally, over its own
gathered blocks, through SDPA.

On an AVX-512F CPU with the compiled ops, every linear layer's weights are held as panels of 16
output columns and multiplied by the library's ``panel_linear``: each output element one float32
sum over the inputs in order, so a row gets the same bits at any row count (batch invariance by
construction, bf16 included), and one row streams the weights at the memory's pace (on a 2-core
AMD EPYC oneDNN's packed GEMM read them at 22-24 GB/s at one row, the panels at ~35:
docs/benchmarks.md, "One GEMM for every row count", after the "peers-amd" section). bf16
weights are multiplied as pairs with the input rounded to bf16 where the CPU has AVX512-BF16,
else widened as read; the outputs stay float32. Elsewhere (AVX2 only,
``--kernels torch``) the weights of every linear layer are prepacked once for oneDNN
(``torch.ops.mkldnn._reorder_linear_weight``), a blocked layout its GEMM reads without
reordering per call (the gain is measured by ``make bench-kernels``, in docs/benchmarks.md),
in float32 or bf16. With bf16 weights the pass still computes in float32 around the GEMMs
(``activation_dtype``: norms, RoPE, attention, the KV cache, the logits' sampler), each GEMM
reading bf16-rounded inputs and accumulating in float32, as torch's CPU autocast does; so
the compiled ops serve both. ``--dtype auto`` takes bf16 where its packed GEMMs measure
faster on the host (``packed_gemm_gain``, ``model.cpu_precision``). Elsewhere (CUDA, or
fp16), plain ``F.linear``. When the
engine owns the model (the server, ``release_weights``), the pass's own weights (packed,
or the fused q/k/v and gate/up) replace the model's layer by layer (the embedding table
stays, for the lookup), so memory does not grow and the model's own ``forward`` can no
longer run.

Numbers: every step computes, row by row, the same arithmetic a row alone would
(the same projections, RoPE, fp32 RMSNorm and masked softmax attention); only the
GEMM's blocking differs with the number of rows, as it does in ``transformers``.
``tests/test_native_forward.py`` holds it to ``transformers``' own forward.
"""

from __future__ import annotations

import bisect
import ctypes
import dataclasses
import functools
import logging
import mmap
import sys
import time
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ..model import attention_shape
from ..quantize import INT8_LAYERS, Int8GroupLinear, Int8Linear
from ..transfer import host_tensor, to_device
from . import ATTENTION_CHOICES, KERNEL_CHOICES, kernels
from .flex import FlexAttention
from .kv import PagedCache, flat_index, places, write
from .ops import (
    ChunkAttention,
    CompiledOps,
    GroupedAttention,
    PagedDecodeAttention,
    Places,
    Segment,
    TorchOps,
    static_decode_attention,
)
from .panel_store import PanelStore

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .lora import StepAdapters

SUPPORTED_TYPES = frozenset({"llama"})
# A decoder layer's (attention, MLP) classes the pass reads: transformers' Llama, and the plain
# modules of a checkpoint read without transformers' model code (``checkpoint``).
LAYER_CLASSES = frozenset({("LlamaAttention", "LlamaMLP"), ("Attention", "MLP")})
# One layer's attention, given (layer index, qkv, q, k, v): stores its keys and values, returns [tokens, heads, dim].
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# The work around the GEMMs (decode attention, RMSNorm, RoPE, SiLU*up): ``auto``: the
# compiled CPU ops (``kernels``) where they build and run (float32 on an AVX2+FMA CPU),
# else stock torch ops; ``compiled``: insist; ``torch``: never.


def unsupported_reason(model: Any) -> str | None:
    """Why this model cannot take the native pass (None: it can)."""
    config: Any = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_TYPES:
        return f"model_type {model_type!r} (native pass: {', '.join(sorted(SUPPORTED_TYPES))})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r}"
    if int(getattr(config, "pretraining_tp", 1) or 1) != 1:
        return "pretraining_tp != 1"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "no model.layers / model.rotary_emb"
    if getattr(getattr(inner, "embed_tokens", None), "weight", None) is None:
        return "no embedding table"
    for layer in inner.layers:
        attention = layer.self_attn
        if (type(attention).__name__, type(layer.mlp).__name__) not in LAYER_CLASSES:
            return f"layer type {type(attention).__name__}/{type(layer.mlp).__name__}"
    for module in (*inner.layers[0].self_attn.children(), *inner.layers[0].mlp.children()):
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and type(weight) not in (torch.Tensor, torch.nn.Parameter):
            return (
                f"weights held as {type(weight).__name__} (torchao int4/fp8); "
                "the native pass takes full-precision or int8 layers"
            )
    devices = {parameter.device for parameter in model.parameters()}
    if len(devices) != 1:
        return "weights spread over several devices"
    return None


def onednn_available(device: torch.device) -> bool:
    return (
        device.type == "cpu"
        and bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class Linear:
    """One linear layer (``kind``): the compiled ops' panels on an AVX-512F CPU (``panels``
    given), oneDNN-prepacked on another CPU, plain ``F.linear`` elsewhere.

    Its weights may be held in a narrower dtype than the activations it is called with (bf16
    weights in a float32 pass, on a CPU): oneDNN rounds the input to the weights' dtype for the
    GEMM, which accumulates in float32, and the output comes back in the input's dtype; the
    panels widen the weights or (``pairs``) round the input, and give float32 out.
    """

    def __init__(
        self,
        weight: torch.Tensor | list[torch.Tensor],
        bias: torch.Tensor | None,
        packed: bool,
        batch_hint: int,
        panels: Any = None,
        store: PanelStore | None = None,
        name: str = "",
    ) -> None:
        # ``weight``: one matrix, or fused layers' matrices, one after another (``_layer``).
        # ``store``: where panels laid out at an earlier start are kept, as layer ``name``.
        parts = [w.detach() for w in (weight if isinstance(weight, list) else [weight])]
        self.in_features = int(parts[0].shape[1])
        self.bias = None if bias is None else bias.detach().contiguous()
        self.packed = packed
        self.dtype = parts[0].dtype
        out_features = sum(int(part.shape[0]) for part in parts)
        # ``panels``: the compiled library, where it runs ``panel_linear`` (``panel_library``).
        self.library = panels if packed and self.dtype in PACKED_DTYPES and out_features % PANEL == 0 else None
        if any(int(part.shape[0]) % PANEL for part in parts):
            parts = [torch.cat(parts)]  # a part that ends inside a panel: the panels of the whole
        self.kind = "plain" if not packed else "onednn" if self.library is None else "panels"
        bf16 = self.library is not None and self.dtype == torch.bfloat16
        self.pairs = bf16 and self.in_features % 2 == 0 and bf16_pairs(self.library)
        # Whether the GEMM rounds its input to bf16 (bf16 weights only): oneDNN's does, the
        # panels' bf16 pairs do (``bf16_rounding``).
        self.rounds_input = self.dtype == torch.bfloat16 and (self.library is None or self.pairs)
        if self.library is not None:
            # Each part straight into its panels: one copy of the weights at start, not a
            # concatenation and then the panels.
            if self.pairs:  # [out / 16, in / 2, 32]: each panel's 16 columns side by side, two inputs each
                # moved as int32, a pair each (a copy of 2-byte runs takes ~2x as long at start)
                width, view = self.in_features // 2, torch.int32
            else:  # [out / 16, in, 16]: each panel's 16 output columns side by side, input by input
                width, view = self.in_features, self.dtype
            shape = (out_features // PANEL, width, PANEL * view.itemsize // self.dtype.itemsize)
            kept = None if store is None else store.take(name, torch.Size(shape), self.dtype)
            if kept is not None:
                self.weight = kept
            else:
                out = torch.empty((out_features // PANEL, width, PANEL), dtype=view, device=parts[0].device)
                first = 0
                for part in parts:
                    count = int(part.shape[0]) // PANEL
                    source = part.contiguous().view(view).view(count, PANEL, width).transpose(1, 2)
                    out[first : first + count].copy_(source)
                    first += count
                self.weight = out.view(self.dtype)
                if store is not None:
                    store.keep(name, self.weight)
            self.bias = None if self.bias is None else self.bias.float()
        else:
            whole = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
            self.weight = torch.ops.mkldnn._reorder_linear_weight(whole, batch_hint) if packed else whole

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        """``x·Wᵀ + b`` in the weights' dtype.

        oneDNN's packed GEMM takes another kernel for a single row than for two or more (it
        splits the reduction at M=1), so one row alone would come out a rounding apart from the
        same row in a batch. In float32 that stays below what a greedy pick can see; rounded to
        bf16 on the way out it does not (measured: the default model parts at token 19). So a
        single row runs as two and keeps the first, which costs nothing measurable in bf16
        (the GEMM reads the weights once either way) and keeps batch invariance exact.

        Past 32 rows oneDNN may change kernels again, by shape: on an Intel host with AMX the
        vocabulary GEMM gave a row other bf16 bits at 33-256 rows than at 1-32 or 512 (its AMX
        blocking splits the reduction otherwise). A step's prompt tokens would then write other
        K/V alone than beside another prompt. So bf16 GEMMs run ``BF16_ROWS_PER_GEMM`` rows per
        call at most (``rows_per_call_consistent``, which the tests run on each host, checks it).
        The cost falls on prompt reading alone, a decode step has at most ``--max-active`` rows:
        on that host 2.2-3.2× the GEMM time of a 128-2,048-token prompt in one call, about
        float32's.

        The compiled panels (``kind == "panels"``) need none of this: every output element is one
        float32 sum over the inputs in order, whatever the row count (``cpu_ops.cpp``), the output
        left float32; bf16 weights are widened to float32 as read, or (``pairs``, on a CPU with
        AVX512-BF16) multiplied two at a time with the input rounded to bf16.
        """
        if self.library is not None:
            result: torch.Tensor = self.library.panel_linear(x.float().contiguous(), self.weight, self.bias, None)
            return result
        if self.packed:
            if self.dtype == torch.bfloat16 and x.shape[0] > BF16_ROWS_PER_GEMM:
                return torch.cat([self._gemm(part) for part in torch.split(x, BF16_ROWS_PER_GEMM)])
            single = self.dtype == torch.bfloat16 and x.shape[0] == 1
            rows = x.expand(2, -1).contiguous() if single else x
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
            return out[:1] if single else out
        return F.linear(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.library is not None:
            return self._gemm(x).to(x.dtype)
        if x.dtype != self.dtype:
            return self._gemm(x.to(self.dtype)).to(x.dtype)
        return self._gemm(x)

    def plus(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``; on oneDNN and the panels the add rides on the GEMM, no separate pass."""
        if self.library is not None:  # on a CPU, where the residual stream is float32 (``activation_dtype``)
            fused: torch.Tensor = self.library.panel_linear(
                x.float().contiguous(), self.weight, self.bias, residual.contiguous()
            )
            return fused
        if x.dtype != self.dtype:  # the sum in the residual's (wider) dtype: type promotion, one pass
            return residual + self._gemm(x.to(self.dtype))
        if self.packed:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, self.bias, "add")
            return out
        return residual + F.linear(x, self.weight, self.bias)


# ``decoder_layers``' LoRA arguments for a step without adapters: no slots, empty lists.
NO_ADAPTERS: tuple[Any, ...] = (torch.empty(0, dtype=torch.long), [], [], [], 0)

# The output columns of one panel of ``panel_linear`` (cpu_ops.cpp: kPanel).
PANEL = 16


def panel_library() -> Any | None:
    """The compiled library where this CPU runs its ``panel_linear`` (AVX-512F), else None."""
    loaded = kernels.load()
    if loaded.ops is None or not hasattr(loaded.ops, "panel_linear") or not loaded.ops.cpu_has_avx512f():
        return None
    return loaded.ops


def bf16_pairs(library: Any) -> bool:
    """Whether the panels hold bf16 weights as pairs (``panel_linear``'s VDPBF16PS: the input
    rounded to bf16, twice the products an instruction) rather than widening each to float32:
    where the CPU has AVX512-BF16."""
    return bool(library.cpu_has_avx512bf16())


def bf16_rounding() -> tuple[bool, bool]:
    """What the native pass's GEMMs round to bf16 with bf16 weights on this CPU: (their input,
    their output). oneDNN's bf16 GEMM rounds both; the panels keep the output float32, and round
    the input only as pairs (``bf16_pairs``)."""
    library = panel_library()
    if library is None:
        return True, True
    return bf16_pairs(library), False


# NOTE: bf16 GEMMs take at most this many rows per oneDNN call, so a row's bits do not depend on
# how many rows share the step (``Linear._gemm``). Costs prompt reading in bf16 on AMX (large-M
# kernels); lifted by a GEMM whose reduction order does not follow M: the panels, which take
# over on an AVX-512F CPU and need no such bound.
BF16_ROWS_PER_GEMM = 32


def rows_per_call_consistent(layers: list[Linear], sizes: tuple[int, ...] = (2, 3, 8, 17, 32, 33, 80)) -> str | None:
    """Whether every row of a call of each size gets the bits it gets alone (None: it does),
    through ``Linear`` as the pass calls it (bf16: ``BF16_ROWS_PER_GEMM`` rows a call)."""
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for layer in layers:
            x = torch.randn(max(sizes), layer.in_features, generator=generator)
            alone = torch.cat([layer(x[j : j + 1]) for j in range(max(sizes))])
            for size in sizes:
                if not torch.equal(layer(x[:size]), alone[:size]):
                    return f"a {size}-row GEMM [{layer.in_features} in, {layer.dtype}] parts from its rows alone"
    return None


# The dtypes whose GEMMs oneDNN runs from prepacked weights (bf16 natively with AVX512-BF16 or
# AMX; elsewhere it emulates it, slower: ``--dtype auto`` measures bf16 only where the host
# computes it natively, ``packed_gemm_gain``).
PACKED_DTYPES = (torch.float32, torch.bfloat16)


def activation_dtype(weights: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the native pass computes in around its GEMMs: float32 on a CPU whatever the
    weights' dtype (RMSNorm, RoPE, attention and the KV cache in float32, as torch's CPU autocast
    keeps them, through the compiled ops; only the GEMMs read bf16), the weights' own on a GPU."""
    return torch.float32 if device.type == "cpu" and weights.is_floating_point else weights


def gemm_shapes(config: Any) -> list[tuple[int, int]] | None:
    """The ``[out, in]`` weights of the native pass's GEMMs for a model of this config, in the
    order a forward reads them (fused q/k/v, o, fused gate/up, down per layer, then the
    vocabulary), or None when the config is not one the pass takes (``unsupported_reason``
    holds the loaded model to the rest)."""
    if getattr(config, "model_type", None) not in SUPPORTED_TYPES or getattr(config, "hidden_act", "silu") != "silu":
        return None
    hidden, inner = int(config.hidden_size), int(config.intermediate_size)
    heads, kv_heads, head_dim = attention_shape(config)
    layer = [
        ((heads + 2 * kv_heads) * head_dim, hidden),
        (hidden, heads * head_dim),
        (2 * inner, hidden),
        (hidden, inner),
    ]
    return layer * int(config.num_hidden_layers) + [(int(config.vocab_size), hidden)]


def packed_gemm_gain(
    shapes: list[tuple[int, int]],
    rows: tuple[int, ...] = (1, 16),
    *,
    budget_bytes: int = 128 << 20,
    repeats: int = 5,
) -> dict[int, float]:
    """How many times faster the packed GEMMs (the compiled panels on an AVX-512F CPU, else
    oneDNN's) run with bf16 weights than with float32 ones on this CPU, at each row count:
    float32 seconds ÷ bf16 seconds over ``shapes`` (``gemm_shapes``),
    taken in order until ``budget_bytes`` of float32 weights (more than a CPU's caches hold, as
    a model's weights are: decode reads them from memory). Both run as the pass runs them
    (``Linear``: float32 activations; oneDNN rounds them to bf16 for bf16 weights); the best of
    ``repeats`` interleaved passes each. 0.5–0.7 s on a 2-core host for the default model."""
    taken: list[tuple[int, int]] = []
    size = 0
    for out_features, in_features in shapes:
        if taken and size + 4 * out_features * in_features > budget_bytes:
            break
        taken.append((out_features, in_features))
        size += 4 * out_features * in_features
    batch_hint = max(rows)
    panels = panel_library()  # the GEMM the pass takes on this CPU (``Linear``)
    arms: dict[torch.dtype, list[Linear]] = {}
    for dtype in (torch.float32, torch.bfloat16):
        arms[dtype] = [
            Linear(torch.empty(o, i, dtype=dtype).uniform_(-0.05, 0.05), None, True, batch_hint, panels)
            for o, i in taken
        ]
    gains: dict[int, float] = {}
    with torch.inference_mode():
        for count in rows:
            inputs = {i: torch.randn(count, i) for _, i in taken}
            best = {dtype: float("inf") for dtype in arms}
            for attempt in range(repeats + 1):  # the first of each is a warm-up
                for dtype, layers in arms.items():
                    start = time.perf_counter()
                    for layer, (_, in_features) in zip(layers, taken, strict=True):
                        layer(inputs[in_features])
                    if attempt:
                        best[dtype] = min(best[dtype], time.perf_counter() - start)
            gains[count] = best[torch.float32] / best[torch.bfloat16]
    return gains


_MADV_DONTNEED = 4
_MADV_PAGEOUT = 21  # Linux 5.4+


class Mappings:
    """This process's memory mappings (``/proc/self/smaps``), read once: where each mapping of a
    file lies whose pages are all the file's, none written since it was mapped (``page_out``
    gives such pages back without reclaiming them)."""

    def __init__(self, smaps: str = "") -> None:
        self._ranges: list[tuple[int, int]] = []  # unwritten file mappings, by start
        current: tuple[int, int] | None = None
        for line in smaps.splitlines():
            fields = line.split()
            if not fields:
                continue
            if ":" not in fields[0]:  # a mapping's first line: "low-high perms offset dev inode path"
                low, high = fields[0].split("-")
                current = (int(low, 16), int(high, 16)) if len(fields) >= 6 and fields[4] != "0" else None
            elif fields[0] == "Anonymous:" and current is not None and fields[1] == "0":
                self._ranges.append(current)  # copied-on-write pages: 0 kB
        self._ranges.sort()

    @classmethod
    def of_this_process(cls) -> Mappings:
        try:
            with open("/proc/self/smaps") as f:  # ~10 ms
                return cls(f.read())
        except OSError:  # not Linux: no mapping is known, page_out reclaims
            return cls()

    def file_pages(self, start: int, end: int) -> bool:
        """Whether ``[start, end)`` lies in one mapping of a file whose pages are all the file's."""
        at = bisect.bisect_right(self._ranges, (start, 1 << 64)) - 1
        return at >= 0 and self._ranges[at][0] <= start and end <= self._ranges[at][1]


@functools.cache
def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def page_out(tensor: torch.Tensor, mappings: Mappings | None = None) -> None:
    """Give the pages behind ``tensor``, which nothing reads any more, back now.

    The loaded weights are usually pages of the mmapped checkpoint; once packed they are
    never read again, but they stay resident until the whole file is unmapped, at the end
    (the peak would hold the model twice).
    - In a mapping of a file none of whose pages was written (``mappings``: the checkpoint, which
      nothing writes): ``MADV_DONTNEED`` on the pages that lie wholly inside the tensor. They
      leave this process at once and stay in the page cache for the next start, and such a
      page is the file's, so whatever touches it again reads the same bytes. (``MADV_PAGEOUT``,
      used here before, left them in the process on this host's kernel (tests/
      test_native_forward.py), and where it works it reclaims them from the page cache too, so
      the next start reads the checkpoint from the disk again: a start's engine phase went
      0.58 -> ~0.3 s, docs/benchmarks.md, "Start-up".)
    - Elsewhere (anonymous memory): ``MADV_PAGEOUT`` on every page it touches. Reclaiming never
      loses data: an anonymous page without swap simply stays.
    A no-op off Linux or where the call fails.
    """
    if sys.platform != "linux" or tensor.device.type != "cpu" or tensor.numel() == 0:
        return
    page = mmap.PAGESIZE
    first, last = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * tensor.element_size()
    if mappings is not None and mappings.file_pages(first, last):
        advice, start, end = _MADV_DONTNEED, -(-first // page) * page, last // page * page
    else:
        advice, start, end = _MADV_PAGEOUT, first // page * page, -(-last // page) * page
    if end <= start:
        return
    try:
        _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(advice))
    except (OSError, AttributeError):  # no libc symbol, or a platform without it
        pass


def _fused_int8(*linears: Int8Linear | Int8GroupLinear) -> Int8Linear | Int8GroupLinear:
    """One int8 layer of several (q, k, v; gate, up): their rows (or panels), scales and biases
    one after another. A layer of its own even for one module (sharing its tensors): the model's
    module may drop its reference once the pass holds the layer."""
    first = linears[0]
    device = first.panels.device if isinstance(first, Int8GroupLinear) else first.qdata.device
    bias = _fused_bias([(linear.out_features, linear.bias) for linear in linears], device, torch.float32)
    if all(isinstance(linear, Int8GroupLinear) for linear in linears):
        groups = typing.cast("list[Int8GroupLinear]", list(linears))
        panels = torch.cat([linear.panels for linear in groups]) if len(groups) > 1 else groups[0].panels
        return Int8GroupLinear(panels, bias, groups[0].library)
    if not all(isinstance(linear, Int8Linear) for linear in linears):
        raise ValueError("cannot fuse int8 layers of two schemes")
    channels = typing.cast("list[Int8Linear]", list(linears))
    qdata = torch.cat([linear.qdata for linear in channels]) if len(channels) > 1 else channels[0].qdata
    scale = torch.cat([linear.scale for linear in channels]) if len(channels) > 1 else channels[0].scale
    return Int8Linear(qdata, scale, bias, channels[0].kernel)


def _layer(
    packed: bool, batch_hint: int, panels: Any, *modules: Any, store: PanelStore | None = None, name: str = ""
) -> Gemm:
    """The pass's layer for one or several fused modules, full-precision or int8; ``panels``:
    the compiled library where the full-precision GEMMs run as its panels (``Linear``), kept in
    ``store`` as layer ``name``."""
    if all(isinstance(module, INT8_LAYERS) for module in modules):
        return _fused_int8(*modules)
    if any(isinstance(module, INT8_LAYERS) for module in modules):
        raise ValueError("cannot fuse int8 with full-precision layers")
    if len(modules) == 1:
        return Linear(modules[0].weight, modules[0].bias, packed, batch_hint, panels, store, name)
    weights = [module.weight.detach() for module in modules]
    bias = _fused_bias([(int(w.shape[0]), module.bias) for w, module in zip(weights, modules, strict=True)],
                       weights[0].device, weights[0].dtype)  # fmt: skip
    return Linear(weights, bias, packed, batch_hint, panels, store, name)


# A layer of the pass: full-precision, or int8 in either scheme.
Gemm = Linear | Int8Linear | Int8GroupLinear


def panel_weights(gemm: Gemm) -> torch.Tensor | None:
    """What the compiled ``panel_linear`` takes for ``gemm``: its float panels, or its 8-bit
    panels; None where ``gemm`` does not run as the panels."""
    if isinstance(gemm, Linear) and gemm.kind == "panels":
        return gemm.weight
    if isinstance(gemm, Int8GroupLinear):
        return gemm.panels
    return None


def _fused_bias(
    parts: list[tuple[int, torch.Tensor | None]], device: torch.device, dtype: torch.dtype
) -> torch.Tensor | None:
    """The biases of fused layers, ``(rows, bias)`` each, one after another; zeros for a layer
    without one; None when none has one."""
    if all(bias is None for _, bias in parts):
        return None
    return torch.cat(
        [
            torch.zeros(rows, dtype=dtype, device=device) if bias is None else bias.detach().to(dtype)
            for rows, bias in parts
        ]
    )


@dataclasses.dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: Gemm
    out: Gemm
    post_norm: torch.Tensor
    gate_up: Gemm
    down: Gemm


class NativeForward:
    """The forward pass of a Llama-shaped model over a ``PagedCache``; weights taken from the loaded model."""

    def __init__(
        self,
        model: Any,
        cache: PagedCache,
        batch_hint: int,
        release_weights: bool = False,
        kernel_choice: str = "auto",
        pack_weights: bool = True,
        attention_choice: str = "auto",
    ) -> None:
        if kernel_choice not in KERNEL_CHOICES:
            raise ValueError(f"unknown kernels {kernel_choice!r}; expected one of {', '.join(KERNEL_CHOICES)}")
        if attention_choice not in ATTENTION_CHOICES:
            raise ValueError(f"unknown attention {attention_choice!r}; expected one of {', '.join(ATTENTION_CHOICES)}")
        config = model.config
        inner = model.model
        self.device = next(model.parameters()).device
        # The weights' dtype, and the one the pass computes in around its GEMMs (``activation_dtype``).
        self.weight_dtype = next(model.parameters()).dtype
        self.dtype = activation_dtype(self.weight_dtype, self.device)
        self.heads, self.kv_heads, self.head_dim = attention_shape(config)
        self.eps = float(config.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.cache = cache
        # oneDNN's packed GEMM is an op torch.compile cannot trace (no fake kernel): a
        # compiled step (``--compile-step``) takes plain weights, and inductor picks the GEMM.
        packed = pack_weights and onednn_available(self.device) and self.weight_dtype in PACKED_DTYPES
        self.packed = packed
        release = release_weights
        head = model.get_output_embeddings()
        self.quantized = any(isinstance(module, INT8_LAYERS) for module in model.modules())
        tied = not isinstance(head, INT8_LAYERS) and head.weight.data_ptr() == inner.embed_tokens.weight.data_ptr()
        if release and self.device.type == "cpu":
            # Everything but the linear layers (the embedding table, the norms) moves to
            # memory of its own: the loaded weights may be pages of the mmapped checkpoint,
            # which is unmapped only once no tensor points into it any more.
            for module in model.modules():
                if isinstance(module, torch.nn.Linear):
                    continue
                for name, parameter in list(module._parameters.items()):
                    if parameter is not None:
                        module._parameters[name] = torch.nn.Parameter(parameter.detach().clone(), requires_grad=False)
            if tied:  # the head is the table: it follows the table's copy, or the old pages stay held
                head.weight = inner.embed_tokens.weight
        self.layers: list[Layer] = []
        # Where the checkpoint is mapped, read once before any weight is dropped (``page_out``).
        # NOTE: page_out's MADV_DONTNEED relies on nothing writing into the mapped checkpoint
        # between this read and the drops (a written page would read back as the file's).
        self._mappings = Mappings.of_this_process() if release and self.device.type == "cpu" else None
        embed = inner.embed_tokens.weight
        library, self.ops_reason = self._compiled_ops(kernel_choice)
        # With the compiled ops, on an AVX-512F CPU, the packed GEMMs are its panels, not oneDNN's.
        panels = panel_library() if library is not None and packed else None
        # Panels an earlier start laid out from these weights, kept in the model cache (``panel_store``).
        store = None if panels is None else PanelStore.for_model(model, PANEL)
        # The lm head is packed before any plain weight is dropped (it may be the
        # embedding table itself, which stays plain for the lookup).
        self.lm_head = _layer(packed, batch_hint, panels, head, store=store, name="lm_head")
        for index, layer in enumerate(inner.layers):
            attention, mlp = layer.self_attn, layer.mlp
            at = f"layers.{index}."
            self.layers.append(
                Layer(
                    input_norm=layer.input_layernorm.weight.detach().to(self.dtype),
                    qkv=_layer(
                        packed,
                        batch_hint,
                        panels,
                        attention.q_proj,
                        attention.k_proj,
                        attention.v_proj,
                        store=store,
                        name=at + "qkv",
                    ),  # fmt: skip
                    out=_layer(packed, batch_hint, panels, attention.o_proj, store=store, name=at + "out"),
                    post_norm=layer.post_attention_layernorm.weight.detach().to(self.dtype),
                    gate_up=_layer(
                        packed, batch_hint, panels, mlp.gate_proj, mlp.up_proj, store=store, name=at + "gate_up"
                    ),  # fmt: skip
                    down=_layer(packed, batch_hint, panels, mlp.down_proj, store=store, name=at + "down"),
                )
            )
            if release:
                # The pass's copies (packed, or fused) replace the model's weights, layer by
                # layer, so the peak memory holds one layer twice at most, never the model.
                # (Unpacked o_proj and down share their storage with the pass: dropping the
                # module's reference frees nothing, and costs nothing either.)
                for module in (
                    attention.q_proj,
                    attention.k_proj,
                    attention.v_proj,
                    attention.o_proj,
                    mlp.gate_proj,
                    mlp.up_proj,
                    mlp.down_proj,
                ):
                    self._drop(module, packed)
        if release and (isinstance(head, INT8_LAYERS) or head.weight.data_ptr() != embed.data_ptr()):
            self._drop(head, packed)
        self.panels_mapped = 0 if store is None else store.mapped  # layers whose panels an earlier start laid out
        if store is not None:
            store.save()
        self.norm = inner.norm.weight.detach().to(self.dtype)
        self.embed = embed.detach()
        self.embed_scale = float(getattr(inner.embed_tokens, "embed_scale", 1.0) or 1.0)
        self.rotary = inner.rotary_emb
        self.intermediate = int(config.intermediate_size)
        heads, kv_heads, head_dim, intermediate = self.heads, self.kv_heads, self.head_dim, self.intermediate
        # The fixed-shape decode step (``decode_step``, what ``graphs`` captures) runs stock torch
        # ops on any device: the compiled CPU ops are not for a CUDA graph.
        self.static_ops = TorchOps(self.eps, heads, kv_heads, head_dim, intermediate)
        self.ops: TorchOps = (
            self.static_ops
            if library is None
            else CompiledOps(library, self.eps, heads, kv_heads, head_dim, intermediate)
        )
        # Compiled ops this model is past the limits of, each with why: those run on stock
        # torch, checked here once rather than failing every step.
        self.ops_fallbacks: dict[str, str] = {}
        group = heads // kv_heads
        if library is not None and group > kernels.MAX_QUERY_HEADS_PER_KV_HEAD:
            self.ops_fallbacks["decode_attention"] = (
                f"{group} query heads per KV head; the compiled op takes at most {kernels.MAX_QUERY_HEADS_PER_KV_HEAD}"
            )
        self.decode_attention: PagedDecodeAttention | GroupedAttention | FlexAttention
        if attention_choice == "flex":
            if self.device.type == "cpu":
                log.warning(
                    "--attention flex on a CPU: FlexAttention compiles once per shape of a step (seconds each), "
                    "a check of the path CUDA serves, not a way to serve"
                )
            self.decode_attention = FlexAttention(heads, kv_heads, self.scale, dynamic=self.device.type != "cpu")
            cache.finite_from_start()
        elif library is not None and "decode_attention" not in self.ops_fallbacks and attention_choice == "auto":
            self.decode_attention = PagedDecodeAttention(library, heads, kv_heads, self.scale)
        else:
            self.decode_attention = GroupedAttention(heads, kv_heads, self.scale)
        # Prompt chunks: FlexAttention's where it reads the decode rows, else SDPA over gathered blocks.
        self.chunk_attention: ChunkAttention | FlexAttention = (
            self.decode_attention if isinstance(self.decode_attention, FlexAttention) else ChunkAttention(self.scale)
        )
        narrow = "int8" if self.quantized else "bf16" if self.weight_dtype == torch.bfloat16 else ""
        if narrow and self.device.type == "cpu" and isinstance(self.decode_attention, GroupedAttention):
            log.warning(
                f"{narrow} layers with stock torch attention: a sampled row may differ alone and in a batch "
                f"(SDPA over rows padded to the longest sums in another order, and {narrow}'s bf16 GEMM inputs "
                "round that up); the compiled CPU ops attend row by row and keep rows batch-invariant",
                extra={"ops": "torch", "why": self.ops_reason or self.ops_fallbacks.get("decode_attention", "")},
            )

        # Every layer of a step in one compiled call (``decoder_layers``), where each of its GEMMs
        # is the panels and the compiled ops do the rest: the same calls the Python loop makes
        # (``_layers``), without a Python frame and ~17 dispatches a layer, a step's LoRA adapters
        # included where they run on the compiled ops (``StepAdapters.layer_lists``). False: the loop.
        self.fused_layers = (
            isinstance(self.ops, CompiledOps)
            and isinstance(self.decode_attention, PagedDecodeAttention)
            and hasattr(self.ops.library, "decoder_layers")
            and all(
                panel_weights(gemm) is not None
                for layer in self.layers
                for gemm in (layer.qkv, layer.out, layer.gate_up, layer.down)
            )
        )
        self._layer_lists: tuple[list[torch.Tensor], ...] | None = None

    def layer_lists(self) -> tuple[list[torch.Tensor], ...]:
        """``decoder_layers``' weight lists and the cache's keys and values per layer (built once)."""
        if self._layer_lists is None:
            none = torch.empty(0)
            gemms = [[layer.qkv, layer.out, layer.gate_up, layer.down] for layer in self.layers]
            weights = [[typing.cast("torch.Tensor", panel_weights(gemm)) for gemm in g] for g in gemms]
            self._layer_lists = (
                [layer.input_norm for layer in self.layers],
                [w[0] for w in weights],
                [w[1] for w in weights],
                [layer.post_norm for layer in self.layers],
                [w[2] for w in weights],
                [w[3] for w in weights],
                [none if gemm.bias is None else gemm.bias for g in gemms for gemm in g],
                [layer.keys for layer in self.cache.layers],
                [layer.values for layer in self.cache.layers],
            )
        return self._layer_lists

    def cache_reallocated(self) -> None:
        """The cache's tensors were allocated anew (``PagedCache.reallocate``): forget the old ones."""
        self._layer_lists = None

    @property
    def gemm(self) -> str:
        """Which GEMM the full-precision layers run: "panels" (the compiled ``panel_linear``),
        "onednn" (oneDNN's packed), "plain" (``F.linear``) or "int8"."""
        return self.lm_head.kind if isinstance(self.lm_head, Linear) else "int8"

    @property
    def compiled(self) -> bool:
        """Whether the compiled CPU ops run this pass's work around its GEMMs."""
        return isinstance(self.ops, CompiledOps)

    def _drop(self, module: Any, packed: bool) -> None:
        """Replace a module's weight by an empty one; a packed copy's source pages go back at once."""
        if isinstance(module, Int8Linear):
            module.qdata = torch.empty(0, 0, dtype=torch.int8, device=self.device)
            return
        if isinstance(module, Int8GroupLinear):
            module.panels = torch.empty(0, 0, 0, dtype=torch.uint8, device=self.device)
            return
        if packed:
            page_out(module.weight, self._mappings)
        module.weight = torch.nn.Parameter(
            torch.empty(0, dtype=self.weight_dtype, device=self.device), requires_grad=False
        )

    def _compiled_ops(self, choice: str) -> tuple[Any | None, str | None]:
        """The compiled CPU ops (``kernels``) where asked for and able, else None and why."""
        if choice == "torch":
            return None, "--kernels torch"
        if self.device.type != "cpu" or self.dtype != torch.float32:
            reason = f"they run float32 on a CPU (here {self.dtype} on {self.device.type})"
        elif self.head_dim % 16:
            reason = f"head dim {self.head_dim} is not a multiple of 16"
        else:
            loaded = kernels.load()
            if loaded.ops is not None:
                return loaded.ops, None
            reason = loaded.reason or "unavailable"
        if choice == "compiled":
            raise ValueError(f"--kernels compiled: {reason}")
        return None, reason

    def _embed(
        self, ids: torch.Tensor, positions: torch.Tensor, ops: TorchOps
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tokens' embeddings ``[tokens, hidden]`` and their rotary tables, as ``ops.rope`` takes them."""
        hidden = F.embedding(ids, self.embed).to(self.dtype)
        if self.embed_scale != 1.0:
            hidden = hidden * self.embed_scale
        cos, sin = ops.rope_tables(*self.rotary(hidden, positions.unsqueeze(0)))
        return hidden, cos, sin

    def _layers(
        self,
        hidden: torch.Tensor,
        ops: TorchOps,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Attend,
        lora: StepAdapters | None = None,
    ) -> torch.Tensor:
        """Every decoder layer over the step's tokens. ``attend(index, qkv, q, k, v)`` stores the
        layer's keys and values and returns its attention ``[tokens, heads, dim]``: the eager
        step (segments) and the fixed-shape one (``decode_step``) differ there alone. ``lora``:
        the step's tokens by LoRA adapter, each adding its delta after each GEMM (``engine.lora``)."""
        tokens = int(hidden.shape[0])
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        for index, layer in enumerate(self.layers):
            normed = ops.rms_norm(hidden, layer.input_norm)
            qkv = layer.qkv(normed) if lora is None else lora.linear(layer.qkv, normed, index, "qkv")
            qk = ops.rope(
                qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim), cos, sin
            )  # q and k at once
            v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
            attended = attend(index, qkv, qk[:, :heads], qk[:, heads:], v).reshape(tokens, heads * dim)
            if lora is None:
                hidden = layer.out.plus(attended, hidden)
            else:
                hidden = lora.linear(layer.out, attended, index, "o", hidden)
            normed = ops.rms_norm(hidden, layer.post_norm)
            gate_up = layer.gate_up(normed) if lora is None else lora.linear(layer.gate_up, normed, index, "gate_up")
            activated = ops.silu_mul(gate_up)
            if lora is None:
                hidden = layer.down.plus(activated, hidden)
            else:
                hidden = lora.linear(layer.down, activated, index, "down", hidden)
        return hidden

    @property
    def columns(self) -> dict[str, tuple[int, int]]:
        """Each projection's columns of its GEMM's output: q, k, v in the fused q/k/v, gate and
        up in the fused gate/up, o and down whole (``engine.lora``)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        inner, width = self.intermediate, int(self.norm.shape[0])
        return {
            "q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv), "o_proj": (0, width),
            "gate_proj": (0, inner), "up_proj": (inner, 2 * inner), "down_proj": (0, width),
        }  # fmt: skip

    @property
    def widths(self) -> dict[str, int]:
        """Each GEMM's output width: the fused q/k/v, o, the fused gate/up, down."""
        q, kv, width = self.heads * self.head_dim, self.kv_heads * self.head_dim, int(self.norm.shape[0])
        return {"qkv": q + 2 * kv, "o": width, "gate_up": 2 * self.intermediate, "down": width}

    @torch.inference_mode()
    def __call__(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        segments: list[Segment],
        emit: list[int],
        lora: StepAdapters | None = None,
    ) -> torch.Tensor:
        """Run one step. ``ids``/``positions``: ``[tokens]`` (segment after segment, one-token
        segments first); ``emit``: the token indices whose next-token logits are returned
        (``[len(emit), vocab]``, fp32); ``lora``: the tokens' LoRA adapters (None: none)."""
        device = self.device
        ids = to_device(ids, device)
        positions = to_device(positions, device)
        tokens = int(ids.shape[0])
        ops, attention = self.ops, self.decode_attention
        hidden, cos, sin = self._embed(ids, positions, ops)

        singles = [segment for segment in segments if segment.count == 1]
        chunks = [segment for segment in segments if segment.count > 1]
        assert segments[: len(singles)] == singles, "one-token segments come first"
        cache, block_size, scratch = self.cache, self.cache.block_size, self.cache.scratch
        blocks, offsets = places(
            [list(s.table) for s in segments], [s.start for s in segments], [s.count for s in segments], block_size
        )
        where = Places(blocks, offsets)
        if isinstance(attention, PagedDecodeAttention) and chunks:
            # NOTE: with the compiled ops every token attends row by row, a prompt chunk's tokens
            # as one-token rows over their own columns (the same kernel and sums as decoding):
            # a token's keys and values then do not depend on how its prompt was cut into chunks,
            # what came from the prefix cache, or which rows shared the step, so a row gives the
            # same tokens alone and in any batch, with int8's bf16 rounding too (SDPA over a chunk
            # sums in an order that follows the chunk). Its cost: a long prompt's attention runs
            # as that many rows rather than one SDPA call.
            singles = singles + [Segment(c.table, c.start + j, 1) for c in chunks for j in range(c.count)]
            chunks = []
        single_plan = attention.plan(singles, block_size, scratch, device) if singles else None
        chunk_plans = self.chunk_attention.chunk_plans(chunks, block_size, scratch, device)

        def attend(index: int, qkv: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys, values = cache.layers[index].keys, cache.layers[index].values
            ops.store_kv(qkv, k, v, keys, values, where)
            attended: list[torch.Tensor] = []  # [count, heads, dim] per segment kind, in token order
            if single_plan is not None:
                attended.append(attention(q[: len(singles)], keys, values, single_plan))
            offset = len(singles)
            for segment, plan in zip(chunks, chunk_plans, strict=True):
                attended.append(
                    self.chunk_attention.chunk(q[offset : offset + segment.count], keys, values, segment, plan)
                )
                offset += segment.count
            return attended[0] if len(attended) == 1 else torch.cat(attended)

        adapted: tuple[Any, ...] | None = None  # decoder_layers' LoRA arguments, where the step takes the one call
        if self.fused_layers and single_plan is not None and not chunks:
            adapted = NO_ADAPTERS if lora is None else lora.layer_lists()
        if adapted is not None:
            assert (
                isinstance(ops, CompiledOps) and isinstance(attention, PagedDecodeAttention) and single_plan is not None
            )
            tables, lengths = single_plan
            hidden = ops.library.decoder_layers(
                hidden, *self.layer_lists(), cos, sin, where.blocks, where.offsets, tables, lengths,
                self.eps, attention.scale, self.heads, self.kv_heads, self.intermediate, *adapted,
            )  # fmt: skip
        else:
            hidden = self._layers(hidden, ops, cos, sin, attend, lora)
        picked = (
            hidden if emit == list(range(tokens)) else hidden.index_select(0, host_tensor(emit, torch.long, device))
        )
        return self.lm_head(ops.rms_norm(picked, self.norm)).float()

    def decode_step(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
        tables: torch.Tensor,
        lengths: torch.Tensor,
    ) -> torch.Tensor:
        """One decode step in fixed shapes: ``rows`` one-token rows (``ids``, ``positions``,
        ``blocks``/``offsets`` where each writes, ``lengths`` = position + 1: ``[rows]``;
        ``tables``: ``[rows, width]``), all already on the device. Every row reads its
        table's full width, masked past its length, so the shapes depend on ``rows`` and
        ``width`` alone and no value goes back to the host: ``graphs.DecodeGraphs`` captures
        this as a CUDA graph per (rows, width) bucket. Padding rows write the scratch block.
        Returns ``[rows, vocab]`` fp32 logits. Called under the runner's inference mode (not
        decorated: ``torch.compile`` traces it)."""
        ops = self.static_ops
        hidden, cos, sin = self._embed(ids, positions, ops)
        flat = flat_index(blocks, offsets, self.kv_heads, self.cache.block_size)

        def attend(index: int, qkv: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys, values = self.cache.layers[index].keys, self.cache.layers[index].values
            write(keys, values, flat, k, v)
            return static_decode_attention(q.contiguous(), keys, values, tables, lengths, self.kv_heads, self.scale)

        hidden = self._layers(hidden, ops, cos, sin, attend)
        return self.lm_head(ops.rms_norm(hidden, self.norm)).float()
