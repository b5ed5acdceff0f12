"""What scoring a prompt costs beside reading it (`make bench-score`)."""

from __future__ import annotations

import argparse
from typing import Any

from tokenwire.v1 import generation_pb2 as pb

from benchmarks import doc, load
from benchmarks.bench import LONG_PROMPT_FILLER
from benchmarks.launcher import serve
from benchmarks.stats import median, p99, spread

TARGET = 1.2  # #40: scoring ÷ prefill, median
FLAGS = {"repeats": 3, "pairs": 8, "prompt_tokens": 1000}
DRY_RUN = {"repeats": 1, "pairs": 2, "prompt_tokens": 40}


def requests(ids: list[int]) -> tuple[Any, Any]:
    """(the scoring call, the prefill) of one prompt."""
    scoring = load.request("", 0, token_ids={"ids": ids}, output={"prompt_logprobs": True, "prompt_top_logprobs": 1})
    return scoring, load.request("", 1, ignore_eos=True, token_ids={"ids": ids}, sampling={"temperature": 0.0})


def run(args: argparse.Namespace) -> doc.Section:
    timed: list[list[tuple[float, float]]] = []  # per repeat: each pair's (scoring, prefill) ms
    scored_tokens: list[int] = []
    for repeat in range(args.repeats):
        with serve(args.dry_run, ["--model", args.model, "--prefix-cache", "off"], ready_timeout=600) as server:
            stub = load.stub(server.target)
            filler = list(stub.Tokenize(pb.TokenizeRequest(text=LONG_PROMPT_FILLER * 2)).ids)
            for warm in requests(filler[: args.prompt_tokens]):
                load.stream(stub, warm, timeout=600)
            timed.append([])
            for pair in range(args.pairs):
                calls = requests(filler[7 * (pair + 1) : 7 * (pair + 1) + args.prompt_tokens])
                first = pair % 2  # which goes first, in turns
                got = {i: load.stream(stub, calls[i], timeout=600) for i in (first, 1 - first)}
                if not args.dry_run:  # the fake answers with no scores
                    scored_tokens.append(len(got[0].chunks[0].prompt_tokens))
                timed[-1].append((got[0].seconds * 1000, got[1].seconds * 1000))
        mine = [a / b for a, b in timed[-1]]
        doc.log(f"repeat {repeat}: scoring ÷ prefill p50 {median(mine):.3f} (min {min(mine):.3f}, max {max(mine):.3f})")
    per_repeat = [median([a / b for a, b in pairs]) for pairs in timed]
    every = [a / b for pairs in timed for a, b in pairs]
    met = median(per_repeat) <= TARGET
    scored = f"{min(scored_tokens)}–{max(scored_tokens)}" if scored_tokens else "-"
    rows = []
    for i, kind in ((1, "prefill (max_new_tokens 1)"), (0, "scoring (max_new_tokens 0)")):
        medians = [median(pair[i] for pair in pairs) for pairs in timed]
        rows.append([kind, spread(medians, 0), f"{p99([pair[i] for pairs in timed for pair in pairs]):.0f}"])
    return doc.section(
        "score", "Scoring a prompt beside reading it (`make bench-score`)", args.command,
        f"The default model over gRPC on the batched engine, {doc.host()}, `--prefix-cache off`. {args.pairs} pairs "
        f"per repeat, each its own {args.prompt_tokens}-token prompt (token ids), in turns: a scoring call "
        "(`max_new_tokens` 0, `prompt_logprobs`, `prompt_top_logprobs` 1: what `client.score` sends) and the same "
        "prompt read for one token (the prefill). Wall time at the client, ms; the ratio is taken inside each pair. "
        f"Cells: median (min–max) over {args.repeats} repeats of each repeat's median; p99 over every pair.",
        "",
        *doc.table("call | p50 | p99", "lrr", rows),
        "",
        f"- scoring ÷ prefill, per repeat's median: {spread(per_repeat, 3)}×; over every pair: p50 "
        f"{median(every):.3f}×, p99 {p99(every):.3f}×",
        f"- prompt tokens scored per call (chunk 0's prompt_tokens): {scored}",
        f"- target (#40: ≤ {TARGET}× the prefill, median): {'met' if met else 'MISSED'}",
        ok=met or args.dry_run,  # a missed target: exit status 1
    )  # fmt: skip
