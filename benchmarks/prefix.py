"""What the prefix cache saves when requests share a long system prompt (`make bench-prefix`).

Two servers on the default model, `--prefix-cache on` (the default) and `--prefix-cache
off`. On each, one after another (so time to first token is the prompt's own cost, not
a queue's):

- **alone**: 16 chats of a question alone (~20 tokens, and the chat template's own
  default system prompt);
- **shared**: one chat with a ~1,000-token system prompt and a question, to fill the
  cache (not counted), then 16 chats with the same system prompt, each with its own
  question.

Time to first token is taken at the client (call start to first chunk, over gRPC); the
server's `cached_prompt_tokens` is read from each answer's usage, and every answer's
text is compared between the two servers. Three repeats alternate the settings; the
section reports TTFT median and p99 per cell, median (min–max) over repeats of the
per-repeat medians, the ratio shared ÷ alone, and replaces the "prefix" section.
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks import doc, load
from benchmarks.launcher import serve
from benchmarks.stats import median, p99, spread

SETTINGS = ("on", "off")
RULES = " ".join(f"Rule {i}: answer politely, briefly and only about topic number {i}." for i in range(60))
DRY_RUN = {"repeats": 1, "requests": 2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=8)


def question(i: int) -> str:
    return f"Question {i}: what is {i} plus {2 * i}, and which colour is the sky at noon?"


def ask(stub: Any, system: str | None, text: str, tokens: int) -> load.Stream:
    from tokenwire.v1 import generation_pb2 as pb

    messages = [pb.ChatMessage(role="system", content=system)] if system else []
    messages.append(pb.ChatMessage(role="user", content=text))
    request = pb.GenerateRequest(chat=pb.Chat(messages=messages), stopping=pb.StoppingCriteria(max_new_tokens=tokens))
    return load.stream(stub, request, timeout=600)


def run(args: argparse.Namespace) -> doc.Section:
    import grpc

    ttft: dict[tuple[str, str], list[list[float]]] = {}  # (setting, kind) -> per repeat, every request's TTFT
    cached: dict[str, list[int]] = {setting: [] for setting in SETTINGS}
    prompt_tokens: list[int] = []
    texts: dict[str, list[str]] = {}
    for repeat in range(args.repeats):
        for setting in SETTINGS:
            with serve(args.dry_run, ["--model", args.model, "--prefix-cache", setting]) as server:
                stub = load.stub(grpc.insecure_channel(server.target))
                ask(stub, None, "Hello!", args.tokens)  # warm
                alone = [ask(stub, None, question(i), args.tokens).ttft for i in range(args.requests)]
                ask(stub, RULES, question(999), args.tokens)  # the first: fills the cache
                shared = [ask(stub, RULES, question(i), args.tokens) for i in range(args.requests)]
            ttft.setdefault((setting, "alone"), []).append(alone)
            ttft.setdefault((setting, "shared"), []).append([s.ttft for s in shared])
            cached[setting] += [s.usage.cached_prompt_tokens for s in shared]
            prompt_tokens += [s.usage.prompt_tokens for s in shared]
            texts.setdefault(setting, [s.text for s in shared])
            print(f"repeat {repeat} prefix-cache {setting}: TTFT p50 alone {median(alone) * 1000:.0f} ms, "
                  f"shared {median(s.ttft for s in shared) * 1000:.0f} ms, cached min {min(cached[setting])}", flush=True)  # fmt: skip
    lines = [
        "## Prefix caching: a shared 1,000-token system prompt (`make bench-prefix`)",
        "",
        doc.written(args.command),
        f"The default model over gRPC, {doc.host()}. {args.requests} chats one after another, {args.tokens} new tokens "
        f"each; the shared ones carry a {min(prompt_tokens)}–{max(prompt_tokens)}-token prompt (system prompt + "
        "question), after one that filled the cache. Time to first token at the client: median (min–max) over "
        f"{args.repeats} repeats of each repeat's median, and the p99 over every request.",
        "",
        "| --prefix-cache | prompt | TTFT p50 (ms) | TTFT p99 (ms) | cached prompt tokens (min–max) |",
        "|---|---|---:|---:|---:|",
    ]
    for setting in SETTINGS:
        for kind in ("alone", "shared"):
            runs = ttft[(setting, kind)]
            every = [t * 1000 for run in runs for t in run]
            hits = f"{min(cached[setting])}–{max(cached[setting])}" if kind == "shared" else "-"
            prompt = "question alone" if kind == "alone" else "shared system prompt"
            lines.append(
                f"| {setting} | {prompt} | {spread([median(r) * 1000 for r in runs], 0)} | {p99(every):.0f} | {hits} |"
            )
    lines.append("")
    for setting in SETTINGS:
        pairs = zip(ttft[(setting, "shared")], ttft[(setting, "alone")], strict=True)
        ratios = [median(s) / median(a) for s, a in pairs]
        lines.append(f"- prefix cache {setting}: TTFT p50 shared ÷ question alone {spread(ratios, 2)}×")
    same = sum(a == b for a, b in zip(texts["on"], texts["off"], strict=True))
    lines.append(f"- answers identical with the cache on and off: {same} of {len(texts['on'])} (first repeat)")
    return doc.Section("prefix", "\n".join(lines) + "\n")
