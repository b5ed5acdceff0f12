"""Automatic prefix caching on the batched engine: reused blocks, the same answers.

- On the tiny model, on both forward passes (native with each kernel set, transformers):
  requests that share a long prefix, run one after another and then together (their
  unshared tails read in chunks beside decoding rows), give exactly the tokens they give
  with ``prefix_cache=False``, greedy and seeded-sampled; each reports the prompt tokens
  it reused.
- On the real default model: 6 chat requests share a ~1,000-token system prompt, each
  with its own question. After the first, each reuses at least 960 prompt tokens
  (``usage.cached_prompt_tokens``), and every answer is identical with the cache off.
  The time-to-first-token figure is measured by ``make bench-prefix``, not here.
- Over gRPC (tests/production/test_observability.py): ``Usage.cached_prompt_tokens`` and
  the ``tokenwire_prefix_cache_hit_tokens_total`` counter report the reuse;
  ``--prefix-cache off`` reports none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_support import kernel_unbuildable, run_all
from tokenwire_server.domain import FinishEvent, GenerationRequest, SamplingOptions
from tokenwire_server.engine import create_engine
from tokenwire_server.engine.base import EngineLimits
from tokenwire_server.model import load_model

pytestmark = pytest.mark.timeout(900)


def requests(prompts: list[list[int]], new: int, tag: str) -> list[GenerationRequest]:
    out = []
    for i, prompt in enumerate(prompts):
        sampling = (
            SamplingOptions(temperature=0.8, top_p=0.9, seed=100 + i) if i % 2 else SamplingOptions(temperature=0.0)
        )
        out.append(GenerationRequest(f"{tag}-{i}", list(prompt), sampling, new, ignore_eos=True, want_tokens=True))
    return out


def answers(
    loaded: Any, prompts: list[list[int]], new: int, prefix_cache: bool, **engine: Any
) -> list[tuple[list[int], int]]:
    """Token ids and cached prompt tokens of each prompt: the first alone, then the rest together."""
    limits = EngineLimits(max_active=8, max_queue=16, kv_cache_tokens=16 * 1024, max_prefill_tokens=24)
    eng = create_engine("batched", loaded, limits, workers=1, prefix_cache=prefix_cache, **engine)
    eng.start()
    try:
        first = run_all(eng, requests(prompts[:1], new, "first"), 300)
        rest = run_all(eng, requests(prompts[1:], new, "rest"), 300)
    finally:
        eng.close()
    out = []
    for rec in first + rest:
        assert isinstance(rec.last, FinishEvent), rec.last
        out.append((rec.token_ids, rec.last.usage.cached_prompt_tokens))
    return out


def shared_prompts(vocab: int, shared: int, tails: list[int]) -> list[list[int]]:
    base = [(7 * i + 3) % (vocab - 10) + 10 for i in range(shared)]
    return [base + [(13 * j + 5 * k) % (vocab - 10) + 10 for j in range(tail)] for k, tail in enumerate(tails)]


KERNEL_REASON = kernel_unbuildable()
FORWARDS = [
    pytest.param(
        {"forward": "native", "kernels": "compiled"},
        marks=pytest.mark.skipif(KERNEL_REASON is not None, reason=f"compiled CPU ops: {KERNEL_REASON}"),
    ),
    {"forward": "native", "kernels": "torch"},
    {"forward": "transformers"},
]


@pytest.mark.parametrize("engine", FORWARDS, ids=["native-compiled", "native-torch", "transformers"])
def test_shared_prefixes_give_the_same_tokens_with_the_cache_on_and_off(tiny_model_dir: Path, engine: dict) -> None:
    loaded = load_model(str(tiny_model_dir))
    prompts = shared_prompts(loaded.vocab_size, 150, [5, 40, 1, 17, 90])
    prompts.append(prompts[0][:150])  # the shared prefix alone: all but its last token reusable
    on = answers(loaded, prompts, 12, prefix_cache=True, **engine)
    off = answers(loaded, prompts, 12, prefix_cache=False, **engine)
    assert [ids for ids, _ in on] == [ids for ids, _ in off]
    assert all(cached == 0 for _, cached in off)
    assert on[0][1] == 0  # nothing cached yet
    assert [cached for _, cached in on[1:]] == [144] * 4 + [144]  # the shared 150 tokens' 9 full blocks


@pytest.mark.e2e
def test_six_chats_share_a_1000_token_system_prompt_on_the_default_model(default_model_dir: Path) -> None:
    loaded = load_model(str(default_model_dir))
    tokenizer = loaded.tokenizer
    rules = " ".join(f"Rule {i}: answer politely, briefly and only about topic number {i}." for i in range(60))
    # Six, not the bench's 16: the cache-off pass reads every prompt whole (~1,000 tokens of
    # prefill each on the real model), and the first, the batch of the rest, and each row's
    # reuse are all there at six.
    questions = [f"Question {i}: what is {i} plus {2 * i}, and which colour is the sky at noon?" for i in range(6)]

    def chat(question: str) -> list[int]:
        messages = [{"role": "system", "content": rules}, {"role": "user", "content": question}]
        ids: list[int] = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return ids

    prompts = [chat(q) for q in questions]
    system_tokens = len(chat("")) - 5
    assert 980 <= system_tokens <= 1100, system_tokens
    on = answers(loaded, prompts, 8, prefix_cache=True)
    off = answers(loaded, prompts, 8, prefix_cache=False)
    assert [ids for ids, _ in on] == [ids for ids, _ in off]
    assert on[0][1] == 0 and all(cached >= 960 for _, cached in on[1:]), [cached for _, cached in on]


def test_a_shared_system_prompt_stays_cached_across_a_pass_of_unrelated_chats(tiny_model_dir: Path) -> None:
    """#38's sequence: 8 chats that share a ~1,000-token system prompt, then 8 short unrelated
    chats, then the first 8 again (each pass admitted together). Every chat of the third pass
    finds the system prompt (>= 960 tokens). Before, a CPU pool reused idle cached blocks from
    the first request on and gave tables back head first, so the second pass evicted part of
    the shared chain and the third pass read it again."""
    loaded = load_model(str(tiny_model_dir))
    rules = " ".join(f"Rule {i}: answer politely, briefly and only about topic number {i}." for i in range(60))

    def chat(question: str, system: bool = True) -> list[int]:
        messages = [{"role": "system", "content": rules}] if system else []
        messages.append({"role": "user", "content": question})
        ids: list[int] = loaded.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return ids

    shared = [chat(f"Question {i}: what is {i} plus {2 * i}?") for i in range(8)]
    unrelated = [chat(f"Tell me a short fact about the number {i}.", system=False) for i in range(8)]
    assert all(len(p) >= 980 for p in shared) and all(len(p) < 80 for p in unrelated)
    # The CPU defaults: the budget a 135M model gets there, the resident limit by device.
    limits = EngineLimits(max_active=8, max_queue=16, kv_cache_tokens=32 * 1024, max_prefill_tokens=20)
    eng = create_engine("batched", loaded, limits, workers=1)
    eng.start()
    try:
        passes = [
            run_all(eng, requests(prompts, 32, f"pass{n}"), 300)
            for n, prompts in enumerate((shared, unrelated, shared))
        ]
    finally:
        eng.close()
    cached = [[rec.last.usage.cached_prompt_tokens for rec in recs] for recs in passes]
    assert all(hit >= 960 for hit in cached[2]), cached  # the old pool: 640 each (its chains lost their tails)
