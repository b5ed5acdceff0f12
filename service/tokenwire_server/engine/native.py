"""The batched engine's own forward pass for Llama-shaped models, over the slot cache.

``transformers``' forward takes a rectangular ``[batch, length]`` input, so a step
that mixes one-token decode rows with a chunk of somebody's prompt has to pad or
run twice. This pass takes the step as it is: a ragged list of *segments* (a slot,
the column its first token goes to, how many tokens), all tokens of the step in one
flat ``[tokens, hidden]`` tensor. Every linear layer therefore runs once per step
over all of them (decode rows and prompt chunks together: prefill rides along with
decoding instead of stopping it), and only the rows that must pick a token go
through the final norm and the vocabulary projection.

Attention is per segment kind. The one-token rows attend together: on an AVX2+FMA CPU
in float32 through the compiled ``decode_attention`` (``kernels``, ``--kernels``), each
row over its own slot's columns and no more; elsewhere as batched
``scaled_dot_product_attention`` calls over their slots with a per-row length mask (the
query heads that share a KV head go in as that head's query rows, so each row's keys
and values are read once; rows of very different lengths go in separate calls, so a
short row does not read up to the longest one's length: ``single_groups``). Each
prompt chunk attends alone, causally, over its own slot, through SDPA. The same
compiled library does RMSNorm, RoPE (in place), SiLU(gate)*up and the K/V cache write
in one call each.

On a CPU the weights of every linear layer are prepacked once for oneDNN
(``torch.ops.mkldnn._reorder_linear_weight``), a blocked layout its fp32 GEMM reads
without reordering per call: measured on a 2-core AVX2 machine over the default
model's weights (``make bench-kernels``), all linear layers of one step take 34 ms
instead of 55 at one row and 60 ms instead of 86 at 16 rows. When the engine owns the model (the server),
the packed copies replace the plain weights layer by layer (``release_weights``;
the embedding table stays plain, for the lookup), so memory does not grow and the
model's own ``forward`` can no longer run. Elsewhere (CUDA, or fp16/bf16), plain
``F.linear``.

Numbers: every step computes, row by row, the same arithmetic a row alone would
(the same projections, RoPE, fp32 RMSNorm and masked softmax attention); only the
GEMM's blocking differs with the number of rows, as it does in ``transformers``.
``tests/test_native_forward.py`` holds it to ``transformers``' own forward.
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import sys
from typing import Any

import torch
import torch.nn.functional as F

from ..model import attention_shape
from . import kernels
from .slots import SlotCache, flat_index, read_slots

SUPPORTED_TYPES = frozenset({"llama"})
# The work around the GEMMs (decode attention, RMSNorm, RoPE, SiLU*up): ``auto``: the
# compiled CPU ops (``kernels``) where they build and run (float32 on an AVX2+FMA CPU),
# else stock torch ops; ``compiled``: insist; ``torch``: never.
KERNEL_CHOICES = ("auto", "compiled", "torch")


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
        if type(attention).__name__ != "LlamaAttention" or type(layer.mlp).__name__ != "LlamaMLP":
            return f"layer type {type(attention).__name__}/{type(layer.mlp).__name__}"
    devices = {parameter.device for parameter in model.parameters()}
    if len(devices) != 1:
        return "weights spread over several devices"
    return None


def onednn_available(device: torch.device) -> bool:
    return device.type == "cpu" and bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")  # type: ignore[no-untyped-call]


class Linear:
    """One linear layer: oneDNN-prepacked on a CPU, plain ``F.linear`` elsewhere."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool, batch_hint: int) -> None:
        weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()
        self.packed = packed
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint) if packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
            return out
        return F.linear(x, self.weight, self.bias)

    def plus(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``; on oneDNN the add rides on the GEMM (a post-op), no separate pass."""
        if self.packed:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, self.bias, "add")
            return out
        return residual + F.linear(x, self.weight, self.bias)


_MADV_PAGEOUT = 21  # Linux 5.4+


def page_out(tensor: torch.Tensor) -> None:
    """Ask the kernel to reclaim the pages behind ``tensor`` now (``MADV_PAGEOUT``).

    The loaded weights are usually pages of the mmapped checkpoint; once packed they are
    never read again, but they stay resident until the whole file is unmapped, at the
    end (the peak would hold the model twice). Reclaiming never loses data: a clean
    file page is read again from the file if touched, and an anonymous page without
    swap simply stays. A no-op off Linux or where the call fails.
    """
    if sys.platform != "linux" or tensor.device.type != "cpu" or tensor.numel() == 0:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        page = mmap.PAGESIZE
        start = tensor.data_ptr() // page * page
        end = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size()) // page) * page
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), ctypes.c_int(_MADV_PAGEOUT))
    except (OSError, AttributeError):  # no libc symbol, or a platform without it
        pass


def _fused(*linears: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = torch.cat([linear.weight.detach() for linear in linears], dim=0)
    biases = [linear.bias for linear in linears]
    if all(bias is None for bias in biases):
        return weight, None
    parts = [torch.zeros(linear.weight.shape[0], dtype=weight.dtype, device=weight.device) if bias is None else bias.detach() for linear, bias in zip(linears, biases, strict=True)]
    return weight, torch.cat(parts)


@dataclasses.dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: Linear
    out: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


@dataclasses.dataclass(frozen=True)
class Segment:
    """``count`` consecutive tokens of one slot, the first at column ``start``."""

    slot: int
    start: int
    count: int


# What one more attention call per layer costs, in row-columns (one row attending over one
# column); measured on a 2-core AVX2 CPU: a call ~25 us, a row-column ~0.15-0.2 us.
ATTENTION_CALL_COST = 128


def single_groups(singles: list[Segment]) -> list[tuple[int, int, int]]:
    """Split the one-token rows into attention calls: ``(first row, rows, first slot)``.

    A call reads its rows' slots as one view, so its rows are consecutive here and sit
    in consecutive slots; it reads as many columns as its longest row. One long row
    among short ones would make every row read its length, so rows are cut into the
    groups that read the fewest row-columns, counting ATTENTION_CALL_COST per call
    (exact over the cuts, ``O(rows^2)``; rows of similar lengths stay one call).
    """
    n = len(singles)
    best = [0.0] + [float("inf")] * n
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        longest = 0
        for first in range(end - 1, -1, -1):
            if first < end - 1 and singles[first].slot + 1 != singles[first + 1].slot:
                break
            longest = max(longest, singles[first].start + 1)
            cost = best[first] + (end - first) * longest + ATTENTION_CALL_COST
            if cost < best[end]:
                best[end], cut[end] = cost, first
    groups: list[tuple[int, int, int]] = []
    end = n
    while end > 0:
        first = cut[end]
        groups.append((first, end - first, singles[first].slot))
        end = first
    return groups[::-1]


def token_places(segments: list[Segment]) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot and the column of every token of the step, in token order."""
    slot = torch.tensor([s.slot for s in segments for _ in range(s.count)], dtype=torch.long)
    column = torch.cat([torch.arange(s.start, s.start + s.count) for s in segments])
    return slot, column


class NativeForward:
    """The forward pass of a Llama-shaped model over a ``SlotCache``; weights taken from the loaded model."""

    def __init__(self, model: Any, cache: SlotCache, batch_hint: int, release_weights: bool = False, ops: str = "auto") -> None:
        if ops not in KERNEL_CHOICES:
            raise ValueError(f"unknown kernels {ops!r}; expected one of {', '.join(KERNEL_CHOICES)}")
        config = model.config
        inner = model.model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.heads, self.kv_heads, self.head_dim = attention_shape(config)
        self.eps = float(config.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self.cache = cache
        packed = onednn_available(self.device) and self.dtype == torch.float32
        self.packed = packed
        release = packed and release_weights
        if release:
            # Everything but the linear layers (the embedding table, the norms) moves to
            # memory of its own: the loaded weights may be pages of the mmapped checkpoint,
            # which is unmapped only once no tensor points into it any more.
            for module in model.modules():
                if isinstance(module, torch.nn.Linear):
                    continue
                for name, parameter in list(module._parameters.items()):
                    if parameter is not None:
                        module._parameters[name] = torch.nn.Parameter(parameter.detach().clone(), requires_grad=False)
        self.layers: list[Layer] = []
        embed = inner.embed_tokens.weight
        head = model.get_output_embeddings()
        # The lm head is packed before any plain weight is dropped (it may be the
        # embedding table itself, which stays plain for the lookup).
        self.lm_head = Linear(head.weight, getattr(head, "bias", None), packed, batch_hint)
        for layer in inner.layers:
            attention, mlp = layer.self_attn, layer.mlp
            qkv_weight, qkv_bias = _fused(attention.q_proj, attention.k_proj, attention.v_proj)
            gu_weight, gu_bias = _fused(mlp.gate_proj, mlp.up_proj)
            self.layers.append(
                Layer(
                    input_norm=layer.input_layernorm.weight.detach(),
                    qkv=Linear(qkv_weight, qkv_bias, packed, batch_hint),
                    out=Linear(attention.o_proj.weight, attention.o_proj.bias, packed, batch_hint),
                    post_norm=layer.post_attention_layernorm.weight.detach(),
                    gate_up=Linear(gu_weight, gu_bias, packed, batch_hint),
                    down=Linear(mlp.down_proj.weight, mlp.down_proj.bias, packed, batch_hint),
                )
            )
            del qkv_weight, gu_weight
            if release:
                # The packed copies replace the plain weights, layer by layer, so the
                # peak memory holds one layer twice at most, never the model.
                for module in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                    page_out(module.weight)
                    module.weight = torch.nn.Parameter(torch.empty(0, dtype=self.dtype), requires_grad=False)
        if release and head.weight.data_ptr() != embed.data_ptr():
            page_out(head.weight)
            head.weight = torch.nn.Parameter(torch.empty(0, dtype=self.dtype), requires_grad=False)
        self.norm = inner.norm.weight.detach()
        self.embed = embed.detach()
        self.embed_scale = float(getattr(inner.embed_tokens, "embed_scale", 1.0) or 1.0)
        self.rotary = inner.rotary_emb
        self.intermediate = int(config.intermediate_size)
        self.ops, self.ops_reason = self._compiled_ops(ops)
        # Compiled ops this model is past the limits of, each with why: those run on stock
        # torch, checked here once rather than failing every step.
        self.ops_fallbacks: dict[str, str] = {}
        group = self.heads // self.kv_heads
        if self.ops is not None and group > kernels.MAX_QUERY_HEADS_PER_KV_HEAD:
            self.ops_fallbacks["decode_attention"] = (
                f"{group} query heads per KV head; the compiled op takes at most {kernels.MAX_QUERY_HEADS_PER_KV_HEAD}"
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

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Llama's RMSNorm, computed in float32 whatever the weights' dtype (as transformers does)."""
        if self.ops is not None:
            norm: torch.Tensor = self.ops.rms_norm(x, weight, self.eps)
            return norm
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, segments: list[Segment], emit: list[int]) -> torch.Tensor:
        """Run one step. ``ids``/``positions``: ``[tokens]`` (segment after segment, one-token
        segments first); ``emit``: the token indices whose next-token logits are returned
        (``[len(emit), vocab]``, fp32)."""
        device = self.device
        ids = ids.to(device)
        positions = positions.to(device)
        tokens = int(ids.shape[0])
        hidden = F.embedding(ids, self.embed)
        if self.embed_scale != 1.0:
            hidden = hidden * self.embed_scale
        ops = self.ops
        cos, sin = self.rotary(hidden, positions.unsqueeze(0))
        half = self.head_dim // 2
        if ops is not None:
            cos, sin = cos[0].contiguous(), sin[0].contiguous()  # [tokens, dim]
        else:
            cos = cos[0].unsqueeze(1)  # [tokens, 1, dim]
            # rotate_half(x) * sin == swap_halves(x) * (sin with its first half negated): the
            # same products, one op (a flip over the two halves) instead of slice, neg and cat.
            sin = sin[0].unsqueeze(1).clone()
            sin[..., :half] = -sin[..., :half]
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim

        singles = [segment for segment in segments if segment.count == 1]
        chunks = [segment for segment in segments if segment.count > 1]
        assert segments[: len(singles)] == singles, "one-token segments come first"
        width = self.cache.capacity + 1
        if ops is not None:
            token_slots, token_columns = token_places(segments)
        else:
            flat = self._write_index(segments, width, kv_heads)
        compiled_attention = "decode_attention" not in self.ops_fallbacks
        decode_attention = ops.decode_attention if ops is not None and compiled_attention and singles else None
        if decode_attention is not None:
            # Each one-token row reads its own slot's columns 0..start, no more: no groups, no mask.
            single_slots = torch.tensor([s.slot for s in singles], dtype=torch.long)
            single_lengths = torch.tensor([s.start + 1 for s in singles], dtype=torch.long)
            groups = []
        else:
            groups = [(first, rows, slot, self._single_mask(singles[first : first + rows])) for first, rows, slot in single_groups(singles)]
        chunk_masks = [self._chunk_mask(segment) for segment in chunks]
        # Each row reads its own slot's columns up to its end, all written by this step's
        # layer or an earlier step; only a group of one-token rows read as one view reads
        # past a shorter row's end, and those columns must be finite (zeroed).
        for _, rows, slot, mask in groups:
            self.cache.ensure_clean(list(range(slot, slot + rows)), int(mask.shape[-1]))

        for index, layer in enumerate(self.layers):
            normed = self._norm(hidden, layer.input_norm)
            qkv = layer.qkv(normed)
            qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)  # RoPE on q and k at once
            if ops is not None:
                ops.rope_(qk, cos, sin)
            else:
                swapped = qk.view(tokens, heads + kv_heads, 2, half).flip(-2).flatten(-2)
                qk = qk * cos + swapped * sin
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
            slot_layer = self.cache.layers[index]
            keys, values = slot_layer.keys, slot_layer.values
            if ops is not None:
                ops.store_kv(qkv, keys, values, token_slots, token_columns, heads)
            else:
                keys.view(-1, dim).index_copy_(0, flat, k.reshape(-1, dim).to(keys.dtype))
                values.view(-1, dim).index_copy_(0, flat, v.reshape(-1, dim).to(values.dtype))
            attended: list[torch.Tensor] = []  # [count, heads, dim] per segment kind, in token order
            if decode_attention is not None:
                attended.append(decode_attention(q[: len(singles)].contiguous(), keys, values, single_slots, single_lengths, self.scale))
            for first, rows, slot, mask in groups:
                sk, sv = read_slots(keys, values, (slot, slot + rows), mask.shape[-1])
                # The query heads that share a KV head are that head's query rows: each
                # row's keys and values are read once, not once per query head.
                grouped = q[first : first + rows].view(rows, kv_heads, heads // kv_heads, dim)
                out = F.scaled_dot_product_attention(grouped, sk, sv, attn_mask=mask, scale=self.scale)
                attended.append(out.reshape(rows, heads, dim))
            offset = len(singles)
            for segment, mask in zip(chunks, chunk_masks, strict=True):
                end = segment.start + segment.count
                ck = keys[segment.slot : segment.slot + 1, :, :end]
                cv = values[segment.slot : segment.slot + 1, :, :end]
                cq = q[offset : offset + segment.count].transpose(0, 1).unsqueeze(0)  # [1, heads, count, dim]
                out = F.scaled_dot_product_attention(cq, ck, cv, attn_mask=mask, scale=self.scale, enable_gqa=kv_heads != heads)
                attended.append(out[0].transpose(0, 1))
                offset += segment.count
            joined = attended[0] if len(attended) == 1 else torch.cat(attended)
            hidden = layer.out.plus(joined.reshape(tokens, heads * dim), hidden)
            normed = self._norm(hidden, layer.post_norm)
            gate_up = layer.gate_up(normed)
            if ops is not None:
                activated = ops.silu_mul(gate_up, self.intermediate)
            else:
                activated = F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :]
            hidden = layer.down.plus(activated, hidden)

        # Only now, every layer having written them (a step that fails midway leaves
        # columns unwritten, and a later zeroing must not skip them).
        for segment in segments:
            self.cache.written(segment.slot, segment.start + segment.count)
        picked = hidden if emit == list(range(tokens)) else hidden.index_select(0, torch.tensor(emit, dtype=torch.long, device=device))
        return self.lm_head(self._norm(picked, self.norm)).float()

    # -- step geometry ---------------------------------------------------------------

    def _write_index(self, segments: list[Segment], width: int, kv_heads: int) -> torch.Tensor:
        """Where each (token, kv head) vector goes in a layer's buffer (``slots.flat_index``)."""
        slot, column = token_places(segments)
        return flat_index(slot.view(-1, 1), column.view(-1, 1), kv_heads, width).to(self.device)

    def _single_mask(self, singles: list[Segment]) -> torch.Tensor:
        """``[rows, 1, 1, columns]`` bool: each one-token row sees its own columns 0..start."""
        columns = max(s.start for s in singles) + 1
        starts = torch.tensor([s.start for s in singles], dtype=torch.long).view(-1, 1)
        allowed = torch.arange(columns).view(1, columns) <= starts
        return allowed.view(len(singles), 1, 1, columns).to(self.device)

    def _chunk_mask(self, segment: Segment) -> torch.Tensor:
        """``[1, 1, count, start + count]`` bool: query i (column start + i) sees columns 0..start + i."""
        end = segment.start + segment.count
        query = torch.arange(segment.start, end).view(-1, 1)
        allowed = torch.arange(end).view(1, end) <= query
        return allowed.view(1, 1, segment.count, end).to(self.device)
