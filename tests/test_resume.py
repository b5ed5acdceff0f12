"""Resuming a cut stream on the engines: the rest is exactly what the uncut stream gave.

Each request runs uncut once. Then it is cut at a random token N and resumed on a fresh
engine with the N token ids the caller had received (``GenerationRequest.resume_ids``):
the resumed run must give the uncut run's tokens from N on, and text that continues the
text the caller had exactly (nothing repeated, nothing lost, a stop sequence that spans
the cut still found). Greedy, seeded top-p and seeded top-k with a repetition penalty;
with and without stop sequences; on the batched engine (each kernel set, with and
without the prefix cache) and the simple one; on the tiny model and the real one.

Over gRPC (chunk indexes, the seed on the first chunk, validation, the client's own
resume across replicas and the drain's hand-off): tests/production/test_resume_replicas.py.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
from engine_support import Recorder, kernel_unbuildable, run_all
from tokenwire_server.domain import FinishEvent, FinishReason, GenerationRequest, SamplingOptions
from tokenwire_server.engine import create_engine
from tokenwire_server.engine.base import EngineLimits
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


def run(loaded: Any, kind: str, requests: list[GenerationRequest], **options: Any) -> list[Recorder]:
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


def check_resume(loaded: Any, kind: str, prompts: list[list[int]], new: int, seed: int, **options: Any) -> int:
    """Run uncut, pick stops from the texts, run again, cut each at a random token, resume; compare.
    Returns how many streams were resumed mid-way."""
    plain = run(loaded, kind, build_requests(prompts, new, [()] * len(prompts)), **options)
    # A stop sequence taken from the middle of an answer (every other request), so that it
    # matches; the cut falls before it, often inside it.
    stops: list[tuple[str, ...]] = []
    for i, rec in enumerate(plain):
        text = rec.text
        stops.append((text[len(text) // 2 : len(text) // 2 + 3],) if i % 2 and len(text) > 8 else ())
    requests = build_requests(prompts, new, stops)
    uncut = run(loaded, kind, requests, **options)
    rng = random.Random(seed)
    resumed_requests = []
    cuts = []
    for req, rec in zip(requests, uncut, strict=True):
        ids = rec.token_ids
        cut = rng.randrange(1, len(ids)) if len(ids) > 1 else 0
        cuts.append(cut)
        resumed_requests.append(
            dataclasses.replace(req, request_id=req.request_id + "-resumed", resume_ids=tuple(ids[:cut]))
        )
    resumed = run(loaded, kind, resumed_requests, **options)
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
    return mid_way


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
    ("kind", "options"),
    [
        pytest.param(
            "batched",
            {"kernels": "compiled"},
            id="batched-compiled",
            marks=pytest.mark.skipif(
                kernel_unbuildable() is not None, reason=f"compiled CPU ops: {kernel_unbuildable()}"
            ),
        ),
        pytest.param("batched", {"kernels": "torch"}, id="batched-torch"),
        pytest.param("batched", {"prefix_cache": False}, id="batched-no-prefix-cache"),
        pytest.param("batched", {"forward": "transformers"}, id="batched-transformers"),
        pytest.param("simple", {}, id="simple"),
    ],
)
def test_a_cut_stream_resumes_exactly_on_the_tiny_model(
    tiny_model_dir: Path, kind: str, options: dict[str, Any]
) -> None:
    loaded = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    assert check_resume(loaded, kind, chat_prompts(loaded.tokenizer, 9), 40, seed=7, **options) >= 6


@pytest.mark.e2e
def test_twenty_cut_streams_resume_exactly_on_the_default_model(default_model_dir: Path) -> None:
    loaded = load_model(str(default_model_dir), device="cpu", dtype="float32")
    assert check_resume(loaded, "batched", chat_prompts(loaded.tokenizer, 20), 48, seed=11) >= 15


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
