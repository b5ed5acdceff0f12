"""The fastest GEMM for the model's weights on this CPU, and decode attention (`make bench-kernels`)."""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable
from typing import Any

from benchmarks import doc, load
from benchmarks.stats import median, ratios, spread

# onednn-bf16, panels, panels-bf16: through the native pass's own ``Linear`` (as a step calls them, float32 in and out);
# the panels where the CPU runs them (AVX-512F); panels-int8: ``--quantization int8``'s 8-bit panels (AVX512-VNNI).
KERNELS = ("F.linear", "onednn", "int8", "int4", "onednn-bf16", "panels", "panels-bf16", "panels-int8")
SLOTS, CAPACITY = 16, 2049  # decode rows, and each row's cache capacity in the engine
BLOCK = 16  # tokens per KV block (engine.blocks.BLOCK_SIZE)
FLAGS = {"repeats": 3, "rows": "1,16", "calls": (5, "passes timed per kernel and repeat"),
         "contexts": ("100,400,1000", "the decode attention's context lengths")}  # fmt: skip
DRY_RUN = {"repeats": 1, "calls": 1, "contexts": "16"}
Results = dict[tuple[str, int], list[float]]  # (kernel or attention, rows or context) -> ms per call, per repeat


def prepare(kernel: str, w: Any) -> Any:
    """A callable x -> x @ w.T for this kernel."""
    import torch
    import torch.nn.functional as F

    if kernel == "F.linear":
        return lambda x: F.linear(x, w)
    if kernel == "panels-int8":
        from tokenwire_server.quantize import Int8GroupLinear, int8_panel_library

        return Int8GroupLinear.from_weight(w, None, int8_panel_library())
    if kernel in ("onednn-bf16", "panels", "panels-bf16"):
        from tokenwire_server.engine.native import Linear, panel_library

        weight = w.bfloat16() if kernel.endswith("bf16") else w
        return Linear(weight, None, True, 16, panel_library() if kernel.startswith("panels") else None)
    if kernel == "onednn":
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    if kernel == "int8":
        scale = w.abs().amax(1).clamp(min=1e-12) / 127
        q = (w / scale[:, None]).round().clamp(-128, 127).to(torch.int8)
        return lambda x: torch.ops.aten._weight_int8pack_mm(x, q, scale)
    n, k = w.shape
    groups = w.view(n, k // 32, 32)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp(min=1e-12)
    q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    scales_zeros = torch.stack([scale, low + 8 * scale], -1).transpose(0, 1).contiguous()
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_zeros)


def kernels_here() -> list[str]:
    """``KERNELS`` this CPU runs: the panels only where it has AVX-512F, the 8-bit ones where it has AVX512-VNNI."""
    from tokenwire_server.engine.native import panel_library
    from tokenwire_server.quantize import int8_panel_library

    here = {"panels": panel_library() is not None, "panels-int8": int8_panel_library() is not None}
    return [k for k in KERNELS if here.get(k, here["panels"] if k.startswith("panels") else True)]


def timed(results: Results, key: tuple[str, int], fn: Callable[[], None], calls: int) -> None:
    """One warm call, then ``calls`` timed: ``results[key]`` gets the ms per call."""
    fn()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    results.setdefault(key, []).append((time.perf_counter() - started) / calls * 1000)
    doc.log(f"  {key[0]} {key[1]}: {results[key][-1]:.1f} ms")


def gemms(args: argparse.Namespace, rows_list: list[int], model: Any, results: Results) -> None:
    """Every linear layer of ``model`` once per pass (as the native pass multiplies by them), with each kernel."""
    import torch

    weights = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        weights += [torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), a.o_proj.weight,
                    torch.cat([m.gate_proj.weight, m.up_proj.weight]), m.down_proj.weight]  # fmt: skip
    weights = [w.detach() for w in [*weights, model.get_output_embeddings().weight]]
    prepared = {kernel: [prepare(kernel, w) for w in weights] for kernel in kernels_here()}
    for _ in range(args.repeats):
        for rows in rows_list:
            inputs = {k: torch.randn(rows, k) for k in {int(w.shape[1]) for w in weights}}
            for kernel, fns in prepared.items():

                def passes(fns: list[Any] = fns, inputs: dict[int, Any] = inputs) -> None:
                    for fn, w in zip(fns, weights, strict=True):
                        fn(inputs[int(w.shape[1])])

                timed(results, (kernel, rows), passes, args.calls)


def heads(config: Any) -> tuple[int, int, int, int]:
    """(layers, KV heads, query heads, head size) of a model's config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_key_value_heads, config.num_attention_heads, head_dim


def attention(args: argparse.Namespace, contexts: list[int], config: Any, results: Results) -> None:
    """Decode attention of 16 rows over every layer, per context length: ``results[(way, context)]``."""
    import torch
    import torch.nn.functional as F
    from tokenwire_server.engine import kernels

    loaded = kernels.load()
    if loaded.ops is None:
        raise SystemExit(f"the compiled CPU ops are unavailable: {loaded.reason}")
    n_layers, kv_heads, n_heads, head_dim = heads(config)
    top = max(contexts)
    per_row = -(-top // BLOCK)
    # row r's block b is pool block b * SLOTS + r: the rows' blocks interleaved, as a busy pool leaves them
    tables = (torch.arange(per_row).view(1, -1) * SLOTS + torch.arange(SLOTS).view(-1, 1)).contiguous()

    def paged(buffer: Any) -> Any:  # only the columns read are ever touched
        buffer[:, :, :top].normal_()
        blocks = buffer[:, :, : per_row * BLOCK].reshape(SLOTS, kv_heads, per_row, BLOCK, head_dim).transpose(1, 2)
        pool = torch.empty(SLOTS * per_row, kv_heads, BLOCK, head_dim)
        pool[tables.reshape(-1)] = blocks.reshape(-1, kv_heads, BLOCK, head_dim)
        return pool

    layers = [[torch.empty(SLOTS, kv_heads, CAPACITY, head_dim) for _ in "kv"] for _ in range(n_layers)]
    pools = [[paged(buffer) for buffer in pair] for pair in layers]
    q = torch.randn(SLOTS, n_heads, head_dim)
    grouped = q.view(SLOTS, kv_heads, n_heads // kv_heads, head_dim)
    scale = head_dim**-0.5
    for _ in range(args.repeats):
        for context in contexts:
            mask = torch.ones(SLOTS, 1, 1, context, dtype=torch.bool)
            lengths = torch.full((SLOTS,), context)

            def sdpa(ctx: int = context, m: Any = mask) -> None:
                for keys, values in layers:
                    F.scaled_dot_product_attention(
                        grouped, keys[:, :, :ctx], values[:, :, :ctx], attn_mask=m, scale=scale
                    )

            def kernel(n: Any = lengths) -> None:
                for keys, values in pools:
                    loaded.ops.decode_attention(q, keys, values, tables, n, scale)

            timed(results, ("sdpa", context), sdpa, args.calls)
            timed(results, ("kernel", context), kernel, args.calls)


def run(args: argparse.Namespace) -> doc.Section:
    import torch
    from tokenwire_server.model import load_model

    results: Results = {}
    rows_list, contexts = [int(r) for r in args.rows.split(",")], [int(c) for c in args.contexts.split(",")]

    def measure() -> Any:  # all of it (the load too) in a thread of its own, as the engine loop runs torch
        model = load_model(args.model, device="cpu", dtype="float32").model
        with torch.inference_mode():
            gemms(args, rows_list, model, results)
            attention(args, contexts, model.config, results)
        return model.config

    n_layers, kv_heads, _, head_dim = heads(load.in_thread(measure))
    m = doc.machine()
    kernels = []
    for kernel in kernels_here():
        cells = [kernel]
        for rows in rows_list:
            values, base = results[(kernel, rows)], median(results[("F.linear", rows)])
            cells += [spread(values), f"{base / median(values):.2f}×"]
        kernels.append(cells)
    attention_rows = []
    for context in contexts:
        read = n_layers * 2 * SLOTS * kv_heads * context * head_dim * 4 / 1e9  # GB
        sdpa, op = results[("sdpa", context)], results[("kernel", context)]
        attention_rows.append([context, spread(sdpa), f"{read / median(sdpa) * 1000:.1f}", spread(op),
                               f"{read / median(op) * 1000:.1f}", f"{median(ratios(sdpa, op)):.2f}×"])  # fmt: skip
    return doc.section(
        "cpu-kernels", "CPU kernels: which GEMM reads the weights fastest; decode attention", args.command,
        f"torch {m['torch']}, {m['torch threads']} threads, {torch.backends.cpu.get_cpu_capability()}, "
        f"{platform.machine()}, {m['cpu']} ({m['instruction sets']}). Every linear layer of the model once "
        "(q/k/v and gate/up fused, plus the vocabulary projection), ms per pass, min/median/max over the repeats; "
        "ratio: median of F.linear / median of the kernel. `onednn-bf16`, `panels`, `panels-bf16`: bf16 or float32 "
        "weights through the native pass's own `Linear`, as a step calls it (float32 in and out; the panels: "
        "`panel_linear`, where the CPU has AVX-512F, bf16 as pairs where it has AVX512-BF16); `panels-int8`: "
        "`--quantization int8`'s 8-bit panels (groups of 16 with their float16 scales and zero points, 1.19 bytes "
        "a weight; where the CPU has AVX512-VNNI).",
        "",
        *doc.table("kernel | " + " | ".join(f"{r} row{'s' if r > 1 else ''} ms | ratio" for r in rows_list),
                   "l" + "rr" * len(rows_list), kernels),
        "",
        f"Decode attention, {SLOTS} rows at one context length, all {n_layers} layers: ms (min/median/max), "
        "the keys and values read per second at the median, and sdpa / kernel (median of the per-repeat ratios).",
        "",
        *doc.table("context | sdpa ms | sdpa GB/s | kernel ms | kernel GB/s | kernel speed-up", "rrrrrr",
                   attention_rows),
    )  # fmt: skip
