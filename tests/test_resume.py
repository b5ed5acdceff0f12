"""Resuming a cut stream on the engines: the rest is exactly what the uncut stream gave.

Each request runs uncut once. Then it is cut at a random token N (a stream that its stop
sequence ended: inside the stop, where the stop spans tokens) and resumed with the N token
ids the caller had received (``GenerationRequest.resume_ids``), on a fresh engine as on
another replica, or on the engine that ran it uncut, starting on the prompt blocks that run
published to the prefix cache: the resumed run must give the uncut run's tokens from N on,
and text that continues the text the caller had exactly (nothing repeated, nothing lost, a
stop sequence that spans the cut still found). Greedy, seeded top-p and seeded top-k with a repetition penalty;
with and without stop sequences; on the batched engine (each kernel set, with and
without the prefix cache, float32 and bf16 weights) and the simple one; on the tiny model and the real one.

Over gRPC (chunk indexes, the seed on the first chunk, validation, the client's own
resume across replicas and the drain's hand-off): tests/production/test_resume_replicas.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from pathlib import Path
from typing import Any

import pytest
from engine_support import Recorder, kernel_unbuildable, run_all
from tokenwire_server.domain import FinishEvent, FinishReason, GenerationRequest, SamplingOptions
from tokenwire_server.engine import create_engine
from tokenwire_server.engine.base import EngineLimits
from tokenwire_server.engine.blocks import BLOCK_SIZE
from tokenwire_server.model import load_model

from benchmarks.resume import QUESTIONS

pytestmark = pytest.mark.timeout(900)

KINDS = [
    SamplingOptions(temperature=0.0),
    SamplingOptions(temperature=0.8, top_p=0.9, seed=1234),
    SamplingOptions(temperature=1.0, top_k=40, repetition_penalty=1.3, seed=99),
]


def engine_for(loaded: Any, kind: str, **options: Any) -> Any:
    limits = EngineLimits(max_active=8, max_queue=32, kv_cache_tokens=8 * 1024, max_prefill_tokens=24)
    if kind == "simple":
        return create_engine("simple", loaded, limits, workers=2)
    return create_engine("batched", loaded, limits, workers=1, **options)


def run(
    loaded: Any, kind: str, requests: list[GenerationRequest], engine: Any = None, **options: Any
) -> list[Recorder]:
    """The requests on ``engine`` (left running), or on a fresh engine of ``kind``."""
    if engine is not None:
        return run_all(engine, requests, 300)
    engine = engine_for(loaded, kind, **options)
    engine.start()
    try:
        return run_all(engine, requests, 300)
    finally:
        engine.close()


def emitted_per_token(rec: Recorder) -> list[str]:
    """The text the caller had after each token (one event per token: it asked for tokens)."""
    out: list[str] = []
    for event in rec.events:
        assert len(event.tokens) <= 1
        if event.tokens:
            out.append(event.text)
        elif out:  # a last event without a token of its own: the held tail
            out[-1] += event.text
    return out


def build_requests(prompts: list[list[int]], new: int, stops: list[tuple[str, ...]]) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            f"r{i}", list(prompt), KINDS[i % 3], new, stop_sequences=stops[i], want_tokens=True, ignore_eos=i % 2 == 0
        )
        for i, prompt in enumerate(prompts)
    ]


def stop_across_a_token_boundary(rec: Recorder) -> tuple[str, ...]:
    """Three characters of the answer that two tokens share, near its middle, and found
    nowhere earlier in it: a stop sequence that matches there first and takes more than
    one token to match, so a cut can fall inside it."""
    ends = [len(text) for text in itertools.accumulate(emitted_per_token(rec))]
    text = rec.text
    boundaries = sorted((end for end in ends if 2 <= end <= len(text) - 1), key=lambda end: abs(end - len(text) // 2))
    if len(text) <= 8:
        return ()
    for end in boundaries:
        stop = text[end - 2 : end + 1]
        if text.find(stop) == end - 2:
            return (stop,)
    return ()


def cut_inside_the_stop(tokenizer: Any, rec: Recorder) -> int | None:
    """A cut that leaves the caller holding part of the stop sequence that ended ``rec``,
    but not all of it (None: the stop came in one token)."""
    if rec.last.reason is not FinishReason.STOP_SEQUENCE:
        return None
    ids, kept = rec.token_ids, len(rec.text)  # the stream's text ends where its stop began
    for cut in range(len(ids) - 1, 0, -1):
        if len(tokenizer.decode(ids[:cut])) > kept:
            return cut
    return None


def check_resume(
    loaded: Any, kind: str, prompts: list[list[int]], new: int, seed: int, same_engine: bool = False, **options: Any
) -> tuple[int, int]:
    """Run uncut, pick stops from the texts, run again, cut each at a random token (a stream
    ended by its stop sequence: inside the stop where it spans tokens), resume; compare.

    ``same_engine``: the resumed requests run on the engine that ran them uncut, so each
    starts on the prompt blocks its uncut run published to the prefix cache (checked in
    its usage); otherwise on a fresh engine, as on another replica. Returns how many streams
    were resumed mid-way, and how many of those with a stop sequence half-matched."""
    plain = run(loaded, kind, build_requests(prompts, new, [()] * len(prompts)), **options)
    # A stop sequence taken from the middle of an answer (every other request), so that it matches.
    stops = [stop_across_a_token_boundary(rec) if i % 2 else () for i, rec in enumerate(plain)]
    requests = build_requests(prompts, new, stops)
    engine = None
    if same_engine:
        engine = engine_for(loaded, kind, **options)
        engine.start()
    try:
        uncut = run(loaded, kind, requests, engine, **options)
        rng = random.Random(seed)
        resumed_requests = []
        cuts = []
        spanning = 0
        for req, rec in zip(requests, uncut, strict=True):
            ids = rec.token_ids
            cut = rng.randrange(1, len(ids)) if len(ids) > 1 else 0
            inside = cut_inside_the_stop(loaded.tokenizer, rec)
            if inside is not None:
                cut, spanning = inside, spanning + 1
            cuts.append(cut)
            resumed_requests.append(
                dataclasses.replace(req, request_id=req.request_id + "-resumed", resume_ids=tuple(ids[:cut]))
            )
        hits_before = engine.pool.hit_tokens if engine is not None else 0
        resumed = run(loaded, kind, resumed_requests, engine, **options)
        if engine is not None and options.get("prefix_cache", True):
            # Every full block the uncut run wrote, generated tokens' included, was published: a
            # resume here reads only the last partial block of its prompt + tokens so far.
            expected = sum(
                (len(req.prompt_ids) + len(req.resume_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE for req in resumed_requests
            )
            assert engine.pool.hit_tokens - hits_before == expected, (engine.pool.hit_tokens - hits_before, expected)
    finally:
        if engine is not None:
            engine.close()
    mid_way = 0
    for req, before, after, cut in zip(requests, uncut, resumed, cuts, strict=True):
        assert isinstance(before.last, FinishEvent) and isinstance(after.last, FinishEvent), (before.last, after.last)
        assert after.token_ids == before.token_ids[cut:], (req.request_id, cut, req.sampling)
        had = "".join(emitted_per_token(before)[:cut])
        assert had + after.text == before.text, (req.request_id, cut)
        assert after.last.reason == before.last.reason
        assert after.last.usage.completion_tokens == before.last.usage.completion_tokens
        assert after.last.usage.prompt_tokens == before.last.usage.prompt_tokens
        mid_way += 0 < cut < len(before.token_ids)
        if same_engine and cut:
            prompt_len, cached = len(req.prompt_ids), after.last.usage.cached_prompt_tokens
            if options.get("prefix_cache", True):  # every full block of its prompt, published by the uncut run
                assert prompt_len // BLOCK_SIZE * BLOCK_SIZE <= cached <= prompt_len, (req.request_id, cached)
            else:
                assert cached == 0
    return mid_way, spanning


def chat_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    questions = QUESTIONS
    out = []
    for i in range(count):
        messages = [{"role": "user", "content": questions[i % len(questions)]}]
        if i % 2:  # raw text, no template, every other one
            out.append(tokenizer(questions[i % len(questions)])["input_ids"])
        else:
            out.append(
                tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            )
    return out


@pytest.mark.parametrize(
    ("kind", "options", "same_engine"),
    [
        pytest.param(
            "batched",
            {"kernels": "compiled"},
            True,
            id="batched-compiled-cached",
            marks=pytest.mark.skipif(
                kernel_unbuildable() is not None, reason=f"compiled CPU ops: {kernel_unbuildable()}"
            ),
        ),
        pytest.param("batched", {"kernels": "torch"}, False, id="batched-torch-fresh"),
        pytest.param("batched", {"dtype": "bfloat16"}, True, id="batched-bf16-cached"),
        pytest.param("batched", {"dtype": "bfloat16"}, False, id="batched-bf16-fresh"),
        pytest.param("batched", {"quantization": "int8"}, True, id="batched-int8-cached"),
        pytest.param("batched", {"quantization": "int8"}, False, id="batched-int8-fresh"),
        pytest.param("batched", {"prefix_cache": False}, True, id="batched-no-prefix-cache"),
        pytest.param("batched", {"forward": "transformers"}, True, id="batched-transformers-cached"),
        pytest.param("simple", {}, False, id="simple"),
    ],
)
def test_a_cut_stream_resumes_exactly_on_the_tiny_model(
    tiny_model_dir: Path, kind: str, options: dict[str, Any], same_engine: bool
) -> None:
    options = dict(options)
    loaded = load_model(
        str(tiny_model_dir),
        device="cpu",
        dtype=options.pop("dtype", "float32"),
        quantization=options.pop("quantization", "none"),
    )
    mid_way, spanning = check_resume(
        loaded, kind, chat_prompts(loaded.tokenizer, 9), 40, seed=7, same_engine=same_engine, **options
    )

    assert mid_way >= 6 and spanning >= 3  # 4 of the 4 streams with a stop here


@pytest.mark.e2e
def test_twenty_cut_streams_resume_exactly_on_the_default_model(default_model_dir: Path) -> None:
    """On the engine that ran them uncut: each resumed stream starts on its prompt's cached blocks."""
    loaded = load_model(str(default_model_dir), device="cpu", dtype="float32")
    mid_way, spanning = check_resume(
        loaded, "batched", chat_prompts(loaded.tokenizer, 20), 48, seed=11, same_engine=True
    )
    assert mid_way >= 15 and spanning >= 6  # 8 here


def test_a_resume_whose_tokens_already_ended_the_stream_finishes_at_once(tiny_model_dir: Path) -> None:
    """A resume that holds max_new_tokens tokens (or ends in EOS) runs nothing: it finishes
    with the reason the uncut stream had, and usage covering its tokens."""
    loaded = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    eos = loaded.eos_token_ids[0]
    full = GenerationRequest("full", [5, 6, 7], SamplingOptions(temperature=0.0), 4, resume_ids=(11, 12, 13, 14))
    ended = GenerationRequest("eos", [5, 6, 7], SamplingOptions(temperature=0.0), 9, resume_ids=(11, eos))
    engine = engine_for(loaded, "batched")
    engine.start()
    try:
        recs = run_all(engine, [full, ended], 60)
    finally:
        engine.close()
    assert [r.last.reason for r in recs] == [FinishReason.LENGTH, FinishReason.EOS]
    assert [r.last.usage.completion_tokens for r in recs] == [4, 2]
