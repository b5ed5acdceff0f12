"""What scoring a prompt costs beside reading it (`make bench-score`).

A 1,000-token prompt over gRPC on the batched server (`--prefix-cache off`, and each pair its
own prompt: nothing is found in a cache), in interleaved pairs, which goes first alternating:
a scoring call (`max_new_tokens` 0, `prompt_logprobs`, `prompt_top_logprobs` 1: what
`client.score` sends) and the same prompt read for one token (`max_new_tokens` 1: the prefill).
The ratio is taken inside each pair; #40's target is a median of at most 1.2x.
Replaces the "score" section.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from tokenwire.v1 import generation_pb2 as pb

from benchmarks import doc, load
from benchmarks.launcher import serve
from benchmarks.stats import median, p99, spread

TARGET = 1.2
FLAGS = {"repeats": 3, "pairs": 8, "prompt_tokens": 1000}
DRY_RUN = {"repeats": 1, "pairs": 2, "prompt_tokens": 40}


def requests(ids: list[int]) -> tuple[Any, Any]:
    """(the scoring call, the prefill) of one prompt."""
    scoring = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids),
        stopping=pb.StoppingCriteria(max_new_tokens=0),
        output=pb.OutputOptions(prompt_logprobs=True, prompt_top_logprobs=1),
    )
    prefill = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_new_tokens=1, ignore_eos=True),
    )
    return scoring, prefill


def run(args: argparse.Namespace) -> doc.Section:
    from benchmarks.bench import LONG_PROMPT_FILLER

    per_repeat: list[float] = []  # each repeat's median ratio
    medians: dict[str, list[float]] = {"prefill": [], "scoring": []}  # each repeat's median time, ms
    score_ms: list[float] = []
    prefill_ms: list[float] = []
    ratios: list[float] = []
    scored_tokens: list[int] = []
    for repeat in range(args.repeats):
        with serve(args.dry_run, ["--model", args.model, "--prefix-cache", "off"], ready_timeout=600) as server:
            stub = load.stub(server.target)
            filler = list(stub.Tokenize(pb.TokenizeRequest(text=LONG_PROMPT_FILLER * 2)).ids)
            warm_score, warm_prefill = requests(filler[: args.prompt_tokens])
            load.stream(stub, warm_score, timeout=600)
            load.stream(stub, warm_prefill, timeout=600)
            mine: list[float] = []
            times: dict[str, list[float]] = {"prefill": [], "scoring": []}
            for pair in range(args.pairs):
                ids = filler[7 * (pair + 1) : 7 * (pair + 1) + args.prompt_tokens]
                scoring, prefill = requests(ids)
                order = (scoring, prefill) if pair % 2 == 0 else (prefill, scoring)
                timed = {id(r): load.stream(stub, r, timeout=600) for r in order}
                s, p = timed[id(scoring)], timed[id(prefill)]
                if not args.dry_run:  # the fake answers with no scores
                    scored_tokens.append(len(s.chunks[0].prompt_tokens))
                times["scoring"].append(s.seconds * 1000)
                times["prefill"].append(p.seconds * 1000)
                mine.append(s.seconds / p.seconds)
            ratios += mine
            per_repeat.append(median(mine))
            for kind, values in times.items():
                medians[kind].append(median(values))
            score_ms += times["scoring"]
            prefill_ms += times["prefill"]
            doc.log(
                f"repeat {repeat}: scoring ÷ prefill p50 {median(mine):.3f} (min {min(mine):.3f}, max {max(mine):.3f})"
            )
    met = median(per_repeat) <= TARGET
    scored = f"{min(scored_tokens)}–{max(scored_tokens)}" if scored_tokens else "-"
    section = doc.section(
        "score", "Scoring a prompt beside reading it (`make bench-score`)", args.command,
        f"The default model over gRPC on the batched engine, {doc.host()}, `--prefix-cache off`. {args.pairs} pairs "
        f"per repeat, each its own {args.prompt_tokens}-token prompt (token ids), in turns: a scoring call "
        "(`max_new_tokens` 0, `prompt_logprobs`, `prompt_top_logprobs` 1: what `client.score` sends) and the same "
        "prompt read for one token (the prefill). Wall time at the client, ms; the ratio is taken inside each pair. "
        f"Cells: median (min–max) over {args.repeats} repeats of each repeat's median; p99 over every pair.",
        "",
        *doc.table("call | p50 | p99", "lrr", [
            ["prefill (max_new_tokens 1)", spread(medians["prefill"], 0), f"{p99(prefill_ms):.0f}"],
            ["scoring (max_new_tokens 0)", spread(medians["scoring"], 0), f"{p99(score_ms):.0f}"],
        ]),
        "",
        f"- scoring ÷ prefill, per repeat's median: {spread(per_repeat, 3)}×; over every pair: p50 "
        f"{median(ratios):.3f}×, p99 {p99(ratios):.3f}×",
        f"- prompt tokens scored per call (chunk 0's prompt_tokens): {scored}",
        f"- target (#40: ≤ {TARGET}× the prefill, median): {'met' if met else 'MISSED'}",
    )  # fmt: skip
    return dataclasses.replace(section, ok=met or args.dry_run)  # a missed target: exit status 1
