"""How far each precision mode moves the default model's answers (`make bench-quality`).

For each mode against the full-precision (float32) model on this device:

- **KL**: mean KL(float32 ‖ mode) per token, in nats, teacher-forced: 64 prompts, each with
  the float32 model's own greedy continuation of 64 tokens, read by both models in one pass;
- **greedy**: of the 16 chat prompts of ``tokenwire bench``, how many greedy answers the
  mode gives identical to float32's for their first 32 tokens (and the median first token
  where they part).

The bar (issue #22): KL ≤ 0.02 nats/token and ≥ 14 of 16 identical. Modes: ``int8``
(``--quantization int8``, the server's own layers) and ``bfloat16`` (``--dtype bfloat16``;
it is also the yardstick: what any 16-bit serving moves). The result replaces the
"quality" section and ``service/tokenwire_server/quality.json``,
which the server reads at start-up: a mode that misses the bar on this device kind is
refused unless ``--allow-unmet-quality-bar`` is given.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import doc

QUALITY_FILE = Path(__file__).resolve().parent.parent / "service" / "tokenwire_server" / "quality.json"


def kl_prompts(count: int) -> list[str]:
    """``count`` varied prompts: the bench's 16 and short task variations of them."""
    from tokenwire.bench import DEFAULT_PROMPTS

    asks = ("", " Answer in one sentence.", " Explain it to a child.", " Give two examples.")
    return [
        p + asks[i // len(DEFAULT_PROMPTS) % len(asks)]
        for i, p in enumerate(DEFAULT_PROMPTS * (count // len(DEFAULT_PROMPTS) + 1))
    ][:count]


def chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    ids: list[int] = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return ids


def reference_answers(
    reference: Any, tokenizer: Any, kl_count: int, kl_tokens: int, greedy_count: int, greedy_tokens: int
) -> dict[str, Any]:
    """float32's own answers, generated once for every mode: ``kl``: (prompt length, prompt and
    its greedy continuation) per KL prompt; ``greedy``: (prompt ids, greedy answer) per prompt."""
    import torch
    from tokenwire.bench import DEFAULT_PROMPTS

    def greedy(ids: list[int], new: int) -> torch.Tensor:
        return reference.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False)

    with torch.inference_mode():
        kl = [(len(ids), greedy(ids, kl_tokens)) for ids in (chat_ids(tokenizer, p) for p in kl_prompts(kl_count))]
        answers = [
            (ids, greedy(ids, greedy_tokens)[0, len(ids) :].tolist())
            for ids in (chat_ids(tokenizer, p) for p in DEFAULT_PROMPTS[:greedy_count])
        ]
    return {"kl": kl, "greedy": answers, "greedy_tokens": greedy_tokens}


def measure(reference: Any, candidate: Any, answers: dict[str, Any]) -> dict[str, Any]:
    import torch

    kls: list[float] = []
    identical, parted = 0, []
    new = answers["greedy_tokens"]
    with torch.inference_mode():
        for prompt_length, full in answers["kl"]:
            want = torch.log_softmax(reference(full).logits[0, prompt_length - 1 : -1].float(), -1)
            got = torch.log_softmax(candidate(full).logits[0, prompt_length - 1 : -1].float(), -1)
            kls.append(float((want.exp() * (want - got)).sum(-1).mean()))
        for ids, a in answers["greedy"]:
            b = candidate.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False)[
                0, len(ids) :
            ].tolist()
            identical += a == b
            parted.append(next((i for i, (u, v) in enumerate(zip(a, b, strict=True)) if u != v), len(a)))
    return {
        "kl": statistics.mean(kls),
        "kl_max": max(kls),
        "identical": identical,
        "of": len(answers["greedy"]),
        "parted_median": statistics.median(parted),
    }


BAR = {"kl": 0.02, "identical": 14, "of": 16, "kl_prompts": 64, "kl_tokens": 64, "greedy_tokens": 32}


def meets(result: dict[str, Any]) -> bool:
    return bool(result["kl"] <= BAR["kl"] and result["identical"] >= BAR["identical"])


DRY_RUN = {"quality_file": "", "kl_prompts": 2, "kl_tokens": 4, "greedy_prompts": 2, "greedy_tokens": 4}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--modes", default="int8,bfloat16")
    parser.add_argument("--kl-prompts", type=int, default=BAR["kl_prompts"])
    parser.add_argument("--kl-tokens", type=int, default=BAR["kl_tokens"])
    parser.add_argument("--greedy-prompts", type=int, default=BAR["of"])
    parser.add_argument("--greedy-tokens", type=int, default=BAR["greedy_tokens"])
    parser.add_argument(
        "--quality-file",
        default=str(QUALITY_FILE),
        help="where the server's start-up gate reads the result ('' to skip)",
    )


def run(args: argparse.Namespace) -> doc.Section:
    import torch
    from tokenwire_server.model import load_model
    from tokenwire_server.quantize import quantize_model

    loaded = load_model(args.model, device="cpu", dtype="float32")
    reference, tokenizer = loaded.model, loaded.tokenizer
    device = "cpu"
    results: dict[str, dict[str, Any]] = {}
    answers = reference_answers(
        reference, tokenizer, args.kl_prompts, args.kl_tokens, args.greedy_prompts, args.greedy_tokens
    )
    for mode in [m for m in args.modes.split(",") if m]:
        began = time.perf_counter()
        candidate = copy.deepcopy(reference)
        if mode == "bfloat16":
            candidate = candidate.to(torch.bfloat16)
        else:
            quantize_model(candidate, mode, torch.device(device))
        results[mode] = measure(reference, candidate, answers)
        results[mode]["meets_bar"] = meets(results[mode])
        print(f"  {mode}: {results[mode]} ({time.perf_counter() - began:.0f} s)", file=sys.stderr, flush=True)
        del candidate

    info = doc.machine()
    lines = [
        "## Quality of each precision mode on the default model (`make bench-quality`)",
        "",
        f"{doc.written(args.command)} Host: {info['cpu']} ({info['instruction sets']}), torch {info['torch']}.",
        f"Against float32 on this CPU. KL: mean KL(float32 ‖ mode) per token, nats, teacher-forced along float32's "
        f"greedy continuations ({args.kl_prompts} prompts × {args.kl_tokens} tokens). Greedy: answers identical to "
        f"float32's for their first {args.greedy_tokens} tokens, of the {args.greedy_prompts} chat prompts of "
        f"`tokenwire bench`. The bar (#22): KL ≤ {BAR['kl']} and ≥ {BAR['identical']}/{BAR['of']}.",
        "",
        "| mode | KL mean | KL worst prompt | greedy identical | median token where they part | meets the bar |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for mode, r in results.items():
        lines.append(
            f"| {mode} | {r['kl']:.4f} | {r['kl_max']:.4f} | {r['identical']}/{r['of']} | {r['parted_median']:g} | {'yes' if r['meets_bar'] else 'NO'} |"
        )
    if args.quality_file:
        path = Path(args.quality_file)
        table = json.loads(path.read_text()) if path.is_file() else {}
        table["bar"] = BAR
        for mode, r in results.items():
            table.setdefault("modes", {}).setdefault(mode, {})[device] = {
                **r,
                "host": info["cpu"],
                "measured": doc.now(),
            }
        path.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    return doc.Section("quality", "\n".join(lines) + "\n")
