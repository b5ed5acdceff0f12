"""Scoring (``OutputOptions.prompt_logprobs``, ``prompt_top_logprobs``, ``logprobs_of``) on
the batched engine (both kernel sets, and transformers' forward) and the simple engine.

The reference is independent of the engines: one in-process transformers forward of the
whole sequence and its ``log_softmax`` in fp32. Checked against it, within 1e-4:

- each prompt token's log-probability, its top alternatives and its ``logprobs_of``, for
  prompts read in several chunks (``max_prefill_tokens`` 24), alone and in a batch with rows
  that do not score (whose tokens do not change);
- a prompt whose blocks are in the prefix cache is still scored whole (and reads them again);
- a scoring call (``max_new_tokens`` 0) sends one event: the prompt, LENGTH, nothing generated;
- ``logprobs_of`` at each generated position.
The default model's prompt logprobs: ``test_the_default_model_scores_a_prompt_as_transformers_does``.
Over gRPC (chunk 0's ``prompt_tokens``, bad values refused): tests/test_server.py and
tests/production/test_bad_input.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import engine_kinds, engine_of, run_all
from tokenwire_server.domain import FinishEvent, FinishReason, GenerationRequest, SamplingOptions, TextEvent
from tokenwire_server.model import load_model

pytestmark = pytest.mark.timeout(600)

ENGINES = [
    *engine_kinds(),
    pytest.param(("batched", {"forward": "transformers"}), id="batched-transformers"),
]
GREEDY = SamplingOptions(temperature=0.0)
SAMPLED = SamplingOptions(temperature=0.8, top_p=0.9, seed=7)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> Any:
    return load_model(str(tiny_model_dir))


def reference(loaded: Any, ids: list[int]) -> torch.Tensor:
    """``log_softmax`` of an in-process forward of ``ids``: row ``p`` scores token ``p + 1``."""
    with torch.inference_mode():
        return loaded.model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)


def prompts(loaded: Any) -> list[list[int]]:
    texts = [
        "The quick brown fox jumps over the lazy dog, and then it runs far away into the forest.",
        "Once upon a time",
        "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20",
        "Is the sky blue? Answer yes or no:",
    ]
    return [loaded.tokenizer(t)["input_ids"] for t in texts]


def check_prompt(loaded: Any, scored: tuple[Any, ...], ids: list[int], top_n: int, named: tuple[int, ...]) -> None:
    expected = reference(loaded, ids)
    assert [t.id for t in scored] == ids
    assert scored[0].logprob is None and not scored[0].top  # nothing before the first token
    for p, token in enumerate(scored[1:]):
        row = expected[p]
        assert token.logprob == pytest.approx(float(row[ids[p + 1]]), abs=TOLERANCE), p
        values, top_ids = torch.topk(row, top_n)
        assert [a.id for a in token.top] == top_ids.tolist(), p
        assert [a.logprob for a in token.top] == pytest.approx(values.tolist(), abs=TOLERANCE)
        assert [a.id for a in token.named] == list(named)
        assert [a.logprob for a in token.named] == pytest.approx(row[list(named)].tolist(), abs=TOLERANCE)
        assert token.text == loaded.tokenizer.decode([ids[p + 1]])


def prompt_of(rec: Any) -> tuple[Any, ...]:
    """The scored prompt: on the first event, and on no other."""
    firsts = [e.prompt for e in rec.events if isinstance(e, TextEvent | FinishEvent) and e.prompt]
    assert len(firsts) == 1 and rec.events[0].prompt, "the prompt comes once, with the first event"
    return firsts[0]


@pytest.mark.parametrize("engine", ENGINES)
def test_prompt_logprobs_equal_a_transformers_forward_alone_and_beside_rows_that_do_not_score(
    loaded: Any, engine: tuple[str, dict[str, Any]]
) -> None:
    kind, options = engine
    named = (5, 1000, 49151)
    asks = [
        GenerationRequest(
            f"s{i}", ids, [GREEDY, SAMPLED][i % 2], 6, ignore_eos=True, want_tokens=True, prompt_logprobs=True,
            prompt_top_logprobs=i % 3 * 2, logprobs_of=named if i % 2 else (),
        )
        for i, ids in enumerate(prompts(loaded))
    ]  # fmt: skip
    plain = [
        dataclasses.replace(r, request_id=f"p{i}", prompt_logprobs=False, prompt_top_logprobs=0, logprobs_of=())
        for i, r in enumerate(asks)
    ]
    eng = engine_of(loaded, kind, options)
    eng.start()
    try:
        alone = [run_all(eng, [r], 300)[0] for r in asks]
        together = run_all(eng, [*asks, *plain], 300)
    finally:
        eng.close()
    for req, a, t, p in zip(asks, alone, together[: len(asks)], together[len(asks) :], strict=True):
        for rec in (a, t):
            check_prompt(loaded, prompt_of(rec), req.prompt_ids, req.prompt_top_logprobs, req.logprobs_of)
            assert rec.token_ids == p.token_ids, "scoring changes no generated token"
        assert not any(e.prompt for e in p.events if isinstance(e, TextEvent | FinishEvent))


@pytest.mark.parametrize("engine", ENGINES[:2])
def test_a_prompt_in_the_prefix_cache_is_still_scored_whole(loaded: Any, engine: tuple[str, dict[str, Any]]) -> None:
    kind, options = engine
    ids = prompts(loaded)[2] * 3  # 3 blocks and more
    plain = GenerationRequest("warm", ids, GREEDY, 4, ignore_eos=True)
    scoring = GenerationRequest("s", ids, GREEDY, 4, ignore_eos=True, prompt_logprobs=True)
    again = GenerationRequest("again", ids, GREEDY, 4, ignore_eos=True)
    eng = engine_of(loaded, kind, options)
    eng.start()
    try:
        (warm,) = run_all(eng, [plain], 300)
        (scored,) = run_all(eng, [scoring], 300)
        (after,) = run_all(eng, [again], 300)
    finally:
        eng.close()
    assert after.last.usage.cached_prompt_tokens >= 32, "the prompt's blocks are cached"
    assert scored.last.usage.cached_prompt_tokens == 0, "a scoring row reads its whole prompt"
    check_prompt(loaded, prompt_of(scored), ids, 0, ())
    assert warm.text == scored.text == after.text


@pytest.mark.parametrize("engine", ENGINES)
def test_a_scoring_call_reads_the_prompt_and_generates_nothing(loaded: Any, engine: tuple[str, dict[str, Any]]) -> None:
    kind, options = engine
    ids = prompts(loaded)[0]
    request = GenerationRequest("score", ids, SAMPLED, 0, prompt_logprobs=True, prompt_top_logprobs=2)
    eng = engine_of(loaded, kind, options)
    eng.start()
    try:
        (rec,) = run_all(eng, [request], 300)
        (beside,) = run_all(eng, [GenerationRequest("next", ids, GREEDY, 3, ignore_eos=True, want_tokens=True)], 300)
    finally:
        eng.close()
    (event,) = rec.events
    assert isinstance(event, FinishEvent) and event.reason is FinishReason.LENGTH
    assert event.text == "" and event.tokens == () and event.matched is None
    assert event.usage.completion_tokens == 0 and event.usage.prompt_tokens == len(ids)
    check_prompt(loaded, event.prompt, ids, 2, ())
    assert len(beside.token_ids) == 3, "the engine goes on serving"


@pytest.mark.parametrize("engine", ENGINES)
def test_logprobs_of_at_each_generated_position_equal_a_transformers_forward(
    loaded: Any, engine: tuple[str, dict[str, Any]]
) -> None:
    kind, options = engine
    named = (0, 2, 17, 4242)
    requests = [
        GenerationRequest(
            f"g{i}", ids, [GREEDY, SAMPLED][i % 2], 8, ignore_eos=True, logprobs_of=named, want_logprobs=True
        )
        for i, ids in enumerate(prompts(loaded))
    ]
    eng = engine_of(loaded, kind, options)
    eng.start()
    try:
        recs = run_all(eng, requests, 300)
    finally:
        eng.close()
    for req, rec in zip(requests, recs, strict=True):
        expected = reference(loaded, req.prompt_ids + rec.token_ids)
        tokens = [t for e in rec.events for t in e.tokens]
        assert len(tokens) == 8
        for n, token in enumerate(tokens):
            row = expected[len(req.prompt_ids) - 1 + n]
            assert [a.id for a in token.named] == list(named)
            assert [a.logprob for a in token.named] == pytest.approx(row[list(named)].tolist(), abs=TOLERANCE)
            assert token.logprob == pytest.approx(float(row[token.id]), abs=TOLERANCE)


@pytest.mark.e2e
def test_the_default_model_scores_a_prompt_as_transformers_does(default_model_dir: Path) -> None:
    loaded = load_model(str(default_model_dir))
    ids = loaded.tokenizer("The capital of France is Paris. The capital of Italy is Rome.")["input_ids"]
    request = GenerationRequest("d", ids, GREEDY, 0, prompt_logprobs=True, prompt_top_logprobs=3, logprobs_of=(12,))
    eng = engine_of(loaded, "batched", {})
    eng.start()
    try:
        (rec,) = run_all(eng, [request], 300)
    finally:
        eng.close()
    check_prompt(loaded, rec.last.prompt, ids, 3, (12,))
    # A real model knows its capitals: " Rome" is the likeliest token where it stands.
    rome = ids.index(loaded.tokenizer(" Rome")["input_ids"][0])
    assert rec.last.prompt[rome].top[0].id == ids[rome]
