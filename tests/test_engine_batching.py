"""The batched engine's paged KV cache, chunked prefill and vectorised sampler.

- KV blocks live on the device of their layer's weights (a fake device map, CPU only);
  transformers' forward writes through block tables and reads each row's columns gathered.
- A prompt read in chunks (while others decode, or forced) gives the tokens a one-shot read gives.
- The sampler's seeded draw depends on (seed, step) only, never on the batch.
- On the real default model: greedy and seeded requests give the same tokens alone and
  in a concurrent batch of 12 with mixed parameters, and the streamed text is decode(ids);
  a prompt sampled gives other tokens than the same prompt greedy.
- Chunked prefill and alone == batched run on both ``--kernels compiled`` (skipped, with
  the reason, where this machine cannot build the compiled CPU ops) and ``--kernels torch``.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from engine_support import Recorder, kernel_choices
from engine_support import run_all as run_requests
from tokenwire_server.domain import (
    ErrorEvent,
    FinishEvent,
    GenerationRequest,
    RequestHandle,
    SamplingOptions,
)
from tokenwire_server.engine import batched, create_engine
from tokenwire_server.engine import scheduler as scheduler_module
from tokenwire_server.engine.base import EngineLimits
from tokenwire_server.engine.generation import Generation
from tokenwire_server.engine.kv import PagedCache, layer_placements, table_tensor
from tokenwire_server.engine.sampling import Sampler, gumbel_noise, row_keys
from tokenwire_server.engine.scheduler import IDLE_PREFILL_TOKENS
from tokenwire_server.model import LoadedModel, load_model

pytestmark = pytest.mark.timeout(600)
KERNELS = kernel_choices()


def make_request(
    rid: str, prompt: list[int], max_new: int, sampling: SamplingOptions | None = None
) -> GenerationRequest:
    return GenerationRequest(
        rid, list(prompt), sampling or SamplingOptions(temperature=0.0), max_new, ignore_eos=True, want_tokens=True
    )


def run_all(engine: Any, requests: list[GenerationRequest], timeout: float = 300.0) -> list[Recorder]:
    """engine_support.run_all, and each request must have finished (no error)."""
    recorders = run_requests(engine, requests, timeout)
    for rec in recorders:
        assert isinstance(rec.last, FinishEvent), rec.last
    return recorders


# -- blocks on their layer's device ----------------------------------------------------


class FakeLinear:
    def __init__(self, device: str) -> None:
        self.weight = torch.empty((1, 1), device=device)  # "meta" stands in for a second GPU


class FakeLayer:
    def __init__(self, device: str) -> None:
        self.self_attn = SimpleNamespace(k_proj=FakeLinear(device))

    def parameters(self) -> Any:
        return iter([self.self_attn.k_proj.weight])


class FakeModel:
    """What ``layer_placements`` looks at: ``get_decoder().layers`` with weights on several devices."""

    def __init__(self, devices: list[str]) -> None:
        self._decoder = SimpleNamespace(layers=[FakeLayer(d) for d in devices])

    def get_decoder(self) -> Any:
        return self._decoder


def test_blocks_are_allocated_on_each_layers_device() -> None:
    model = FakeModel(["cpu", "cpu", "meta", "meta"])
    placements = layer_placements(model, 4, torch.device("cpu"), torch.float32)
    assert [device.type for device, _ in placements] == ["cpu", "cpu", "meta", "meta"]
    cache = PagedCache(num_blocks=6, block_size=16, kv_heads=2, head_dim=8, placements=placements)
    assert [d.type for d in cache.devices] == ["cpu", "cpu", "meta", "meta"]
    for layer in cache.layers:
        assert layer.keys.device == layer.values.device == layer.device
        assert tuple(layer.keys.shape) == (7, 2, 16, 8)  # the blocks + the scratch block


def test_block_writes_land_in_their_tables_blocks_and_reads_gather_each_rows_columns() -> None:
    cache = PagedCache(
        num_blocks=4, block_size=4, kv_heads=2, head_dim=4, placements=[(torch.device("cpu"), torch.float32)]
    )
    layer = cache.layers[0]
    layer.keys.fill_(float("nan"))  # as uninitialised memory may be
    layer.values.fill_(float("nan"))
    keys = torch.randn(2, 2, 3, 4)  # [rows, heads, queries, dim]
    values = torch.randn(2, 2, 3, 4)
    tables = table_tensor(
        [[3, 1], [0]], cache.scratch, 2
    )  # row 0: blocks 3 then 1; row 1: block 0 (padded with scratch)
    # row 0 writes its columns 2..4 (block 3 offsets 2, 3; block 1 offset 0); row 1 its columns 0, 1 and a padding query
    write_blocks = torch.tensor([[3, 3, 1], [0, 0, cache.scratch]])
    write_offsets = torch.tensor([[2, 3, 0], [0, 1, 0]])
    cache.plan.set(tables, write_blocks, write_offsets, torch.tensor([5, 2]), columns=5)
    read_k, read_v = cache.update(keys, values, 0)
    assert torch.equal(layer.keys[3, :, 2:4], keys[0, :, :2]) and torch.equal(layer.keys[1, :, 0], keys[0, :, 2])
    assert torch.equal(layer.values[0, :, 0:2], values[1, :, :2])
    assert torch.equal(layer.keys[cache.scratch, :, 0], keys[1, :, 2])
    assert torch.isnan(layer.keys[2]).all()  # the block nobody holds
    assert tuple(read_k.shape) == (2, 2, 5, 4)  # each row's columns, gathered through its table
    assert torch.equal(read_k[0, :, 2:5], keys[0]) and torch.equal(read_v[1, :, :2], values[1, :, :2])
    # past each row's length (never written, NaN here) the copy is zeros: masked, and finite
    assert torch.equal(read_k[1, :, 2:], torch.zeros(2, 3, 4)) and torch.isnan(read_k[0, :, :2]).all()


def test_layer_placements_fall_back_to_the_model_device() -> None:
    placements = layer_placements(object(), 2, torch.device("cpu"), torch.bfloat16)
    assert placements == [(torch.device("cpu"), torch.bfloat16)] * 2


def test_real_model_blocks_follow_its_layers(tiny_model_dir: Path) -> None:
    loaded = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    placements = layer_placements(
        loaded.model, loaded.model.config.num_hidden_layers, torch.device("meta"), torch.float16
    )
    assert placements == [(torch.device("cpu"), torch.float32)] * loaded.model.config.num_hidden_layers


# -- chunked prefill ------------------------------------------------------------------------


def long_prompt(loaded: LoadedModel, tokens: int) -> list[int]:
    text = " ".join(f"Step {i}: add {i * 3 % 11} apples to the basket." for i in range(200))
    ids: list[int] = loaded.tokenizer(text)["input_ids"]
    assert len(ids) >= tokens
    return ids[:tokens]


def chunked_equals_one_shot(
    loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch, prompt_tokens: int, new: int, kernels: str
) -> None:
    prompt = long_prompt(loaded, prompt_tokens)
    limits = EngineLimits(max_active=4, max_queue=4, kv_cache_tokens=4 * 1024, max_prefill_tokens=16)
    # The prefix cache off: the same prompt is read again each time, chunked differently.
    engine = create_engine("batched", loaded, limits, workers=1, kernels=kernels, prefix_cache=False)
    assert engine.kernels == kernels  # type: ignore[attr-defined]
    engine.start()
    try:
        # Alone, nobody decodes: the whole prompt in one forward pass.
        before = engine.prefill_steps  # type: ignore[attr-defined]
        one_shot = run_all(engine, [make_request("one-shot", prompt, new)])[0]
        assert engine.prefill_steps - before == 1  # type: ignore[attr-defined]

        # Alone but forced to read 16 tokens per pass.
        monkeypatch.setattr(scheduler_module, "IDLE_PREFILL_TOKENS", 16)
        before = engine.prefill_steps  # type: ignore[attr-defined]
        forced = run_all(engine, [make_request("forced", prompt, new)])[0]
        assert engine.prefill_steps - before == -(-prompt_tokens // 16)  # type: ignore[attr-defined]
        monkeypatch.undo()

        # While another stream decodes: chunks of max_prefill_tokens, the other keeps going.
        busy = Recorder()
        busy_handle = engine.submit(make_request("busy", prompt[:10], 400), busy)
        while len(busy.token_ids) < 3:
            time.sleep(0.005)
        steps_before = engine.steps  # type: ignore[attr-defined]
        during = run_all(engine, [make_request("during", prompt, new)])[0]
        assert engine.steps - steps_before >= -(-prompt_tokens // 16)  # type: ignore[attr-defined]  # decoding went on
        assert not busy.done.is_set()  # it decoded all along, and is still going
        busy_handle.cancel()
        assert busy_handle.done.wait(60)
    finally:
        engine.close()
    assert forced.token_ids == one_shot.token_ids
    assert during.token_ids == one_shot.token_ids
    assert len(one_shot.token_ids) == new


@pytest.mark.parametrize("kernels", KERNELS)
def test_chunked_prefill_equals_one_shot_tiny(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, kernels: str
) -> None:
    loaded = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    chunked_equals_one_shot(loaded, monkeypatch, prompt_tokens=200, new=24, kernels=kernels)


@pytest.mark.e2e
@pytest.mark.parametrize("kernels", KERNELS)
def test_chunked_prefill_equals_one_shot_default_model(
    default_model_dir: Path, monkeypatch: pytest.MonkeyPatch, kernels: str
) -> None:
    loaded = load_model(str(default_model_dir), device="cpu", dtype="float32")
    chunked_equals_one_shot(loaded, monkeypatch, prompt_tokens=150, new=16, kernels=kernels)


def test_while_rows_decode_a_chunk_deep_into_a_long_prompt_gets_fewer_tokens(tiny_model_dir: Path) -> None:
    """A prompt token read at column c counts 1 + c / span against --max-prefill-tokens
    (its attention reads the c columns before it); with nobody decoding, depth is free."""
    smollm2 = SimpleNamespace(
        hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64, intermediate_size=1536
    )
    assert 1300 < batched.prefill_span_columns(smollm2) < 1400  # the figure docs/architecture.md gives

    loaded = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    engine: Any = create_engine("batched", loaded, EngineLimits(4, 4, 4 * 1024, max_prefill_tokens=24), workers=1)
    scheduler = engine.scheduler
    span = scheduler.span_columns
    assert span == batched.prefill_span_columns(loaded.model.config)

    def waiting(length: int, left: int = 10_000) -> SimpleNamespace:
        return SimpleNamespace(decoding=False, length=length, seq=SimpleNamespace(context_len=length + left))

    decoding = SimpleNamespace(decoding=True, length=50, seq=SimpleNamespace(context_len=10))
    start, deep, deeper, bottom = waiting(0), waiting(int(span)), waiting(int(3 * span)), waiting(int(100 * span))
    for row, tokens in ((start, 24), (deep, 12), (deeper, 6), (bottom, 1)):
        scheduler.rows = [decoding, row]
        assert scheduler._next_chunks(decoding=True) == ([(row, tokens)], tokens)
        assert scheduler._next_chunks(decoding=False) == ([(row, IDLE_PREFILL_TOKENS)], IDLE_PREFILL_TOKENS)
    # the budget left after one prompt's last tokens goes to the next, at its own depth
    short, after = waiting(0, left=10), waiting(int(span))
    scheduler.rows = [decoding, short, after]
    assert scheduler._next_chunks(decoding=True) == ([(short, 10), (after, 7)], 17)


# -- the sampler -------------------------------------------------------------------------


def generation(prompt: list[int], sampling: SamplingOptions, generated: list[int] | None = None) -> Generation:
    request = make_request("s", prompt, 8, sampling)
    seq = Generation(request, RequestHandle(), lambda event: None, None, (2,), torch.device("cpu"))
    seq.generated = list(generated or [])
    return seq


def test_noise_is_a_function_of_seed_step_and_token() -> None:
    keys = torch.tensor([row_keys(7, 3), row_keys(8, 3), row_keys(7, 4)], dtype=torch.int64)
    noise = gumbel_noise(keys, 1000)
    again = gumbel_noise(keys[[2, 0]], 1000)
    assert torch.equal(noise[0], again[1]) and torch.equal(noise[2], again[0])
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    # Gumbel(0, 1): mean ~0.577, variance ~pi^2/6
    big = gumbel_noise(torch.tensor([row_keys(1, 0)], dtype=torch.int64), 200_000)
    assert abs(float(big.mean()) - 0.5772) < 0.02 and abs(float(big.var()) - 1.6449) < 0.05


def test_noise_is_finite_for_every_hash_value() -> None:
    # Every value the 23 bits can take, the extremes included: no +inf (which would win any
    # draw, a masked token's too) and no -inf.
    from tokenwire_server.engine.sampling import _gumbel_of

    every = _gumbel_of(torch.arange(1 << 23, dtype=torch.int64))
    assert bool(torch.isfinite(every).all())
    assert float(every.max()) < 17 and float(every.min()) > -3


def test_a_sampled_constrained_row_never_takes_a_masked_token() -> None:
    # Rows whose every token but a few is masked (-inf), drawn over many steps and seeds: the
    # pick is always one of the allowed tokens (the old noise gave +inf to one token in 2**24,
    # and -inf + inf = NaN won the argmax).
    vocab = 49152
    allowed = torch.tensor([3, 1000, 40000])
    logits = torch.full((64, vocab), float("-inf"))
    logits[:, allowed] = torch.randn(64, 3)
    for step in range(40):
        keys = torch.tensor([row_keys(seed, step) for seed in range(64)], dtype=torch.int64)
        picks = torch.argmax(logits / 0.7 + gumbel_noise(keys, vocab), dim=-1)
        assert bool(torch.isin(picks, allowed).all()), step


def test_sampled_rows_do_not_depend_on_their_neighbours() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 500) * 3
    sampler = Sampler([2])
    rows = [
        generation([5, 6], SamplingOptions(temperature=0.9, top_p=0.8, seed=11)),
        generation([5], SamplingOptions(temperature=0.0)),
        generation([7, 7, 9], SamplingOptions(temperature=1.2, top_k=20, repetition_penalty=1.3, seed=12), [9, 4]),
        generation([1], SamplingOptions(temperature=0.7, seed=13)),
    ]
    together = [pick[0] for pick in sampler(logits, rows)]
    alone = [sampler(logits[i : i + 1], [rows[i]])[0][0] for i in range(4)]
    assert together == alone
    assert together[1] == int(torch.argmax(logits[1]))  # greedy is the exact argmax


def test_sampling_distribution_follows_top_k_and_top_p() -> None:
    sampler = Sampler([])
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    counts = {"k2": [0] * 4, "p": [0] * 4, "free": [0] * 4}
    for seed in range(3000):
        for name, options in (
            ("k2", SamplingOptions(temperature=1.0, top_k=2, seed=seed)),
            ("p", SamplingOptions(temperature=1.0, top_p=0.7, seed=seed)),
            ("free", SamplingOptions(temperature=1.0, seed=seed)),
        ):
            counts[name][sampler(logits, [generation([0], options)])[0][0]] += 1
    assert counts["k2"][2] == counts["k2"][3] == 0 and abs(counts["k2"][0] / 3000 - 0.625) < 0.04
    assert counts["p"][2] == counts["p"][3] == 0  # 0.5 + 0.3 reaches 0.7
    assert abs(counts["free"][0] / 3000 - 0.5) < 0.04 and abs(counts["free"][3] / 3000 - 0.05) < 0.02


def test_eos_is_blocked_until_min_new_tokens_and_logprobs_come_back() -> None:
    sampler = Sampler([2])
    logits = torch.zeros(2, 10)
    logits[:, 2] = 10.0
    request = GenerationRequest(
        "m", [1], SamplingOptions(temperature=0.0), 8, min_new_tokens=2, want_logprobs=True, top_logprobs=3
    )
    blocked = Generation(
        request,
        RequestHandle(),
        lambda event: None,
        SimpleNamespace(decode=lambda ids, **kw: "x"),
        (2,),
        torch.device("cpu"),
    )
    free = generation([1], SamplingOptions(temperature=0.0))
    (token_a, logprob_a, top_a, _), (token_b, logprob_b, top_b, _) = sampler(logits, [blocked, free])
    assert token_a != 2 and token_b == 2
    assert logprob_a is not None and logprob_a < -9 and logprob_b is None
    assert [alt.id for alt in top_a][0] == 2 and len(top_a) == 3 and top_b == ()


# -- the real model, alone and in a mixed batch -----------------------------------------


@pytest.mark.parametrize("model", ["tiny", pytest.param("default", marks=pytest.mark.e2e)])
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("precision", ["float32", "bfloat16", "int8"])
def test_alone_equals_batch_of_12_mixed(
    model: str, kernels: str, precision: str, request: pytest.FixtureRequest
) -> None:
    """The one place for "batched == alone" on a CPU (tests/gpu has the CUDA one): twelve
    requests, greedy and sampled (seeded, top-p, top-k, repetition penalty), each gives in
    a batch of twelve the tokens it gives alone, on the tiny model and the real one, in
    every precision mode: float32, bf16 weights (``--dtype bfloat16``, packed like float32's)
    and int8 weights (``--quantization int8``)."""
    quantization = "int8" if precision == "int8" else "none"
    if precision != "float32" and kernels == "torch" and model == "default":
        # Measured: on the default model a sampled row parts at its 15th token (int8) or its
        # 11th (bf16). SDPA over a group padded to its longest row sums in another order than
        # alone; float32 absorbs that, but bf16 GEMM inputs (int8pack's activations, the bf16
        # weights' inputs) round it up to a near-tie's margin. The compiled ops (the default
        # wherever they build) attend row by row. The tiny model still runs it: no near-tie.
        pytest.skip(f"{precision} is batch-invariant on the compiled ops only (the server logs it on stock torch ops)")
    folder = request.getfixturevalue("tiny_model_dir" if model == "tiny" else "default_model_dir")
    loaded = load_model(
        str(folder), device="cpu", dtype="bfloat16" if precision == "bfloat16" else "float32", quantization=quantization
    )
    tok = loaded.tokenizer
    questions = [
        "What is the capital of France?",
        "Write a haiku about rain.",
        "Explain photosynthesis briefly.",
        "List three primary colors.",
        "Why is the sky blue?",
        "Give me a tip for learning Python.",
    ]
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for q in questions
    ]
    kinds = [
        SamplingOptions(temperature=0.0),
        SamplingOptions(temperature=0.8, top_p=0.9, seed=1234),
        SamplingOptions(temperature=1.0, top_k=40, repetition_penalty=1.3, seed=99),
    ]
    # Each prompt twice (i and i + 6), with two different kinds: four prompts greedy once
    # and sampled once, two sampled with both seeded kinds.
    requests = [make_request(f"r{i}", prompts[i % 6], 24 + i % 3 * 4, kinds[(i + i // 6) % 3]) for i in range(12)]
    engine = create_engine("batched", loaded, EngineLimits(16, 16, 16 * 2048), workers=1, kernels=kernels)
    assert engine.kernels == kernels  # type: ignore[attr-defined]
    engine.start()
    try:
        alone = [run_all(engine, [req])[0] for req in requests]
        together = run_all(engine, requests)
    finally:
        engine.close()
    for req, a, t in zip(requests, alone, together, strict=True):
        assert t.token_ids == a.token_ids, req.sampling
        assert t.text == tok.decode(t.token_ids, skip_special_tokens=True)
        assert len(t.token_ids) == req.max_new_tokens
    # Sampling is not ignored: the same prompt, with the same length, sampled and greedy.
    greedy = {tuple(req.prompt_ids): a.token_ids for a, req in zip(alone, requests, strict=True) if req.sampling.greedy}
    pairs = [
        (req.sampling, a.token_ids, greedy[tuple(req.prompt_ids)])
        for a, req in zip(alone, requests, strict=True)
        if not req.sampling.greedy and tuple(req.prompt_ids) in greedy
    ]
    assert len(pairs) == 4
    for sampling, sampled_ids, greedy_ids in pairs:
        assert sampled_ids != greedy_ids, sampling


def test_empty_prompt_fails_and_the_engine_goes_on(tiny_model_dir: Path) -> None:
    loaded = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    engine = create_engine("batched", loaded, EngineLimits(2, 2, 2048), workers=1)
    engine.start()
    try:
        empty = Recorder()
        engine.submit(make_request("empty", [], 4), empty)
        assert empty.done.wait(30) and isinstance(empty.events[-1], ErrorEvent)
        after = run_all(engine, [make_request("after", [1, 2, 3], 4)])[0]
        assert len(after.token_ids) == 4
        assert engine.stats().active == 0
    finally:
        engine.close()
