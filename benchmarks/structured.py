"""Do constrained answers follow their format, and what do they cost? (`make bench-structured`)

On the default model, one server (``--max-active 16``) and 16 client threads:

- **Constrained:** 64 requests over 4 JSON schemas (a short one; a person with a nested
  address and an array; an order with an array of objects, enums and a pattern; a
  page-long product review with nested objects, arrays and enums), plus 8 regex and 8
  choice requests; half greedy, half seeded top-p. Every answer that ends EOS (or a stop
  sequence) is parsed and validated with ``jsonschema`` (or matched against its regex or
  choice); the table counts them.
- **Unconstrained twin:** the same 80 requests without a format, each held to exactly the
  number of tokens its constrained answer had (``max_new_tokens`` = that count,
  ``ignore_eos``): the same work, so tokens/s compare like with like.

Each repeat runs both over four slices of 20 requests (every fourth), each slice
constrained and unconstrained in ABBA order, so that a burst of load from a neighbour
lands on both alike; throughput is all completion tokens ÷ the summed wall time. A first pass learns the answer lengths and
fills the grammar cache (and is not counted). Compile time: each format compiled cold,
in process, with the server's options. Replaces the "structured" section.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from typing import Any

from benchmarks import doc, load
from benchmarks.launcher import serve
from benchmarks.stats import median, spread

CONCURRENCY = 16
SLICES = 4

SHORT = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
    "required": ["answer", "confidence"],
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30}},
            "required": ["city", "country"],
        },
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "address", "hobbies"],
}
ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
        "express": {"type": "boolean"},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                    "size": {"enum": ["S", "M", "L", "XL"]},
                },
                "required": ["sku", "quantity", "size"],
            },
        },
    },
    "required": ["order_id", "status", "express", "items"],
}


def _text(limit: int, description: str) -> dict[str, Any]:
    return {"type": "string", "maxLength": limit, "description": description}


REVIEW = {
    "title": "ProductReview",
    "description": "A customer's review of a product, as a review site stores it.",
    "type": "object",
    "properties": {
        "product": {
            "type": "object",
            "description": "What was reviewed.",
            "properties": {
                "name": _text(40, "The product's name as sold."),
                "brand": _text(30, "The maker."),
                "category": {"enum": ["electronics", "kitchen", "garden", "toys", "books", "clothing", "sports"]},
                "price": {
                    "type": "object",
                    "properties": {
                        "amount": {"type": "integer", "minimum": 0, "maximum": 10000},
                        "currency": {"enum": ["EUR", "USD", "GBP", "JPY"]},
                    },
                    "required": ["amount", "currency"],
                },  # fmt: skip
            },
            "required": ["name", "brand", "category", "price"],
        },
        "reviewer": {
            "type": "object",
            "properties": {
                "nickname": _text(24, "Shown beside the review."),
                "verified_purchase": {"type": "boolean"},
                "reviews_written": {"type": "integer", "minimum": 0, "maximum": 999},
            },
            "required": ["nickname", "verified_purchase", "reviews_written"],
        },
        "rating": {"type": "integer", "minimum": 1, "maximum": 5, "description": "Stars, 1 to 5."},
        "headline": _text(60, "One line that sums the review up."),
        "pros": {"type": "array", "items": _text(40, "One good point."), "minItems": 1, "maxItems": 3},
        "cons": {"type": "array", "items": _text(40, "One bad point."), "maxItems": 3},
        "would_recommend": {"type": "boolean"},
        "usage": {
            "type": "object",
            "properties": {
                "duration": {"enum": ["days", "weeks", "months", "years"]},
                "frequency": {"enum": ["daily", "weekly", "monthly", "rarely"]},
            },
            "required": ["duration", "frequency"],
        },
        "sentiment": {"enum": ["positive", "mixed", "negative"]},
    },
    "required": ["product", "reviewer", "rating", "headline", "pros", "cons", "would_recommend", "usage", "sentiment"],
}
SCHEMAS = {"short": SHORT, "person": PERSON, "order": ORDER, "page-long review": REVIEW}
REGEX = r"[A-Z][a-z]{2,9}, [A-Z][a-z]{2,9} [0-9]{4}"
CHOICES = ["positive", "negative", "neutral"]
QUESTIONS = {
    "short": [
        "Is water wet? Answer in JSON.",
        "Is the Earth flat? Answer in JSON.",
        "Do cats like fish? Answer in JSON.",
        "Is Python a snake? Answer in JSON.",
    ],
    "person": [
        "Describe a famous scientist as JSON.",
        "Invent a character for a novel, as JSON.",
        "Describe your best friend as JSON.",
        "Describe a chef as JSON.",
    ],
    "order": [
        "Create an order for two t-shirts as JSON.",
        "Make a sample shop order as JSON.",
        "Order three pairs of socks, as JSON.",
        "Write an order for a jacket as JSON.",
    ],
    "page-long review": [
        "Review a coffee machine you bought, as JSON.",
        "Write a review of a children's toy as JSON.",
        "Review running shoes as JSON.",
        "Review a cookbook as JSON.",
    ],
}


def requests(max_new_tokens: int) -> list[tuple[str, Any]]:
    """(what it is, request): 16 per schema, 8 regex, 8 choice; greedy and seeded top-p in turn."""
    from tokenwire.v1 import generation_pb2 as pb

    def chat(question: str) -> Any:
        return pb.Chat(messages=[pb.ChatMessage(role="user", content=question)])

    def sampling(i: int) -> Any:
        return (
            pb.SamplingParams(temperature=0.0)
            if i % 2 == 0
            else pb.SamplingParams(temperature=0.7, top_p=0.9, seed=1000 + i)
        )

    out: list[tuple[str, Any]] = []
    stopping = pb.StoppingCriteria(max_new_tokens=max_new_tokens)
    for name, schema in SCHEMAS.items():
        fmt = pb.ResponseFormat(json_schema=json.dumps(schema))
        for i in range(16):
            question = QUESTIONS[name][i % 4]
            out.append(
                (
                    name,
                    pb.GenerateRequest(
                        request_id=f"{name}-{i}",
                        chat=chat(question),
                        sampling=sampling(i),
                        stopping=stopping,
                        response_format=fmt,
                    ),
                )
            )
    for i in range(8):
        out.append(("regex", pb.GenerateRequest(request_id=f"regex-{i}", chat=chat("Where and when were you born? City, Country Year."),
                                                sampling=sampling(i), stopping=stopping, response_format=pb.ResponseFormat(regex=REGEX))))  # fmt: skip
        out.append(("choice", pb.GenerateRequest(request_id=f"choice-{i}", chat=chat(f"Is this review positive? 'It broke after {i + 1} days.'"),
                                                 sampling=sampling(i), stopping=stopping,
                                                 response_format=pb.ResponseFormat(choice=pb.Choice(options=CHOICES)))))  # fmt: skip
    return out


def follows(kind: str, text: str) -> bool:
    import jsonschema

    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    try:
        jsonschema.validate(json.loads(text), SCHEMAS[kind])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def twins(todo: list[tuple[str, Any]], lengths: list[int]) -> list[Any]:
    """The same requests without a format, each held to its constrained answer's token count."""
    from tokenwire.v1 import generation_pb2 as pb

    out = []
    for (_, request), length in zip(todo, lengths, strict=True):
        twin = pb.GenerateRequest()
        twin.CopyFrom(request)
        twin.ClearField("response_format")
        twin.request_id = request.request_id + "-free"
        twin.stopping.max_new_tokens = max(1, length)
        twin.stopping.ignore_eos = True
        out.append(twin)
    return out


def domain_formats() -> dict[str, Any]:
    from tokenwire_server.domain import ResponseFormat

    formats = {name: ResponseFormat("json_schema", json.dumps(schema)) for name, schema in SCHEMAS.items()}
    formats["regex"] = ResponseFormat("regex", REGEX)
    formats["choice"] = ResponseFormat("choice", options=tuple(CHOICES))
    return formats


def compile_times(loaded: Any) -> dict[str, float]:
    """Each format compiled cold with the server's options, in ms (median of 3 fresh compilers)."""
    from tokenwire_server.domain import ResponseFormat
    from tokenwire_server.structured import Grammars

    formats = domain_formats()
    grammars = Grammars(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
    grammars.compile(ResponseFormat("json_object"))  # reads the vocabulary once
    out = {}
    for name, fmt in formats.items():
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
    """The shared sampler's time per step for 16 rows (half greedy, half seeded top-p) on logits of
    the model's vocabulary, unconstrained and with every row constrained (each row's matcher moving
    on with the token picked, and starting again when its answer is complete), in ms: the only
    work a constrained step adds. Medians over ``steps`` steps, the two kinds in turns."""
    import torch
    from tokenwire_server.domain import GenerationRequest, RequestHandle, SamplingOptions
    from tokenwire_server.engine.generation import Generation
    from tokenwire_server.engine.sampling import Sampler
    from tokenwire_server.structured import Grammars

    formats = list(domain_formats().values())
    grammars = Grammars(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
    sampler = Sampler(loaded.eos_token_ids)

    def rows(constrained: bool) -> list[Generation]:
        out = []
        for i in range(CONCURRENCY):
            sampling = (
                SamplingOptions(temperature=0.0) if i % 2 == 0 else SamplingOptions(temperature=0.7, top_p=0.9, seed=i)
            )
            fmt = formats[i % len(formats)] if constrained else None
            request = GenerationRequest(f"s{i}", [1], sampling, 1_000_000, response_format=fmt)
            constraint = grammars.constraint(fmt) if fmt is not None else None
            out.append(Generation(request, RequestHandle(), lambda event: None, loaded.tokenizer, loaded.eos_token_ids,
                                  torch.device("cpu"), constraint))  # fmt: skip
        return out

    free, bound = rows(False), rows(True)
    torch.manual_seed(0)
    times: dict[bool, list[float]] = {False: [], True: []}
    for step in range(steps):
        logits = torch.randn(CONCURRENCY, loaded.vocab_size) * 4
        for constrained, seqs in ((False, free), (True, bound)) if step % 2 == 0 else ((True, bound), (False, free)):
            started = time.perf_counter()
            picks = sampler(logits, seqs)
            times[constrained].append((time.perf_counter() - started) * 1000)
            if constrained:
                for i, (seq, (token, _, _)) in enumerate(zip(seqs, picks, strict=True)):
                    assert seq.constraint is not None and seq.constraint.accept(token)
                    if seq.constraint.terminated:
                        seqs[i] = rows(True)[i]
    return median(times[False]), median(times[True])


DRY_RUN = {"repeats": 1, "max_new_tokens": 8, "sampler_steps": 4}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", default="batched", choices=["batched", "vllm"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=400)
    parser.add_argument("--sampler-steps", type=int, default=200, help="steps the in-process sampler is timed over")


def run(args: argparse.Namespace) -> doc.Section:
    import grpc
    from tokenwire.v1 import generation_pb2 as pb
    from tokenwire_server.model import load_model

    loaded = load_model(args.model, device="cpu", dtype="float32")
    compiled_ms = compile_times(loaded)
    print("compile ms:", {k: round(v, 1) for k, v in compiled_ms.items()}, flush=True)
    sampler_ms = [sampler_cost(loaded, args.sampler_steps) for _ in range(args.repeats)]
    print("sampler ms per step (free, constrained):", sampler_ms, flush=True)
    del loaded
    todo = requests(args.max_new_tokens)
    flags = ["--model", args.model, "--max-active", str(CONCURRENCY), "--max-queue", "256",
             "--max-new-tokens-limit", str(args.max_new_tokens)]  # fmt: skip
    if args.engine == "vllm":
        flags += ["--enforce-eager", "--kv-cache-tokens", "32768"]
    ended: dict[tuple[str, bool], list[int]] = {}  # (kind, greedy) -> [ended whole, of which follow, all]
    rows: list[dict[str, float]] = []
    with serve(args.dry_run, flags, args.engine) as server:
        stub = load.stub(grpc.insecure_channel(server.target))
        constrained = [r for _, r in todo]
        _, learned = load.streams(stub, constrained, CONCURRENCY)
        free = twins(todo, [s.usage.completion_tokens for s in learned])
        for repeat in range(args.repeats):
            # Four slices of 20 (every fourth request), each run constrained and unconstrained
            # in ABBA order: a burst of load from a neighbour lands on both kinds alike.
            seconds = {"constrained": 0.0, "free": 0.0}
            results: dict[str, list[Any]] = {"constrained": [None] * len(todo), "free": [None] * len(todo)}
            for part in range(SLICES):
                picked = list(range(part, len(todo), SLICES))
                for which in ("constrained", "free") if (part + repeat) % 2 == 0 else ("free", "constrained"):
                    source = constrained if which == "constrained" else free
                    took, got = load.streams(stub, [source[i] for i in picked], CONCURRENCY)
                    seconds[which] += took
                    for i, result in zip(picked, got, strict=True):
                        results[which][i] = result
            for (kind, request), answer in zip(todo, results["constrained"], strict=True):
                counts = ended.setdefault((kind, request.sampling.temperature == 0), [0, 0, 0])
                counts[2] += 1
                if answer.chunks[-1].finish_reason in (pb.FINISH_REASON_EOS, pb.FINISH_REASON_STOP_SEQUENCE):
                    counts[0] += 1
                    counts[1] += follows(kind, answer.text)
            tokens = {which: sum(s.usage.completion_tokens for s in got) for which, got in results.items()}
            row = {f"{which}_tps": tokens[which] / seconds[which] for which in results}
            row |= {f"ttft_{which}": median(s.ttft for s in got) * 1000 for which, got in results.items()}
            row["ratio"] = row["constrained_tps"] / row["free_tps"]
            rows.append(row)
            print(f"repeat {repeat}: constrained {row['constrained_tps']:.1f} tok/s ({tokens['constrained']} tokens), "
                  f"unconstrained {row['free_tps']:.1f} tok/s ({tokens['free']} tokens), ratio {row['ratio']:.3f}",
                  flush=True)  # fmt: skip
    lines = [
        "## Structured output (`make bench-structured`)",
        "",
        doc.written(args.command),
        f"{doc.host()}; engine `{args.engine}`, the default model, "
        f"{CONCURRENCY} streams at a time over gRPC. 80 constrained requests per pass (16 per JSON schema, 8 regex, "
        "8 choice; greedy and seeded top-p in turn) against their unconstrained twins (the same requests without a "
        "format, each held to its constrained answer's token count with ignore_eos: the same work). "
        f"Medians (min–max) over {args.repeats} repeats; each repeat runs four slices of 20 requests, each slice "
        "constrained and unconstrained in ABBA order, and sums their times.",
        "",
        "Ended: the answer ended EOS or at a stop, not cut by max_new_tokens "
        f"({args.max_new_tokens}); valid: of those, parsed and valid against the schema (`jsonschema`), or matching "
        "the regex or the choice. All repeats together.",
        "",
        "| format | greedy: ended | greedy: valid | seeded top-p: ended | seeded top-p: valid | compile, cold (ms) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for kind in [*SCHEMAS, "regex", "choice"]:
        cells = []
        for greedy in (True, False):
            whole, valid, total = ended.get((kind, greedy), [0, 0, 0])
            cells += [f"{whole}/{total}", f"{valid}/{whole}"]
        lines.append(f"| {kind} | {' | '.join(cells)} | {compiled_ms[kind]:.1f} |")
    lines += [
        "",
        "| pass | tokens/s at c=16 | TTFT p50 (ms) |",
        "|---|---:|---:|",
        f"| all rows constrained | {spread([r['constrained_tps'] for r in rows])} "
        f"| {spread([r['ttft_constrained'] for r in rows], 0)} |",
        f"| unconstrained twins | {spread([r['free_tps'] for r in rows])} | {spread([r['ttft_free'] for r in rows], 0)} |",
        f"| constrained ÷ unconstrained | {spread([r['ratio'] for r in rows], 3)} | |",
        "",
        f"The sampler alone, in process, per step of {CONCURRENCY} rows (the only work a constrained step adds: "
        "each row's bitmask filled and applied): "
        f"{spread([free for free, _ in sampler_ms], 2)} ms unconstrained, "
        f"{spread([bound for _, bound in sampler_ms], 2)} ms with every row constrained "
        f"(constrained − unconstrained: {spread([bound - free for free, bound in sampler_ms], 2)} ms a step).",
    ]
    return doc.Section("structured", "\n".join(lines) + "\n")
