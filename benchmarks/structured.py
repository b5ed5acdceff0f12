"""Do constrained answers follow their format, and what do they cost? (`make bench-structured`)"""

from __future__ import annotations

import argparse
import json
import re
import time
from typing import Any

from tokenwire.v1 import generation_pb2 as pb

from benchmarks import doc, load
from benchmarks.launcher import serve
from benchmarks.stats import median, spread

CONCURRENCY = 16
SLICES = 4
FLAGS = {"engine": {"default": "batched", "choices": ["batched", "vllm"]}, "repeats": 3, "max_new_tokens": 400,
         "sampler_steps": (200, "steps the in-process sampler is timed over")}  # fmt: skip
DRY_RUN = {"repeats": 1, "max_new_tokens": 8, "sampler_steps": 4}


def _obj(description: str | None = None, **properties: Any) -> dict[str, Any]:
    """An object that requires every one of its ``properties``, in order."""
    head = {"type": "object"} | ({"description": description} if description else {})
    return head | {"properties": properties, "required": list(properties)}


def _int(low: int, high: int, **more: Any) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high, **more}


def _str(limit: int, description: str | None = None) -> dict[str, Any]:
    return {"type": "string", "maxLength": limit} | ({"description": description} if description else {})


def _enum(*values: str) -> dict[str, Any]:
    return {"enum": list(values)}


def _list(items: dict[str, Any], high: int, low: int | None = None) -> dict[str, Any]:
    return {"type": "array", "items": items} | ({"minItems": low} if low is not None else {}) | {"maxItems": high}


SHORT = _obj(answer=_enum("yes", "no"), confidence=_int(0, 100))
PERSON = _obj(
    name=_str(40), age=_int(0, 120), address=_obj(city=_str(30), country=_str(30)), hobbies=_list(_str(20), 3)
)
ORDER = _obj(
    order_id={"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
    status=_enum("pending", "shipped", "delivered", "cancelled"),
    express={"type": "boolean"},
    items={"type": "array", "minItems": 1, "maxItems": 3, "items": _obj(
        sku={"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}, quantity=_int(1, 9), size=_enum("S", "M", "L", "XL"))},
)  # fmt: skip
REVIEW = {"title": "ProductReview",
          "description": "A customer's review of a product, as a review site stores it."} | _obj(
    product=_obj("What was reviewed.", name=_str(40, "The product's name as sold."), brand=_str(30, "The maker."),
                 category=_enum("electronics", "kitchen", "garden", "toys", "books", "clothing", "sports"),
                 price=_obj(amount=_int(0, 10000), currency=_enum("EUR", "USD", "GBP", "JPY"))),
    reviewer=_obj(nickname=_str(24, "Shown beside the review."), verified_purchase={"type": "boolean"},
                  reviews_written=_int(0, 999)),
    rating=_int(1, 5, description="Stars, 1 to 5."),
    headline=_str(60, "One line that sums the review up."),
    pros=_list(_str(40, "One good point."), 3, 1),
    cons=_list(_str(40, "One bad point."), 3),
    would_recommend={"type": "boolean"},
    usage=_obj(duration=_enum("days", "weeks", "months", "years"),
               frequency=_enum("daily", "weekly", "monthly", "rarely")),
    sentiment=_enum("positive", "mixed", "negative"),
)  # fmt: skip
SCHEMAS = {"short": SHORT, "person": PERSON, "order": ORDER, "page-long review": REVIEW}
REGEX = r"[A-Z][a-z]{2,9}, [A-Z][a-z]{2,9} [0-9]{4}"
CHOICES = ["positive", "negative", "neutral"]
QUESTIONS = {
    "short": ["Is water wet? Answer in JSON.", "Is the Earth flat? Answer in JSON.",
              "Do cats like fish? Answer in JSON.", "Is Python a snake? Answer in JSON."],
    "person": ["Describe a famous scientist as JSON.", "Invent a character for a novel, as JSON.",
               "Describe your best friend as JSON.", "Describe a chef as JSON."],
    "order": ["Create an order for two t-shirts as JSON.", "Make a sample shop order as JSON.",
              "Order three pairs of socks, as JSON.", "Write an order for a jacket as JSON."],
    "page-long review": ["Review a coffee machine you bought, as JSON.", "Write a review of a children's toy as JSON.",
                         "Review running shoes as JSON.", "Review a cookbook as JSON."],
}  # fmt: skip


def requests(max_new_tokens: int) -> list[tuple[str, Any]]:
    """(what it is, request): 16 per schema, 8 regex, 8 choice; greedy and seeded top-p in turn."""
    asks = [(name, i, QUESTIONS[name][i % 4], {"json_schema": json.dumps(schema)})
            for name, schema in SCHEMAS.items() for i in range(16)]  # fmt: skip
    for i in range(8):
        asks.append(("regex", i, "Where and when were you born? City, Country Year.", {"regex": REGEX}))
        asks.append(
            ("choice", i, f"Is this review positive? 'It broke after {i + 1} days.'", {"choice": {"options": CHOICES}})
        )
    greedy, top_p = {"temperature": 0.0}, {"temperature": 0.7, "top_p": 0.9}
    return [(kind, load.request(question, max_new_tokens, chat=True, request_id=f"{kind}-{i}", response_format=fmt,
                                sampling={**top_p, "seed": 1000 + i} if i % 2 else greedy))
            for kind, i, question, fmt in asks]  # fmt: skip


def follows(kind: str, text: str) -> bool:
    import jsonschema

    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    try:  # json_object: any object
        jsonschema.validate(json.loads(text), {"type": "object"} if kind == "json_object" else SCHEMAS[kind])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def twins(todo: list[tuple[str, Any]], lengths: list[int]) -> list[Any]:
    """The same requests without a format, each held to its constrained answer's token count."""
    return [pb.GenerateRequest(request_id=request.request_id + "-free", chat=request.chat, sampling=request.sampling,
                               stopping={"max_new_tokens": max(1, length), "ignore_eos": True})
            for (_, request), length in zip(todo, lengths, strict=True)]  # fmt: skip


def domain_formats() -> dict[str, Any]:
    from tokenwire_server.domain import ResponseFormat

    formats = {name: ResponseFormat("json_schema", json.dumps(schema)) for name, schema in SCHEMAS.items()}
    return formats | {
        "regex": ResponseFormat("regex", REGEX),
        "choice": ResponseFormat("choice", options=tuple(CHOICES)),
    }


def compile_times(loaded: Any) -> dict[str, float]:
    """Each format compiled cold with the server's options, in ms (median of 3 fresh compilers)."""
    from tokenwire_server.domain import ResponseFormat
    from tokenwire_server.structured import Grammars

    grammars = Grammars(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
    grammars.compile(ResponseFormat("json_object"))  # reads the vocabulary once
    out = {}
    for name, fmt in domain_formats().items():
        times = []
        for _ in range(3):
            fresh = Grammars(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
            fresh._compiler = grammars._get_compiler()  # the vocabulary read once; the cache empty
            seconds = fresh.compile(fmt)[1]
            assert seconds is not None
            times.append(seconds * 1000)
        out[name] = median(times)
    return out


def sampler_cost(loaded: Any, steps: int = 200) -> tuple[float, float]:
    """The shared sampler's ms per step for 16 rows (half greedy, half seeded top-p) on random logits, unconstrained
    and with every row constrained (each row starting again when its answer is complete); medians, in turns."""
    import torch
    from tokenwire_server.domain import GenerationRequest, RequestHandle, SamplingOptions
    from tokenwire_server.engine.generation import Generation
    from tokenwire_server.engine.sampling import Sampler
    from tokenwire_server.structured import Grammars

    formats = list(domain_formats().values())
    grammars = Grammars(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
    sampler = Sampler(loaded.eos_token_ids)

    def row(i: int, constrained: bool) -> Generation:
        sampling = SamplingOptions(0.0) if i % 2 == 0 else SamplingOptions(temperature=0.7, top_p=0.9, seed=i)
        fmt = formats[i % len(formats)] if constrained else None
        request = GenerationRequest(f"s{i}", [1], sampling, 1_000_000, response_format=fmt)
        return Generation(request, RequestHandle(), lambda event: None, loaded.tokenizer, loaded.eos_token_ids,
                          torch.device("cpu"), grammars.constraint(fmt) if fmt is not None else None)  # fmt: skip

    free, bound = [row(i, False) for i in range(CONCURRENCY)], [row(i, True) for i in range(CONCURRENCY)]
    torch.manual_seed(0)
    times: dict[bool, list[float]] = {False: [], True: []}
    for step in range(steps):
        logits = torch.randn(CONCURRENCY, loaded.vocab_size) * 4
        for constrained, seqs in ((False, free), (True, bound))[:: 1 if step % 2 == 0 else -1]:
            started = time.perf_counter()
            picks = sampler(logits, seqs)
            times[constrained].append((time.perf_counter() - started) * 1000)
            for i, (seq, (token, *_)) in enumerate(zip(seqs, picks, strict=True)):
                if constrained:
                    assert seq.constraint is not None and seq.constraint.accept(token)
                    if seq.constraint.terminated:
                        seqs[i] = row(i, True)
    return median(times[False]), median(times[True])


def abba(stub: Any, passes: dict[str, list[Any]], repeat: int) -> tuple[dict[str, float], dict[str, list[Any]]]:
    """Each pass's requests in ``SLICES`` slices (every fourth request), each slice run by every pass in ABBA
    order (a burst of load from a neighbour lands on both kinds alike): (each pass's seconds, its streams)."""
    seconds = dict.fromkeys(passes, 0.0)
    results: dict[str, list[Any]] = {which: [None] * len(todo) for which, todo in passes.items()}
    for part in range(SLICES):
        picked = range(part, len(results["free"]), SLICES)
        for which in list(passes)[:: 1 if (part + repeat) % 2 == 0 else -1]:
            took, got = load.streams(stub, [passes[which][i] for i in picked], CONCURRENCY)
            seconds[which] += took
            for i, result in zip(picked, got, strict=True):
                results[which][i] = result
    return seconds, results


def run(args: argparse.Namespace) -> doc.Section:
    from tokenwire_server.model import load_model

    loaded = load_model(args.model, device="cpu", dtype="float32")
    compiled_ms = compile_times(loaded)
    doc.log(f"compile ms: { {k: round(v, 1) for k, v in compiled_ms.items()} }")
    sampler_ms = [sampler_cost(loaded, args.sampler_steps) for _ in range(args.repeats)]
    doc.log(f"sampler ms per step (free, constrained): {sampler_ms}")
    del loaded
    todo = requests(args.max_new_tokens)
    flags = ["--model", args.model, "--max-active", str(CONCURRENCY), "--max-queue", "256",
             "--max-new-tokens-limit", str(args.max_new_tokens)]  # fmt: skip
    if args.engine == "vllm":
        flags += ["--enforce-eager", "--kv-cache-tokens", "32768"]
    ended: dict[tuple[str, bool], list[int]] = {}  # (kind, greedy) -> [ended whole, of which follow, all]
    rows: list[dict[str, float]] = []
    with serve(args.dry_run, flags, args.engine) as server:
        stub = load.stub(server.target)
        constrained = [r for _, r in todo]
        _, learned = load.streams(stub, constrained, CONCURRENCY)
        passes = {"constrained": constrained, "free": twins(todo, [s.usage.completion_tokens for s in learned])}
        for repeat in range(args.repeats):
            seconds, results = abba(stub, passes, repeat)
            for (kind, request), answer in zip(todo, results["constrained"], strict=True):
                counts = ended.setdefault((kind, request.sampling.temperature == 0), [0, 0, 0])
                whole = answer.chunks[-1].finish_reason in (pb.FINISH_REASON_EOS, pb.FINISH_REASON_STOP_SEQUENCE)
                counts[:] = [counts[0] + whole, counts[1] + (whole and follows(kind, answer.text)), counts[2] + 1]
            tokens = {which: sum(s.usage.completion_tokens for s in got) for which, got in results.items()}
            row = {f"{which}_tps": tokens[which] / seconds[which] for which in results}
            row |= {f"ttft_{which}": median(s.ttft for s in got) * 1000 for which, got in results.items()}
            row["ratio"] = row["constrained_tps"] / row["free_tps"]
            rows.append(row)
            doc.log(
                f"repeat {repeat}: constrained {row['constrained_tps']:.1f} tok/s ({tokens['constrained']} tokens), "
                f"unconstrained {row['free_tps']:.1f} tok/s ({tokens['free']} tokens), ratio {row['ratio']:.3f}"
            )
    formats = []
    for kind in [*SCHEMAS, "regex", "choice"]:
        cells = [f"{n}/{of}" for greedy in (True, False)
                 for whole, valid, total in [ended.get((kind, greedy), [0, 0, 0])]
                 for n, of in ((whole, total), (valid, whole))]  # fmt: skip
        formats.append([kind, *cells, f"{compiled_ms[kind]:.1f}"])
    col = lambda key, digits=1: spread([r[key] for r in rows], digits)  # noqa: E731
    return doc.section(
        "structured", "Structured output (`make bench-structured`)", args.command,
        f"{doc.host()}; engine `{args.engine}`, the default model, {CONCURRENCY} streams at a time over gRPC. 80 "
        "constrained requests per pass (16 per JSON schema, 8 regex, 8 choice; greedy and seeded top-p in turn) "
        "against their unconstrained twins (the same requests without a format, each held to its constrained answer's "
        f"token count with ignore_eos: the same work). Medians (min–max) over {args.repeats} repeats; each repeat runs "
        "four slices of 20 requests, each slice constrained and unconstrained in ABBA order, and sums their times.",
        "",
        f"Ended: the answer ended EOS or at a stop, not cut by max_new_tokens ({args.max_new_tokens}); valid: of "
        "those, parsed and valid against the schema (`jsonschema`), or matching the regex or the choice. All repeats "
        "together.",
        "",
        *doc.table("format | greedy: ended | greedy: valid | seeded top-p: ended | seeded top-p: valid | "
                   "compile, cold (ms)", "lrrrrr", formats),
        "",
        *doc.table("pass | tokens/s at c=16 | TTFT p50 (ms)", "lrr", [
            ["all rows constrained", col("constrained_tps"), col("ttft_constrained", 0)],
            ["unconstrained twins", col("free_tps"), col("ttft_free", 0)],
            ["constrained ÷ unconstrained", col("ratio", 3), ""]]),
        "",
        f"The sampler alone, in process, per step of {CONCURRENCY} rows (the only work a constrained step adds: each "
        f"row's bitmask filled and applied): {spread([free for free, _ in sampler_ms], 2)} ms unconstrained, "
        f"{spread([bound for _, bound in sampler_ms], 2)} ms with every row constrained (constrained − unconstrained: "
        f"{spread([bound - free for free, bound in sampler_ms], 2)} ms a step).",
    )  # fmt: skip
