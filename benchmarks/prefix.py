"""What the prefix cache saves when requests share a long system prompt (`make bench-prefix`)."""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks import doc, load
from benchmarks.launcher import serve
from benchmarks.stats import median, p99, ratios, spread

SETTINGS = ("on", "off")
RULES = " ".join(f"Rule {i}: answer politely, briefly and only about topic number {i}." for i in range(60))
FLAGS = {"repeats": 3, "requests": 16, "tokens": 8}
DRY_RUN = {"repeats": 1, "requests": 2}


def question(i: int) -> str:
    return f"Question {i}: what is {i} plus {2 * i}, and which colour is the sky at noon?"


def three_passes(stub: Any, count: int, tokens: int) -> list[int]:
    """Cached prompt tokens of each chat of the third pass: shared, unrelated, shared again."""
    shared = [load.request(question(i), tokens, system=RULES) for i in range(count)]
    unrelated = [
        load.request(f"Tell me a short fact about the number {i}.", tokens * 4, chat=True) for i in range(count)
    ]
    for batch in (shared, unrelated, shared):
        _, again = load.streams(stub, batch, concurrency=count, timeout=600)
    return [s.usage.cached_prompt_tokens for s in again]


def run(args: argparse.Namespace) -> doc.Section:
    ttft: dict[tuple[str, str], list[list[float]]] = {}  # (setting, kind) -> per repeat, every request's TTFT
    cached: dict[str, list[int]] = {setting: [] for setting in SETTINGS}
    prompt_tokens: list[int] = []
    texts: dict[str, list[str]] = {}
    third: list[list[int]] = []  # per repeat: the third pass's cached prompt tokens
    for repeat in range(args.repeats):
        for setting in SETTINGS:
            with serve(args.dry_run, ["--model", args.model, "--prefix-cache", setting]) as server:
                stub = load.stub(server.target)

                def ask(text: str, system: str = "", stub: Any = stub) -> load.Stream:
                    return load.stream(stub, load.request(text, args.tokens, chat=True, system=system), timeout=600)

                ask("Hello!")  # warm
                alone = [ask(question(i)).ttft for i in range(args.requests)]
                ask(question(999), RULES)  # the first: fills the cache
                shared = [ask(question(i), RULES) for i in range(args.requests)]
                if setting == "on":
                    third.append(three_passes(stub, min(8, args.requests), args.tokens))
            ttft.setdefault((setting, "alone"), []).append(alone)
            ttft.setdefault((setting, "shared"), []).append([s.ttft for s in shared])
            cached[setting] += [s.usage.cached_prompt_tokens for s in shared]
            prompt_tokens += [s.usage.prompt_tokens for s in shared]
            texts.setdefault(setting, [s.text for s in shared])
            doc.log(f"repeat {repeat} prefix-cache {setting}: TTFT p50 alone {median(alone) * 1000:.0f} ms, "
                    f"shared {median(s.ttft for s in shared) * 1000:.0f} ms, "
                    f"cached min {min(cached[setting])}")  # fmt: skip
    rows = []
    for setting in SETTINGS:
        for kind, prompt in (("alone", "question alone"), ("shared", "shared system prompt")):
            runs = ttft[(setting, kind)]
            p50s, every = [median(r) * 1000 for r in runs], [t * 1000 for run in runs for t in run]
            hits = f"{min(cached[setting])}–{max(cached[setting])}" if kind == "shared" else "-"
            rows.append([setting, prompt, spread(p50s, 0), f"{p99(every):.0f}", hits])
    shared_vs_alone = {
        s: ratios(*([median(r) for r in ttft[(s, kind)]] for kind in ("shared", "alone"))) for s in SETTINGS
    }
    same = sum(a == b for a, b in zip(texts["on"], texts["off"], strict=True))
    return doc.section(
        "prefix", "Prefix caching: a shared 1,000-token system prompt (`make bench-prefix`)", args.command,
        f"The default model over gRPC, {doc.host()}. {args.requests} chats one after another, {args.tokens} new tokens "
        f"each; the shared ones carry a {min(prompt_tokens)}–{max(prompt_tokens)}-token prompt (system prompt + "
        "question), after one that filled the cache. Time to first token at the client: median (min–max) over "
        f"{args.repeats} repeats of each repeat's median, and the p99 over every request.",
        "",
        *doc.table("--prefix-cache | prompt | TTFT p50 (ms) | TTFT p99 (ms) | cached prompt tokens (min–max)", "llrrr",
                   rows),
        "",
        *(f"- prefix cache {s}: TTFT p50 shared ÷ question alone {spread(shared_vs_alone[s], 2)}×" for s in SETTINGS),
        f"- answers identical with the cache on and off: {same} of {len(texts['on'])} (first repeat)",
        f"- three passes (cache on; {len(third[0])} chats sharing the system prompt at once, {len(third[0])} short "
        f"unrelated ones, the first again): chats of the third pass finding >= 960 tokens, per repeat: "
        f"{', '.join(f'{sum(h >= 960 for h in hits)}/{len(hits)} (min {min(hits)})' for hits in third)}",
    )  # fmt: skip
