"""How far each precision mode moves the default model's answers (`make bench-quality`)."""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks import doc
from benchmarks.load import chat_ids

QUALITY_FILE = Path(__file__).resolve().parent.parent / "service" / "tokenwire_server" / "quality.json"


def kl_prompts(count: int) -> list[str]:
    """``count`` varied prompts: the bench's 16 and short task variations of them."""
    from tokenwire.bench import DEFAULT_PROMPTS

    asks = ("", " Answer in one sentence.", " Explain it to a child.", " Give two examples.")
    every = DEFAULT_PROMPTS * (count // len(DEFAULT_PROMPTS) + 1)
    return [p + asks[i // len(DEFAULT_PROMPTS) % len(asks)] for i, p in enumerate(every)][:count]


def greedy(model: Any, ids: list[int], new: int) -> Any:
    """``ids`` and exactly ``new`` greedy tokens after them, as a (1, length) tensor."""
    import torch

    return model.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False)


def reference_answers(
    reference: Any, tokenizer: Any, kl_count: int, kl_tokens: int, greedy_count: int, greedy_tokens: int
) -> dict[str, Any]:
    """float32's own answers, generated once for every mode: ``kl``: (prompt length, prompt and
    its greedy continuation) per KL prompt; ``greedy``: (prompt ids, greedy answer) per prompt."""
    import torch
    from tokenwire.bench import DEFAULT_PROMPTS

    with torch.inference_mode():
        kl = [
            (len(ids), greedy(reference, ids, kl_tokens))
            for ids in (chat_ids(tokenizer, p) for p in kl_prompts(kl_count))
        ]
        answers = [(ids, greedy(reference, ids, greedy_tokens)[0, len(ids) :].tolist())
                   for ids in (chat_ids(tokenizer, p) for p in DEFAULT_PROMPTS[:greedy_count])]  # fmt: skip
    return {"kl": kl, "greedy": answers, "greedy_tokens": greedy_tokens}


def bf16_weights(model: Any, rounding: tuple[bool, bool] | None = None) -> Any:
    """``model`` (float32, changed in place) computing as the native pass does with bf16 weights on a CPU: every
    weight rounded to bf16; ``rounding``: whether each linear layer's (input, output) is rounded to bf16 too, as
    its GEMM does (None: as on this CPU, ``engine.native.bf16_rounding``); the rest in float32.
    tests/test_native_forward.py holds the native pass to it."""
    import torch
    from tokenwire_server.engine.native import bf16_rounding

    rounds_input, rounds_output = bf16_rounding() if rounding is None else rounding
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.to(torch.bfloat16).float())
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if rounds_input:
            module.register_forward_pre_hook(lambda _, args: (args[0].to(torch.bfloat16).float(), *args[1:]))
        if rounds_output:
            module.register_forward_hook(lambda _, args, out: out.to(torch.bfloat16).float())
    return model


def measure(reference: Any, candidate: Any, answers: dict[str, Any]) -> dict[str, Any]:
    """KL(reference ‖ candidate) per token along the reference's answers; greedy answers identical."""
    import torch

    kls: list[float] = []
    identical, parted = 0, []
    with torch.inference_mode():
        for prompt_length, full in answers["kl"]:
            want = torch.log_softmax(reference(full).logits[0, prompt_length - 1 : -1].float(), -1)
            got = torch.log_softmax(candidate(full).logits[0, prompt_length - 1 : -1].float(), -1)
            kls.append(float((want.exp() * (want - got)).sum(-1).mean()))
        for ids, a in answers["greedy"]:
            b = greedy(candidate, ids, answers["greedy_tokens"])[0, len(ids) :].tolist()
            identical += a == b
            parted.append(next((i for i, (u, v) in enumerate(zip(a, b, strict=True)) if u != v), len(a)))
    return {"kl": statistics.mean(kls), "kl_max": max(kls), "identical": identical, "of": len(answers["greedy"]),
            "parted_median": statistics.median(parted)}  # fmt: skip


# #38: KL ≤ 0.01, and greedy answers identical at least as often as bf16's less ``below_bf16``.
BAR = {"kl": 0.01, "below_bf16": 2, "of": 16, "kl_prompts": 64, "kl_tokens": 64, "greedy_tokens": 32}


def meets(result: dict[str, Any], identical: int) -> bool:
    """Whether ``result`` meets the bar, ``identical`` the count of greedy answers it must keep."""
    return bool(result["kl"] <= BAR["kl"] and result["identical"] >= identical)


def judge(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The bar of this run (its count from bf16's answers here), each result's ``meets_bar`` set by it."""
    bar = {**BAR, "identical": results["bfloat16"]["identical"] - BAR["below_bf16"], "relative_to": "bfloat16"}
    for r in results.values():
        r["meets_bar"] = meets(r, bar["identical"])
    return bar


FLAGS = {"modes": "bfloat16,int8,int8-channel", "kl_prompts": BAR["kl_prompts"], "kl_tokens": BAR["kl_tokens"],
         "greedy_prompts": BAR["of"], "greedy_tokens": BAR["greedy_tokens"],
         "quality_file": (str(QUALITY_FILE),
                          "where the server's start-up gate reads the result ('' to skip)")}  # fmt: skip
DRY_RUN = {"quality_file": "", "kl_prompts": 2, "kl_tokens": 4, "greedy_prompts": 2, "greedy_tokens": 4}


def run(args: argparse.Namespace) -> doc.Section:
    import torch
    from tokenwire_server.engine.native import bf16_rounding
    from tokenwire_server.model import load_model
    from tokenwire_server.quantize import INT8_GROUP, INT8_LAYOUT, quality_host, quantize_model

    loaded = load_model(args.model, device="cpu", dtype="float32")
    reference = loaded.model
    answers = reference_answers(
        reference, loaded.tokenizer, args.kl_prompts, args.kl_tokens, args.greedy_prompts, args.greedy_tokens
    )
    results: dict[str, dict[str, Any]] = {}
    modes = [m for m in args.modes.split(",") if m]
    # The bar counts from bf16's answers: bf16 runs first, whether asked for or not.
    for mode in ["bfloat16", *(m for m in modes if m != "bfloat16")]:
        began = time.perf_counter()
        candidate = copy.deepcopy(reference)
        if mode == "bfloat16":  # as the server computes it on a CPU: bf16 weights, the rest float32
            bf16_weights(candidate)
        elif mode == "int8-channel":
            quantize_model(candidate, "int8", torch.device("cpu"), scheme="channel")
        else:
            report = quantize_model(candidate, mode, torch.device("cpu"))
            if mode == "int8" and report["kernel"] != "groups":
                doc.log(f"  int8: this CPU takes the per-channel scheme ({report['kernel']}); stored as int8-channel")
                mode = "int8-channel"
        results[mode] = measure(reference, candidate, answers)
        doc.log(f"  {mode}: {results[mode]} ({time.perf_counter() - began:.0f} s)")
        del candidate
    bar = judge(results)
    info = doc.machine()
    rounding = bf16_rounding()
    if args.quality_file:
        path = Path(args.quality_file)
        table = json.loads(path.read_text()) if path.is_file() else {}
        # The bar's count comes from bf16 on this kind of host (``quality_host``): each entry keeps its own.
        table["bar"] = {key: value for key, value in bar.items() if key != "identical"}
        measured = {"host": info["cpu"], "measured": doc.now(), "bar_identical": bar["identical"]}
        for mode, r in results.items():
            layout = {"layout": INT8_LAYOUT} if mode == "int8" else {}
            table.setdefault("modes", {}).setdefault(mode, {})[quality_host("cpu")] = {**r, **measured, **layout}
        path.write_text(json.dumps(table, indent=2, sort_keys=True) + "\n")
    int8_words = (
        f"asymmetric uint8 weights with a scale and zero point per channel and group of {INT8_GROUP} inputs "
        "(the compiled 8-bit panels, int16 inputs on each row's own scale); int8-channel: symmetric int8 with a "
        "scale per channel (PyTorch's weight-only kernel, bf16 inputs)"
    )
    rows = [[mode, f"{r['kl']:.4f}", f"{r['kl_max']:.4f}", f"{r['identical']}/{r['of']}", f"{r['parted_median']:g}",
             "yes" if r["meets_bar"] else "NO"] for mode, r in results.items()]  # fmt: skip
    return doc.section(
        "quality", "Quality of each precision mode on the default model (`make bench-quality`)", args.command,
        f"Host: {info['cpu']} ({info['instruction sets']}), torch {info['torch']}.",
        f"Against float32 on this CPU. KL: mean KL(float32 ‖ mode) per token, nats, teacher-forced along float32's "
        f"greedy continuations ({args.kl_prompts} prompts × {args.kl_tokens} tokens). Greedy: answers identical to "
        f"float32's for their first {args.greedy_tokens} tokens, of the {args.greedy_prompts} chat prompts of "
        f"`tokenwire bench`. The bar (#38): KL ≤ {BAR['kl']} and ≥ bf16's count less {BAR['below_bf16']} "
        f"({bar['identical']}/{bar['of']} in this run). int8: {int8_words}. bfloat16: bf16 "
        "weights in the float32 pass, as the server runs `--dtype bfloat16` on a CPU (and `auto` where it takes bf16): "
        f"on this CPU each GEMM's input {'rounded' if rounding[0] else 'not rounded'} to bf16, its output "
        f"{'rounded' if rounding[1] else 'not rounded'} (`engine.native.bf16_rounding`).",
        "",
        *doc.table("mode | KL mean | KL worst prompt | greedy identical | median token where they part | meets the bar",
                   "lrrrrl", rows),
    )  # fmt: skip
