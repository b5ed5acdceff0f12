"""The batched engine's own forward pass (``engine/native.py``) against transformers' forward.

- Its logits match the model's own forward: a prompt read at once, the same prompt
  read in two chunks, and a mixed step (two decode rows and a third row's prompt chunk
  in one pass), on the tiny model and on the real default model; with the one-token
  work around the GEMMs done by the compiled CPU ops (``engine/kernels``) and by stock
  torch ops. With bf16 weights (packed for oneDNN like float32's, the rest in float32) the
  same, against transformers' float32 forward rounded where oneDNN's bf16 GEMM rounds.
- The engine gives the same greedy tokens with ``--forward native`` and
  ``--forward transformers`` on the real model, for requests decoded together while a
  long prompt is read alongside them.
- ``auto`` falls back to transformers' forward for a model it does not know; ``native``
  refuses it by name; a server-owned engine drops the plain weights it packed.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import Recorder, fresh_cache, kernel_unbuildable, run_all, slot_segment
from tokenwire_server.domain import FinishEvent, GenerationRequest, SamplingOptions
from tokenwire_server.engine import create_engine
from tokenwire_server.engine import native as native_module
from tokenwire_server.engine.base import EngineLimits
from tokenwire_server.engine.native import NativeForward, onednn_available, panel_library, unsupported_reason
from tokenwire_server.engine.ops import ATTENTION_CALL_COST, Segment, single_groups
from tokenwire_server.model import load_model
from tokenwire_server.quantize import int8_panel_library

from benchmarks.quality import bf16_weights

pytestmark = pytest.mark.timeout(600)


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


# Both ways the work around the GEMMs runs: the compiled CPU ops (where this machine can
# build them) and stock torch ops.
KERNEL_REASON = kernel_unbuildable()
KERNELS = [
    pytest.param(
        "compiled", marks=pytest.mark.skipif(KERNEL_REASON is not None, reason=f"compiled CPU ops: {KERNEL_REASON}")
    ),
    "torch",
]


# bf16 GEMM inputs and outputs: a float32 difference upstream (the GEMMs' blocking) may round a
# value to its neighbouring bf16 one (2^-8 relative), and that carries on through the layers.
# Measured: at most 1 bf16 step of the logits (0.016) on the tiny model; 0.125-0.5 on the
# default model's 30 layers, whose logits reach ~30 (a bf16 step there is 0.125).
TOLERANCE_BF16 = {"tiny": 0.05, "default": 1.0}


def check_against_transformers(model_dir: Path, tolerance: float, kernels: str, dtype: str = "auto") -> None:
    """``dtype`` bfloat16: bf16 weights through the same packed GEMMs, the rest in float32, against
    transformers' float32 forward rounded where they round (``bf16_weights``: the model
    `make bench-quality` measures bf16's quality on)."""
    loaded = load_model(str(model_dir), dtype=dtype)
    model = loaded.model
    native = NativeForward(model, fresh_cache(model, poisoned=True), batch_hint=4, kernel_choice=kernels)
    assert native.compiled == (kernels == "compiled")
    if dtype == "bfloat16":
        assert native.dtype == torch.float32 and native.weight_dtype == torch.bfloat16
        assert native.packed == onednn_available(torch.device("cpu"))
        assert native.gemm == ("panels" if kernels == "compiled" and panel_library() else "onednn")
        qkv = native.layers[0].qkv
        model = bf16_weights(
            load_model(str(model_dir), dtype="float32").model, (qkv.rounds_input, qkv.kind != "panels")
        )
    vocab = loaded.vocab_size
    generator = torch.Generator().manual_seed(1)
    first = torch.randint(10, vocab, (37,), generator=generator).tolist()
    second = torch.randint(10, vocab, (23,), generator=generator).tolist()
    want_first = reference_logits(model, first)
    want_second = reference_logits(model, second)

    # slot 0: the whole prompt at once, every position's logits
    got = native(torch.tensor(first), torch.arange(37), [slot_segment(0, 0, 37)], list(range(37)))
    assert (got - want_first).abs().max().item() < tolerance
    # slot 1: the same prompt in two chunks
    native(torch.tensor(first[:20]), torch.arange(20), [slot_segment(1, 0, 20)], [19])
    got = native(torch.tensor(first[20:]), torch.arange(20, 37), [slot_segment(1, 20, 17)], [16])
    assert (got[0] - want_first[-1]).abs().max().item() < tolerance

    # One mixed step: slots 0 and 1 decode their next token while slot 2 reads a chunk.
    next_token = int(want_first[-1].argmax())
    want_next = reference_logits(model, [*first, next_token])[-1]
    ids = torch.tensor([next_token, next_token, *second[:15]])
    positions = torch.tensor([37, 37, *range(15)])
    got = native(ids, positions, [slot_segment(0, 37, 1), slot_segment(1, 37, 1), slot_segment(2, 0, 15)], [0, 1, 16])
    assert (got[0] - want_next).abs().max().item() < tolerance
    assert (got[1] - want_next).abs().max().item() < tolerance
    assert (got[2] - want_second[14]).abs().max().item() < tolerance
    # One-token rows of different lengths in adjacent slots (2 and 3), the second a one-token chunk.
    got = native(
        torch.tensor([second[15], first[0]]),
        torch.tensor([15, 0]),
        [slot_segment(2, 15, 1), slot_segment(3, 0, 1)],
        [0, 1],
    )
    assert (got[0] - want_second[15]).abs().max().item() < tolerance
    assert (got[1] - want_first[0]).abs().max().item() < tolerance


@pytest.mark.parametrize("kernels", KERNELS)
def test_native_logits_match_transformers_on_the_tiny_model(tiny_model_dir: Path, kernels: str) -> None:
    check_against_transformers(tiny_model_dir, 1e-3, kernels)


@pytest.mark.parametrize("kernels", KERNELS)
def test_bf16_weights_are_packed_and_their_logits_match_transformers_on_the_tiny_model(
    tiny_model_dir: Path, kernels: str
) -> None:
    check_against_transformers(tiny_model_dir, TOLERANCE_BF16["tiny"], kernels, dtype="bfloat16")


# Llama shapes the native pass must read like transformers does: (query heads, KV heads,
# head dim, tied lm_head, biases). Small widths; the geometry is what differs.
SHAPES = {
    "head-dim-128": dict(heads=4, kv_heads=2, head_dim=128),
    "multi-head": dict(heads=4, kv_heads=4, head_dim=16),
    "gqa-2": dict(heads=4, kv_heads=2, head_dim=32),
    "gqa-4": dict(heads=8, kv_heads=2, head_dim=16),
    "gqa-8": dict(heads=8, kv_heads=1, head_dim=16),
    "gqa-32-past-the-compiled-op": dict(heads=32, kv_heads=1, head_dim=16),
    "untied-lm-head": dict(heads=4, kv_heads=2, head_dim=16, tie=False),
    "biases": dict(heads=4, kv_heads=2, head_dim=16, bias=True),
}


@pytest.fixture(scope="module")
def shape_models(tiny_model_factory: Any) -> dict[str, Path]:
    return {name: tiny_model_factory(name, initializer_range=0.1, **shape) for name, shape in SHAPES.items()}


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_native_logits_match_transformers_on_every_llama_shape(
    shape_models: dict[str, Path], shape: str, kernels: str
) -> None:
    check_against_transformers(shape_models[shape], 1e-3, kernels)


def test_a_model_past_a_compiled_op_limit_reads_that_op_on_torch_and_says_why(shape_models: dict[str, Path]) -> None:
    if KERNEL_REASON is not None:
        pytest.skip(f"compiled CPU ops: {KERNEL_REASON}")
    model = load_model(str(shape_models["gqa-32-past-the-compiled-op"])).model
    native = NativeForward(model, fresh_cache(model), batch_hint=4, kernel_choice="compiled")
    assert native.compiled  # the other compiled ops still run
    assert native.ops_fallbacks == {"decode_attention": "32 query heads per KV head; the compiled op takes at most 16"}
    within = load_model(str(shape_models["gqa-8"])).model
    assert NativeForward(within, fresh_cache(within), batch_hint=4, kernel_choice="compiled").ops_fallbacks == {}


@pytest.mark.e2e
@pytest.mark.parametrize("kernels", KERNELS)
def test_native_logits_match_transformers_on_the_default_model(default_model_dir: Path, kernels: str) -> None:
    # fp32 logits of a 30-layer model agree to ~1e-4 (only the GEMM blocking differs)
    check_against_transformers(default_model_dir, 2e-3, kernels)


@pytest.mark.e2e
@pytest.mark.parametrize("kernels", KERNELS)
def test_bf16_weights_are_packed_and_their_logits_match_transformers_on_the_default_model(
    default_model_dir: Path, kernels: str
) -> None:
    check_against_transformers(default_model_dir, TOLERANCE_BF16["default"], kernels, dtype="bfloat16")


def test_one_token_rows_split_into_the_attention_calls_that_read_the_fewest_columns() -> None:
    def rows(*starts: int) -> list[Segment]:
        return [Segment((row,), start, 1) for row, start in enumerate(starts)]

    # similar lengths: one call
    assert single_groups(rows(100, 120, 90)) == [(0, 3)]
    # one long row among short ones reads alone
    assert single_groups(rows(100, 1500, 90, 95)) == [(0, 1), (1, 1), (2, 2)]
    # a call costs more than reading a few columns more
    short, long = 10, 10 + ATTENTION_CALL_COST // 4
    assert single_groups(rows(short, long)) == [(0, 2)]
    assert single_groups([]) == []


@pytest.mark.parametrize("kernels", KERNELS)
def test_rows_of_very_different_lengths_attend_in_separate_calls_and_match_transformers(
    tiny_model_dir: Path, kernels: str
) -> None:
    loaded = load_model(str(tiny_model_dir))
    model = loaded.model
    native = NativeForward(model, fresh_cache(model, poisoned=True), batch_hint=4, kernel_choice=kernels)
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(10, loaded.vocab_size, (n,), generator=generator).tolist() for n in (5, 200, 7)]
    for slot, prompt in enumerate(prompts):
        native(
            torch.tensor(prompt[:-1]),
            torch.arange(len(prompt) - 1),
            [slot_segment(slot, 0, len(prompt) - 1)],
            [len(prompt) - 2],
        )
    step = [slot_segment(slot, len(prompt) - 1, 1) for slot, prompt in enumerate(prompts)]
    assert len(single_groups(step)) == 3  # the 200-token row does not make the others read 200 columns
    got = native(torch.tensor([p[-1] for p in prompts]), torch.tensor([len(p) - 1 for p in prompts]), step, [0, 1, 2])
    for row, prompt in enumerate(prompts):
        assert (got[row] - reference_logits(model, prompt)[-1]).abs().max().item() < 1e-3


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_long_prompt_read_beside_short_rows_never_reads_past_any_rows_length(
    tiny_model_dir: Path, kernels: str
) -> None:
    # Unwritten columns are NaN: a row that read one unmasked would give NaN logits, and
    # a gathered read that did not zero what lies past a row's length (masked, but NaN
    # times a zero weight is NaN) would too. No block outside the rows' tables is touched.
    loaded = load_model(str(tiny_model_dir))
    model = loaded.model
    cache = fresh_cache(model, capacity=1024, poisoned=True)
    native = NativeForward(model, cache, batch_hint=4, kernel_choice=kernels)
    generator = torch.Generator().manual_seed(3)
    short = [torch.randint(10, loaded.vocab_size, (n,), generator=generator).tolist() for n in (6, 9)]
    long = torch.randint(10, loaded.vocab_size, (700,), generator=generator).tolist()
    for slot, prompt in enumerate(short):
        native(
            torch.tensor(prompt[:-1]),
            torch.arange(len(prompt) - 1),
            [slot_segment(slot, 0, len(prompt) - 1, 1024)],
            [len(prompt) - 2],
        )
    # Requests 0 and 1 each decode one token a step (their prompts' own tokens, teacher-forced)
    # while request 2 reads the long prompt in chunks of 100.
    grown = [list(prompt) for prompt in short]
    for chunk in range(7):
        ids = [grown[0][-1], grown[1][-1], *long[chunk * 100 : (chunk + 1) * 100]]
        starts = [len(grown[0]) - 1, len(grown[1]) - 1]
        step = [
            slot_segment(0, starts[0], 1, 1024),
            slot_segment(1, starts[1], 1, 1024),
            slot_segment(2, chunk * 100, 100, 1024),
        ]
        got = native(
            torch.tensor(ids), torch.tensor([*starts, *range(chunk * 100, (chunk + 1) * 100)]), step, [0, 1, 101]
        )
        assert torch.isfinite(got).all()
        for row in range(2):
            want = reference_logits(model, grown[row])[-1]
            assert (got[row] - want).abs().max().item() < 1e-3
            grown[row].append(int(want.argmax()))
    assert (got[2] - reference_logits(model, long)[-1]).abs().max().item() < 1e-3
    keys = cache.layers[0].keys
    written = {
        block
        for slot, length in ((0, len(grown[0]) - 1), (1, len(grown[1]) - 1), (2, 700))
        for block in slot_segment(slot, 0, length, 1024).table[: -(-length // 16)]
    }
    untouched = [block for block in range(cache.num_blocks) if block not in written]
    assert torch.isnan(keys[untouched]).all()  # nobody's block but the rows' own is written
    assert torch.isnan(keys[cache.scratch]).all()  # and nothing padded writes to scratch here


def test_on_this_cpu_the_native_pass_packs_its_weights_for_onednn_and_computes_with_them(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packed where oneDNN is (stated apart from ``onednn_available``: every x86-64 CPU
    wheel of torch has it); every linear layer's weight is the packed copy, the pass runs
    on those copies (never ``F.linear``), and gives the logits of the same pass unpacked."""
    loaded = load_model(str(tiny_model_dir))
    native = NativeForward(loaded.model, fresh_cache(loaded.model), batch_hint=4, kernel_choice="torch")
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert torch.backends.mkldnn.is_available(), "an x86-64 CPU wheel of torch without oneDNN"
        assert native.packed, "oneDNN is here, and the native pass did not pack"
    if not native.packed:
        pytest.skip(f"no oneDNN packing on this {platform.machine()} CPU")
    linears = [native.lm_head] + [
        getattr(layer, name) for layer in native.layers for name in ("qkv", "out", "gate_up", "down")
    ]
    assert all(linear.packed and linear.weight.is_mkldnn for linear in linears)

    with monkeypatch.context() as patch:  # the same pass, its weights left plain
        patch.setattr(native_module, "onednn_available", lambda device: False)
        plain = NativeForward(loaded.model, fresh_cache(loaded.model), batch_hint=4, kernel_choice="torch")
    assert not plain.packed and not any(layer.qkv.weight.is_mkldnn for layer in plain.layers)
    prompt = torch.randint(10, loaded.vocab_size, (19,), generator=torch.Generator().manual_seed(4))
    want = plain(prompt, torch.arange(19), [slot_segment(0, 0, 19)], list(range(19)))

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("a packed pass called F.linear")

    with monkeypatch.context() as patch:
        patch.setattr(native_module.F, "linear", refuse)
        got = native(prompt, torch.arange(19), [slot_segment(0, 0, 19)], list(range(19)))
    assert (got - want).abs().max().item() < 1e-4
    assert (got - reference_logits(loaded.model, prompt.tolist())).abs().max().item() < 1e-3


def serves_one_request(engine, loaded, tokens: int) -> None:
    """The engine, started, answers one greedy request with ``tokens`` tokens; then it is closed."""
    try:
        engine.start()
        prompt = loaded.tokenizer("Hello there")["input_ids"]
        [rec] = run_all(
            engine,
            [
                GenerationRequest(
                    "r", prompt, SamplingOptions(temperature=0.0), tokens, ignore_eos=True, want_tokens=True
                )
            ],
        )
        assert isinstance(rec.last, FinishEvent) and len(rec.token_ids) == tokens
    finally:
        engine.close()


def test_an_engine_that_owns_the_model_drops_the_plain_weights_it_packed(tiny_model_dir: Path) -> None:
    loaded = load_model(str(tiny_model_dir))
    layer = loaded.model.model.layers[0]
    engine = create_engine("batched", loaded, EngineLimits(2, 2, 1024), workers=1, own_weights=True)
    assert engine.forward == "native"  # type: ignore[attr-defined]
    if onednn_available(torch.device("cpu")):
        assert layer.self_attn.q_proj.weight.numel() == 0
        assert layer.mlp.down_proj.weight.numel() == 0
    assert loaded.model.model.embed_tokens.weight.numel() > 0  # still read for the lookup
    serves_one_request(engine, loaded, 8)


def test_unpacked_the_fused_weights_replace_the_models_instead_of_sitting_beside_them(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Weights not packed (as on a GPU, or a CPU without oneDNN; bf16 here): the fused q/k/v
    and gate/up copies take the place of the model's q, k, v, gate and up weights, so the
    weights are held once."""
    monkeypatch.setattr(native_module, "onednn_available", lambda device: False)
    loaded = load_model(str(tiny_model_dir), dtype="bfloat16")
    model = loaded.model
    before = sum(p.numel() for p in model.parameters())
    engine = create_engine("batched", loaded, EngineLimits(2, 2, 1024), workers=1, forward="native", own_weights=True)
    native = engine.runner.native  # type: ignore[attr-defined]
    assert native is not None and not native.packed
    layer = model.model.layers[0]
    for module in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.mlp.gate_proj, layer.mlp.up_proj):
        assert module.weight.numel() == 0
    kept = sum(p.numel() for p in model.parameters())
    fused = sum(
        x.qkv.weight.numel() + x.gate_up.weight.numel() + x.out.weight.numel() + x.down.weight.numel()
        for x in native.layers
    )
    table = model.model.embed_tokens.weight
    head = 0 if native.lm_head.weight.data_ptr() == table.data_ptr() else native.lm_head.weight.numel()
    assert kept + fused + head == before  # every weight held once: by the model or by the pass
    serves_one_request(engine, loaded, 8)


def test_auto_falls_back_to_transformers_for_a_model_it_does_not_know(tiny_model_dir: Path) -> None:
    loaded = load_model(str(tiny_model_dir))
    loaded.model.config.model_type = "not-llama"
    assert "not-llama" in (unsupported_reason(loaded.model) or "")
    engine = create_engine("batched", loaded, EngineLimits(2, 2, 1024), workers=1)
    assert engine.forward == "transformers"  # type: ignore[attr-defined]
    serves_one_request(engine, loaded, 6)
    with pytest.raises(ValueError, match="--forward native cannot run this model: model_type 'not-llama'"):
        create_engine("batched", loaded, EngineLimits(2, 2, 1024), workers=1, forward="native")


@pytest.mark.e2e
def test_both_forwards_give_the_same_greedy_tokens_with_a_long_prompt_read_alongside(default_model_dir: Path) -> None:
    """Four requests decode while a 300-token prompt is read in 64-token chunks beside them
    (native: in the same passes; transformers: in passes of its own): same tokens either way."""
    loaded = load_model(str(default_model_dir))
    tok = loaded.tokenizer
    prompts = [
        tok(text)["input_ids"] for text in ("The capital of France is", "def fib(n):", "Water boils at", "1, 2, 3, 4,")
    ]
    long_prompt = tok(" ".join(f"item {i}," for i in range(100)))["input_ids"][:300]
    assert len(long_prompt) == 300

    greedy = SamplingOptions(temperature=0.0)
    results = {}
    for forward in ("native", "transformers"):
        engine = create_engine(
            "batched", loaded, EngineLimits(8, 8, 8 * 1024, max_prefill_tokens=64), workers=1, forward=forward
        )
        engine.start()
        try:
            recorders = [Recorder() for _ in range(5)]
            for i, (prompt, rec) in enumerate(zip(prompts, recorders, strict=False)):
                engine.submit(GenerationRequest(f"r{i}", prompt, greedy, 40, ignore_eos=True, want_tokens=True), rec)
            deadline = time.monotonic() + 120
            while not all(rec.token_ids for rec in recorders[:4]):  # all four are decoding
                assert time.monotonic() < deadline
                time.sleep(0.01)
            prefill_steps = engine.prefill_steps  # type: ignore[attr-defined]
            engine.submit(
                GenerationRequest("long", long_prompt, greedy, 8, ignore_eos=True, want_tokens=True), recorders[4]
            )
            for rec in recorders:
                assert rec.done.wait(300)
                assert isinstance(rec.last, FinishEvent), rec.last
            # the long prompt was read in 64-token chunks while the others decoded
            assert engine.prefill_steps - prefill_steps >= 300 // 64  # type: ignore[attr-defined]
            assert len(recorders[0].token_ids) == 40
            results[forward] = [rec.token_ids for rec in recorders]
        finally:
            engine.close()
    assert results["native"] == results["transformers"]


def test_transformers_forward_keeps_one_logits_row_per_prompt_read_together(tiny_model_dir: Path) -> None:
    """Prompts of different lengths read in one rectangular pass each end at its last position
    (their padding comes first), so ``logits_to_keep=1`` keeps each row's last logits alone on any
    transformers (5.17, the GPU machine's, has no per-row ``logits_to_keep``: before, every
    position's logits came back, rows x width x vocabulary floats); the native forward's greedy
    tokens either way."""
    loaded = load_model(str(tiny_model_dir))
    prompts = [loaded.tokenizer(text)["input_ids"] for text in ("Hi", "The weather today is", "Once upon a time, far")]
    assert len({len(p) for p in prompts}) == 3
    kept: list[tuple[int, ...]] = []
    forward = loaded.model.forward

    def spied(*args: Any, **kwargs: Any) -> Any:
        output = forward(*args, **kwargs)
        kept.append(tuple(output.logits.shape[:2]))
        return output

    results = {}
    for name in ("native", "transformers"):
        engine = create_engine("batched", loaded, EngineLimits(4, 8, 4096), workers=1, forward=name)
        engine.start()
        loaded.model.forward = spied
        try:
            recorders = run_all(
                engine,
                [
                    GenerationRequest(
                        f"r{i}", p, SamplingOptions(temperature=0.0), 12, ignore_eos=True, want_tokens=True
                    )
                    for i, p in enumerate(prompts)
                ],  # fmt: skip
                120,
            )
        finally:
            loaded.model.forward = forward
            engine.close()
        results[name] = [rec.token_ids for rec in recorders]
    assert results["transformers"] == results["native"]
    assert kept and all(width == 1 for _, width in kept), kept
    assert max(rows for rows, _ in kept) > 1  # prompts were read together


def test_a_bf16_row_gets_the_same_bits_in_a_gemm_of_any_size() -> None:
    """oneDNN picks its bf16 kernel by row count (on an AMX host the vocabulary GEMM rounds a
    row otherwise at 33-256 rows than alone), so bf16 GEMMs run at most BF16_ROWS_PER_GEMM rows
    a call: at the default model's shapes every row of a call of 2-80 rows has its bits alone.
    The check itself fails a layer whose rows follow the call's size."""
    from tokenwire_server.engine.native import Linear, rows_per_call_consistent

    torch.manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
    layers = [Linear(torch.randn(o, i, dtype=torch.bfloat16) * 0.05, None, True, 16) for o, i in shapes]
    assert rows_per_call_consistent(layers) is None

    class FollowsSize:
        in_features, dtype = 8, torch.float32

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum(1, keepdim=True) + (1e-3 if x.shape[0] > 16 else 0.0)

    verdict = rows_per_call_consistent([FollowsSize()])  # type: ignore[list-item]
    assert verdict is not None and "a 17-row GEMM" in verdict


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_every_layer_in_one_compiled_call_gives_the_python_loops_bits(tiny_model_dir: Path, dtype: str) -> None:
    """Where every GEMM is the panels and the compiled ops do the rest (an AVX-512F CPU), a step's
    layers run as one ``decoder_layers`` call: the same logits and the same keys and values in
    the cache, bit for bit, as the loop of calls it replaces, over prompts read whole and in
    chunks and a step that mixes decoding rows with a prompt chunk; float32 and bf16 panels, and
    int8's 8-bit panels (``--quantization int8`` where the CPU runs them)."""
    if kernel_unbuildable() or panel_library() is None:
        pytest.skip("the compiled ops' panels need an x86 CPU with AVX-512F and a C++ compiler")
    if dtype == "int8" and int8_panel_library() is None:
        pytest.skip("the compiled 8-bit panels need AVX-512BW and AVX512-VNNI")
    quantization = "int8" if dtype == "int8" else "none"
    model = load_model(
        str(tiny_model_dir), dtype="float32" if dtype == "int8" else dtype, quantization=quantization
    ).model
    fused = NativeForward(model, fresh_cache(model, poisoned=True), batch_hint=4, kernel_choice="compiled")
    loop = NativeForward(model, fresh_cache(model, poisoned=True), batch_hint=4, kernel_choice="compiled")
    assert fused.fused_layers and loop.fused_layers
    loop.fused_layers = False

    def no_loop(*args: object, **kwargs: object) -> None:
        raise AssertionError("the fused pass ran the Python loop")

    fused._layers = no_loop  # type: ignore[method-assign]
    generator = torch.Generator().manual_seed(4)
    first = torch.randint(10, 200, (37,), generator=generator).tolist()
    second = torch.randint(10, 200, (23,), generator=generator).tolist()
    steps = [
        (first, list(range(37)), [slot_segment(0, 0, 37)], list(range(37))),
        (first[:20], list(range(20)), [slot_segment(1, 0, 20)], [19]),
        (first[20:], list(range(20, 37)), [slot_segment(1, 20, 17)], [16]),
        (
            [5, 6, *second[:15]], [37, 37, *range(15)],
            [slot_segment(0, 37, 1), slot_segment(1, 37, 1), slot_segment(2, 0, 15)], [0, 1, 16],
        ),
        ([7], [38], [slot_segment(0, 38, 1)], [0]),
    ]  # fmt: skip
    for ids, positions, segments, emit in steps:
        got = fused(torch.tensor(ids), torch.tensor(positions), segments, emit)
        want = loop(torch.tensor(ids), torch.tensor(positions), segments, emit)
        assert torch.isfinite(got).all()
        assert torch.equal(got, want)
    for mine, theirs in zip(fused.cache.layers, loop.cache.layers, strict=True):
        assert torch.equal(mine.keys.nan_to_num(), theirs.keys.nan_to_num())
        assert torch.equal(mine.values.nan_to_num(), theirs.values.nan_to_num())


def resident_kib(address: int) -> int:
    """Rss of the mapping of this process that holds ``address`` (``/proc/self/smaps``)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if ":" not in head[0]:  # a mapping's first line: "low-high perms offset ..."
                low, high = (int(x, 16) for x in head[0].split("-"))
                inside = low <= address < high
            elif inside and head[0] == "Rss:":
                return int(head[1])
    raise AssertionError("no mapping holds the address")


def pages_cached(path: Path) -> int:
    """Pages of ``path`` in the page cache (``mincore`` over a fresh read-only mapping of it)."""
    import ctypes
    import mmap

    import numpy as np

    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mapped:
        vector = (ctypes.c_ubyte * -(-size // mmap.PAGESIZE))()
        view = np.frombuffer(mapped, dtype=np.uint8)
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vector) == 0
        del view
        return sum(byte & 1 for byte in vector)


@pytest.mark.skipif(platform.system() != "Linux", reason="madvise and /proc are Linux's")
def test_page_out_gives_a_checkpoints_pages_back_and_keeps_every_byte(tmp_path: Path) -> None:
    """``page_out`` of a weight in a private mapping of a file (how the checkpoint is mapped):
    its whole pages leave the process at once, stay in the page cache for the next start, and
    every byte, its neighbours' too, reads back as the file's. A mapping with a written page
    and anonymous memory (a copy) are reclaimed the safe way: nothing is lost."""
    import mmap

    page = mmap.PAGESIZE
    values = torch.arange(64 * page // 4, dtype=torch.float32)
    path = tmp_path / "weights.bin"
    path.write_bytes(values.numpy().tobytes())
    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:  # rw-p
        whole = torch.frombuffer(mapped, dtype=torch.float32)
        assert torch.equal(whole, values)  # every page touched: resident
        address = whole.data_ptr()
        before = resident_kib(address)
        assert before >= 60 * page // 1024
        mappings = native_module.Mappings.of_this_process()
        weight = whole[100 : 100 + 50 * page // 4]  # not page-aligned at either end
        assert mappings.file_pages(weight.data_ptr(), weight.data_ptr() + weight.numel() * 4)
        native_module.page_out(weight, mappings)
        assert resident_kib(address) <= before - 48 * page // 1024  # its ~49 whole pages left
        assert pages_cached(path) >= 60  # still in the page cache
        assert torch.equal(whole, values)  # read again from the file: the same bytes
        whole[0] = -1.0  # a written page: this mapping's pages are no longer all the file's
        assert not native_module.Mappings.of_this_process().file_pages(address, address + 4)
        native_module.page_out(whole[1:], native_module.Mappings.of_this_process())
        assert whole[0] == -1.0 and torch.equal(whole[1:], values[1:])
        del whole, weight
    anonymous = values.clone()
    assert not native_module.Mappings.of_this_process().file_pages(anonymous.data_ptr(), anonymous.data_ptr() + 4)
    native_module.page_out(anonymous[100:5000], native_module.Mappings.of_this_process())
    assert torch.equal(anonymous, values)


def test_mappings_know_unwritten_file_mappings_only() -> None:
    def mapping(span: str, perms: str, inode: str, path: str, anonymous_kib: int) -> str:
        return f"{span} {perms} 00000000 08:01 {inode} {path}\nRss: 64 kB\nAnonymous: {anonymous_kib} kB\nVmFlags: rd\n"

    maps = native_module.Mappings(
        mapping("7f0000000000-7f0000010000", "rw-p", "1234", "/cache/model.safetensors", 0)
        + mapping("7f0000010000-7f0000020000", "rw-p", "1235", "/cache/written.bin", 4)
        + mapping("7f0000020000-7f0000030000", "rw-p", "0", "", 0)
        + mapping("7f0000030000-7f0000040000", "r--s", "99", "/cache/shared.bin", 0)
    )
    assert maps.file_pages(0x7F0000001000, 0x7F0000010000)
    assert not maps.file_pages(0x7F0000001000, 0x7F0000010001)  # runs past it
    assert not maps.file_pages(0x7F0000011000, 0x7F0000012000)  # a page written
    assert not maps.file_pages(0x7F0000021000, 0x7F0000022000)  # anonymous
    assert maps.file_pages(0x7F0000030000, 0x7F0000030004)
    assert not maps.file_pages(0x6F0000000000, 0x6F0000000004)  # below every mapping
    assert not native_module.Mappings().file_pages(0x7F0000001000, 0x7F0000002000)


def test_a_chunks_causal_bias_on_cuda_attends_as_its_mask_does() -> None:
    """On CUDA a prompt chunk's causal mask is ``causal_lower_right`` (``ops.chunk_plan``): no mask
    crosses from the host, and flash attention takes it with grouped heads (an explicit mask with
    ``enable_gqa`` ran SDPA's math backend). Its alignment is the mask's: run here, where SDPA
    materialises the bias, both give the same attention for chunks at several depths, GQA 3:1."""
    from tokenwire_server.engine.ops import chunk_attention, chunk_plan
    from torch.nn.attention.bias import causal_lower_right

    torch.manual_seed(0)
    block, heads, kv_heads, dim = 16, 6, 2, 16
    keys, values = torch.randn(2, 9, kv_heads, block, dim).unbind(0)
    for start, count in ((0, 5), (7, 9), (40, 24), (100, 1)):
        table = tuple(range(8, 8 - (start + count + block - 1) // block, -1))  # blocks in any order
        segment = Segment(table, start, count)
        ((tables, mask),) = chunk_plan([segment], block, 8, torch.device("cpu"))
        assert mask.shape == (1, 1, count, start + count)
        q = torch.randn(count, heads, dim)
        by_mask = chunk_attention(q, keys, values, segment, (tables, mask), dim**-0.5)
        by_bias = chunk_attention(
            q, keys, values, segment, (tables, causal_lower_right(count, start + count)), dim**-0.5
        )
        assert torch.equal(by_mask, by_bias), (start, count)


@pytest.mark.parametrize("pairs", [False, True], ids=["float", "bf16-pairs"])
def test_fused_layers_go_straight_into_the_panels_of_their_concatenation(
    monkeypatch: pytest.MonkeyPatch, pairs: bool
) -> None:
    """q/k/v (or gate/up) are copied part by part into their panels, one copy at start: the
    panels are those of the concatenated matrix (a part that ends inside a panel takes the
    concatenation first), in float32 and as bf16 pairs. Layout only: no GEMM runs, so any
    CPU checks it (a fake library stands for the compiled one)."""
    library: Any = type("Library", (), {"cpu_has_avx512bf16": staticmethod(lambda: pairs)})()
    dtype = torch.bfloat16 if pairs else torch.float32
    generator = torch.Generator().manual_seed(0)
    for rows in ([48, 16, 16], [40, 8, 16]):
        parts = [torch.randn(r, 8, generator=generator).to(dtype) for r in rows]
        whole = torch.cat(parts)
        fused = native_module.Linear(parts, None, True, 4, library)
        assert fused.kind == "panels" and fused.pairs == pairs
        if pairs:
            expected = whole.view(torch.int32).view(-1, 16, 4).transpose(1, 2).contiguous().view(torch.bfloat16)
        else:
            expected = whole.view(-1, 16, 8).transpose(1, 2).contiguous()
        assert torch.equal(fused.weight, expected)
