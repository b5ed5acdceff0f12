"""tokenwire beside vLLM's own OpenAI server and llama.cpp, in one run, repeated (`make bench-peers`).

Every system (``LABELS``) on the same model, prompts, new tokens (``ignore_eos``, greedy; llama.cpp
forbids the end tokens by ``logit_bias`` instead) and concurrency. Every server starts once and
stays up; each repeat runs every system in turn (c=1, then c=16) and each ratio is taken inside
a repeat; the CPU time idle servers used meanwhile is recorded. llama.cpp runs where
.venv-llamacpp exists (``make setup-llamacpp``). Replaces the "peers" section (``--section``,
``--title``: another, for a subset of the systems).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks import doc, load
from benchmarks.bench import LOADED, in_process
from benchmarks.launcher import serve, serve_openai, tree_cpu_seconds, tree_rss_mb, venv_python
from benchmarks.load import Measure
from benchmarks.stats import median, spread

LABELS = {
    "generate": "in-process `generate`", "batched": "tokenwire batched (gRPC)",
    "batched-int8": "tokenwire batched, `--quantization int8` (gRPC)",
    "batched-hf": "tokenwire batched, transformers' forward (gRPC)",
    "batched-1t": "tokenwire batched, 1 torch thread (gRPC)",
    "tokenwire-vllm": "tokenwire on vLLM (gRPC)", "vllm-openai": "vLLM OpenAI server (HTTP)",
    "llamacpp-q4": "llama.cpp Q4_1 (llama-cpp-python server, HTTP)",
    "llamacpp-q8": "llama.cpp Q8_0 (llama-cpp-python server, HTTP)",
}  # fmt: skip
SYSTEMS = tuple(LABELS)
BATCHED = {"batched": [], "batched-hf": ["--forward", "transformers"], "batched-1t": ["--torch-threads", "1"],
           "batched-int8": ["--quantization", "int8", "--allow-unmet-quality-bar"]}  # fmt: skip
LLAMACPP = ("llamacpp-q4", "llamacpp-q8")
OPENAI_SYSTEMS = ("vllm-openai", *LLAMACPP)
# SmolLM2's end tokens (<|endoftext|>, <|im_end|>): forbidden in llama.cpp's requests, its ignore_eos.
LLAMACPP_NO_EOS = {"0": -100, "2": -100}
OPENAI_PROMPT_TOKENS: dict[str, int] = {}  # prompt -> prompt tokens, as vLLM's OpenAI server counted them
CONCURRENCY = (1, 16)
FLAGS = {
    # one torch thread did not pay: on request
    "systems": (",".join(s for s in SYSTEMS if s != "batched-1t"), f"comma-separated, from {', '.join(SYSTEMS)}"),
    "repeats": 3,
    "max_new_tokens": 128,
    "requests": ("4,32", "requests per run at c=1 and at c=16"),
    "eager": (False, "both vLLM servers in eager mode (no compile; starts faster, runs slower)"),
    "kv_cache_tokens": (16 * 2048, "KV cache of both vLLM servers, in tokens"),
    "vllm_python": venv_python("vllm"),
    "llamacpp_python": venv_python("llamacpp"),
    "log_dir": "/tmp",
    "json": ("", "also write every measurement as JSON here"),
    "section": ("peers", "the section of --out this run replaces"),
    "title": ("Beside the peers (`make bench-peers`)", "that section's heading"),
}
DRY_RUN = {"repeats": 1, "max_new_tokens": 4, "requests": "2,4", "systems": ",".join(SYSTEMS)}
# (target, system, compared with, concurrency, field, ratio|delta, at least | at most, bound)
TARGETS = (
    ("#10 CPU c=16: batched ≥ 1.5× in-process static batch 16",
     "batched", "generate", 16, "tokens_per_s", "ratio", ">=", 1.5),
    ("#10 CPU c=16: batched ≥ 1.4× vLLM-CPU (OpenAI server)",
     "batched", "vllm-openai", 16, "tokens_per_s", "ratio", ">=", 1.4),
    ("#10 CPU c=1: batched ≥ 1.2× in-process generate", "batched", "generate", 1, "tokens_per_s", "ratio", ">=", 1.2),
    ("#10 CPU c=1: batched ≥ 1.0× vLLM-CPU (OpenAI server)",
     "batched", "vllm-openai", 1, "tokens_per_s", "ratio", ">=", 1.0),
    ("#10 CPU c=1: batched TTFT p50 ≤ in-process + 15 ms (ms)",
     "batched", "generate", 1, "ttft_p50", "delta", "<=", 15),
    ("#22 CPU c=1: int8 ≥ 1.6× batched float32", "batched-int8", "batched", 1, "tokens_per_s", "ratio", ">=", 1.6),
    ("#22 CPU c=1: int8 ≥ 1.0× llama.cpp Q8_0", "batched-int8", "llamacpp-q8", 1, "tokens_per_s", "ratio", ">=", 1.0),
    ("#22 CPU c=16: int8 ≥ 1.0× batched float32", "batched-int8", "batched", 16, "tokens_per_s", "ratio", ">=", 1.0),
    ("#11 c=16: tokenwire on vLLM ≥ 0.95× vLLM OpenAI server",
     "tokenwire-vllm", "vllm-openai", 16, "tokens_per_s", "ratio", ">=", 0.95),
    ("#11 c=1: tokenwire on vLLM TTFT p50 ≤ OpenAI server + 10 ms (ms)",
     "tokenwire-vllm", "vllm-openai", 1, "ttft_p50", "delta", "<=", 10),
)  # fmt: skip


def measure(
    args: argparse.Namespace, system: str, server: Any, c: int, requests: int, prompts: Sequence[str]
) -> Measure:
    """One run of one system at concurrency ``c``."""
    if system == "generate":
        return dataclasses.replace(
            in_process(args.model, c, max(1, requests // c), args.max_new_tokens, tuple(prompts)), system=system
        )
    if system in OPENAI_SYSTEMS:
        extra = {"logit_bias": LLAMACPP_NO_EOS} if system in LLAMACPP else None
        counted = OPENAI_PROMPT_TOKENS.__setitem__ if system == "vllm-openai" else None
        return load.openai_load(
            server.port, system, c, requests, args.max_new_tokens, prompts, extra, on_prompt=counted
        )
    return load.grpc_load(server.target, system, c, requests, args.max_new_tokens, prompts)


def per_repeat(rows: list[Measure], a: str, b: str, c: int, field: str, how: str) -> list[float]:
    """``a / b`` (how="ratio") or ``a - b`` (how="delta") of one field, per repeat where both ran."""
    out = []
    for r in sorted({m.repeat for m in rows}):
        x, y = (next((getattr(m, field) for m in rows if (m.system, m.concurrency, m.repeat) == (s, c, r)), None)
                for s in (a, b))  # fmt: skip
        if x is not None and y is not None and (how != "ratio" or y):
            out.append(x / y if how == "ratio" else x - y)
    return out


def targets(rows: list[Measure]) -> list[tuple[str, list[float], bool | None]]:
    """(target, per-repeat values, met by the median; None where it did not run)."""

    def met(values: list[float], sense: str, bound: float) -> bool | None:
        if not values:
            return None
        return median(values) >= bound if sense == ">=" else median(values) <= bound

    out = []
    for name, a, b, c, field, how, sense, bound in TARGETS:
        values = per_repeat(rows, a, b, c, field, how)
        out.append((name, values, met(values, sense, bound)))
    batched16 = [m for m in rows if m.system == "batched" and m.concurrency == 16]
    itl = [m.itl_p99 / m.itl_p50 for m in batched16 if m.itl_p50 and m.itl_p99]
    out.append(("#10 CPU c=16: batched ITL p99 ≤ 2× p50", itl, met(itl, "<=", 2)))
    rss = [m.rss_mb for m in batched16 if m.rss_mb]
    out.append(("#10 CPU c=16: batched server RSS ≤ 1.5 GB (MB)", rss, met(rss, "<=", 1536)))
    return out


def render(args: argparse.Namespace, rows: list[Measure], requests: dict[int, int], setup: dict[str, str],
           notes: list[str]) -> doc.Section:  # fmt: skip
    cells = []
    for system in (s for s in SYSTEMS if any(m.system == s for m in rows)):
        for c in CONCURRENCY:
            ms = [m for m in rows if m.system == system and m.concurrency == c]
            if ms:
                col = lambda field, digits=1, ms=ms: spread([v for m in ms if (v := field(m)) is not None], digits)  # noqa: E731
                cpu = col(lambda m: 1000 * m.cpu_s / m.tokens if m.cpu_s is not None and m.tokens else None, 2)
                cells.append([LABELS[system], c, col(lambda m: m.tokens_per_s), col(lambda m: m.ttft_p50),
                              col(lambda m: m.ttft_p99), col(lambda m: m.itl_p50), col(lambda m: m.itl_p99),
                              col(lambda m: m.rss_mb, 0), cpu, sum(sum(m.errors.values()) for m in ms)])  # fmt: skip
    met = [(name, ", ".join(f"{v:.2f}" for v in values) or "-", f"{median(values):.2f}" if values else "-",
            "yes" if ok else "NO") for name, values, ok in targets(rows) if ok is not None]  # fmt: skip
    lines = [
        f"{args.repeats} repeats; in each, every system ran c=1 then c=16, one after another, "
        "with every server already up.",
        "Each cell: median (min–max) over the repeats; ratios are taken inside a repeat. Work: the 16 chat prompts of",
        f"`tokenwire bench`, `max_new_tokens={args.max_new_tokens}` with `ignore_eos`, greedy; "
        f"{requests[1]} (c=1) / {requests[16]} (c=16)",
        "requests per run at each concurrency (closed loop: c streams kept busy). TTFT and ITL are client-side, in",
        "milliseconds; ITL is the gap between token arrivals.",
        "",
        *doc.table("|", "ll", [*doc.machine().items(), *setup.items()]),
        "",
        *doc.table("system | c | tokens/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | server RSS MB | "
                   "server CPU s / 1k tokens | errors",
                   "lrrrrrrrrr", cells),
        "",
        "### Targets",
        "",
        *doc.table("target | per repeat | median | met", "llrl", met),
        *(["", "### Notes", "", *(f"- {n}" for n in notes)] if notes else []),
    ]  # fmt: skip
    return doc.section(args.section, args.title, args.command, *lines)


@contextlib.contextmanager
def started(systems: Sequence[str], args: argparse.Namespace, notes: list[str]) -> Iterator[dict[str, Any]]:
    servers: dict[str, Any] = {}
    vllm_env = {"VLLM_USE_AOT_COMPILE": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    eager = ["--enforce-eager"] if args.eager else []
    with contextlib.ExitStack() as stack:
        for system in (s for s in systems if s != "generate"):
            began = time.monotonic()
            if system in BATCHED:
                flags = ["--model", args.model, *BATCHED[system]]
                servers[system] = stack.enter_context(serve(args.dry_run, flags, "batched"))
            elif system == "tokenwire-vllm":
                flags = ["--model", args.model, "--kv-cache-tokens", str(args.kv_cache_tokens), *eager]
                server = serve(args.dry_run, flags, "vllm", env=vllm_env, python=args.vllm_python)
                servers[system] = stack.enter_context(server)
            else:
                if system == "vllm-openai":
                    folder, kv_bytes = (
                        (Path(), 0) if args.dry_run else vllm_folder_and_kv(args.model, args.kv_cache_tokens)
                    )
                    peer = (args.vllm_python, folder, ["--dtype", "float32", "--kv-cache-memory-bytes", str(kv_bytes),
                                                       "--max-num-seqs", "16", *eager], vllm_env)  # fmt: skip
                else:
                    threads = str(os.cpu_count() or 1)
                    gguf = Path() if args.dry_run else llamacpp_gguf(args.llamacpp_python, system)
                    peer = (args.llamacpp_python, gguf,
                            ["--n_ctx", "4096", "--n_threads", threads, "--n_threads_batch", threads], {})  # fmt: skip
                kind, ready_s = ("vllm", 900) if system == "vllm-openai" else ("llamacpp", 300)
                servers[system] = serve_openai(args.dry_run, *peer, Path(args.log_dir) / f"{system}.log", ready_s, kind)
                stack.callback(servers[system].close)
                label = "vLLM OpenAI server" if system == "vllm-openai" else LABELS[system]
                notes.append(f"{label}: `" + " ".join(servers[system].command[1:]) + "`")
            doc.log(f"  {system}: ready in {time.monotonic() - began:.0f} s")
        yield servers


def llamacpp_gguf(python: str, system: str) -> Path:
    """The GGUF a llama.cpp system serves: the shipped Q4_1, or a Q8_0 made from it once by
    llama.cpp's own quantizer (``llama_model_quantize``, requantizing allowed), in the model cache."""
    from tokenwire_server.model import default_cache_dir, default_gguf_path

    source = default_gguf_path()
    if system == "llamacpp-q4":
        return source
    target = default_cache_dir() / source.name.replace("Q4_1", "Q8_0")
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        script = (
            "import sys, llama_cpp\n"
            "p = llama_cpp.llama_model_quantize_default_params()\n"
            "p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0\n"
            "p.allow_requantize = True\n"
            "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))\n"
        )
        partial = target.with_suffix(".partial")
        subprocess.run([python, "-c", script, str(source), str(partial)], check=True, capture_output=True)
        partial.rename(target)
    return target


def same_prompts(target: str, openai_counts: dict[str, int]) -> str:
    """Both front ends must read the same prompt tokens (the same chat template)."""
    from tokenwire import Client, Message

    with Client(target) as client:
        ours = {p: client.tokenize(messages=[Message("user", p)]).count for p in openai_counts}
    differ = {p: (ours[p], n) for p, n in openai_counts.items() if ours[p] != n}
    if differ:
        return f"prompt tokens differ between tokenwire and vLLM's chat template (tokenwire, vLLM): {differ}"
    return (
        "prompt tokens: the same on every prompt through both front ends "
        f"({min(ours.values())}–{max(ours.values())} tokens)"
    )


def vllm_folder_and_kv(model: str, kv_tokens: int) -> tuple[Path, int]:
    """The folder and KV size tokenwire's vllm engine uses, so the peer gets the same."""
    import torch
    from tokenwire_server.engine.vllm_backend import vllm_model_folder
    from tokenwire_server.model import kv_bytes_per_token, resolve_model_path
    from transformers import AutoConfig

    folder, _, _ = resolve_model_path(model, "")
    per_token = kv_bytes_per_token(AutoConfig.from_pretrained(folder), torch.float32)
    return vllm_model_folder(Path(folder)), max(256 << 20, kv_tokens * per_token)


def run(args: argparse.Namespace) -> doc.Section:
    import torch
    from tokenwire.bench import DEFAULT_PROMPTS

    systems = [s for s in args.systems.split(",") if s]
    if unknown := set(systems) - set(SYSTEMS):
        raise SystemExit(f"unknown systems: {', '.join(sorted(unknown))}")
    vllm = {"tokenwire-vllm", "vllm-openai"} & set(systems)
    if vllm and not (args.dry_run or Path(args.vllm_python).exists()):
        raise SystemExit(f"{args.vllm_python} is missing: run `make setup-vllm` first")
    requests = dict(zip(CONCURRENCY, (int(x) for x in args.requests.split(",")), strict=True))
    notes: list[str] = []
    if set(LLAMACPP) & set(systems) and not (args.dry_run or Path(args.llamacpp_python).exists()):
        systems = [s for s in systems if s not in LLAMACPP]
        notes.append(
            f"llama.cpp left out: {args.llamacpp_python} is missing (`make setup-llamacpp` builds it, ~15 min)"
        )
    rows: list[Measure] = []
    doc.log(f"starting {', '.join(s for s in systems if s != 'generate')} ...")
    with started(systems, args, notes) as servers:
        for r in range(args.repeats):
            for system in systems:
                for c in CONCURRENCY:
                    server = servers.get(system)
                    pid = server.proc.pid if server is not None else os.getpid()
                    others = {s: tree_cpu_seconds(v.proc.pid) for s, v in servers.items() if s != system}
                    cpu_before = tree_cpu_seconds(pid)
                    m = measure(args, system, server, c, requests[c], DEFAULT_PROMPTS)
                    m.repeat = r
                    if server is not None:
                        m.cpu_s, m.rss_mb = tree_cpu_seconds(pid) - cpu_before, tree_rss_mb(pid)
                    idle = {s: tree_cpu_seconds(servers[s].proc.pid) - before for s, before in others.items()}
                    busiest = max(idle.items(), key=lambda kv: kv[1], default=("-", 0.0))
                    rows.append(m)
                    doc.log(f"  repeat {r + 1} {system:>14} c={c:<2} {m.tokens_per_s:7.1f} tok/s  "
                            f"TTFT p50 {m.ttft_p50 or 0:7.1f} ms"
                            f"  ITL p50 {m.itl_p50 or 0:6.1f} ms  "
                            f"(idle servers: at most {busiest[1]:.2f} CPU s, {busiest[0]})")  # fmt: skip
                    if busiest[1] > 0.05 * (m.cpu_s or 1e9):
                        notes.append(
                            f"repeat {r + 1}, {system} c={c}: an idle server used {busiest[1]:.2f} CPU s meanwhile"
                        )
        grpc_server = next((servers[s] for s in systems if s in ("batched", "tokenwire-vllm")), None)
        if grpc_server is not None and OPENAI_PROMPT_TOKENS:
            notes.append(same_prompts(grpc_server.target, OPENAI_PROMPT_TOKENS))
    LOADED.clear()
    setup = {"tokenwire batched": f"{torch.get_num_threads()} torch threads (`batched-1t`: 1)"}
    if vllm:
        setup["vLLM"] = ("vllm-cpu, " + ("eager" if args.eager else "compiled (`VLLM_USE_AOT_COMPILE=0`)")
                         + ", its default CPU binding "
                         "(`VLLM_CPU_OMP_THREADS_BIND=auto`: on 2 cores the worker computes "
                         "with 1 thread, the other core is left to the engine loop and front end)")  # fmt: skip
        setup["vLLM KV cache"] = f"{args.kv_cache_tokens} tokens, both vLLM servers; `--max-num-seqs 16`"
    if set(LLAMACPP) & set(systems):
        setup["llama.cpp"] = ("llama-cpp-python's server, one stream at a time (it does not batch), all cores; "
                              "no ignore_eos: the end tokens are forbidden by logit_bias")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(m) for m in rows], indent=2))
    return render(args, rows, requests, setup, notes)
