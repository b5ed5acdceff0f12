"""tokenwire beside vLLM's own OpenAI server and llama.cpp, in one run, repeated (`make bench-peers`).

The systems, all on the same model folder, the same 16 chat prompts, the same number of
new tokens (``ignore_eos``, greedy) and the same concurrency:

- ``generate``: transformers ``model.generate`` in this process (batch 1; static batch = c);
- ``batched``: a tokenwire server, ``--engine batched``, over gRPC;
- ``batched-hf``: the same with ``--forward transformers`` (the model's own forward, a
  prefill pass of its own between decode passes: the engine before its native pass);
- ``batched-1t``: ``batched`` with ``--torch-threads 1`` (one core left to the gRPC loop;
  not run unless named: it did not pay);
- ``tokenwire-vllm``: a tokenwire server, ``--engine vllm`` (run by .venv-vllm's python), over gRPC;
- ``vllm-openai``: vLLM's own OpenAI-compatible server (``python -m
  vllm.entrypoints.openai.api_server``, same venv), streaming ``/v1/chat/completions``;
- ``batched-int8``: ``batched`` with ``--quantization int8`` (per-channel int8 weights);
- ``llamacpp-q4`` / ``llamacpp-q8``: llama-cpp-python's OpenAI server (``make setup-llamacpp``,
  its own venv) on the shipped Q4_1 GGUF, and on a Q8_0 requantized from it by llama.cpp's
  own quantizer (made once into the model cache). tokenwire's default model is that same
  Q4_1 file dequantized, so all three read the same weights. llama.cpp has no
  ``ignore_eos``: its requests forbid the end tokens by ``logit_bias`` instead. Run when
  .venv-llamacpp exists, else left out with a note.

Every server is started once and stays up; each repeat then runs every system in turn
(c=1, then c=16), so machine noise lands on all of them alike, and each ratio is taken
between rows of the same repeat. Idle servers cost nothing measurable: the CPU time each
one used while another ran is recorded and reported. Replaces the "peers" section
(``--section``, ``--title``: another, for a subset of the systems).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks import doc, load
from benchmarks.bench import LOADED, in_process
from benchmarks.launcher import serve, serve_openai, tree_cpu_seconds, tree_rss_mb, venv_python
from benchmarks.load import Measure
from benchmarks.stats import spread

SYSTEMS = (
    "generate",
    "batched",
    "batched-int8",
    "batched-hf",
    "batched-1t",
    "tokenwire-vllm",
    "vllm-openai",
    "llamacpp-q4",
    "llamacpp-q8",
)
LLAMACPP = ("llamacpp-q4", "llamacpp-q8")
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if s != "batched-1t")  # one torch thread did not pay: on request
LABELS = {
    "generate": "in-process `generate`",
    "batched": "tokenwire batched (gRPC)",
    "batched-hf": "tokenwire batched, transformers' forward (gRPC)",
    "batched-1t": "tokenwire batched, 1 torch thread (gRPC)",
    "tokenwire-vllm": "tokenwire on vLLM (gRPC)",
    "vllm-openai": "vLLM OpenAI server (HTTP)",
    "batched-int8": "tokenwire batched, `--quantization int8` (gRPC)",
    "llamacpp-q4": "llama.cpp Q4_1 (llama-cpp-python server, HTTP)",
    "llamacpp-q8": "llama.cpp Q8_0 (llama-cpp-python server, HTTP)",
}
OPENAI_SYSTEMS = ("vllm-openai", *LLAMACPP)
# SmolLM2's end tokens (<|endoftext|>, <|im_end|>): forbidden in llama.cpp's requests, its ignore_eos.
LLAMACPP_NO_EOS = {"0": -100, "2": -100}
OPENAI_PROMPT_TOKENS: dict[str, int] = {}  # prompt -> prompt tokens, as vLLM's OpenAI server counted them


DRY_RUN = {"repeats": 1, "max_new_tokens": 4, "requests": "2,4", "systems": ",".join(SYSTEMS)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma-separated, from {', '.join(SYSTEMS)}"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--requests", default="4,32", help="requests per run at c=1 and at c=16")
    parser.add_argument(
        "--eager", action="store_true", help="both vLLM servers in eager mode (no compile; starts faster, runs slower)"
    )
    parser.add_argument(
        "--kv-cache-tokens", type=int, default=16 * 2048, help="KV cache of both vLLM servers, in tokens"
    )
    parser.add_argument("--vllm-python", default=venv_python("vllm"))
    parser.add_argument("--llamacpp-python", default=venv_python("llamacpp"))
    parser.add_argument("--log-dir", default="/tmp")
    parser.add_argument("--json", default="", help="also write every measurement as JSON here")
    parser.add_argument("--section", default="peers", help="the section of --out this run replaces")
    parser.add_argument("--title", default="Beside the peers (`make bench-peers`)", help="that section's heading")


def measure(
    args: argparse.Namespace, system: str, server: Any, c: int, requests: int, prompts: Sequence[str]
) -> Measure:
    """One run of one system at concurrency ``c``."""
    if system == "generate":
        m = in_process(args.model, c, max(1, requests // c), args.max_new_tokens, tuple(prompts))
        m.system = system
        return m
    if system in OPENAI_SYSTEMS:
        extra = {"logit_bias": LLAMACPP_NO_EOS} if system in LLAMACPP else None
        counted = OPENAI_PROMPT_TOKENS.__setitem__ if system == "vllm-openai" else None
        return load.openai_load(
            server.port, system, c, requests, args.max_new_tokens, prompts, extra, on_prompt=counted
        )
    return load.grpc_load(server.target, system, c, requests, args.max_new_tokens, prompts)


# -- the report ----------------------------------------------------------------------


def per_repeat(rows: list[Measure], a: str, b: str, c: int, field: str, how: str) -> list[float]:
    """``a / b`` (how="ratio") or ``a - b`` (how="delta") of one field, per repeat where both ran."""
    out = []
    for r in sorted({m.repeat for m in rows}):
        x = next((getattr(m, field) for m in rows if m.system == a and m.concurrency == c and m.repeat == r), None)
        y = next((getattr(m, field) for m in rows if m.system == b and m.concurrency == c and m.repeat == r), None)
        if x is None or y is None or (how == "ratio" and not y):
            continue
        out.append(x / y if how == "ratio" else x - y)
    return out


# (target, system, compared with, concurrency, field, ratio|delta, at least | at most, bound)
TARGETS = (
    ("#10 CPU c=16: batched ≥ 1.5× in-process static batch 16", "batched", "generate", 16, "tokens_per_s", "ratio", ">=", 1.5),
    ("#10 CPU c=16: batched ≥ 1.4× vLLM-CPU (OpenAI server)", "batched", "vllm-openai", 16, "tokens_per_s", "ratio", ">=", 1.4),
    ("#10 CPU c=1: batched ≥ 1.2× in-process generate", "batched", "generate", 1, "tokens_per_s", "ratio", ">=", 1.2),
    ("#10 CPU c=1: batched ≥ 1.0× vLLM-CPU (OpenAI server)", "batched", "vllm-openai", 1, "tokens_per_s", "ratio", ">=", 1.0),
    ("#10 CPU c=1: batched TTFT p50 ≤ in-process + 15 ms (ms)", "batched", "generate", 1, "ttft_p50", "delta", "<=", 15),
    ("#22 CPU c=1: int8 ≥ 1.6× batched float32", "batched-int8", "batched", 1, "tokens_per_s", "ratio", ">=", 1.6),
    ("#22 CPU c=1: int8 ≥ 1.0× llama.cpp Q8_0", "batched-int8", "llamacpp-q8", 1, "tokens_per_s", "ratio", ">=", 1.0),
    ("#22 CPU c=16: int8 ≥ 1.0× batched float32", "batched-int8", "batched", 16, "tokens_per_s", "ratio", ">=", 1.0),
    ("#11 c=16: tokenwire on vLLM ≥ 0.95× vLLM OpenAI server", "tokenwire-vllm", "vllm-openai", 16, "tokens_per_s", "ratio", ">=", 0.95),
    ("#11 c=1: tokenwire on vLLM TTFT p50 ≤ OpenAI server + 10 ms (ms)", "tokenwire-vllm", "vllm-openai", 1, "ttft_p50", "delta", "<=", 10),
)  # fmt: skip


def targets(rows: list[Measure]) -> list[tuple[str, list[float], bool | None]]:
    """(target, per-repeat values, met by the median; None where it did not run)."""

    def met(values: list[float], sense: str, bound: float) -> bool | None:
        if not values:
            return None
        median = statistics.median(values)
        return median >= bound if sense == ">=" else median <= bound

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


def render(rows: list[Measure], meta: dict[str, Any]) -> str:
    systems = [s for s in SYSTEMS if any(m.system == s for m in rows)]
    lines = [
        f"## {meta.get('title', 'Beside the peers (`make bench-peers`)')}",
        "",
        f"Written by `{meta['command']}` at {meta['when']}; do not edit by hand.",
        f"{meta['repeats']} repeats; in each, every system ran c=1 then c=16, one after another, with every server",
        "already up. Each cell: median (min–max) over the repeats; ratios are taken inside a repeat.",
        f"Work: the 16 chat prompts of `tokenwire bench`, `max_new_tokens={meta['max_new_tokens']}` with `ignore_eos`, greedy;",
        f"{meta['requests']} requests per run at each concurrency (closed loop: c streams kept busy).",
        "TTFT and ITL are client-side, in milliseconds; ITL is the gap between token arrivals.",
        "",
        "| | |",
        "|---|---|",
    ]
    lines += [f"| {k} | {v} |" for k, v in meta["machine"].items()]
    lines += [f"| {k} | {v} |" for k, v in meta["setup"].items()]
    lines += [
        "",
        "| system | c | tokens/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | server RSS MB | server CPU s / 1k tokens | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for system in systems:
        for c in meta["concurrency"]:
            ms = [m for m in rows if m.system == system and m.concurrency == c]
            if not ms:
                continue

            def col(f: Callable[[Measure], float | None], digits: int = 1, ms: list[Measure] = ms) -> str:
                return spread([v for m in ms if (v := f(m)) is not None], digits)

            cpu = col(lambda m: 1000 * m.cpu_s / m.tokens if m.cpu_s is not None and m.tokens else None, 2)
            lines.append(
                f"| {LABELS[system]} | {c} | {col(lambda m: m.tokens_per_s)} | {col(lambda m: m.ttft_p50)} "
                f"| {col(lambda m: m.ttft_p99)} | {col(lambda m: m.itl_p50)} | {col(lambda m: m.itl_p99)} "
                f"| {col(lambda m: m.rss_mb, 0)} | {cpu} | {sum(sum(m.errors.values()) for m in ms)} |"
            )
    lines += ["", "### Targets", "", "| target | per repeat | median | met |", "|---|---|---:|---|"]
    for name, values, met in targets(rows):
        if met is None:  # a system it compares did not run here
            continue
        per = ", ".join(f"{v:.2f}" for v in values) or "-"
        median = f"{statistics.median(values):.2f}" if values else "-"
        lines.append(f"| {name} | {per} | {median} | {'-' if met is None else 'yes' if met else 'NO'} |")
    if meta.get("notes"):
        lines += ["", "### Notes", ""] + [f"- {n}" for n in meta["notes"]]
    return "\n".join(lines) + "\n"


# -- the run -------------------------------------------------------------------------


@contextlib.contextmanager
def started(systems: Sequence[str], args: argparse.Namespace, notes: list[str]) -> Iterator[dict[str, Any]]:
    servers: dict[str, Any] = {}
    vllm_env = {"VLLM_USE_AOT_COMPILE": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    eager = ["--enforce-eager"] if args.eager else []
    with contextlib.ExitStack() as stack:
        for system in systems:
            began = time.monotonic()
            if system in ("batched", "batched-hf", "batched-1t", "batched-int8"):
                extra = {"batched": [], "batched-hf": ["--forward", "transformers"], "batched-1t": ["--torch-threads", "1"],
                         "batched-int8": ["--quantization", "int8", "--allow-unmet-quality-bar"]}[system]  # fmt: skip
                servers[system] = stack.enter_context(serve(args.dry_run, ["--model", args.model, *extra], "batched"))
            elif system == "tokenwire-vllm":
                flags = ["--model", args.model, "--kv-cache-tokens", str(args.kv_cache_tokens), *eager]
                servers[system] = stack.enter_context(
                    serve(args.dry_run, flags, "vllm", env=vllm_env, python=args.vllm_python)
                )
            elif system == "vllm-openai":
                folder, kv_bytes = (Path(), 0) if args.dry_run else vllm_folder_and_kv(args.model, args.kv_cache_tokens)
                peer_args = [
                    "--dtype",
                    "float32",
                    "--kv-cache-memory-bytes",
                    str(kv_bytes),
                    "--max-num-seqs",
                    "16",
                    *eager,
                ]
                log = Path(args.log_dir) / "vllm-openai.log"
                servers[system] = serve_openai(
                    args.dry_run, args.vllm_python, folder, peer_args, vllm_env, log, 900, "vllm"
                )
                notes.append("vLLM OpenAI server: `" + " ".join(servers[system].command[1:]) + "`")
            elif system in LLAMACPP:
                gguf = Path() if args.dry_run else llamacpp_gguf(args.llamacpp_python, system)
                threads = str(os.cpu_count() or 1)
                llama_args = ["--n_ctx", "4096", "--n_threads", threads, "--n_threads_batch", threads]
                log = Path(args.log_dir) / f"{system}.log"
                servers[system] = serve_openai(
                    args.dry_run, args.llamacpp_python, gguf, llama_args, {}, log, 300, "llamacpp"
                )
                notes.append(f"{LABELS[system]}: `" + " ".join(servers[system].command[1:]) + "`")
            else:
                continue
            print(f"  {system}: ready in {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
            if hasattr(servers[system], "close"):
                stack.callback(servers[system].close)
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
    return f"prompt tokens: the same on every prompt through both front ends ({min(ours.values())}–{max(ours.values())} tokens)"


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
    from tokenwire.bench import DEFAULT_PROMPTS

    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems: {', '.join(sorted(unknown))}")
    if {"tokenwire-vllm", "vllm-openai"} & set(systems) and not (args.dry_run or Path(args.vllm_python).exists()):
        raise SystemExit(f"{args.vllm_python} is missing: run `make setup-vllm` first")
    prompts = tuple(DEFAULT_PROMPTS)
    concurrency = (1, 16)
    requests = dict(zip(concurrency, (int(x) for x in args.requests.split(",")), strict=True))
    notes: list[str] = []
    if set(LLAMACPP) & set(systems) and not (args.dry_run or Path(args.llamacpp_python).exists()):
        systems = [s for s in systems if s not in LLAMACPP]
        notes.append(
            f"llama.cpp left out: {args.llamacpp_python} is missing (`make setup-llamacpp` builds it, ~15 min)"
        )
    rows: list[Measure] = []
    print(f"starting {', '.join(s for s in systems if s != 'generate')} ...", file=sys.stderr, flush=True)
    with started(systems, args, notes) as servers:
        for r in range(args.repeats):
            for system in systems:
                for c in concurrency:
                    server = servers.get(system)
                    pid = server.proc.pid if server is not None else os.getpid()
                    others = {s: tree_cpu_seconds(v.proc.pid) for s, v in servers.items() if s != system}
                    cpu_before = tree_cpu_seconds(pid)
                    m = measure(args, system, server, c, requests[c], prompts)
                    m.repeat = r
                    if server is not None:
                        m.cpu_s = tree_cpu_seconds(pid) - cpu_before
                        m.rss_mb = tree_rss_mb(pid)
                    idle = {s: tree_cpu_seconds(servers[s].proc.pid) - before for s, before in others.items()}
                    busiest = max(idle.items(), key=lambda kv: kv[1], default=("-", 0.0))
                    rows.append(m)
                    print(f"  repeat {r + 1} {system:>14} c={c:<2} {m.tokens_per_s:7.1f} tok/s  TTFT p50 {m.ttft_p50 or 0:7.1f} ms"
                          f"  ITL p50 {m.itl_p50 or 0:6.1f} ms  (idle servers: at most {busiest[1]:.2f} CPU s, {busiest[0]})",
                          file=sys.stderr, flush=True)  # fmt: skip
                    m_idle = max(idle.values(), default=0.0)
                    if m_idle > 0.05 * (m.cpu_s or 1e9):
                        notes.append(
                            f"repeat {r + 1}, {system} c={c}: an idle server used {m_idle:.2f} CPU s meanwhile"
                        )
        grpc_server = next((servers[s] for s in systems if s in ("batched", "tokenwire-vllm")), None)
        if grpc_server is not None and OPENAI_PROMPT_TOKENS:
            notes.append(same_prompts(grpc_server.target, OPENAI_PROMPT_TOKENS))
    LOADED.clear()
    import torch

    setup = {
        "tokenwire batched": f"{torch.get_num_threads()} torch threads (`batched-1t`: 1)",
        "vLLM": "vllm-cpu, "
        + ("eager" if args.eager else "compiled (`VLLM_USE_AOT_COMPILE=0`)")
        + ", its default CPU binding (`VLLM_CPU_OMP_THREADS_BIND=auto`: on 2 cores the worker computes with 1 thread, the other core is left to the engine loop and front end)",
        "vLLM KV cache": f"{args.kv_cache_tokens} tokens, both vLLM servers; `--max-num-seqs 16`",
    }
    if not {"tokenwire-vllm", "vllm-openai"} & set(systems):
        setup = {k: v for k, v in setup.items() if not k.startswith("vLLM")}
    if set(LLAMACPP) & set(systems):
        setup["llama.cpp"] = (
            "llama-cpp-python's server, one stream at a time (it does not batch), all cores; "
            "no ignore_eos: the end tokens are forbidden by logit_bias"
        )
    meta = {
        "command": args.command,
        "when": doc.now(),
        "repeats": args.repeats,
        "max_new_tokens": args.max_new_tokens,
        "requests": f"{requests[1]} (c=1) / {requests[16]} (c=16)",
        "concurrency": concurrency,
        "machine": doc.machine(),
        "setup": setup,
        "notes": notes,
        "title": args.title,
    }
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(m) for m in rows], indent=2))
    return doc.Section(args.section, render(rows, meta))
