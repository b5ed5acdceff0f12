"""Do torch.compile or int8 weights pay on this CPU? Speed and quality (`make bench-levers`).

The issue behind the engine work asks to use them "only where the bench shows they pay,
behind a flag, with the figures either way". This measures the model's own decode step
(transformers forward over a static KV cache, the default model, float32) three ways:

- ``eager``: as the engines run it today;
- ``compile``: ``torch.compile(model.forward)`` (inductor, static shapes);
- ``int8``: ``torch.ao.quantization.quantize_dynamic`` on every ``nn.Linear``, per-channel
  int8 weights, activations quantized per call (fbgemm).

Speed: the median decode step at batch 1 and at batch 16, three repeats alternating the
variants. Quality (int8 only; compile computes the same function): on the 16 chat prompts,
the mean KL divergence per token from the float32 model along its own greedy answer
(48 tokens), and how many of those answers int8 reproduces token for token.
Replaces the "cpu-levers" section.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from typing import Any

from benchmarks import doc
from benchmarks.stats import spread

VARIANTS = ("eager", "compile", "int8")
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
            out = forward(
                input_ids=token,
                position_ids=torch.full((batch, 1), p),
                past_key_values=cache,
                use_cache=True,
                cache_position=torch.tensor([p]),
            )
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - started)
    return times


def quality(model: Any, quantized: Any, tokenizer: Any, prompts: tuple[str, ...], new: int) -> dict[str, float]:
    import torch

    kls, same, prefixes = [], 0, []
    with torch.inference_mode():
        for p in prompts:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            x = torch.tensor([ids])
            a = model.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            b = quantized.generate(x, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            ta, tb = a[0, len(ids) :].tolist(), b[0, len(ids) :].tolist()
            same += ta == tb
            prefixes.append(next((i for i, (u, v) in enumerate(zip(ta, tb, strict=False)) if u != v), len(ta)))
            la = torch.log_softmax(model(a).logits[0, len(ids) - 1 : -1], -1)
            lb = torch.log_softmax(quantized(a).logits[0, len(ids) - 1 : -1], -1)
            kls.append(float((la.exp() * (la - lb)).sum(-1).mean()))
    return {
        "kl": statistics.mean(kls),
        "identical": same,
        "prompts": len(prompts),
        "prefix_median": statistics.median(prefixes),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"from {', '.join(VARIANTS)}")
    parser.add_argument("--quality-tokens", type=int, default=48, help="tokens of each greedy answer int8 is held to")


def run(args: argparse.Namespace) -> doc.Section:
    import torch
    from tokenwire.bench import DEFAULT_PROMPTS
    from tokenwire_server.model import load_model
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    loaded = load_model(args.model, device="cpu", dtype="float32")
    model, tokenizer = loaded.model, loaded.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": DEFAULT_PROMPTS[0]}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
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
                steps.setdefault((name, batch), []).append(statistics.median(times) * 1000)
                print(
                    f"  repeat {r + 1} batch {batch:>2} {name:>7}: {steps[(name, batch)][-1]:7.1f} ms/step",
                    file=sys.stderr,
                    flush=True,
                )
    print("  int8 quality ...", file=sys.stderr, flush=True)
    q = quality(model, int8, tokenizer, tuple(DEFAULT_PROMPTS), args.quality_tokens)

    info = doc.machine()
    lines = [
        "## CPU levers: torch.compile and int8 weights (`make bench-levers`)",
        "",
        doc.written(args.command),
        f"The default model's decode step (transformers forward over a static KV cache, {info['torch threads']} torch threads,",
        f"{info['cpu']}, {info['cores']} cores), median over {args.steps - 5} steps; each cell median (min–max) over",
        f"{args.repeats} repeats that alternate the variants.",
        "",
        "| variant | batch | ms per step | tokens/s | vs eager (median of per-repeat ratios) |",
        "|---|---:|---:|---:|---:|",
    ]
    for batch in batches:
        for name in variants:
            ms = steps[(name, batch)]
            ratio = [e / m for e, m in zip(steps[("eager", batch)], ms, strict=True)]
            lines.append(
                f"| {name} | {batch} | {spread(ms)} | {spread([batch * 1000 / m for m in ms])} | {statistics.median(ratio):.2f}× |"
            )
    lines += [
        "",
        *[f"- compile time before the first step: {', '.join(f'batch {b}: {s:.0f} s' for b, s in compile_s.items())}."]
        * bool(compile_s),
        f"- int8 quality: mean KL(float32 ‖ int8) {q['kl']:.3f} nats per token along float32's greedy answers;"
        f" {q['identical']} of {q['prompts']} answers identical over {args.quality_tokens} tokens; median first "
        f"differing token: {q['prefix_median']:g}.",
        "",
    ]
    return doc.Section("cpu-levers", "\n".join(lines))
