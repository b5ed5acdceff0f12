"""`make bench-kernels`: which GEMM reads the default model's weights fastest on this CPU,
and how fast do 16 decode rows attend over the KV cache?

Every linear layer of the default model (q/k/v and gate/up fused, as the batched
engine's native pass runs them, and the vocabulary projection), once each, at 1 row
and at 16 rows; the time of the whole set is about what the weights cost one decode
step. Four kernels, all from stock torch:

- ``F.linear``: float32, what transformers' forward calls;
- ``onednn``: float32, weights reordered once for oneDNN
  (``torch.ops.mkldnn._reorder_linear_weight``, ``_linear_pointwise``): what
  ``--forward native`` runs on a CPU;
- ``int8``: ``torch.ops.aten._weight_int8pack_mm``, int8 weights per output channel,
  float32 activations;
- ``int4``: ``torch.ops.aten._weight_int4pack_mm_for_cpu``, 4-bit weights in groups of
  32 with a scale and a minimum: exactly the default checkpoint's Q4_1 numbers.

Decode attention: 16 one-token rows over the default model's 30 layers of KV cache
(3 KV heads of 64, 9 query heads), every row at the same context length, two ways:

- ``sdpa``: ``scaled_dot_product_attention`` over each row's columns laid out
  contiguously (the rows' query heads grouped by KV head, a length mask): its best
  case; the native pass's stock-torch path first gathers a row's blocks into that layout;
- ``kernel``: ``torch.ops.tokenwire.decode_attention`` (``engine/kernels``), what
  ``--kernels auto`` runs where the compiled ops build, reading each row's columns
  through its block table (16-token blocks, interleaved with the other rows' in the pool).

Each row shows the time for all 30 layers and the keys and values read per
second (the bytes a step must read at least: the rows' columns).

Each repeat times every kernel in turn (the machine is shared: compare within a
repeat); min/median/max over the repeats. Loading and timing run in one thread of
their own, the only one that ever runs torch in parallel (as the server's engine
loop is: a second OpenMP pool alive slows the first). The result replaces the
"cpu-kernels" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.doc import replace_section
from benchmarks.peers import spread

SECTION = "cpu-kernels"
KERNELS = ("F.linear", "onednn", "int8", "int4")
ATTENTIONS = ("sdpa", "kernel")
CONTEXTS = (100, 400, 1000)
LAYERS, SLOTS, KV_HEADS, HEADS, HEAD_DIM, CAPACITY = 30, 16, 3, 9, 64, 2049  # the default model's cache
BLOCK = 16  # tokens per KV block (engine.blocks.BLOCK_SIZE)


def weights() -> list[Any]:
    import torch
    from tokenwire_server.model import load_model, prepare_default_model

    model = load_model(str(prepare_default_model()), device="cpu", dtype="float32").model
    out = []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        out += [
            torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach(),
            a.o_proj.weight.detach(),
            torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach(),
            m.down_proj.weight.detach(),
        ]
    out.append(model.get_output_embeddings().weight.detach())
    return out


def prepare(kernel: str, w: Any) -> Any:
    """A callable x -> x @ w.T for this kernel."""
    import torch
    import torch.nn.functional as F

    if kernel == "F.linear":
        return lambda x: F.linear(x, w)
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


def measure(repeats: int, rows_list: list[int], calls: int) -> dict[tuple[str, int], list[float]]:
    import torch

    results: dict[tuple[str, int], list[float]] = {}

    def run() -> None:
        ws = weights()
        with torch.inference_mode():
            prepared = {kernel: [prepare(kernel, w) for w in ws] for kernel in KERNELS}
            for _ in range(repeats):
                for rows in rows_list:
                    inputs = {k: torch.randn(rows, k) for k in {int(w.shape[1]) for w in ws}}
                    for kernel in KERNELS:
                        fns = prepared[kernel]
                        for fn, w in zip(fns, ws, strict=True):  # warm
                            fn(inputs[int(w.shape[1])])
                        started = time.perf_counter()
                        for _ in range(calls):
                            for fn, w in zip(fns, ws, strict=True):
                                fn(inputs[int(w.shape[1])])
                        results.setdefault((kernel, rows), []).append((time.perf_counter() - started) / calls * 1000)
                        print(f"  {kernel} rows={rows}: {results[(kernel, rows)][-1]:.1f} ms", file=sys.stderr, flush=True)

        attention(repeats, calls, results)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    return results


def attention(repeats: int, calls: int, results: dict[tuple[str, int], list[float]]) -> None:
    """Decode attention of 16 rows over 30 layers, per context length: ``results[(way, context)]``."""
    import torch
    import torch.nn.functional as F
    from tokenwire_server.engine import kernels

    loaded = kernels.load()
    if loaded.ops is None:
        raise SystemExit(f"the compiled CPU ops are unavailable: {loaded.reason}")
    op = loaded.ops.decode_attention
    top = max(CONTEXTS)
    layers = []
    per_row = -(-top // BLOCK)
    # row r's block b is pool block b * SLOTS + r: the rows' blocks interleaved, as a busy pool leaves them
    tables = (torch.arange(per_row).view(1, -1) * SLOTS + torch.arange(SLOTS).view(-1, 1)).contiguous()
    pools = []
    for _ in range(LAYERS):  # only the columns read are ever touched
        keys = torch.empty(SLOTS, KV_HEADS, CAPACITY, HEAD_DIM)
        values = torch.empty(SLOTS, KV_HEADS, CAPACITY, HEAD_DIM)
        keys[:, :, :top].normal_()
        values[:, :, :top].normal_()
        layers.append((keys, values))
        pool = []
        for buffer in (keys, values):
            blocks = buffer[:, :, : per_row * BLOCK].reshape(SLOTS, KV_HEADS, per_row, BLOCK, HEAD_DIM).transpose(1, 2)
            paged = torch.empty(SLOTS * per_row, KV_HEADS, BLOCK, HEAD_DIM)
            paged[tables.reshape(-1)] = blocks.reshape(-1, KV_HEADS, BLOCK, HEAD_DIM)
            pool.append(paged)
        pools.append((pool[0], pool[1]))
    q = torch.randn(SLOTS, HEADS, HEAD_DIM)
    grouped = q.view(SLOTS, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    with torch.inference_mode():
        for _ in range(repeats):
            for context in CONTEXTS:
                mask = torch.ones(SLOTS, 1, 1, context, dtype=torch.bool)
                lengths = torch.full((SLOTS,), context)

                def sdpa(ctx: int = context, m: Any = mask) -> None:
                    for keys, values in layers:
                        F.scaled_dot_product_attention(grouped, keys[:, :, :ctx], values[:, :, :ctx], attn_mask=m, scale=scale)

                def kernel(n: Any = lengths) -> None:
                    for keys, values in pools:
                        op(q, keys, values, tables, n, scale)

                for way, fn in (("sdpa", sdpa), ("kernel", kernel)):
                    fn()
                    started = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    results.setdefault((way, context), []).append((time.perf_counter() - started) / calls * 1000)
                    print(f"  attention {way} context={context}: {results[(way, context)][-1]:.1f} ms", file=sys.stderr, flush=True)


def render(results: dict[tuple[str, int], list[float]], rows_list: list[int], command: str, meta: str) -> str:
    lines = [
        "## CPU kernels: which GEMM reads the weights fastest; decode attention",
        "",
        f"Command: `{command}` ({meta}). Every linear layer of the default model once "
        "(q/k/v and gate/up fused, plus the vocabulary projection), ms per pass, "
        "min/median/max over the repeats; ratio: median of F.linear / median of the kernel.",
        "",
        "| kernel | " + " | ".join(f"{r} row{'s' if r > 1 else ''} ms | ratio" for r in rows_list) + " |",
        "|---|" + "---:|---:|" * len(rows_list),
    ]
    for kernel in KERNELS:
        cells = []
        for rows in rows_list:
            values = results[(kernel, rows)]
            base = statistics.median(results[("F.linear", rows)])
            cells.append(f"{spread(values)} | {base / statistics.median(values):.2f}×")
        lines.append(f"| {kernel} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Decode attention, {SLOTS} rows at one context length, all {LAYERS} layers: ms (min/median/max), "
        "the keys and values read per second at the median, and sdpa / kernel (median of the per-repeat ratios).",
        "",
        "| context | sdpa ms | sdpa GB/s | kernel ms | kernel GB/s | kernel speed-up |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for context in CONTEXTS:
        read = LAYERS * 2 * SLOTS * KV_HEADS * context * HEAD_DIM * 4 / 1e9  # GB
        sdpa, kernel = results[("sdpa", context)], results[("kernel", context)]
        ratio = statistics.median(a / b for a, b in zip(sdpa, kernel, strict=True))
        lines.append(
            f"| {context} | {spread(sdpa)} | {read / statistics.median(sdpa) * 1000:.1f} | {spread(kernel)} | "
            f"{read / statistics.median(kernel) * 1000:.1f} | {ratio:.2f}× |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--calls", type=int, default=5, help="passes timed per kernel and repeat")
    parser.add_argument("--out", default="docs/benchmarks.md")
    args = parser.parse_args(argv)
    import platform

    import torch

    rows_list = [int(r) for r in args.rows.split(",")]
    results = measure(args.repeats, rows_list, args.calls)
    meta = f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}, {platform.machine()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    command = "make bench-kernels" + (f" KERNELS_ARGS=\"{' '.join(argv)}\"" if argv else "")
    text = render(results, rows_list, command, meta)
    print(text)
    if args.out:
        replace_section(Path(args.out), SECTION, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
