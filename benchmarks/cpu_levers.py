"""Do torch.compile or int8 weights pay on this CPU? Speed and quality (`make bench-levers`)."""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any

from benchmarks import doc, quality
from benchmarks.load import chat_ids
from benchmarks.stats import median, ratios, spread

VARIANTS = ("eager", "compile", "int8")
FLAGS = {"repeats": 3, "steps": 40, "batches": "1,16", "variants": (",".join(VARIANTS), f"from {', '.join(VARIANTS)}"),
         "quality_tokens": (48, "tokens of each greedy answer int8 is held to")}  # fmt: skip
DRY_RUN = {"repeats": 1, "steps": 7, "batches": "1,2", "variants": "eager,int8", "quality_tokens": 4}


def step_times(forward: Any, model: Any, prompt: list[int], batch: int, steps: int) -> list[float]:
    import torch
    from transformers import StaticCache

    ids = torch.tensor([prompt] * batch)
    length = ids.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=length + steps + 8)
    times = []
    with torch.inference_mode():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(length))
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        for i in range(steps):
            p = length + i
            started = time.perf_counter()
            out = forward(input_ids=token, position_ids=torch.full((batch, 1), p), past_key_values=cache,
                          use_cache=True, cache_position=torch.tensor([p]))  # fmt: skip
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - started)
    return times


def run(args: argparse.Namespace) -> doc.Section:
    import torch
    from tokenwire.bench import DEFAULT_PROMPTS
    from tokenwire_server.model import load_model
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    loaded = load_model(args.model, device="cpu", dtype="float32")
    model, tokenizer = loaded.model, loaded.tokenizer
    prompt = chat_ids(tokenizer, DEFAULT_PROMPTS[0])
    int8 = quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)
    every = {"eager": (model.forward, model), "compile": (None, model), "int8": (int8.forward, int8)}
    variants = {name: every[name] for name in args.variants.split(",")}
    compiled: dict[int, Any] = {}
    compile_s: dict[int, float] = {}
    batches = [int(b) for b in args.batches.split(",")]
    steps: dict[tuple[str, int], list[float]] = {}
    for r in range(args.repeats):
        for batch in batches:
            for name, (forward, owner) in variants.items():
                if name == "compile":
                    if batch not in compiled:
                        compiled[batch] = torch.compile(model.forward, dynamic=False)
                        began = time.perf_counter()
                        step_times(compiled[batch], model, prompt, batch, 3)  # compiles
                        compile_s[batch] = time.perf_counter() - began
                    forward = compiled[batch]
                times = step_times(forward, owner, prompt, batch, args.steps)[5:]
                steps.setdefault((name, batch), []).append(median(times) * 1000)
                doc.log(f"  repeat {r + 1} batch {batch:>2} {name:>7}: {steps[(name, batch)][-1]:7.1f} ms/step")
    doc.log("  int8 quality ...")
    new, count = args.quality_tokens, len(DEFAULT_PROMPTS)
    q = quality.measure(model, int8, quality.reference_answers(model, tokenizer, count, new, count, new))
    rows = []
    for batch in batches:
        for name in variants:
            ms = steps[(name, batch)]
            ratio = median(ratios(steps[("eager", batch)], ms))
            rows.append([name, batch, spread(ms), spread([batch * 1000 / m for m in ms]), f"{ratio:.2f}×"])
    info = doc.machine()
    compiled = ", ".join(f"batch {b}: {s:.0f} s" for b, s in compile_s.items())
    return doc.section(
        "cpu-levers", "CPU levers: torch.compile and int8 weights (`make bench-levers`)", args.command,
        f"The default model's decode step (transformers forward over a static KV cache, {info['torch threads']} torch "
        f"threads, {info['cpu']}, {info['cores']} cores), median over {args.steps - 5} steps; each cell median "
        f"(min–max) over {args.repeats} repeats that alternate the variants.",
        "",
        *doc.table("variant | batch | ms per step | tokens/s | vs eager (median of per-repeat ratios)", "lrrrr", rows),
        "",
        *[f"- compile time before the first step: {compiled}."] * bool(compile_s),
        f"- int8 quality: mean KL(float32 ‖ int8) {q['kl']:.3f} nats per token along float32's greedy answers;"
        f" {q['identical']} of {q['of']} answers identical over {new} tokens; median first "
        f"differing token: {q['parted_median']:g}.",
    )  # fmt: skip
