"""Stop token ids (``StoppingCriteria.stop_token_ids``) on both engines, tiny model.

- A stop token ends a stream at its first occurrence: the tokens are the uncut stream's up
  to it, the finish is ``STOP_TOKEN`` naming the token, and its text is left out unless
  ``include_stop_sequence``; ``ignore_eos`` does not turn it off. The same tokens alone and
  in a batch of 12, greedy and seeded, on both kernel sets and the simple engine.
- Before ``min_new_tokens`` the sampler cannot draw a stop token (as it cannot draw EOS).
- A resume is exact at every cut, the cut just after the stop token included (it ends there).
Over gRPC (the last chunk's ``stop_token_id``, bad ids refused): tests/test_server.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from engine_support import engine_kinds, engine_of, run_all
from tokenwire_server.domain import FinishEvent, FinishReason, GenerationRequest, SamplingOptions
from tokenwire_server.model import load_model

pytestmark = pytest.mark.timeout(600)

ENGINES = engine_kinds()
KINDS = [
    SamplingOptions(temperature=0.0),
    SamplingOptions(temperature=0.8, top_p=0.9, seed=1234),
    SamplingOptions(temperature=1.0, top_k=40, repetition_penalty=1.2, seed=99),
]


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> Any:
    return load_model(str(tiny_model_dir))


def prompts(loaded: Any) -> list[list[int]]:
    questions = ["Count to ten.", "Name a colour.", "Say hello.", "What is rain?"]
    return [
        loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for q in questions
    ]


def first_new_token(ids: list[int], after: int) -> int:
    """The index of a token at or past ``after`` that appears there for the first time."""
    return next(i for i in range(after, len(ids)) if ids[i] not in ids[:i])


@pytest.mark.parametrize("engine", ENGINES)
def test_a_stop_token_ends_each_stream_at_its_first_occurrence_alone_and_in_a_batch(
    loaded: Any, engine: tuple[str, dict[str, Any]]
) -> None:
    kind, options = engine
    tokenizer = loaded.tokenizer
    base = [
        GenerationRequest(f"u{i}", prompt, KINDS[i % 3], 20, ignore_eos=True, want_tokens=True)
        for i, prompt in enumerate(prompts(loaded) * 3)
    ]
    eng = engine_of(loaded, kind, options)
    eng.start()
    try:
        uncut = run_all(eng, base, 300)
        stops, cut = [], []
        for i, (req, rec) in enumerate(zip(base, uncut, strict=True)):
            at = first_new_token(rec.token_ids, 2 + i % 5)
            # One stop that occurs, one that never does (ids are below the vocabulary).
            never = next(t for t in range(100, 200) if t not in rec.token_ids)
            stops.append(at)
            cut.append(
                dataclasses.replace(
                    req, request_id=f"c{i}", stop_token_ids=frozenset({rec.token_ids[at], never}),
                    include_stop_sequence=i % 4 == 3,
                )
            )  # fmt: skip
        alone = [run_all(eng, [req], 300)[0] for req in cut]
        together = run_all(eng, cut, 300)
    finally:
        eng.close()
    for req, before, at, a, t in zip(cut, uncut, stops, alone, together, strict=True):
        assert t.token_ids == a.token_ids == before.token_ids[: at + 1], req.request_id
        assert isinstance(t.last, FinishEvent) and t.last.reason is FinishReason.STOP_TOKEN
        assert t.last.matched == before.token_ids[at] and t.last.usage.completion_tokens == at + 1
        kept = at + 1 if req.include_stop_sequence else at
        assert t.text == a.text == tokenizer.decode(before.token_ids[:kept], skip_special_tokens=True)


@pytest.mark.parametrize("engine", ENGINES[1:2])
def test_min_new_tokens_holds_the_stop_tokens_back(loaded: Any, engine: tuple[str, dict[str, Any]]) -> None:
    kind, options = engine
    prompt = prompts(loaded)[0]
    eng = engine_of(loaded, kind, options)
    eng.start()
    try:
        (free,) = run_all(eng, [GenerationRequest("f", prompt, KINDS[0], 12, ignore_eos=True, want_tokens=True)], 300)
        first = free.token_ids[0]
        request = GenerationRequest(
            "m", prompt, KINDS[0], 12, min_new_tokens=4, ignore_eos=True, stop_token_ids=frozenset({first}),
            want_tokens=True,
        )  # fmt: skip
        (held,) = run_all(eng, [request], 300)
    finally:
        eng.close()
    assert first not in held.token_ids[:4]  # greedy would have taken it first: it was masked
    assert held.token_ids[0] != first and len(held.token_ids) >= 4


@pytest.mark.parametrize("engine", ENGINES)
def test_a_resume_with_stop_tokens_is_exact_at_every_cut(loaded: Any, engine: tuple[str, dict[str, Any]]) -> None:
    kind, options = engine
    prompt = prompts(loaded)[1]
    eng = engine_of(loaded, kind, options)
    eng.start()
    try:
        results = []
        for sampling in KINDS[:2]:
            probe = GenerationRequest("p", prompt, sampling, 16, ignore_eos=True, want_tokens=True)
            (plain,) = run_all(eng, [probe], 300)
            at = first_new_token(plain.token_ids, 5)
            request = dataclasses.replace(probe, request_id="s", stop_token_ids=frozenset({plain.token_ids[at]}))
            (uncut,) = run_all(eng, [request], 300)
            assert uncut.token_ids == plain.token_ids[: at + 1]
            resumed = run_all(
                eng,
                [
                    dataclasses.replace(request, request_id=f"r{c}", resume_ids=tuple(uncut.token_ids[:c]))
                    for c in range(1, at + 2)
                ],
                300,
            )
            results.append((uncut, at, resumed))
    finally:
        eng.close()
    for uncut, at, resumed in results:
        for c, rec in enumerate(resumed, start=1):
            assert rec.token_ids == uncut.token_ids[c:], c
            assert rec.last.reason is FinishReason.STOP_TOKEN and rec.last.matched == uncut.token_ids[at], c
            assert rec.last.usage.completion_tokens == at + 1
        # Cut just after the stop token: it ends at once, with nothing more to send.
        assert resumed[-1].token_ids == [] and resumed[-1].text == ""


def test_a_resume_just_after_a_quiet_stop_token_sends_nothing_more_with_text_held(loaded: Any) -> None:
    """Text held back when the stop token comes (the start of a stop sequence) is released by the
    finish, and the stop token's own text is not sent. A resume whose tokens end with that stop
    token ends at once, sending nothing more and keeping the finish reason, even where pushing
    the stop token's text would complete the stop sequence."""
    import torch
    from engine_support import Recorder
    from tokenwire_server.domain import RequestHandle
    from tokenwire_server.engine.generation import Generation

    tokenizer = loaded.tokenizer
    held = tokenizer.encode("Hello ab", add_special_tokens=False)
    stop_token = tokenizer.encode("c", add_special_tokens=False)[0]  # would complete "abc"
    ids = [*held, stop_token]
    request = GenerationRequest(
        "q", [1], KINDS[0], 16, stop_sequences=("abc",), stop_token_ids=frozenset({stop_token}), want_tokens=True
    )

    def run(resume: tuple[int, ...]) -> Recorder:
        rec = Recorder()
        seq = Generation(
            dataclasses.replace(request, resume_ids=resume), RequestHandle(), rec, tokenizer, (0,), torch.device("cpu")
        )
        if seq.ended_at_cut is not None:
            seq.finish(seq.ended_at_cut)
        for token in ids[len(resume) :]:
            if seq.add_token(token):
                break
        return rec

    uncut = run(())
    assert uncut.last.reason is FinishReason.STOP_TOKEN and uncut.text == "Hello ab"  # "ab" released at the finish
    resumed = run(tuple(ids))
    assert resumed.last.reason is FinishReason.STOP_TOKEN and resumed.text == "" and resumed.token_ids == []
    assert resumed.last.matched == stop_token
