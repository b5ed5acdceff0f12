"""The batched engine on a GPU with random weights in a real shape: tokens/s, ITL, GPU busy, MBU.

Each shape (``SHAPES``) served once per ``--forwards`` entry, beside the ceiling (static-batch ``generate``);
benchmarks/gpu-check.sh runs it on a lent GPU machine (``python -m benchmarks.gpu_bench``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import sys
import threading
import time
import traceback
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks import doc, load
from benchmarks.launcher import serve
from benchmarks.stats import cell


def _shape(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int) -> dict[str, Any]:
    return {"hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "tie_word_embeddings": True}  # fmt: skip


# SmolLM2-135M-Instruct; a Llama-3.2-1B-like shape (the "1B shape"); a few layers, for tests.
SHAPES = {
    "135m": _shape(576, 1536, 30, 9, 3, 64),
    "1b": _shape(2048, 8192, 16, 32, 8, 64),
    "tiny": _shape(64, 128, 2, 4, 2, 16),
}
PEAK_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0, "A10G": 600.0, "L4": 300.0}
STEP_HISTOGRAMS = ("tokenwire_decode_step_seconds", "tokenwire_decode_step_host_seconds")
# ``:sampled`` requests: the sampler's temperatures, rows and seed keys cross to the device every step.
SAMPLED = {"temperature": 0.8, "seed": 1}
OUT = Path("docs/benchmarks-cuda.md")
HEADER = "# Benchmarks on a GPU\n"
FLAGS = {
    "random_weights": ("135m,1b", f"comma-separated shapes, from {', '.join(SHAPES)}"),
    "device": {"default": "cuda", "choices": ("cuda", "cpu")}, "concurrency": "1,16,64,128",
    "forwards": ("native,native:flex,transformers,native:no-overlap,native:sampled,native:flex+sampled,"
                 "native:sampled+no-overlap",
                 "the engine's --forward values to serve each shape with, variants after a colon joined by + "
                 "(no-overlap: with --overlap off; sampled: sampled requests, not greedy; flex: --attention flex, "
                 "attention over the KV pool in place)"),
    "step_graphs": ("auto", "the native pass's --step-graphs (auto: CUDA graphs on CUDA)"),
    "ceiling": {"default": "ends", "choices": ("ends", "all", "none"),
                "help": "static-batch generate at the smallest and largest concurrency (ends), at each, or not"},
    "prefill_budgets": (
        "", "comma-separated --max-prefill-tokens to measure at the last shape, last of all (empty: none)"
    ),
    "prefill_streams": 16, "prefill_stream_tokens": 2000, "max_new_tokens": 128, "requests_per_stream": 2,
    "peak_gbs": {"type": float, "default": None, "help": "peak memory bandwidth, GB/s (default: from the GPU's name)"},
    "tokenizer": {"default": None, "help": "the default model's tokenizer files (default: $TOKENWIRE_TOKENIZER_DIR, "
                  "else the converted default model)"},
    "cache": "/tmp/tokenwire-random-models",
    "budget_s": (0.0, "start no phase but the first after this many seconds (0: no budget)"),
    "server_arg": ([], "extra server flag (repeatable)"),
}  # fmt: skip
DRY_RUN = {"random_weights": "tiny", "device": "cpu", "concurrency": "1,2", "forwards": "native,native:sampled",
           "max_new_tokens": 4, "requests_per_stream": 1, "peak_gbs": 10.0, "prefill_budgets": "64",
           "prefill_streams": 2, "prefill_stream_tokens": 400}  # fmt: skip


def peak_gbs(device_name: str) -> float | None:
    """The peak memory bandwidth of a GPU known by its name (``PEAK_GBS``), else None."""
    return next((gbs for key, gbs in PEAK_GBS.items() if key in device_name), None)


def tokenizer_source(given: str | None = None) -> Path:
    """The default model's tokenizer files: ``given``, else ``$TOKENWIRE_TOKENIZER_DIR`` (what ``make gpu-wheels``
    packs for a bare GPU machine), else the converted default model."""
    folder = given or os.environ.get("TOKENWIRE_TOKENIZER_DIR")
    if folder:
        return Path(folder)
    from tokenwire_server.model import prepare_default_model

    return prepare_default_model()


def model_folder(shape: str, args: argparse.Namespace) -> Path:
    """A Llama of ``shape`` with random weights and the default model's tokenizer and chat template, in
    ``--cache`` (float32 on a CPU, else bfloat16; reused when already there)."""
    folder = Path(args.cache) / f"random-{shape}"
    if (folder / "config.json").exists() and any(folder.glob("*.safetensors")):
        return folder
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    source = tokenizer_source(args.tokenizer)
    loaded = AutoTokenizer.from_pretrained(source)
    config = LlamaConfig(vocab_size=len(loaded), max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         bos_token_id=loaded.bos_token_id, eos_token_id=loaded.eos_token_id,
                         pad_token_id=loaded.eos_token_id, **SHAPES[shape])  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(torch.float32 if args.device == "cpu" else torch.bfloat16).eval()
    model.save_pretrained(folder)
    loaded.save_pretrained(folder)
    for name in ("chat_template.jinja", "generation_config.json"):
        if (source / name).exists() and not (folder / name).exists():
            (folder / name).write_bytes((source / name).read_bytes())
    return folder


def weight_bytes(shape: str, vocab: int, element: int) -> int:
    s = SHAPES[shape]
    h, i, layers = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    q, kv = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
    embed = vocab * h * (1 if s["tie_word_embeddings"] else 2)
    return (layers * per_layer + embed + h) * element


def mbu_of(shape: str, folder: Path, device: str, concurrency: int, step_s: float | None, peak: float | None,
           new_tokens: int) -> float | None:  # fmt: skip
    """Bytes a decode step reads (every weight once, plus the batch's KV cache) / step time / peak bandwidth."""
    import torch
    from tokenwire_server.model import kv_bytes_per_token

    if not step_s or not peak:
        return None
    element, dtype = (4, torch.float32) if device == "cpu" else (2, torch.bfloat16)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    per_token_kv = kv_bytes_per_token(SimpleNamespace(**SHAPES[shape]), dtype)
    context = 40 + new_tokens / 2  # mean tokens in a row's cache over the run
    return (weight_bytes(shape, vocab, element) + concurrency * context * per_token_kv) / step_s / (peak * 1e9)


@contextlib.contextmanager
def gpu_busy() -> Iterator[list[int]]:
    """NVML utilisation of device 0 (%), sampled every 100 ms while inside (none without NVML)."""
    samples: list[int] = []
    stop = threading.Event()
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:  # no NVML here: no utilisation figure
        yield samples
        return

    def sample() -> None:
        while not stop.wait(0.1):
            samples.append(int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def metrics(metrics_port: int) -> dict[str, float]:
    """The server's /metrics samples, {name with its labels: value} ({} without the page: the fake)."""
    if not metrics_port:
        return {}
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return {name: float(value) for name, value in re.findall(r"^(\w[\w:]*(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def mean_between(before: dict[str, float], after: dict[str, float], histogram: str) -> float | None:
    """The mean of a histogram's observations between two readings of ``metrics`` (None: none)."""
    count = after.get(f"{histogram}_count", 0) - before.get(f"{histogram}_count", 0)
    return (after.get(f"{histogram}_sum", 0) - before.get(f"{histogram}_sum", 0)) / count if count else None


def reserved_bytes(metrics_port: int) -> int | None:
    """The most any device's ``tokenwire_gpu_memory_reserved_bytes`` reads (its high-water mark); None on a CPU."""
    name = "tokenwire_gpu_memory_reserved_bytes{"
    values = [value for key, value in metrics(metrics_port).items() if key.startswith(name)]
    return int(max(values)) if values else None


@dataclasses.dataclass
class Result(load.Measure):
    """One row: a ``Measure`` (``system``: the path), with the shape and the server's figures (ms, GiB)."""

    shape: str = ""
    step_ms: float | None = None
    host_ms: float | None = None
    gpu_busy: float | None = None
    mbu: float | None = None
    reserved_gib: float | None = None
    # The server's "kv cache sized from device memory" line: the check (GiB), the worst step and graph pool it
    # counted (GiB), the KV tokens and the context it serves.
    sized: tuple[float, float, float, int, int] | None = None


def run_shape(shape: str, spec: str, args: argparse.Namespace) -> list[Result]:
    """The engine over gRPC at each concurrency with one ``--forwards`` entry: a ``--forward`` and its variants,
    ``no-overlap`` (``--overlap off``), ``sampled`` (SAMPLED requests, not greedy) and ``flex``
    (``--attention flex``)."""
    forward, _, variant = spec.partition(":")
    variants = {v for v in variant.split("+") if v}
    if variants - {"no-overlap", "sampled", "flex"}:
        raise ValueError(f"unknown variant {variant!r} of --forwards entry {spec!r} (known: no-overlap, sampled, flex)")
    sampling = SAMPLED if "sampled" in variants else {}
    folder = model_folder(shape, args)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    flags = [
        "--model", str(folder), "--device", args.device, "--max-active", str(max(concurrency)),
        "--max-queue", str(2 * max(concurrency)), "--metrics-port", "-1", "--forward", forward,
        *(["--step-graphs", args.step_graphs] if forward == "native" else []),
        *args.server_arg, *(["--overlap", "off"] if "no-overlap" in variants else []),  # the variant wins
        *(["--attention", "flex"] if "flex" in variants else []),
    ]  # fmt: skip
    results: list[Result] = []
    with serve(args.dry_run, flags, "batched") as server:
        peak = args.peak_gbs
        if peak is None and args.device == "cuda":
            peak = peak_gbs(str(next((r.get("name", "") for r in server.find("gpu")), "")))
        engine = next(iter(server.find("batched engine forward pass")), {})
        path = f"tokenwire {engine.get('forward', forward)}"
        path += f" +{engine['step_graphs']} graphs" if engine.get("step_graphs") not in (None, "off") else ""
        path += " +overlap" if engine.get("overlap") else " -overlap" if "no-overlap" in variants else ""
        path += " +flex" if engine.get("attention") == "flex" else ""
        path += " sampled" if sampling else ""
        load.warm(server.target)
        line = next(iter(server.find("kv cache sized from device memory")), None)
        sized = None if line is None else (
            line["fraction"] * line["total_bytes"] / 2**30, line["worst_step_bytes"] / 2**30,
            line["graph_pool_bytes"] / 2**30, line["kv_cache_tokens"], line["context_limit"],
        )  # fmt: skip
        for c in concurrency:
            before = metrics(server.metrics_port)
            with gpu_busy() as busy:
                m = load.grpc_load(
                    server.target, path, c, c * args.requests_per_stream, args.max_new_tokens, **sampling
                )
            after = metrics(server.metrics_port)
            step_s, host_s = (mean_between(before, after, name) for name in STEP_HISTOGRAMS)
            reserved = reserved_bytes(server.metrics_port)
            results.append(Result(**vars(m), shape=shape, step_ms=step_s * 1000 if step_s else None,
                                  host_ms=None if host_s is None else host_s * 1000,
                                  gpu_busy=sum(busy) / len(busy) if busy else None,
                                  mbu=mbu_of(shape, folder, args.device, c, step_s, peak, args.max_new_tokens),
                                  reserved_gib=None if reserved is None else reserved / 2**30,
                                  sized=sized))  # fmt: skip
            doc.log(f"  {shape} {path} c={c}: {m.tokens_per_s:.0f} tok/s, step {results[-1].step_ms} ms")
    return results


def run_ceiling(shape: str, args: argparse.Namespace, batches: list[int]) -> list[Result]:
    """transformers ``generate`` on static batches of 32-token prompts, static cache (compiled on CUDA), greedy:
    one warm-up run (the compile), one timed run."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = model_folder(shape, args)
    device, cuda = torch.device(args.device), args.device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    peak = args.peak_gbs if args.peak_gbs is not None or not cuda else peak_gbs(torch.cuda.get_device_name(device))
    label = "ceiling: static generate" + (" (compiled)" if cuda else " (eager)")
    results = []
    new = args.max_new_tokens
    for batch in sorted(batches, reverse=True):  # the largest batch first: the figure the target needs
        torch.manual_seed(0)
        ids = torch.randint(10, model.config.vocab_size, (batch, 32), device=device)
        kwargs: dict[str, Any] = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                      cache_implementation="static", pad_token_id=model.config.eos_token_id,
                                      attention_mask=torch.ones_like(ids),
                                      **({} if cuda else {"disable_compile": True}))  # fmt: skip
        with torch.inference_mode():
            model.generate(ids, **kwargs)  # warm-up: the compile
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            model.generate(ids, **kwargs)
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - started
        step_s = elapsed / new
        results.append(Result(
            label, batch, batch, batch * new, batch * new / elapsed, itl_p50=step_s * 1000, shape=shape,
            step_ms=step_s * 1000, mbu=mbu_of(shape, folder, args.device, batch, step_s, peak, new),
            reserved_gib=torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None))  # fmt: skip
        doc.log(f"  {shape} {label} batch={batch}: {results[-1].tokens_per_s:.0f} tok/s")
    del model
    if cuda:
        torch.cuda.empty_cache()
    return results


def run_prefill(shape: str, args: argparse.Namespace) -> list[list[Any]]:
    """``benchmarks.bench.long_prompt`` twice per ``--prefill-budgets`` entry: the table's cells."""
    from benchmarks.bench import long_prompt

    folder = model_folder(shape, args)
    out = []
    for budget in [int(b) for b in args.prefill_budgets.split(",") if b]:
        extra = ["--device", args.device, "--forward", "native", "--max-prefill-tokens", str(budget), "--max-active",
                 str(args.prefill_streams + 1), "--step-graphs", args.step_graphs, *args.server_arg]  # fmt: skip
        runs = long_prompt(str(folder), repeats=2, streams=args.prefill_streams, extra=extra,
                           stream_tokens=args.prefill_stream_tokens, dry_run=args.dry_run)  # fmt: skip
        worst = max(runs, key=lambda run: run.ratio)  # the worse of two arrivals
        first = max(run.first_token_s for run in runs)
        out.append(
            [shape, budget, f"{worst.ratio:.1f}", f"{worst.itl_p50_ms:.2f}", f"{worst.max_gap_ms:.1f}", f"{first:.2f}"]
        )
        doc.log(f"  {shape} prompt budget {budget}: stall {worst.ratio:.1f}x, long prompt TTFT {first:.2f} s")
    return out


def render(args: argparse.Namespace, results: list[Result], prefill: list[list[Any]], skipped: list[str],
           not_yet: list[str], failed: Sequence[str] = ()) -> doc.Section:  # fmt: skip
    rows = [[r.shape, r.system, r.concurrency, f"{r.tokens_per_s:.0f}", cell(r.ttft_p50), cell(r.ttft_p99),
             cell(r.itl_p50, 2), cell(r.itl_p99, 2), cell(r.step_ms, 2), cell(r.host_ms, 2), cell(r.gpu_busy, 0),
             cell(r.mbu, 1, 100), cell(r.reserved_gib, 2)]
            for r in results]  # fmt: skip
    lines = [
        *([f"Still to run: {', '.join(not_yet)}."] if not_yet else []),
        "Random weights in the named shape, the default model's tokenizer; greedy, `ignore_eos`; one run. tokenwire "
        "rows: the server over gRPC (TTFT and ITL from the client; decode step: the server's mean). Ceiling rows: "
        "transformers `generate` on a static batch with a static cache, in-process (ITL there is the mean step, "
        "prefill included). MBU: bytes a decode step reads (weights + the batch's KV cache) ÷ step time ÷ peak "
        "bandwidth. Host ms/step: the server's mean `tokenwire_decode_step_host_seconds`, a decode step's wall time "
        "(delivery included) less its compute (CPU) or its wait on the device (CUDA): on a GPU, host work the device "
        "may idle through. Reserved: torch's device memory high-water mark.",
        "",
        *doc.table("shape | path | c | tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | decode step ms "
                   "| host ms/step | GPU busy % | MBU % | reserved GiB", "llrrrrrrrrrrr", rows),
    ]  # fmt: skip
    memory = {(r.shape, r.system): r for r in results if r.sized is not None}  # the last (largest c) of each
    if memory:
        lines += [
            "",
            "Memory (`--kv-cache-tokens 0`: the KV pool sized after the engine's worst step, engine/memory.py): "
            "the check (`--kv-cache-memory-fraction` × the card), what the server counted for its worst step and "
            "its graph pool, the KV and context that left, and torch's reserved high-water mark after the runs.",
            "",
            *doc.table("shape | path | check GiB | worst step GiB | graph pool GiB | KV tokens | context "
                       "| reserved GiB", "llrrrrrr",
                       [[shape, system, cell(r.sized[0], 2), cell(r.sized[1], 2), cell(r.sized[2], 2), r.sized[3],
                         r.sized[4], cell(r.reserved_gib, 2)] for (shape, system), r in memory.items() if r.sized]),
        ]  # fmt: skip
    if prefill:
        lines += [
            "",
            "Prompt budget (`--max-prefill-tokens`, native pass): streams decode, a 1,500-token prompt arrives (two "
            "arrivals, the worse shown); stall: the streams' largest gap while it is read ÷ their ITL p50 before; "
            "TTFT: the long prompt's own.",
            "",
            *doc.table(
                "shape | budget | stall × | ITL p50 ms | largest gap ms | long prompt TTFT s", "lrrrrr", prefill
            ),
        ]
    if skipped:
        lines += ["", "Not run (the time budget was spent): " + "; ".join(skipped) + "."]
    if failed:
        lines += ["", "Failed (the phase raised; the log has its traceback): " + "; ".join(failed) + "."]
    return doc.section("gpu", f"The batched engine with random weights on {args.device}", args.command, *lines)


def run(args: argparse.Namespace) -> doc.Section:
    shapes = args.random_weights.split(",")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    batches = {"ends": sorted({min(concurrency), max(concurrency)}), "all": concurrency, "none": []}[args.ceiling]
    forwards = [f for f in args.forwards.split(",") if f]
    # The comparison the target needs first: the last (largest) shape's first forward (the one
    # under test) and its ceiling, then each smaller shape's; then the other forwards; then the
    # prompt budget. A lease cut short still has the figures that matter most.
    phases: list[tuple[str, str]] = []
    for shape in reversed(shapes):
        phases += [(shape, forwards[0])] if forwards else []
        phases += [(shape, "ceiling")] if batches else []
    phases += [(shape, forward) for forward in forwards[1:] for shape in reversed(shapes)]
    if args.prefill_budgets:
        phases.append((shapes[-1], "prefill"))
    started = time.monotonic()
    results: list[Result] = []
    skipped: list[str] = []
    failed: list[str] = []
    prefill: list[list[Any]] = []
    order = {shape: i for i, shape in enumerate(shapes)}

    def report(not_yet: list[tuple[str, str]]) -> doc.Section:
        """The section so far, written before the first phase and after each: a run cut short leaves it."""
        results.sort(key=lambda r: (order[r.shape], r.system.startswith("ceiling"), r.system, r.concurrency))
        section = render(args, results, prefill, skipped, [f"{s} {w}" for s, w in not_yet], failed)
        if args.out:
            doc.replace_section(args.out, section.name, section.text, HEADER)
        return section

    section = report(phases)
    for index, (shape, what) in enumerate(phases):
        if index and args.budget_s and time.monotonic() - started > args.budget_s:  # the first phase always runs
            skipped.append(f"{shape} {what}")
        else:
            try:  # a phase that raises is a row of the report, not the end of it
                if what == "prefill":
                    prefill += run_prefill(shape, args)
                else:
                    results += run_ceiling(shape, args, batches) if what == "ceiling" else run_shape(shape, what, args)
            except Exception as exc:
                doc.log(f"  {shape} {what} failed:\n{traceback.format_exc()}")
                failed.append(f"{shape} {what}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        section = report(phases[index + 1 :])
    return section


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.gpu_bench ARGS`` (what gpu-check.sh runs): ``python -m benchmarks gpu ARGS``."""
    from benchmarks.__main__ import main as benchmarks

    return benchmarks(["gpu", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
