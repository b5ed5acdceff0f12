"""OpenAI's sampling controls (#40): logit_bias, presence and frequency penalties, min_p.

- The sampler against a small reference written here in numpy over the same logits: the
  processed logits (bias first, -100 banning; the repetition penalty; the frequency and
  presence penalties over the generated tokens only), greedy rows' argmax of them, and
  sampled rows' draw after temperature and min_p (the same noise; top_k/top_p through the
  reference draw of tests/test_sampling.py).
- On the tiny model, on both kernel sets and the simple engine: a bias of -100 on the greedy
  first token changes the first token; twelve requests with these options mixed give the
  same tokens alone and together; a resume is exact at every cut. The first two on the
  default model too.
"""

from __future__ import annotations

import collections
import dataclasses
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from engine_support import engine_kinds, engine_of, run_all
from test_sampling import reference_draw
from tokenwire_server.domain import FinishEvent, GenerationRequest, RequestHandle, SamplingOptions
from tokenwire_server.engine.generation import Generation
from tokenwire_server.engine.sampling import Sampler, gumbel_noise, row_keys
from tokenwire_server.model import load_model

pytestmark = pytest.mark.timeout(600)

# -- the reference ----------------------------------------------------------------------------------


def reference_processed(logits: np.ndarray, prompt: list[int], generated: list[int], o: SamplingOptions) -> np.ndarray:
    x = logits.astype(np.float32).copy()
    for token, bias in o.logit_bias:
        x[token] = -np.inf if bias <= -100 else x[token] + np.float32(bias)
    if o.repetition_penalty != 1.0:
        r = np.float32(o.repetition_penalty)
        for token in set(prompt + generated):
            x[token] = x[token] / r if x[token] > 0 else x[token] * r
    for token, count in collections.Counter(generated).items():
        x[token] = x[token] + np.float32(-(o.frequency_penalty * count + o.presence_penalty))
    return x


def reference_pick(x: np.ndarray, o: SamplingOptions, step: int) -> int:
    if o.greedy:
        return int(np.argmax(x))
    scaled = x / np.float32(o.temperature)
    if o.min_p > 0:
        scaled = np.where(scaled < scaled.max() + np.log(np.float32(o.min_p)), -np.inf, scaled).astype(np.float32)
    keys = torch.tensor([row_keys(o.seed or 0, step)], dtype=torch.int64)
    if not (0 < o.top_k < len(x) or o.top_p < 1.0):
        noise = gumbel_noise(keys, len(x))[0].numpy()
        return int(np.argmax(scaled + noise))
    # reference_draw divides by the temperature itself: it gets the scaled values, at temperature 1
    return int(
        reference_draw(torch.from_numpy(scaled).unsqueeze(0), [dataclasses.replace(o, temperature=1.0)], keys)[0]
    )


def generation(prompt: list[int], generated: list[int], options: SamplingOptions) -> Generation:
    request = GenerationRequest("s", prompt, options, 64, ignore_eos=True)
    seq = Generation(request, RequestHandle(), lambda event: None, None, (2,), torch.device("cpu"))
    seq.generated = list(generated)
    return seq


CONTROLS = [
    dict(logit_bias=((3, -100.0), (17, 5.5), (250, -2.25))),
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.7),
    dict(frequency_penalty=-1.0, presence_penalty=2.0),
    dict(min_p=0.05),
    dict(min_p=0.3, top_p=0.9),
    dict(min_p=0.1, top_k=20),
    dict(repetition_penalty=1.3, frequency_penalty=0.5, logit_bias=((9, 100.0),)),
    dict(logit_bias=((5, -100.0),), min_p=0.02, presence_penalty=-0.5, top_p=0.95),
]


def test_the_sampler_equals_a_numpy_reference_greedy_and_sampled() -> None:
    rng = random.Random(5)
    torch.manual_seed(5)
    vocab = 1200
    rows = []
    for i in range(160):
        control = CONTROLS[i % len(CONTROLS)]
        temperature = 0.0 if i % 3 == 0 else rng.choice([0.6, 1.0, 1.4])
        options = SamplingOptions(temperature=temperature, seed=i, **control)  # type: ignore[arg-type]
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        generated = [rng.choice((3, 9, 17, 40, 41, rng.randrange(vocab))) for _ in range(rng.randrange(0, 40))]
        rows.append((torch.randn(vocab) * rng.choice([1.0, 3.0, 6.0]), prompt, generated, options))
    expected = [reference_pick(reference_processed(logits.numpy(), p, g, o), o, len(g)) for logits, p, g, o in rows]
    sampler = Sampler([2])
    for start in range(0, len(rows), 16):  # in batches, as the engine draws them
        batch = rows[start : start + 16]
        picks = sampler(torch.stack([r[0] for r in batch]), [generation(p, g, o) for _, p, g, o in batch])
        got = [pick[0] for pick in picks]
        assert got == expected[start : start + 16], [r[3] for r in batch]

    # -100 bans: a token far above the rest is never drawn; an added -100 would leave it first.
    towering = torch.randn(8, vocab)
    towering[:, 3] = 200.0
    banned = [
        generation([1], [], SamplingOptions(temperature=t, logit_bias=((3, -100.0),), seed=s))
        for t, s in zip((0.0, 0.8, 1.0, 2.0) * 2, range(8), strict=True)
    ]
    assert 3 not in [pick[0] for pick in sampler(towering, banned)]


def test_min_p_keeps_exactly_the_tokens_at_least_that_likely() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    counts = collections.Counter()
    sampler = Sampler([])
    for seed in range(2000):
        options = SamplingOptions(temperature=1.0, min_p=0.15, seed=seed)  # keeps p >= 0.075: the first three
        counts[sampler(logits, [generation([0], [], options)])[0][0]] += 1
    assert set(counts) == {0, 1, 2}
    assert abs(counts[0] / 2000 - 0.5 / 0.9) < 0.04 and abs(counts[2] / 2000 - 0.1 / 0.9) < 0.03


def test_the_penalties_count_generated_tokens_only_and_update_as_tokens_come() -> None:
    options = SamplingOptions(temperature=0.0, frequency_penalty=2.0)
    seq = generation([7, 7, 7], [5], options)
    logits = torch.zeros(1, 10)
    logits[0, 5] = 1.5  # 1.5 - 2 * 1 < 0: the penalty moves the argmax off it
    logits[0, 7] = 1.0  # in the prompt only: not penalised
    assert Sampler([])(logits, [seq])[0][0] == 7
    seq.generated.append(7)
    assert seq.generated_counts() == {5: 1, 7: 1}
    assert Sampler([])(logits, [seq])[0][0] not in (5, 7)


# -- the engines ------------------------------------------------------------------------------------

ENGINES = engine_kinds()
MIXED = [
    SamplingOptions(temperature=0.0, frequency_penalty=0.8, presence_penalty=0.4),
    SamplingOptions(temperature=0.8, top_p=0.95, min_p=0.05, seed=7),
    SamplingOptions(temperature=1.0, presence_penalty=1.0, logit_bias=((13, 4.0), (28, -100.0)), seed=8),
    SamplingOptions(temperature=0.7, top_k=30, frequency_penalty=-0.5, min_p=0.1, seed=9),
    SamplingOptions(temperature=0.0, logit_bias=tuple((t, -100.0) for t in range(200, 300))),
    SamplingOptions(temperature=0.9, seed=10),
]


def chat_prompts(loaded: Any) -> list[list[int]]:
    questions = ["What is the capital of France?", "Write a haiku about rain.", "Why is the sky blue?"]
    return [
        loaded.tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for q in questions
    ]


def first_token_is_changed_by_a_ban(loaded: Any, eng: Any) -> None:
    prompt = chat_prompts(loaded)[0]
    plain = GenerationRequest("g", prompt, SamplingOptions(temperature=0.0), 4, ignore_eos=True, want_tokens=True)
    (before,) = run_all(eng, [plain], 300)
    banned = dataclasses.replace(
        plain, request_id="b", sampling=SamplingOptions(temperature=0.0, logit_bias=((before.token_ids[0], -100.0),))
    )
    (after,) = run_all(eng, [banned], 300)
    assert after.token_ids[0] != before.token_ids[0] and before.token_ids[0] not in after.token_ids


@pytest.mark.parametrize("model", ["tiny", pytest.param("default", marks=pytest.mark.e2e)])
@pytest.mark.parametrize("engine", ENGINES)
def test_a_ban_and_the_controls_mixed_give_the_same_tokens_alone_and_in_a_batch_of_12(
    model: str, engine: tuple[str, dict[str, Any]], request: pytest.FixtureRequest
) -> None:
    if model == "default" and engine[0] == "simple":
        pytest.skip("the default model runs on the batched engine's kernel sets here (the simple one on tiny)")
    loaded = load_model(str(request.getfixturevalue("tiny_model_dir" if model == "tiny" else "default_model_dir")))
    prompts = chat_prompts(loaded)
    requests = [
        GenerationRequest(f"r{i}", prompts[i % 3], MIXED[i % 6], 20 + i % 3 * 4, ignore_eos=True, want_tokens=True)
        for i in range(12)
    ]
    eng = engine_of(loaded, *engine)
    eng.start()
    try:
        first_token_is_changed_by_a_ban(loaded, eng)
        alone = [run_all(eng, [r], 300)[0] for r in requests]
        together = run_all(eng, requests, 300)
    finally:
        eng.close()
    for req, a, t in zip(requests, alone, together, strict=True):
        assert t.token_ids == a.token_ids and len(t.token_ids) == req.max_new_tokens, req.sampling
        banned = {token for token, bias in req.sampling.logit_bias if bias == -100.0}
        assert not banned & set(t.token_ids), req.sampling


@pytest.mark.parametrize("engine", ENGINES)
def test_a_resume_with_the_controls_is_exact(tiny_model_dir: Path, engine: tuple[str, dict[str, Any]]) -> None:
    loaded = load_model(str(tiny_model_dir))
    prompts = chat_prompts(loaded)
    requests = [
        GenerationRequest(f"u{i}", prompts[i % 3], MIXED[i], 16, ignore_eos=True, want_tokens=True) for i in range(6)
    ]
    rng = random.Random(3)
    eng = engine_of(loaded, *engine)
    eng.start()
    try:
        uncut = run_all(eng, requests, 300)
        cuts = [rng.randrange(1, 16) for _ in requests]
        resumed = run_all(
            eng,
            [
                dataclasses.replace(r, request_id=f"r{i}", resume_ids=tuple(u.token_ids[:c]))
                for i, (r, u, c) in enumerate(zip(requests, uncut, cuts, strict=True))
            ],
            300,
        )
    finally:
        eng.close()
    for req, u, r, c in zip(requests, uncut, resumed, cuts, strict=True):
        assert isinstance(r.last, FinishEvent)
        assert r.token_ids == u.token_ids[c:], (req.sampling, c)
