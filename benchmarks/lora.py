"""What LoRA adapters cost the batched engine (`make bench-lora`)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks import doc, load
from benchmarks.launcher import serve
from benchmarks.stats import median, ratios, spread

TARGETS = {"c16": 0.8, "c1": 0.9}  # c=16: four adapters mixed ÷ base; c=1: an adapter ÷ none
ADAPTERS = 4
FLAGS = {"repeats": 3, "tokens": 128, "rank": 16, "c1_streams": 4}
DRY_RUN = {"repeats": 1, "tokens": 8, "rank": 4, "c1_streams": 1}
QUESTIONS = (
    "Explain how a refrigerator works.", "Write a short story about a lighthouse.", "What is photosynthesis?",
    "Give three tips for learning a language.", "Describe the water cycle.", "Why do leaves change colour?",
    "How does a bicycle stay upright?", "Summarise the plot of a heist film.",
)  # fmt: skip
SAMPLED = {"temperature": 0.8, "top_p": 0.95}


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


def timed(
    stub: object, tokens: int, adapters: list[str], concurrency: int, sampled: bool = False, first: int = 0
) -> tuple[int, float]:
    """(completion tokens, seconds) of a chat per adapter ("": none), greedy or ``SAMPLED`` with a seed each;
    chat i asks question ``first + i``."""
    requests = [
        load.request(QUESTIONS[(first + i) % len(QUESTIONS)], tokens, chat=True, ignore_eos=True, adapter=adapter,
                     sampling={**SAMPLED, "seed": 1000 + i} if sampled else {"temperature": 0.0})
        for i, adapter in enumerate(adapters)
    ]  # fmt: skip
    wall, streams = load.streams(stub, requests, concurrency)
    return sum(s.usage.completion_tokens for s in streams), wall


def tokens_per_s(stub: object, tokens: int, adapters: list[str], concurrency: int, sampled: bool = False) -> float:
    done, wall = timed(stub, tokens, adapters, concurrency, sampled)
    return done / wall


def one_at_a_time(stub: object, tokens: int, streams: int) -> tuple[float, float]:
    """Tokens/s of ``streams`` chats one at a time without an adapter and with one, in pairs (the same
    question, one after the other), so the host's drift over the run falls on both arms alike."""
    totals = {"": [0, 0.0], "a0": [0, 0.0]}
    for i in range(streams):
        for adapter in ("", "a0") if i % 2 == 0 else ("a0", ""):  # each arm goes first in half the pairs
            done, wall = timed(stub, tokens, [adapter], 1, first=i)
            totals[adapter][0] += done
            totals[adapter][1] += wall
    return totals[""][0] / totals[""][1], totals["a0"][0] / totals["a0"][1]


def run(args: argparse.Namespace) -> doc.Section:
    mixed = [f"a{i % ADAPTERS}" for i in range(16)]
    arms = {  # name: (adapters, concurrency, sampled), run in turns
        "c16 base": ([""] * 16, 16, False), "c16 four adapters": (mixed, 16, False),
        "c16 sampled base": ([""] * 16, 16, True), "c16 sampled four adapters": (mixed, 16, True),
    }  # fmt: skip
    rates: dict[str, list[float]] = {arm: [] for arm in [*arms, "c1 base", "c1 adapter"]}
    with tempfile.TemporaryDirectory() as scratch:
        flags = make_adapters(args.model, Path(scratch), args.rank)
        for repeat in range(args.repeats):
            with serve(args.dry_run, ["--model", args.model, *flags], ready_timeout=600) as server:
                stub = load.stub(server.target)
                tokens_per_s(stub, 8, ["", "a0"], 2)  # warm both paths
                for arm, (adapters, concurrency, sampled) in arms.items():
                    rates[arm].append(tokens_per_s(stub, args.tokens, adapters, concurrency, sampled))
                base, adapter = one_at_a_time(stub, args.tokens, args.c1_streams)
                rates["c1 base"].append(base)
                rates["c1 adapter"].append(adapter)
            doc.log(f"repeat {repeat}: " + ", ".join(f"{arm} {rates[arm][-1]:.1f} tok/s" for arm in rates))
    c16, c1 = ratios(rates["c16 four adapters"], rates["c16 base"]), ratios(rates["c1 adapter"], rates["c1 base"])
    sampled = ratios(rates["c16 sampled four adapters"], rates["c16 sampled base"])
    met = {"c16": median(c16) >= TARGETS["c16"], "c1": median(c1) >= TARGETS["c1"]}
    return doc.section(
        "lora", "LoRA adapters: what they cost the batched engine (`make bench-lora`)", args.command,
        f"{doc.host()}. The default dtype (`--dtype auto`) over gRPC; {ADAPTERS} PEFT adapters of rank {args.rank} "
        f"over all seven projections (random A and B), loaded with `--lora`; chats of {args.tokens} tokens "
        f"(`ignore_eos`), greedy unless sampled (temperature {SAMPLED['temperature']}, top_p {SAMPLED['top_p']}, a "
        f"seed per chat). Per repeat, one server and, in turns: 16 streams at once on the base model, 16 with the "
        f"adapters mixed (row i: adapter i mod {ADAPTERS}), the same two sampled, then {args.c1_streams} pairs "
        f"of streams one at a time, one without and one with an adapter (the same chat; in turns, each arm first in "
        f"half the pairs). Tokens/s: median (min–max) over {args.repeats} repeats; "
        "ratios inside each repeat.",
        "",
        *doc.table("arm | tokens/s", "lr", [[arm, spread(rates[arm])] for arm in rates]),
        "",
        f"- c=16, four adapters mixed ÷ base: {spread(c16, 2)}× (target ≥ {TARGETS['c16']}×: "
        f"{'met' if met['c16'] else 'MISSED'})",
        f"- c=1, an adapter ÷ none: {spread(c1, 2)}× (target ≥ {TARGETS['c1']}×: "
        f"{'met' if met['c1'] else 'MISSED'})",
        f"- c=16 sampled, four adapters mixed ÷ base: {spread(sampled, 2)}× (no target: #41's are greedy)",
        ok=all(met.values()) or args.dry_run,
    )  # fmt: skip
