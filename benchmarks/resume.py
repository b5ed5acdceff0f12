"""`make bench-resume`: does a cut stream resume exactly, and what does a resume cost?

For each engine (``--engines batched,vllm``; vllm runs from .venv-vllm), two servers on
the default model: one serves 20 requests uncut (greedy, seeded top-p, seeded top-k with
a repetition penalty; chat and raw; some with a stop sequence), 4 at a time; each is then
cut at a random chunk and resumed on the *other*, fresh server with
``GenerateRequest.resume``, 4 at a time. Per engine and sampling kind: how many resumed
streams are byte-identical to the uncut ones (text, token ids, chunk indexes), and the
time to the first chunk of a resumed call ÷ that of its uncut call (the resume reads
prompt + the tokens so far as a prompt), median and p99 over the requests, per repeat.
Replaces the "resume" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.bench import machine
from benchmarks.doc import replace_section
from benchmarks.launcher import ServerProcess
from benchmarks.peers import spread

SECTION = "resume"
REPO = Path(__file__).resolve().parent.parent
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about rain.",
    "Explain photosynthesis briefly.",
    "List three primary colors.",
    "Why is the sky blue?",
    "Give me a tip for learning Python.",
    "Name three rivers in Europe.",
]
KINDS = ("greedy", "seeded top-p", "seeded top-k + penalty")


def requests(tokens: int, count: int = 20, stops: Sequence[str] | None = None) -> list[tuple[str, Any]]:
    """(sampling kind, request): greedy, seeded top-p, seeded top-k with a repetition penalty in
    turn; chat and raw text in turn; every fourth ignores EOS; ``stops[i]`` (else "\n\n" on
    every fourth) as request i's stop sequence; token ids on, for the resume."""
    from tokenwire.v1 import generation_pb2 as pb

    sampling = [
        pb.SamplingParams(temperature=0.0),
        pb.SamplingParams(temperature=0.8, top_p=0.9, seed=1234),
        pb.SamplingParams(temperature=1.0, top_k=40, repetition_penalty=1.3, seed=99),
    ]
    out = []
    for i in range(count):
        stop = stops[i] if stops is not None else ("\n\n" if i % 4 == 1 else "")
        request = pb.GenerateRequest(
            request_id=f"resume-{i}",
            sampling=sampling[i % 3],
            stopping=pb.StoppingCriteria(max_new_tokens=tokens, ignore_eos=i % 4 == 0, stop_sequences=[stop] if stop else []),
            output=pb.OutputOptions(token_ids=True),
        )
        if i % 2:
            request.prompt = QUESTIONS[i % len(QUESTIONS)]
        else:
            request.chat.messages.add(role="user", content=QUESTIONS[i % len(QUESTIONS)])
        out.append((KINDS[i % 3], request))
    return out


def stream(stub: Any, request: Any) -> tuple[float, list[Any]]:
    start = time.perf_counter()
    first = None
    chunks = []
    for chunk in stub.Generate(request, timeout=900):
        if first is None:
            first = time.perf_counter() - start
        chunks.append(chunk)
    assert first is not None
    return first, chunks


def one_repeat(engine: str, model: str, tokens: int, seed: int) -> dict[str, Any]:
    import grpc
    from tokenwire.v1 import generation_pb2 as pb
    from tokenwire.v1 import generation_pb2_grpc as pb_grpc

    python = str(REPO / ".venv-vllm" / "bin" / "python") if engine == "vllm" else None
    args = ["--model", model, "--engine", engine, "--max-active", "4"]
    if engine == "vllm":  # vLLM needs room for one whole context (8,192 tokens) in its cache
        args += ["--enforce-eager", "--kv-cache-tokens", "16384"]
    todo = requests(tokens)
    rng = random.Random(seed)
    with ServerProcess(args, python=python, ready_timeout=900) as first:
        stub = pb_grpc.TextGenerationStub(grpc.insecure_channel(first.target))
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            uncut = list(pool.map(lambda kr: stream(stub, kr[1]), todo))
    resumed_requests = []
    for (_, request), (_, chunks) in zip(todo, uncut, strict=True):
        cut = rng.randrange(1, len(chunks)) if len(chunks) > 1 else 0
        resumed = pb.GenerateRequest()
        resumed.CopyFrom(request)
        resumed.resume.generated_token_ids.extend(t.id for c in chunks[:cut] for t in c.tokens)
        resumed.resume.next_index = cut
        resumed_requests.append((cut, resumed))
    with ServerProcess(args, python=python, ready_timeout=900) as fresh:
        stub = pb_grpc.TextGenerationStub(grpc.insecure_channel(fresh.target))
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            rest = list(pool.map(lambda cr: stream(stub, cr[1]), resumed_requests))
    exact: dict[str, list[bool]] = {kind: [] for kind in KINDS}
    ratios = []
    for (kind, _), (ttft, chunks), (cut, _), (resumed_ttft, after) in zip(todo, uncut, resumed_requests, rest, strict=True):
        same = (
            [c.index for c in after] == [c.index for c in chunks[cut:]]
            and "".join(c.text for c in after) == "".join(c.text for c in chunks[cut:])
            and [t.id for c in after for t in c.tokens] == [t.id for c in chunks[cut:] for t in c.tokens]
        )
        exact[kind].append(same)
        ratios.append(resumed_ttft / ttft)
    return {"exact": exact, "ttft_ratio_p50": statistics.median(ratios), "ttft_ratio_p99": max(ratios), "cuts": [c for c, _ in resumed_requests]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="batched")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--model", default="")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks.md")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    model = args.model
    if not model:
        from tokenwire_server.model import prepare_default_model

        model = str(prepare_default_model())
    results: dict[str, list[dict[str, Any]]] = {}
    for repeat in range(args.repeats):
        for engine in args.engines.split(","):
            result = one_repeat(engine, model, args.max_new_tokens, seed=repeat)
            results.setdefault(engine, []).append(result)
            counts = {kind: f"{sum(v)}/{len(v)}" for kind, v in result["exact"].items()}
            print(f"repeat {repeat} {engine}: exact {counts}, resumed TTFT / uncut TTFT p50 {result['ttft_ratio_p50']:.2f} "
                  f"max {result['ttft_ratio_p99']:.2f}", flush=True)  # fmt: skip
    info = machine()
    command = "python -m benchmarks.resume " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        "## Resuming cut streams (`make bench-resume`)",
        "",
        f"Written by `{command.strip()}` at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; do not edit by hand.",
        f"{info['cpu']}, {info['cores']} cores, torch {info['torch']}. The default model; 20 requests of "
        f"{args.max_new_tokens} tokens, 4 at a time, each cut at a random chunk (a new cut each repeat) and resumed "
        "on a fresh server. Exact: the resumed stream's text, token ids and chunk indexes equal the uncut stream's "
        "from the cut on (all repeats together). TTFT ratio: time to the first chunk of the resumed call ÷ of the "
        "uncut call, median (and largest) over the 20, median (min–max) over the repeats.",
        "",
        "| engine | greedy exact | seeded top-p exact | seeded top-k + penalty exact | resumed ÷ uncut TTFT, median | largest |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for engine, runs in results.items():
        cells = []
        for kind in KINDS:
            values = [v for run in runs for v in run["exact"][kind]]
            cells.append(f"{sum(values)}/{len(values)}")
        p50 = spread([r["ttft_ratio_p50"] for r in runs], 2)
        p99 = spread([r["ttft_ratio_p99"] for r in runs], 2)
        lines.append(f"| {engine} | {' | '.join(cells)} | {p50} | {p99} |")
    print("\n".join(lines))
    if not args.no_write:
        replace_section(args.out, SECTION, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
