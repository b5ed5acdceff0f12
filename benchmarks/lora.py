"""What LoRA adapters cost the batched engine (`make bench-lora`).

One server per repeat with four rank-``rank`` PEFT adapters over every projection of the model
(made here with peft, random A and B); in turns, over gRPC: c=16 greedy on the base model and
with the four adapters mixed (row i: adapter i mod 4), the same two sampled, and c=1 without and
with an adapter. #41's targets, greedy: mixed ≥ ``TARGETS["c16"]``× the base at c=16, an adapter
≥ ``TARGETS["c1"]``× none at c=1; the sampled ratio is reported beside them.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

from benchmarks import doc, load
from benchmarks.launcher import serve
from benchmarks.stats import median, spread

TARGETS = {"c16": 0.8, "c1": 0.9}
ADAPTERS = 4
FLAGS = {"repeats": 3, "tokens": 128, "rank": 16, "c1_streams": 3}
DRY_RUN = {"repeats": 1, "tokens": 8, "rank": 4, "c1_streams": 1}
QUESTIONS = (
    "Explain how a refrigerator works.", "Write a short story about a lighthouse.", "What is photosynthesis?",
    "Give three tips for learning a language.", "Describe the water cycle.", "Why do leaves change colour?",
    "How does a bicycle stay upright?", "Summarise the plot of a heist film.",
)  # fmt: skip


def make_adapters(model: str, folder: Path, rank: int) -> list[str]:
    """``--lora`` flags for ``ADAPTERS`` PEFT adapters over ``model`` (every projection, random A and B)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from tokenwire_server.model import resolve_model_path
    from transformers import AutoModelForCausalLM

    base, _, _ = resolve_model_path(model)
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    flags = []
    for index in range(ADAPTERS):
        torch.manual_seed(index)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules, init_lora_weights=False)
        get_peft_model(AutoModelForCausalLM.from_pretrained(base), config).save_pretrained(folder / f"a{index}")
        flags += ["--lora", f"a{index}={folder / f'a{index}'}"]
    return flags


SAMPLED = {"temperature": 0.8, "top_p": 0.95}


def tokens_per_s(stub: object, tokens: int, adapters: list[str], concurrency: int, sampled: bool = False) -> float:
    """Completion tokens per second of ``len(adapters)`` chats (each naming its adapter; "": none), greedy or
    ``SAMPLED`` with a seed per chat."""
    requests = [
        load.request(QUESTIONS[i % len(QUESTIONS)], tokens, chat=True, ignore_eos=True, adapter=adapter,
                     sampling={**SAMPLED, "seed": 1000 + i} if sampled else {"temperature": 0.0})
        for i, adapter in enumerate(adapters)
    ]  # fmt: skip
    wall, streams = load.streams(stub, requests, concurrency)
    return sum(s.usage.completion_tokens for s in streams) / wall


def run(args: argparse.Namespace) -> doc.Section:
    arms = ("c16 base", "c16 four adapters", "c16 sampled base", "c16 sampled four adapters", "c1 base", "c1 adapter")
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as scratch:
        flags = make_adapters(args.model, Path(scratch), args.rank)
        for repeat in range(args.repeats):
            with serve(args.dry_run, ["--model", args.model, *flags], ready_timeout=600) as server:
                stub = load.stub(server.target)
                tokens_per_s(stub, 8, ["", "a0"], 2)  # warm both paths
                mixed = [f"a{i % ADAPTERS}" for i in range(16)]
                rates["c16 base"].append(tokens_per_s(stub, args.tokens, [""] * 16, 16))
                rates["c16 four adapters"].append(tokens_per_s(stub, args.tokens, mixed, 16))
                rates["c16 sampled base"].append(tokens_per_s(stub, args.tokens, [""] * 16, 16, sampled=True))
                rates["c16 sampled four adapters"].append(tokens_per_s(stub, args.tokens, mixed, 16, sampled=True))
                rates["c1 base"].append(tokens_per_s(stub, args.tokens, [""] * args.c1_streams, 1))
                rates["c1 adapter"].append(tokens_per_s(stub, args.tokens, ["a0"] * args.c1_streams, 1))
            doc.log(f"repeat {repeat}: " + ", ".join(f"{arm} {rates[arm][-1]:.1f} tok/s" for arm in arms))
    ratios = {
        "c16": [a / b for a, b in zip(rates["c16 four adapters"], rates["c16 base"], strict=True)],
        "c1": [a / b for a, b in zip(rates["c1 adapter"], rates["c1 base"], strict=True)],
    }
    met = {key: median(values) >= TARGETS[key] for key, values in ratios.items()}
    sampled = [a / b for a, b in zip(rates["c16 sampled four adapters"], rates["c16 sampled base"], strict=True)]
    section = doc.section(
        "lora", "LoRA adapters: what they cost the batched engine (`make bench-lora`)", args.command,
        f"{doc.host()}. The default dtype (`--dtype auto`) over gRPC; {ADAPTERS} PEFT adapters of rank {args.rank} "
        f"over all seven projections (random A and B), loaded with `--lora`; chats of {args.tokens} tokens "
        f"(`ignore_eos`), greedy unless sampled (temperature {SAMPLED['temperature']}, top_p {SAMPLED['top_p']}, a "
        f"seed per chat). Per repeat, one server and, in turns: 16 streams at once on the base model, 16 with the "
        f"adapters mixed (row i: adapter i mod {ADAPTERS}), the same two sampled, then {args.c1_streams} streams "
        f"one at a time without and with an adapter. Tokens/s: median (min–max) over {args.repeats} repeats; "
        "ratios inside each repeat.",
        "",
        *doc.table("arm | tokens/s", "lr", [[arm, spread(rates[arm])] for arm in arms]),
        "",
        f"- c=16, four adapters mixed ÷ base: {spread(ratios['c16'], 2)}× (target ≥ {TARGETS['c16']}×: "
        f"{'met' if met['c16'] else 'MISSED'})",
        f"- c=1, an adapter ÷ none: {spread(ratios['c1'], 2)}× (target ≥ {TARGETS['c1']}×: "
        f"{'met' if met['c1'] else 'MISSED'})",
        f"- c=16 sampled, four adapters mixed ÷ base: {spread(sampled, 2)}× (no target: #41's are greedy)",
    )  # fmt: skip
    return dataclasses.replace(section, ok=all(met.values()) or args.dry_run)
