"""Does a cut stream resume exactly, and what does a resume cost? (`make bench-resume`)"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from typing import Any

from benchmarks import doc, load
from benchmarks.launcher import serve
from benchmarks.stats import median, spread

QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.", "Explain photosynthesis briefly.",
             "List three primary colors.", "Why is the sky blue?", "Give me a tip for learning Python.",
             "Name three rivers in Europe."]  # fmt: skip
KINDS = ("greedy", "seeded top-p", "seeded top-k + penalty")
SAMPLING = ({"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.9, "seed": 1234},
            {"temperature": 1.0, "top_k": 40, "repetition_penalty": 1.3, "seed": 99})  # fmt: skip
FLAGS = {"engines": "batched,vllm", "repeats": 3, "max_new_tokens": 64}
DRY_RUN = {"repeats": 1, "engines": "batched", "max_new_tokens": 8}


def requests(tokens: int, count: int = 20, stops: Sequence[str] | None = None) -> list[tuple[str, Any]]:
    """(sampling kind, request): greedy, seeded top-p, seeded top-k with a repetition penalty in
    turn; chat and raw text in turn; every fourth ignores EOS; ``stops[i]`` (else "\\n\\n" on
    every fourth) as request i's stop sequence; token ids on, for the resume."""
    out = []
    for i in range(count):
        stop = stops[i] if stops is not None else ("\n\n" if i % 4 == 1 else "")
        ask = QUESTIONS[i % len(QUESTIONS)]
        request = load.request(ask, tokens, chat=i % 2 == 0, ignore_eos=i % 4 == 0, request_id=f"resume-{i}",
                               sampling=SAMPLING[i % 3], output={"token_ids": True})  # fmt: skip
        request.stopping.stop_sequences.extend([stop] if stop else [])
        out.append((KINDS[i % 3], request))
    return out


def one_repeat(args: argparse.Namespace, engine: str, seed: int) -> dict[str, Any]:
    flags = ["--model", args.model, "--max-active", "4"]
    if engine == "vllm":  # vLLM needs room for one whole context (8,192 tokens) in its cache
        flags += ["--enforce-eager", "--kv-cache-tokens", "16384"]
    todo = requests(args.max_new_tokens)
    rng = random.Random(seed)
    with serve(args.dry_run, flags, engine) as first:
        _, uncut = load.streams(load.stub(first.target), [r for _, r in todo], 4, 900)
    resumed = []
    for (_, request), whole in zip(todo, uncut, strict=True):
        cut = rng.randrange(1, len(whole.chunks)) if len(whole.chunks) > 1 else 0
        resumed.append((cut, load.resumed(request, whole.chunks[:cut])))
    with serve(args.dry_run, flags, engine) as fresh:
        _, rest = load.streams(load.stub(fresh.target), [r for _, r in resumed], 4, 900)
    exact: dict[str, list[bool]] = {kind: [] for kind in KINDS}
    for (kind, _), whole, (cut, _), after in zip(todo, uncut, resumed, rest, strict=True):
        tail = load.Stream(whole.ttft, whole.seconds, whole.chunks[cut:])
        exact[kind].append([c.index for c in after.chunks] == [c.index for c in tail.chunks]
                           and after.text == tail.text and after.ids == tail.ids)  # fmt: skip
    slower = [after.ttft / whole.ttft for whole, after in zip(uncut, rest, strict=True)]
    return {"exact": exact, "ttft_ratio_p50": median(slower), "ttft_ratio_max": max(slower)}


def run(args: argparse.Namespace) -> doc.Section:
    results: dict[str, list[dict[str, Any]]] = {}
    for repeat in range(args.repeats):
        for engine in args.engines.split(","):
            result = one_repeat(args, engine, seed=repeat)
            results.setdefault(engine, []).append(result)
            counts = {kind: f"{sum(v)}/{len(v)}" for kind, v in result["exact"].items()}
            doc.log(f"repeat {repeat} {engine}: exact {counts}, resumed TTFT / uncut TTFT p50 "
                    f"{result['ttft_ratio_p50']:.2f} max {result['ttft_ratio_max']:.2f}")  # fmt: skip
    rows = [[engine, *(f"{sum(v)}/{len(v)}" for v in ([x for r in runs for x in r["exact"][kind]] for kind in KINDS)),
             spread([r["ttft_ratio_p50"] for r in runs], 2), spread([r["ttft_ratio_max"] for r in runs], 2)]
            for engine, runs in results.items()]  # fmt: skip
    return doc.section(
        "resume", "Resuming cut streams (`make bench-resume`)", args.command,
        f"{doc.host()}. The default model; 20 requests of {args.max_new_tokens} tokens, 4 at a time, each cut at a "
        "random chunk (a new cut each repeat) and resumed on a fresh server. Exact: the resumed stream's text, token "
        "ids and chunk indexes equal the uncut stream's from the cut on (all repeats together). TTFT ratio: time to "
        "the first chunk of the resumed call ÷ of the uncut call, median (and largest) over the 20, median (min–max) "
        "over the repeats.",
        "",
        *doc.table("engine | greedy exact | seeded top-p exact | seeded top-k + penalty exact | "
                   "resumed ÷ uncut TTFT, median | largest", "lrrrrr", rows),
    )  # fmt: skip
