"""The compiled CPU ops (``engine/kernels``) against stock torch, and how the native pass picks them.

- ``decode_attention``: each one-token row attends over the first ``length`` columns of
  its own block table (blocks scattered over the pool, in any order): the same numbers
  as ``scaled_dot_product_attention`` over those columns (grouped query heads, ragged
  lengths on both sides of the 8-column steps and the 16-token blocks). A row's output
  does not depend on the other rows of the call, nor on what lies past its length (NaN
  there changes nothing): batch invariance by construction.
- ``rms_norm``, ``silu_mul``, ``rope_``: transformers' Llama RMSNorm, SiLU(gate)*up and
  ``apply_rotary_pos_emb``, to float32 rounding, on sizes with and without a tail past
  the 8-lane vectors; each row alone gives the same bits as among others.
- ``lora_add_``: each token's ``(x·Aᵀ)·Bᵀ`` over its adapter's spans, added to its row in
  place, to float32 rounding of the dense product; rows without an adapter keep their bits,
  and a row gets the same bits alone, among other adapters' rows and in any tile of its own.
- Bad arguments are errors with a reason, never a crash.
- ``--kernels auto`` keeps stock torch ops where the library is unavailable and says
  why; ``compiled`` refuses to start without it; ``torch`` never takes it.
- Where the ops cannot be used (a CPU without AVX2+FMA: ``ATEN_CPU_CAPABILITY=default``,
  or torch's capability faked; no compiler: ``CXX=/nonexistent`` and an empty
  ``TOKENWIRE_KERNEL_DIR``), the server and the engine start on stock torch ops and the
  "batched engine forward pass" log line gives the reason; likewise when the native pass
  itself is not taken (``why_not_native``).
- ``make kernels`` (``python -m tokenwire_server.engine.kernels``) builds with a compiler
  alone, on an x86 CPU without AVX2 too; exits 0 with the reason where the host cannot
  build (no compiler, not x86-64); shows the compiler's warnings; exits 1 when the build fails.

On a machine with a C++ compiler and an AVX2+FMA x86 CPU (CI's) the library must build:
those tests fail rather than skip if it does not. Elsewhere they skip with the reason
and the stock torch ops are what the engine tests run.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from engine_support import fresh_cache, kernel_unbuildable, run_all
from servers import ServerProcess
from tokenwire_server.domain import FinishEvent, GenerationRequest, SamplingOptions
from tokenwire_server.engine import create_engine, kernels
from tokenwire_server.engine.base import EngineLimits
from tokenwire_server.engine.native import NativeForward
from tokenwire_server.engine.ops import Segment
from tokenwire_server.model import load_model

# On two threads at least, whatever the parallel suite's one per worker: the kernels split rows over them.
pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("two_threads")]


def compiled_ops():
    """``torch.ops.tokenwire``; skipped only where the machine cannot build it (no compiler, no AVX2+FMA)."""
    reason = kernel_unbuildable()
    if reason:
        pytest.skip(f"compiled CPU ops: {reason}")
    loaded = kernels.load()
    assert loaded.ops is not None, loaded.reason
    return loaded.ops


def kernel_op():
    return compiled_ops().decode_attention


def paged(keys, values, seed: int = 0, block_size: int = 16):
    """Per-row buffers ``[rows, kv_heads, capacity, dim]`` laid out as a block pool with the
    blocks shuffled: (pool keys, pool values, one table per row)."""
    rows, kv_heads, capacity, dim = keys.shape
    per_row = capacity // block_size
    order = torch.randperm(rows * per_row, generator=torch.Generator().manual_seed(seed))
    tables = order.view(rows, per_row).contiguous()
    pools = []
    for buffer in (keys, values):
        pool = torch.empty(rows * per_row, kv_heads, block_size, dim)
        blocks = buffer.view(rows, kv_heads, per_row, block_size, dim).transpose(1, 2)
        pool[tables.reshape(-1)] = blocks.reshape(rows * per_row, kv_heads, block_size, dim)
        pools.append(pool)
    return pools[0], pools[1], tables


def reference(q, keys, values, slots, lengths, scale):
    rows, heads, dim = q.shape
    kv_heads = keys.shape[1]
    out = torch.empty_like(q)
    for r in range(rows):
        s, n = int(slots[r]), int(lengths[r])
        grouped = q[r].view(kv_heads, heads // kv_heads, dim)
        out[r] = F.scaled_dot_product_attention(grouped, keys[s, :, :n], values[s, :, :n], scale=scale).reshape(
            heads, dim
        )
    return out


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 16)])
def test_the_kernel_gives_sdpa_numbers_over_each_rows_own_columns(heads: int, kv_heads: int, dim: int) -> None:
    op = kernel_op()
    generator = torch.Generator().manual_seed(0)
    slots_n, capacity = 6, 320
    keys = torch.randn(slots_n, kv_heads, capacity, dim, generator=generator)
    values = torch.randn(slots_n, kv_heads, capacity, dim, generator=generator)
    lengths = torch.tensor([1, 7, 8, 9, 300, 64], dtype=torch.long)  # around the 8-column blocks
    slots = torch.tensor([4, 0, 5, 2, 1, 3], dtype=torch.long)  # any order
    q = torch.randn(6, heads, dim, generator=generator) * 3  # large scores: softmax's max matters
    pool_k, pool_v, tables = paged(keys, values)
    got = op(q, pool_k, pool_v, tables[slots].contiguous(), lengths, dim**-0.5)
    want = reference(q, keys, values, slots, lengths, dim**-0.5)
    assert got.shape == q.shape
    assert (got - want).abs().max().item() < 1e-5


def test_a_row_gives_the_same_bits_alone_as_among_others_and_never_reads_past_its_length() -> None:
    op = kernel_op()
    generator = torch.Generator().manual_seed(1)
    keys = torch.randn(4, 3, 200, 64, generator=generator)
    values = torch.randn(4, 3, 200, 64, generator=generator)
    q = torch.randn(4, 9, 64, generator=generator)
    lengths = torch.tensor([17, 150, 3, 90])
    pool_k, pool_v, tables = paged(keys, values, seed=1, block_size=8)
    together = op(q, pool_k, pool_v, tables, lengths, 0.125)
    keys[:, :, 150:] = float("nan")  # past every row's length
    values[:, :, 150:] = float("nan")
    keys[2, :, 3:] = float("nan")  # past row 2's
    pool_k, pool_v, tables = paged(keys, values, seed=1, block_size=8)
    tables[2, 1:] = 10**9  # and row 2's table past its one block points nowhere: never read
    for row in range(4):
        alone = op(
            q[row : row + 1].contiguous(),
            pool_k,
            pool_v,
            tables[row : row + 1].contiguous(),
            lengths[row : row + 1],
            0.125,
        )
        assert torch.equal(alone[0], together[row])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tables": torch.tensor([[0], [9]])}, "block out of range"),
        ({"lengths": torch.tensor([0, 4])}, "length out of range"),
        ({"lengths": torch.tensor([4, 17])}, "length out of range"),
        ({"lengths": torch.tensor([4])}, "one table and one length per row"),
        (
            {"keys": torch.zeros(2, 3, 12, 64), "values": torch.zeros(2, 3, 12, 64)},
            "block size must be a multiple of 8",
        ),
        ({"q": torch.randn(2, 9, 64, dtype=torch.float64)}, "float32 only"),
        ({"q": torch.randn(2, 8, 64)}, "multiple of KV heads"),
        ({"q": torch.randn(9, 2, 64).transpose(0, 1)}, "contiguous"),
    ],
)
def test_bad_arguments_are_errors_that_say_which(change: dict, message: str) -> None:
    op = kernel_op()
    args = {
        "q": torch.randn(2, 9, 64),
        "keys": torch.zeros(2, 3, 16, 64),
        "values": torch.zeros(2, 3, 16, 64),
        "tables": torch.tensor([[0], [1]]),
        "lengths": torch.tensor([4, 4]),
    }
    args.update(change)
    with pytest.raises(RuntimeError, match=message):
        op(args["q"], args["keys"], args["values"], args["tables"], args["lengths"], 0.125)


def test_a_built_kernel_is_found_again_without_compiling() -> None:
    kernel_op()
    built = kernels.build()
    assert built.seconds == 0.0 and built.path == kernels.load().path == kernels.library_path() and built.path.is_file()


def test_auto_keeps_torch_ops_where_the_library_is_unavailable_and_compiled_refuses_to_start(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded = load_model(str(tiny_model_dir))
    monkeypatch.setattr(kernels, "load", lambda: kernels.Kernel(None, "no C++ compiler (test)"))
    native = NativeForward(loaded.model, fresh_cache(loaded.model, 64), batch_hint=2)
    assert not native.compiled and native.ops_reason == "no C++ compiler (test)"
    with pytest.raises(ValueError, match=r"--kernels compiled: no C\+\+ compiler \(test\)"):
        NativeForward(loaded.model, fresh_cache(loaded.model, 64), batch_hint=2, kernel_choice="compiled")
    with pytest.raises(ValueError, match="unknown kernels 'fast'"):
        NativeForward(loaded.model, fresh_cache(loaded.model, 64), batch_hint=2, kernel_choice="fast")


def test_a_failed_build_is_a_reason_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    if kernels.cpu_reason():
        pytest.skip(kernels.cpu_reason() or "")

    def broken(directory=None):
        raise RuntimeError("c++ failed (1): error: something")

    monkeypatch.setattr(kernels, "build", broken)
    loaded = kernels._load()
    assert loaded.ops is None and "c++ failed (1)" in (loaded.reason or "")


def test_the_engine_takes_the_compiled_ops_on_this_cpu_and_torch_ops_when_told(tiny_model_dir: Path) -> None:
    compiled_ops()
    loaded = load_model(str(tiny_model_dir))
    engine = create_engine("batched", loaded, EngineLimits(2, 2, 1024), workers=1)
    assert engine.runner.native.compiled and engine.kernels == "compiled"  # type: ignore[attr-defined]
    engine = create_engine("batched", loaded, EngineLimits(2, 2, 1024), workers=1, kernels="torch")
    assert not engine.runner.native.compiled and engine.kernels == "torch"  # type: ignore[attr-defined]


# -- the row-wise ops ------------------------------------------------------------------


@pytest.mark.parametrize("width", [576, 13])  # the default model's hidden size; a tail past the 8-lane vectors
def test_rms_norm_is_llamas(width: int) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ops = compiled_ops()
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(5, width, generator=generator) * 4
    norm = LlamaRMSNorm(width, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(width, generator=generator) + 0.5)
        want = norm(x)
    got = ops.rms_norm(x, norm.weight.detach(), 1e-5)
    assert (got - want).abs().max().item() < 1e-5
    assert torch.equal(ops.rms_norm(x[2:3].contiguous(), norm.weight.detach(), 1e-5)[0], got[2])


@pytest.mark.parametrize("intermediate", [1536, 21])
def test_silu_mul_is_silu_of_the_gate_times_the_up_half(intermediate: int) -> None:
    ops = compiled_ops()
    generator = torch.Generator().manual_seed(4)
    gate_up = torch.randn(6, 2 * intermediate, generator=generator) * 6  # past exp's comfortable range too
    gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])
    got = ops.silu_mul(gate_up, intermediate)
    want = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
    assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item()
    assert torch.equal(ops.silu_mul(gate_up[4:5].contiguous(), intermediate)[0], got[4])


@pytest.mark.parametrize(("heads", "dim"), [(12, 64), (3, 16)])
def test_rope_in_place_is_transformers_rotary_embedding(heads: int, dim: int) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    ops = compiled_ops()
    generator = torch.Generator().manual_seed(5)
    tokens = 7
    angles = torch.arange(tokens).view(-1, 1) * (10000.0 ** (-torch.arange(0, dim, 2) / dim)).view(1, -1)
    angles = torch.cat([angles, angles], -1)
    cos, sin = angles.cos(), angles.sin()
    # Rows of a wider tensor (the fused q/k/v output): rope_ writes q and k, leaves v alone.
    qkv = torch.randn(tokens, heads + 2, dim, generator=generator)
    x = qkv[:, :heads]
    batched = x.transpose(0, 1).unsqueeze(0)  # [1, heads, tokens, dim], as transformers holds it
    want, _ = apply_rotary_pos_emb(batched, batched, cos.unsqueeze(0), sin.unsqueeze(0))
    untouched = qkv[:, heads:].clone()
    ops.rope_(x, cos, sin)
    assert (x - want[0].transpose(0, 1)).abs().max().item() < 1e-5
    assert torch.equal(qkv[:, heads:], untouched)


def test_store_kv_writes_each_tokens_key_and_value_where_index_copy_would() -> None:
    ops = compiled_ops()
    generator = torch.Generator().manual_seed(6)
    heads, kv_heads, dim, tokens = 9, 3, 64, 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=generator)
    keys, values = torch.zeros(4, kv_heads, 16, dim), torch.zeros(4, kv_heads, 16, dim)
    blocks, offsets = torch.tensor([2, 0, 0, 0, 3]), torch.tensor([7, 0, 1, 2, 15])
    ops.store_kv(qkv, keys, values, blocks, offsets, heads)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    for t in range(tokens):
        assert torch.equal(keys[blocks[t], :, offsets[t]], k[t]) and torch.equal(values[blocks[t], :, offsets[t]], v[t])
    assert int((keys != 0).any(-1).sum()) == tokens * kv_heads  # nothing else written
    with pytest.raises(RuntimeError, match="block or offset out of range"):
        ops.store_kv(qkv, keys, values, blocks, torch.tensor([7, 0, 1, 2, 16]), heads)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda ops: ops.store_kv(
                torch.randn(2, 64),
                torch.zeros(1, 1, 4, 16),
                torch.zeros(1, 1, 4, 16),
                torch.tensor([0, 0]),
                torch.tensor([0, 1]),
                1,
            ),
            "qkv must be",
        ),
        (lambda ops: ops.rms_norm(torch.randn(2, 8), torch.ones(9), 1e-5), "rms_norm weight"),
        (lambda ops: ops.rms_norm(torch.randn(8, 2).t(), torch.ones(8), 1e-5), "contiguous float32"),
        (lambda ops: ops.silu_mul(torch.randn(2, 9), 4), "2 \\* intermediate"),
        (lambda ops: ops.rope_(torch.randn(2, 3, 24), torch.ones(2, 24), torch.ones(2, 24)), "multiple of 16"),
        (lambda ops: ops.rope_(torch.randn(2, 3, 16), torch.ones(3, 16), torch.ones(3, 16)), "cos and sin"),
    ],
)
def test_bad_arguments_to_the_row_wise_ops_are_errors_that_say_which(call, message: str) -> None:
    ops = compiled_ops()
    with pytest.raises(RuntimeError, match=message):
        call(ops)


# -- lora_add_ ----------------------------------------------------------------------------


def lora_case(ranks: list[int], spans: list[tuple[int, int]], width: int, inputs: int, seed: int):
    """One adapter in ``lora_add_``'s layout (down, flat up, segments) and its dense ``[width, Σ rank]`` B."""
    generator = torch.Generator().manual_seed(seed)
    down = torch.randn(sum(ranks), inputs, generator=generator)
    dense = torch.zeros(width, sum(ranks))
    ups, segments, low = [], [], 0
    for rank, (first, end) in zip(ranks, spans, strict=True):
        block = torch.randn(end - first, rank, generator=generator)
        dense[first:end, low : low + rank] = block
        ups.append(block.T.contiguous().flatten())
        segments.append((first, end, low, low + rank))
        low += rank
    return down, torch.cat(ups), torch.tensor(segments), dense


# Widths and spans off the 8- and 16-column steps, a rank-0 (absent) adapter, tiles of 1-4+.
LORA_ADAPTERS = [
    ([8, 8, 8], [(0, 40), (40, 56), (56, 72)], 72),
    ([16], [(0, 72)], 72),
    ([4, 12], [(3, 37), (45, 70)], 72),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_add_is_each_rows_low_rank_product_and_leaves_other_rows_alone(dtype: torch.dtype) -> None:
    """To float32 rounding of the dense product over weights in ``dtype`` (bf16: widened as read)."""
    ops = compiled_ops()
    inputs, width, tokens = 45, 72, 19
    cases = [lora_case(r, s, w, inputs, seed) for seed, (r, s, w) in enumerate(LORA_ADAPTERS)]
    cases = [(down.to(dtype), up.to(dtype), spans, dense.to(dtype).float()) for down, up, spans, dense in cases]
    none = torch.empty(0)
    downs, ups = [c[0] for c in cases] + [none], [c[1] for c in cases] + [none]
    spans = [c[2] for c in cases] + [none]
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(tokens, inputs, generator=generator)
    base = torch.randn(tokens, width, generator=generator)
    slots = torch.tensor([(-1, 0, 1, 0, 2, 3, 0, 0, 0, 0, 1)[t % 11] for t in range(tokens)])
    out = base.clone()
    ops.lora_add_(out, x, slots, downs, ups, spans)
    for t in range(tokens):
        slot = int(slots[t])
        if slot in (-1, 3):  # no adapter, or one with nothing at this site: the row's bits unchanged
            assert torch.equal(out[t], base[t]), t
            continue
        down, _, _, dense = cases[slot]
        expected = base[t] + (x[t] @ down.float().T) @ dense.T
        torch.testing.assert_close(out[t], expected, rtol=1e-5, atol=1e-5)
        alone = base[t : t + 1].clone()  # alone, and as a tile's only row
        ops.lora_add_(alone, x[t : t + 1].clone(), slots[t : t + 1].clone(), downs, ups, spans)
        assert torch.equal(alone[0], out[t]), t
    untouched = [c for c in range(width) if not 3 <= c < 37 and not 45 <= c < 70]
    assert torch.equal(out[slots == 2][:, untouched], base[slots == 2][:, untouched])  # outside its segments
    for count in (2, 3, 4, 5, 9):  # the same adapter's rows in tiles of every size
        rows = torch.nonzero(slots == 0).flatten()[:count]
        some = base[rows].clone()
        ops.lora_add_(some, x[rows].contiguous(), torch.zeros(len(rows), dtype=torch.long), downs, ups, spans)
        assert torch.equal(some, out[rows]), count


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"slots": torch.tensor([4, 0])}, "slot past the adapters"),
        ({"slots": torch.tensor([0])}, "a row per token|slots"),
        ({"x": torch.randn(2, 7)}, "down is \\[rank, in\\]"),
        ({"spans": [torch.tensor([[0, 99, 0, 8]])]}, "inside the output"),
        ({"spans": [torch.tensor([[0, 8, 0, 4], [4, 16, 4, 8]])]}, "disjoint"),
        ({"spans": [torch.tensor([[0, 16, 0, 4]])]}, "cover the down's rank rows"),
        ({"spans": [torch.tensor([0, 16, 0, 8])]}, "int64 \\[segments, 4\\]"),
        ({"ups": [torch.zeros(3)]}, "cover the down's rank rows and the up"),
        ({"ups": [torch.zeros(128, dtype=torch.bfloat16)]}, "in its down's dtype"),
        ({"downs": [torch.randn(6, 8).t()]}, "contiguous float32 or bf16"),
        ({"extra": True}, "one down, up and spans per adapter"),
    ],
)
def test_bad_arguments_to_lora_add_are_errors_that_say_which(change: dict, message: str) -> None:
    ops = compiled_ops()
    down, up, spans, _ = lora_case([8], [(0, 16)], 16, 6, 0)
    args = {"out": torch.zeros(2, 16), "x": torch.randn(2, 6), "slots": torch.tensor([0, -1])}
    args |= {"downs": [down], "ups": [up], "spans": [spans]}
    if change.pop("extra", False):
        args["ups"] = [up, up]
    args |= change
    with pytest.raises(RuntimeError, match=message):
        ops.lora_add_(args["out"], args["x"], args["slots"], args["downs"], args["ups"], args["spans"])


# -- panel_linear: the native pass's GEMM on an AVX-512F CPU ---------------------------------


def panel_ops():
    """The compiled ops, where this CPU runs ``panel_linear`` (skipped only on a CPU without AVX-512F)."""
    ops = compiled_ops()
    if not ops.cpu_has_avx512f():
        pytest.skip("panel_linear: this CPU lacks AVX-512F (the native pass keeps oneDNN's GEMM)")
    return ops


def panels_of(weight: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """``weight`` [out, in] as ``panel_linear`` holds it: [out / 16, in, 16], or bf16 pairs [out / 16, in / 2, 32]."""
    out_features, in_features = weight.shape
    if pairs:
        return (
            weight.view(out_features // 16, 16, in_features // 2, 2)
            .permute(0, 2, 1, 3)
            .reshape(-1, in_features // 2, 32)
        )
    return weight.view(out_features // 16, 16, in_features).transpose(1, 2).contiguous()


LAYOUTS = {
    "float32": (torch.float32, False),
    "bf16-widened": (torch.bfloat16, False),
    "bf16-pairs": (torch.bfloat16, True),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("out_features", [48, 112, 576])  # 3 panels (a tail group), 7 (4 + 3), 36
def test_panel_linear_is_x_times_w_transposed_and_a_row_gets_its_bits_alone_and_among_any_rows(
    layout: str, out_features: int
) -> None:
    """Against float64 ``F.linear`` of the same (bf16: rounded) weights, with and without the bias
    and the residual, at 1-13 rows (past two 6-row tiles) and an input width that is no multiple
    of a vector (40); every row gives the same bits alone, in any split of the rows. Widened bf16
    weights leave the input unrounded; bf16 pairs (AVX512-BF16) round it to bf16 first."""
    ops = panel_ops()
    dtype, pairs = LAYOUTS[layout]
    if pairs and not ops.cpu_has_avx512bf16():
        pytest.skip("bf16 pairs: this CPU lacks AVX512-BF16 (its panels widen bf16 weights)")
    generator = torch.Generator().manual_seed(out_features)
    weight = (torch.randn(out_features, 40, generator=generator) * 0.1).to(dtype)
    bias = torch.randn(out_features, generator=generator)
    x = torch.randn(13, 40, generator=generator)
    residual = torch.randn(13, out_features, generator=generator)
    panels = panels_of(weight, pairs)
    exact = F.linear((x.bfloat16() if pairs else x).double(), weight.double())
    for with_bias, with_residual in ((False, False), (True, False), (False, True), (True, True)):
        b = bias if with_bias else None
        r = residual if with_residual else None
        want = exact + (bias.double() if with_bias else 0) + (residual.double() if with_residual else 0)
        whole = ops.panel_linear(x, panels, b, r)
        assert whole.dtype == torch.float32 and whole.shape == (13, out_features)
        assert (whole.double() - want).abs().max().item() < 1e-5
        for rows in range(1, 13):
            part = ops.panel_linear(x[:rows], panels, b, None if r is None else r[:rows])
            assert torch.equal(part, whole[:rows]), f"{rows} rows"
        alone = torch.cat(
            [ops.panel_linear(x[i : i + 1], panels, b, None if r is None else r[i : i + 1]) for i in range(13)]
        )
        assert torch.equal(alone, whole)
    assert ops.panel_linear(x[:0], panels, None, None).shape == (0, out_features)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"panels": torch.zeros(3, 40, 8)}, "\\[out / 16, in, 16\\]"),
        ({"panels": torch.zeros(3, 40, 16, dtype=torch.float16)}, "float32 or bf16"),
        ({"panels": torch.zeros(3, 32, 16)}, "x has 40 columns, the panels 32"),
        ({"panels": torch.zeros(3, 20, 32)}, "pairs \\[out / 16, in / 2, 32\\] are bf16"),
        ({"panels": torch.zeros(3, 16, 32, dtype=torch.bfloat16)}, "x has 40 columns, the panels 32"),
        ({"x": torch.zeros(4, 40, dtype=torch.float64)}, "contiguous float32"),
        ({"bias": torch.zeros(47)}, "bias: float32 \\[out\\]"),
        ({"bias": torch.zeros(48, dtype=torch.bfloat16)}, "bias: float32 \\[out\\]"),
        ({"residual": torch.zeros(3, 48)}, "residual: \\[rows, out\\]"),
    ],
)
def test_bad_arguments_to_panel_linear_are_errors_that_say_which(change: dict, message: str) -> None:
    ops = panel_ops()
    args = {"x": torch.zeros(4, 40), "panels": torch.zeros(3, 40, 16), "bias": None, "residual": None} | change
    with pytest.raises(RuntimeError, match=message):
        ops.panel_linear(args["x"], args["panels"], args["bias"], args["residual"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("adapter_dtype", [torch.float32, torch.bfloat16])
def test_panel_linear_lora_gives_the_bits_of_panel_linear_then_lora_add(
    layout: str, adapter_dtype: torch.dtype
) -> None:
    """The fused call (one per adapted GEMM in the native pass; the adapters' weights asked for
    while the GEMM runs) is the two calls it replaces, bit for bit: with and without the residual,
    rows of three adapters, of one with nothing at this site and of none, alone and together."""
    ops = panel_ops()
    dtype, pairs = LAYOUTS[layout]
    if pairs and not ops.cpu_has_avx512bf16():
        pytest.skip("bf16 pairs: this CPU lacks AVX512-BF16 (its panels widen bf16 weights)")
    inputs, width, tokens = 40, 80, 11
    spans = [([8, 8, 8], [(0, 40), (40, 56), (56, 72)]), ([16], [(0, 80)]), ([4, 12], [(3, 37), (45, 70)])]
    cases = [lora_case(r, s, width, inputs, seed) for seed, (r, s) in enumerate(spans)]
    none = torch.empty(0)
    downs = [c[0].to(adapter_dtype) for c in cases] + [none]
    ups = [c[1].to(adapter_dtype) for c in cases] + [none]
    segments = [c[2] for c in cases] + [none]
    generator = torch.Generator().manual_seed(5)
    panels = panels_of((torch.randn(width, inputs, generator=generator) * 0.1).to(dtype), pairs)
    bias = torch.randn(width, generator=generator)
    x = torch.randn(tokens, inputs, generator=generator)
    residual = torch.randn(tokens, width, generator=generator)
    slots = torch.tensor([(-1, 0, 1, 0, 2, 3, 0, 2, 1, -1, 0)[t] for t in range(tokens)])
    for r in (None, residual):
        want = ops.panel_linear(x, panels, bias, r)
        ops.lora_add_(want, x, slots, downs, ups, segments)
        got = ops.panel_linear_lora(x, panels, bias, r, slots, downs, ups, segments)
        assert torch.equal(got, want)
        assert not torch.equal(got[slots == 0], ops.panel_linear(x, panels, bias, r)[slots == 0])  # applied
        for t in range(tokens):
            alone = ops.panel_linear_lora(
                x[t : t + 1], panels, bias, None if r is None else r[t : t + 1], slots[t : t + 1], downs, ups, segments
            )
            assert torch.equal(alone[0], want[t]), t


def test_panel_linear_lora_gives_the_same_bits_on_any_number_of_threads() -> None:
    """The GEMM's threads run the adapters' pass (each a share of the A rows before its panels,
    the B pass over its own columns after them; what no thread took is finished by whichever
    needs it): on one thread, where the call runs inline, on as many threads as the GEMM has
    tiles of panels and on more, the bits of ``panel_linear`` then ``lora_add_``, for one decode
    row and for a prompt chunk's rows over several adapters."""
    ops = panel_ops()
    inputs, width = 40, 16 * 21  # 21 panels: tiles of 4 and a thread's end at 1-3
    spans = [([24, 8], [(0, 200), (200, 336)]), ([16], [(16, 330)])]
    cases = [lora_case(r, s, width, inputs, seed) for seed, (r, s) in enumerate(spans)]
    downs, ups, segments = [c[0] for c in cases], [c[1] for c in cases], [c[2] for c in cases]
    generator = torch.Generator().manual_seed(7)
    panels = panels_of(torch.randn(width, inputs, generator=generator) * 0.1)
    x = torch.randn(13, inputs, generator=generator)
    residual = torch.randn(13, width, generator=generator)
    slots = torch.tensor([0, 1, -1, 0, 0, 1, 0, 0, 1, 1, 0, -1, 1])
    before = torch.get_num_threads()
    try:
        for rows in (slice(0, 1), slice(0, 13)):
            want = ops.panel_linear(x[rows], panels, None, residual[rows])
            ops.lora_add_(want, x[rows], slots[rows], downs, ups, segments)
            for threads in (1, 2, 3, 8):
                torch.set_num_threads(threads)
                got = ops.panel_linear_lora(x[rows], panels, None, residual[rows], slots[rows], downs, ups, segments)
                assert torch.equal(got, want), (rows, threads)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"slots": torch.tensor([4, 0])}, "slot past the adapters"),
        ({"x": torch.zeros(2, 6, dtype=torch.float64)}, "contiguous float32"),
        ({"panels": torch.zeros(1, 8, 16)}, "x has 6 columns, the panels 8"),
        ({"spans": [torch.tensor([[0, 99, 0, 8]])]}, "inside the output"),
    ],
)
def test_bad_arguments_to_panel_linear_lora_are_errors_that_say_which(change: dict, message: str) -> None:
    ops = panel_ops()
    down, up, spans, _ = lora_case([8], [(0, 16)], 16, 6, 0)
    args = {"x": torch.randn(2, 6), "panels": torch.zeros(1, 6, 16), "slots": torch.tensor([0, -1])}
    args |= {"downs": [down], "ups": [up], "spans": [spans]} | change
    with pytest.raises(RuntimeError, match=message):
        ops.panel_linear_lora(
            args["x"], args["panels"], None, None, args["slots"], args["downs"], args["ups"], args["spans"]
        )


def test_the_widened_panels_hold_no_avx512_bf16_instruction() -> None:
    """The panel functions carry the AVX512-BF16 target for the pairs' sake (cpu_ops.cpp's NOTE):
    only the pairs' own code may hold its instructions, so widened panels run on an AVX-512F CPU
    without it. Read from the built library's code (objdump)."""
    compiled_ops()
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("no objdump here")
    loaded = kernels.load()
    assert loaded.path is not None
    code = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", str(loaded.path)], capture_output=True, text=True)
    assert code.returncode == 0, code.stderr
    holders, function = set(), ""
    for line in code.stdout.splitlines():
        if line.endswith(">:"):
            function = line
        elif re.search(r"\b(vdpbf16ps|vcvtne2ps2bf16|vcvtneps2bf16)\b", line):
            holders.add(function)
    assert holders, "no AVX512-BF16 instruction at all: the pairs were not built"
    assert all("Pairs" in function for function in holders), sorted(holders)


def test_on_an_avx512f_cpu_the_native_pass_runs_its_full_precision_gemms_as_panels(tiny_model_dir: Path) -> None:
    """Every full-precision layer (fused q/k/v, o, gate/up, down, the vocabulary) holds panels and
    runs ``panel_linear``, in float32 and bf16 (pairs where the CPU has AVX512-BF16); ``--kernels
    torch`` keeps oneDNN's packed GEMM."""
    ops = panel_ops()
    for dtype in ("float32", "bfloat16"):
        loaded = load_model(str(tiny_model_dir), dtype=dtype)
        native = NativeForward(loaded.model, fresh_cache(loaded.model), batch_hint=4, kernel_choice="compiled")
        linears = [native.lm_head] + [
            getattr(layer, name) for layer in native.layers for name in ("qkv", "out", "gate_up", "down")
        ]
        assert native.gemm == "panels" and all(linear.kind == "panels" for linear in linears), dtype
        assert all(linear.weight.dim() == 3 and linear.weight.dtype == loaded.model.dtype for linear in linears)
        pairs = dtype == "bfloat16" and ops.cpu_has_avx512bf16()
        assert all(linear.pairs == pairs and linear.weight.shape[2] == (32 if pairs else 16) for linear in linears)
        stock = NativeForward(loaded.model, fresh_cache(loaded.model), batch_hint=4, kernel_choice="torch")
        assert stock.gemm == "onednn"
        prompt = torch.randint(10, loaded.vocab_size, (19,), generator=torch.Generator().manual_seed(3))
        step = (prompt, torch.arange(19), [Segment(tuple(range(2)), 0, 19)], list(range(19)))
        want = stock(*step)

        def refuse(*args: object, **kwargs: object) -> torch.Tensor:
            raise AssertionError("the panels' pass called oneDNN's GEMM")

        with pytest.MonkeyPatch.context() as patch:  # every GEMM of the step through the panels
            patch.setattr(torch.ops.mkldnn, "_linear_pointwise", refuse)
            got = native(*step)
        assert bool(torch.isfinite(got).all()) and got.shape == want.shape
        if dtype == "float32":  # the same products summed in another order (bf16's numbers:
            # oneDNN rounds each output to bf16 and the panels do not; tests/test_native_forward.py
            # holds each to transformers under its own rounding)
            assert (got - want).abs().max().item() < 1e-3


# -- where the ops cannot be used: the log line says why -----------------------------------

FORWARD_PASS = "batched engine forward pass"


@pytest.fixture
def reload_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kernels.load()`` looks again under this test's conditions (restored after it)."""
    monkeypatch.setattr(kernels, "_loaded", None)


def forward_pass_line(caplog: pytest.LogCaptureFixture) -> logging.LogRecord:
    (record,) = [r for r in caplog.records if r.getMessage() == FORWARD_PASS]
    return record


def serves(engine, loaded) -> None:
    engine.start()
    try:
        prompt = loaded.tokenizer("Hello there")["input_ids"]
        request = GenerationRequest("r", prompt, SamplingOptions(temperature=0.0), 6, ignore_eos=True, want_tokens=True)
        [rec] = run_all(engine, [request])
        assert isinstance(rec.last, FinishEvent) and len(rec.token_ids) == 6
    finally:
        engine.close()


def test_a_cpu_without_avx2_runs_the_torch_ops_and_the_log_line_says_why(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, reload_kernels: None
) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    loaded = load_model(str(tiny_model_dir))
    with caplog.at_level(logging.INFO):
        engine = create_engine("batched", loaded, EngineLimits(2, 2, 1024), workers=1)
    line = forward_pass_line(caplog)
    assert (line.forward, line.kernels, line.why_not_native) == ("native", "torch", None)  # type: ignore[attr-defined]
    assert line.why_not_compiled == "the CPU lacks AVX2+FMA (torch capability DEFAULT)"  # type: ignore[attr-defined]
    serves(engine, loaded)
    with pytest.raises(ValueError, match=r"--kernels compiled: the CPU lacks AVX2\+FMA"):
        create_engine("batched", loaded, EngineLimits(2, 2, 1024), workers=1, kernels="compiled")


def test_no_compiler_and_nothing_built_runs_the_torch_ops_and_the_log_line_says_why(
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    reload_kernels: None,
) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv(kernels.KERNEL_DIR_ENV, str(tmp_path / "kernels"))
    if platform.machine().lower() in kernels.X86_64:
        assert kernels.build_reason() == "no C++ compiler: $CXX (/nonexistent/c++) is not on PATH"
    loaded = load_model(str(tiny_model_dir))
    with caplog.at_level(logging.INFO):
        engine = create_engine("batched", loaded, EngineLimits(2, 2, 1024), workers=1)
    line = forward_pass_line(caplog)
    assert (line.forward, line.kernels) == ("native", "torch")  # type: ignore[attr-defined]
    if kernels.cpu_reason() is None:
        assert line.why_not_compiled == (  # type: ignore[attr-defined]
            f"not built in {kernels.library_path().parent}, and this host cannot build it: "
            "no C++ compiler: $CXX (/nonexistent/c++) is not on PATH"
        )
        assert not (tmp_path / "kernels").exists()
    else:  # pragma: no cover - a CPU that could not run them anyway
        assert line.why_not_compiled == kernels.cpu_reason()  # type: ignore[attr-defined]
    serves(engine, loaded)


def test_the_log_line_says_why_when_the_native_pass_or_the_compiled_ops_are_not_taken_by_choice(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    loaded = load_model(str(tiny_model_dir))
    with caplog.at_level(logging.INFO):
        create_engine("batched", loaded, EngineLimits(2, 2, 1024), workers=1, kernels="torch")
    line = forward_pass_line(caplog)
    assert (line.forward, line.kernels, line.why_not_compiled, line.why_not_native) == (
        "native",
        "torch",
        "--kernels torch",
        None,
    )  # type: ignore[attr-defined]
    caplog.clear()
    with caplog.at_level(logging.INFO):
        create_engine("batched", loaded, EngineLimits(2, 2, 1024), workers=1, forward="transformers")
    line = forward_pass_line(caplog)
    assert (line.forward, line.kernels, line.why_not_compiled, line.why_not_native) == (
        "transformers",
        None,
        None,
        "--forward transformers",
    )  # type: ignore[attr-defined]
    caplog.clear()
    loaded.model.config.model_type = "not-llama"
    with caplog.at_level(logging.INFO):
        create_engine("batched", loaded, EngineLimits(2, 2, 1024), workers=1)
    line = forward_pass_line(caplog)
    assert (line.forward, line.kernels, line.why_not_compiled) == ("transformers", None, None)  # type: ignore[attr-defined]
    assert line.why_not_native == "model_type 'not-llama' (native pass: llama)"  # type: ignore[attr-defined]


@pytest.mark.skipif(
    platform.machine().lower() not in kernels.X86_64,
    reason="ATEN_CPU_CAPABILITY=default fakes a CPU without AVX2 on x86-64 only",
)
def test_a_server_on_a_cpu_without_avx2_logs_why_and_serves_on_torch_ops(tiny_model_dir: Path) -> None:
    """The real server, with torch itself told the CPU has no AVX2 (``ATEN_CPU_CAPABILITY=default``)."""
    env = {"ATEN_CPU_CAPABILITY": "default"}
    with ServerProcess(["--model", str(tiny_model_dir), "--engine", "batched"], env=env) as server:
        (line,) = server.find(FORWARD_PASS)
        assert (line["forward"], line["kernels"], line["why_not_native"]) == ("native", "torch", None)
        assert line["why_not_compiled"] == "the CPU lacks AVX2+FMA (torch capability DEFAULT)"
    with pytest.raises(RuntimeError, match="server exited") as refused:
        ServerProcess(
            ["--model", str(tiny_model_dir), "--engine", "batched", "--kernels", "compiled"], env=env, ready_timeout=120
        )
    assert "--kernels compiled: the CPU lacks AVX2+FMA (torch capability DEFAULT)" in str(refused.value)


# -- make kernels ----------------------------------------------------------------------


def test_make_kernels_exits_0_with_the_reason_where_the_host_cannot_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(kernels.KERNEL_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert kernels.main() == 0
    out = capsys.readouterr().out
    if platform.machine().lower() in kernels.X86_64:
        assert "compiled CPU ops not built: no C++ compiler: $CXX (/nonexistent/c++) is not on PATH" in out
    monkeypatch.setattr(kernels.platform, "machine", lambda: "aarch64")
    monkeypatch.delenv("CXX")
    assert kernels.main() == 0
    assert "compiled CPU ops not built: not an x86-64 host (aarch64)" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_make_kernels_builds_on_an_x86_cpu_without_avx2(tmp_path: Path) -> None:
    """Building needs a compiler only: with torch told the CPU has no AVX2, the library is
    built where the server looks for it, with the shipped source and flags, and not loaded.
    The compiler is a stand-in that records its command and writes the library's file (the
    real build of the same command: ``test_the_shipped_source_compiles_without_a_warning``);
    it hands anything else, the ABI check's version questions, to the real one."""
    if kernels.build_reason():
        pytest.skip(f"this host cannot build: {kernels.build_reason()}")
    real = kernels.compiler()
    called = tmp_path / "called"
    stand_in = tmp_path / "c++"
    stand_in.write_text(
        "#!/bin/sh\n"
        'out=""; prev=""\n'
        'for arg in "$@"; do [ "$prev" = "-o" ] && out="$arg"; prev="$arg"; done\n'
        f'[ -z "$out" ] && exec {real} "$@"\n'
        f'printf "%s\\n" "$@" > {called}\n'
        'printf "library" > "$out"\n'
    )
    stand_in.chmod(0o755)
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", kernels.KERNEL_DIR_ENV: str(tmp_path), "CXX": str(stand_in)}
    done = subprocess.run(
        [sys.executable, "-m", "tokenwire_server.engine.kernels"], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    target = kernels.library_path(tmp_path)
    assert target.read_text() == "library"
    assert re.fullmatch(
        re.escape(str(target))
        + r" \(built in [\d.]+ s\); not loaded: the CPU lacks AVX2\+FMA \(torch capability DEFAULT\), "
        r"so a server on this machine runs stock torch ops",
        done.stdout.strip(),
    ), done.stdout
    arguments = called.read_text().splitlines()
    assert str(kernels.SOURCE) in arguments and set(kernels.FLAGS) <= set(arguments), arguments
    assert target.with_name(kernels.BUILD_LOG).read_text() == ""


def test_the_shipped_source_compiles_without_a_warning(tmp_path: Path) -> None:
    """The library the suite runs was built (``make kernels``, or the first test to load it)
    with its compiler's output kept beside it: nothing. A library built before that log was
    kept is built again here."""
    if kernels.build_reason():
        pytest.skip(f"this host cannot build: {kernels.build_reason()}")
    log = kernels.build().path.with_name(kernels.BUILD_LOG)
    if not log.is_file():
        log = kernels.build(tmp_path).path.with_name(kernels.BUILD_LOG)
    assert log.read_text() == "", log.read_text()


def test_make_kernels_shows_the_compilers_warnings_and_fails_when_the_build_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], reload_kernels: None
) -> None:
    if kernels.build_reason():
        pytest.skip(f"this host cannot build: {kernels.build_reason()}")
    monkeypatch.setenv(kernels.KERNEL_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(kernels, "cpu_reason", lambda: "not loaded in this test")
    warned = tmp_path / "warned.cpp"
    warned.write_text("int answer() { int unused = 1; return 42; }\n")
    monkeypatch.setattr(kernels, "SOURCE", warned)
    assert kernels.main() == 0
    captured = capsys.readouterr()
    assert "the compiler warned" in captured.err and "unused" in captured.err
    assert kernels.library_path().is_file()
    broken = tmp_path / "broken.cpp"
    broken.write_text("int answer() { return undeclared; }\n")
    monkeypatch.setattr(kernels, "SOURCE", broken)
    assert kernels.main() == 1
    captured = capsys.readouterr()
    assert "the build failed" in captured.err and "undeclared" in captured.err
    assert not kernels.library_path().exists()


def test_bad_lists_to_decoder_layers_are_errors_that_say_which() -> None:
    """The one-call layers (``engine.native``'s ``fused_layers``) check their lists' lengths before any work."""
    ops = panel_ops()
    hidden, cos, empty = torch.zeros(1, 16), torch.zeros(1, 16), torch.empty(0, dtype=torch.long)
    weight = torch.zeros(1, 16, 16)
    one, four = [torch.ones(16)], [torch.empty(0)] * 4
    lists = [
        one,
        [weight],
        [weight],
        one,
        [weight],
        [weight],
        four,
        [torch.zeros(1, 1, 16, 16)] * 1,
        [torch.zeros(1, 1, 16, 16)],
    ]
    plan = [cos, cos, empty, empty, empty.view(1, 0), empty, 1e-5, 1.0, 1, 1, 8]
    with pytest.raises(RuntimeError, match="four biases per layer"):
        ops.decoder_layers(hidden, *lists[:6], [torch.empty(0)], *lists[7:], *plan, empty, [], [], [], 0)
    with pytest.raises(RuntimeError, match="lora_add_'s lists for each of the four GEMMs"):
        ops.decoder_layers(hidden, *lists, *plan, torch.zeros(1, dtype=torch.long), [], [], [], 1)
