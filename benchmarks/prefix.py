"""`make bench-prefix`: what the prefix cache saves when requests share a long system prompt.

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
per-repeat medians, the ratio shared ÷ alone, and replaces the "prefix" section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from benchmarks.bench import machine
from benchmarks.doc import replace_section
from benchmarks.launcher import ServerProcess
from benchmarks.peers import spread

SECTION = "prefix"
SETTINGS = ("on", "off")
RULES = " ".join(f"Rule {i}: answer politely, briefly and only about topic number {i}." for i in range(60))


def question(i: int) -> str:
    return f"Question {i}: what is {i} plus {2 * i}, and which colour is the sky at noon?"


def ask(stub: object, system: str | None, text: str, tokens: int) -> tuple[float, int, int, str]:
    """(seconds to the first chunk, prompt tokens, cached prompt tokens, answer)."""
    from tokenwire.v1 import generation_pb2 as pb

    messages = ([pb.ChatMessage(role="system", content=system)] if system else []) + [pb.ChatMessage(role="user", content=text)]
    request = pb.GenerateRequest(chat=pb.Chat(messages=messages), stopping=pb.StoppingCriteria(max_new_tokens=tokens))
    start = time.perf_counter()
    first = None
    chunks = []
    for chunk in stub.Generate(request, timeout=600):  # type: ignore[attr-defined]
        if first is None:
            first = time.perf_counter() - start
        chunks.append(chunk)
    usage = chunks[-1].usage
    assert first is not None
    return first, usage.prompt_tokens, usage.cached_prompt_tokens, "".join(c.text for c in chunks)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    import grpc
    from tokenwire.v1 import generation_pb2_grpc as pb_grpc

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    args = parser.parse_args(argv)

    ttft: dict[tuple[str, str], list[list[float]]] = {}  # (setting, kind) -> per repeat, every request's TTFT
    cached: dict[str, list[int]] = {setting: [] for setting in SETTINGS}
    prompt_tokens: list[int] = []
    texts: dict[str, list[str]] = {setting: [] for setting in SETTINGS}
    for repeat in range(args.repeats):
        for setting in SETTINGS:
            with ServerProcess(["--model", args.model, "--prefix-cache", setting]) as server, grpc.insecure_channel(server.target) as channel:
                stub = pb_grpc.TextGenerationStub(channel)
                ask(stub, None, "Hello!", args.tokens)  # warm
                alone = [ask(stub, None, question(i), args.tokens)[0] for i in range(args.requests)]
                ask(stub, RULES, question(999), args.tokens)  # the first: fills the cache
                shared = [ask(stub, RULES, question(i), args.tokens) for i in range(args.requests)]
                ttft.setdefault((setting, "alone"), []).append(alone)
                ttft.setdefault((setting, "shared"), []).append([s[0] for s in shared])
                cached[setting] += [s[2] for s in shared]
                prompt_tokens += [s[1] for s in shared]
                if repeat == 0:
                    texts[setting] = [s[3] for s in shared]
                print(
                    f"repeat {repeat} prefix-cache {setting}: TTFT p50 alone {statistics.median(alone) * 1000:.0f} ms, "
                    f"shared {statistics.median(s[0] for s in shared) * 1000:.0f} ms, cached min {min(s[2] for s in shared)}",
                    flush=True,
                )

    info = machine()
    command = "python -m benchmarks.prefix " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        "## Prefix caching: a shared 1,000-token system prompt (`make bench-prefix`)",
        "",
        f"Written by `{command.strip()}` at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; do not edit by hand.",
        f"The default model over gRPC, {info['cpu']}, {info['cores']} cores, torch {info['torch']}. {args.requests} chats "
        f"one after another, {args.tokens} new tokens each; the shared ones carry a {min(prompt_tokens)}–{max(prompt_tokens)}-token "
        f"prompt (system prompt + question), after one that filled the cache. Time to first token at the client: "
        f"median (min–max) over {args.repeats} repeats of each repeat's median, and the p99 over every request.",
        "",
        "| --prefix-cache | prompt | TTFT p50 (ms) | TTFT p99 (ms) | cached prompt tokens (min–max) |",
        "|---|---|---:|---:|---:|",
    ]
    for setting in SETTINGS:
        for kind in ("alone", "shared"):
            runs = ttft[(setting, kind)]
            medians = [statistics.median(run) * 1000 for run in runs]
            every = [t * 1000 for run in runs for t in run]
            hits = f"{min(cached[setting])}–{max(cached[setting])}" if kind == "shared" else "-"
            lines.append(f"| {setting} | {'question alone' if kind == 'alone' else 'shared system prompt'} | {spread(medians, 0)} | {p99(every):.0f} | {hits} |")
    lines.append("")
    for setting in SETTINGS:
        ratios = [
            statistics.median(s) / statistics.median(a)
            for s, a in zip(ttft[(setting, "shared")], ttft[(setting, "alone")], strict=True)
        ]
        lines.append(f"- prefix cache {setting}: TTFT p50 shared ÷ question alone {spread(ratios, 2)}×")
    same = sum(a == b for a, b in zip(texts["on"], texts["off"], strict=True))
    lines.append(f"- answers identical with the cache on and off: {same} of {len(texts['on'])} (first repeat)")
    text = "\n".join(lines) + "\n"
    print(text)
    replace_section(args.out, SECTION, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
