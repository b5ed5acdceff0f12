"""The compiled decode step (``engine/graphs.py``), checked on a CPU.

A CUDA graph holds what ``graphs.DecodeGraphs`` feeds it: the native pass's fixed-shape
``decode_step`` over a bucket's buffers. ``--step-graphs static`` runs that same step
and those same buffers without the graph, so here, without a GPU:

- the buckets: batch sizes, table widths, what falls back to the eager step;
- which mode ``--step-graphs`` / ``--compile-step`` come to, and what they refuse;
- the fixed-shape step's logits equal the eager native pass's, with padding rows in the
  bucket, on a cache whose unused memory is NaN, and it writes nowhere but each row's
  own column and the scratch block;
- the engine gives the same greedy and seeded tokens with ``static`` as with the eager
  step, steps of decode rows alone go through a bucket and steps with a prompt chunk do not;
- ``--compile-step on`` (inductor's C++ backend on this CPU) gives the same tokens;
- the capture itself, with CUDA's stream and graph calls faked (``FakeGraph``: a replay
  runs the recorded step again on the buffers' current contents): warm-up on a side
  stream, one recording per key, one shared pool, every step replayed, the same tokens.

What only a GPU shows (the capture itself, its speed) is ``make test-gpu`` and
``benchmarks/gpu-check.sh``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import fresh_cache, run_all, slot_segment, slot_table
from tokenwire_server.config import parse_config
from tokenwire_server.domain import FinishEvent, GenerationRequest, SamplingOptions
from tokenwire_server.engine import create_engine
from tokenwire_server.engine.base import EngineLimits
from tokenwire_server.engine.graphs import DecodeGraphs, batch_buckets, bucket_for, resolve_mode, width_for
from tokenwire_server.engine.native import NativeForward
from tokenwire_server.model import load_model

pytestmark = pytest.mark.timeout(600)
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_batch_buckets_reach_the_first_at_or_past_max_active() -> None:
    assert batch_buckets(1) == (1,)
    assert batch_buckets(16) == (1, 2, 4, 8, 16)
    assert batch_buckets(12) == (1, 2, 4, 8, 16)
    assert batch_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 128)
    assert batch_buckets(200) == (1, 2, 4, 8, 16, 32, 64, 128, 200)
    assert [bucket_for(n, batch_buckets(16)) for n in (1, 2, 3, 5, 9, 16, 17)] == [1, 2, 4, 8, 16, 16, None]


def test_table_widths_are_powers_of_two_up_to_a_rows_most() -> None:
    assert [width_for(b, 128) for b in (0, 1, 2, 3, 5, 8, 9, 100, 128)] == [1, 1, 2, 4, 8, 8, 16, 128, 128]
    assert width_for(9, 12) == 12  # a row never has more blocks than the context holds


def test_the_modes_graph_on_cuda_by_default_and_refuse_what_cannot_run() -> None:
    assert resolve_mode("auto", True, CUDA) == ("cuda", None)
    mode, why = resolve_mode("auto", True, CPU)
    assert mode == "off" and why is not None and "CUDA" in why
    assert resolve_mode("auto", True, CPU, compile_step=True) == ("static", None)
    assert resolve_mode("auto", False, CUDA)[0] == "off"  # transformers' forward: nothing to graph
    assert resolve_mode("static", True, CPU) == ("static", None)
    assert resolve_mode("off", True, CUDA) == ("off", "--step-graphs off")
    with pytest.raises(ValueError, match="--step-graphs cuda needs a CUDA device"):
        resolve_mode("cuda", True, CPU)
    with pytest.raises(ValueError, match="needs the native pass"):
        resolve_mode("static", False, CPU)
    with pytest.raises(ValueError, match="--compile-step on needs the native pass"):
        resolve_mode("auto", False, CPU, compile_step=True)
    with pytest.raises(ValueError, match="not with --step-graphs off"):
        resolve_mode("off", True, CPU, compile_step=True)
    with pytest.raises(ValueError, match="unknown step graphs"):
        resolve_mode("always", True, CPU)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        DecodeGraphs(lambda *a: torch.zeros(0), CPU, 16, 0, 4, 4, 0, capture=True)


def test_the_flags_parse() -> None:
    config = parse_config(["--step-graphs", "static", "--compile-step", "on", "--step-graphs-context", "0"])
    assert (config.step_graphs, config.compile_step, config.step_graphs_context) == ("static", "on", 0)
    assert parse_config([]).step_graphs_context == 4096
    with pytest.raises(SystemExit):
        parse_config(["--step-graphs-context", "-1"])
    assert (parse_config([]).step_graphs, parse_config([]).compile_step) == ("auto", "off")
    with pytest.raises(SystemExit):
        parse_config(["--step-graphs", "sometimes"])


def test_the_prefill_budget_is_the_devices_unless_given() -> None:
    """``--max-prefill-tokens 0`` (the default): 20 on a CPU, 512 on a GPU, where a chunk that
    small only lengthens the time to first token; a number given is kept; a negative refused."""
    from tokenwire_server.engine.options import prefill_budget

    assert parse_config([]).max_prefill_tokens == 0
    assert prefill_budget(0, CPU) == (20, "auto: 20 on cpu")
    assert prefill_budget(0, CUDA) == (512, "auto: 512 on cuda")
    assert prefill_budget(64, CUDA) == (64, "--max-prefill-tokens")
    assert parse_config(["--max-prefill-tokens", "64"]).max_prefill_tokens == 64
    with pytest.raises(SystemExit):
        parse_config(["--max-prefill-tokens", "-1"])


def test_the_fixed_shape_step_matches_the_eager_pass_and_writes_only_its_rows_and_scratch(tiny_model_dir: Path) -> None:
    loaded = load_model(str(tiny_model_dir))
    cache = fresh_cache(loaded.model, poisoned=True)  # unused memory is NaN: any stray read shows
    native = NativeForward(loaded.model, cache, batch_hint=4, kernel_choice="torch")
    generator = torch.Generator().manual_seed(3)
    # Three rows at different lengths (one past a block boundary), prompts read eagerly.
    lengths = [5, 17, 33]
    prompts = [torch.randint(10, loaded.vocab_size, (n,), generator=generator) for n in lengths]
    for slot, prompt in enumerate(prompts):
        native(prompt, torch.arange(len(prompt)), [slot_segment(slot, 0, len(prompt))], [len(prompt) - 1])
    nxt = [7, 8, 9]
    eager = native(
        torch.tensor(nxt), torch.tensor(lengths), [slot_segment(s, n, 1) for s, n in enumerate(lengths)], [0, 1, 2]
    )
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]

    graphs = DecodeGraphs(
        native.decode_step, CPU, cache.block_size, cache.scratch, max_rows=4, max_width=16, pad_id=0, capture=False
    )
    tables = [list(slot_table(s)) for s in range(3)]
    with torch.inference_mode():
        static = graphs.run(nxt, lengths, tables)
    assert static is not None and static.shape == eager.shape
    assert torch.isfinite(static).all()
    assert (static - eager).abs().max().item() < 1e-4
    assert graphs.keys() == [(4, 4)]  # 3 rows in the bucket of 4 (a padding row); 34 columns: 3 blocks -> width 4

    # Nothing moved but each row's own column (rewritten: the same token) and the scratch block.
    written = {(slot_table(s)[n // 16], n % 16) for s, n in enumerate(lengths)}
    for (keys_before, values_before), layer in zip(before, cache.layers, strict=True):
        for block in range(cache.scratch):
            for offset in range(16):
                if (block, offset) in written:
                    continue
                for old, new in ((keys_before, layer.keys), (values_before, layer.values)):
                    assert torch.equal(old[block, :, offset].nan_to_num(7.0), new[block, :, offset].nan_to_num(7.0)), (
                        block,
                        offset,
                    )


def test_more_rows_than_the_largest_bucket_or_a_wider_table_fall_back_to_the_eager_step(tiny_model_dir: Path) -> None:
    loaded = load_model(str(tiny_model_dir))
    cache = fresh_cache(loaded.model)
    native = NativeForward(loaded.model, cache, batch_hint=4, kernel_choice="torch")
    graphs = DecodeGraphs(
        native.decode_step, CPU, cache.block_size, cache.scratch, max_rows=2, max_width=2, pad_id=0, capture=False
    )
    tables = [list(slot_table(s)) for s in range(3)]
    with torch.inference_mode():
        assert graphs.run([1, 2, 3], [0, 0, 0], tables) is None  # 3 rows: buckets stop at 2
        assert graphs.run([1], [40], tables[:1]) is None  # 41 columns: 3 blocks, wider than 2
        assert graphs.run([1, 2], [0, 20], tables[:2]) is not None
    assert graphs.keys() == [(2, 2)] and graphs.replays == 1


def test_prepare_sets_up_every_bucket_at_every_width_up_to_the_context_once() -> None:
    calls: list[tuple[int, int]] = []
    graphs = DecodeGraphs(lambda *inputs: torch.zeros(len(inputs[0]), 3), CPU, 16, 99, 5, 512, 0, capture=False)
    real = graphs._set_up
    graphs._set_up = lambda rows, width: calls.append((rows, width)) or real(rows, width)  # type: ignore[method-assign]
    assert graphs.prepare(0) == 0 and calls == []  # 0: each key when first needed
    assert graphs.prepare(1000) == 4 * 7  # buckets 1, 2, 4 and 8 (the first past --max-active 5); widths 1..64
    assert sorted({w for _, w in calls}) == [1, 2, 4, 8, 16, 32, 64] and {r for r, _ in calls} == {1, 2, 4, 8}
    assert graphs.prepare(1000) == 0  # set up already
    assert graphs.prepare(100_000) == 4 * 3  # up to the row's most, 512 blocks: 128, 256, 512 more
    # A row's most that is no power of two (a small pool) is itself the widest width, as width_for gives it.
    capped = DecodeGraphs(lambda *inputs: torch.zeros(len(inputs[0]), 3), CPU, 16, 99, 1, 100, 0, capture=False)
    assert capped.prepare(100_000) == 8 and capped.keys()[-1] == (1, 100) and width_for(65, 100) == 100


def requests_for(loaded: object, sampled: bool) -> list[GenerationRequest]:
    tok = loaded.tokenizer  # type: ignore[attr-defined]
    out = []
    for i in range(5):
        sampling = (
            SamplingOptions(temperature=0.8, top_p=0.9, seed=100 + i)
            if sampled and i % 2
            else SamplingOptions(temperature=0.0)
        )
        prompt = tok(f"Story {i}: " + "once upon a time " * (i * 4))["input_ids"]
        # Lengths 24, 20, ... 8: the batch shrinks as they end, through several buckets.
        out.append(GenerationRequest(f"r{i}", prompt, sampling, 24 - 4 * i, ignore_eos=True, want_tokens=True))
    return out


def generate(
    model_dir: Path, step_graphs: str, compile_step: bool = False, max_active: int = 8, quantization: str = "none"
) -> tuple[list[list[int]], object]:
    loaded = load_model(str(model_dir), quantization=quantization)
    engine = create_engine(
        "batched", loaded, EngineLimits(max_active, 8, 8 * 1024, max_prefill_tokens=16), workers=1,
        kernels="torch", step_graphs=step_graphs, compile_step=compile_step,
    )  # fmt: skip
    runner = engine.runner  # type: ignore[attr-defined]
    engine.graph_log = []  # type: ignore[attr-defined]  # per step: (prompt tokens, decode rows, through a bucket)
    if runner.graphs is not None:
        launch, run = runner.launch, runner.graphs.run

        def logged_launch(plan: Any) -> Any:
            engine.graph_log.append([plan.prompt_tokens, plan.decodes, False])  # type: ignore[attr-defined]
            return launch(plan)

        def logged_run(*args: Any) -> Any:
            out = run(*args)
            engine.graph_log[-1][2] = out is not None  # type: ignore[attr-defined]
            return out

        runner.launch, runner.graphs.run = logged_launch, logged_run
    engine.start()
    try:
        recorders = run_all(engine, requests_for(loaded, sampled=True), timeout=300)
    finally:
        engine.close()
    return [r.token_ids for r in recorders], engine


def test_the_engine_gives_the_same_tokens_through_the_buckets_as_eagerly(tiny_model_dir: Path) -> None:
    # Two slots for five requests: the later prompts are read while the others decode, in
    # 16-token chunks (the prefill budget while anyone decodes), in steps with decode rows.
    eager, plain = generate(tiny_model_dir, "off", max_active=2)
    assert plain.runner.graphs is None  # type: ignore[attr-defined]
    static, engine = generate(tiny_model_dir, "static", max_active=2)
    assert static == eager
    graphs = engine.runner.graphs  # type: ignore[attr-defined]
    assert engine.step_graphs == "static" and graphs is not None  # type: ignore[attr-defined]
    # Every step of decode rows alone went through a bucket (2 rows at most: all fit the
    # largest, and every table the widest); no step that read a prompt chunk did, those with
    # decode rows beside the chunk included.
    log = engine.graph_log  # type: ignore[attr-defined]
    assert len(log) == engine.steps + engine.prefill_steps - sum(1 for p, d, _ in log if p and d)  # type: ignore[attr-defined]
    decode_only = [bucketed for prompt, decodes, bucketed in log if decodes and not prompt]
    with_prompt = [bucketed for prompt, _, bucketed in log if prompt]
    assert sum(1 for prompt, decodes, _ in log if prompt and decodes) >= 3 and not any(with_prompt)
    assert decode_only and all(decode_only)
    assert graphs.replays == len(decode_only)
    assert {rows for rows, _ in graphs.keys()} <= set(graphs.buckets)
    assert graphs.captures == len(graphs.keys())


def test_a_bucket_that_runs_out_of_memory_as_it_is_set_up_runs_its_steps_eagerly(tiny_model_dir: Path) -> None:
    """#39 item 8: a key whose set-up (a capture, on CUDA) runs out of device memory is refused,
    at start or mid-run, and its steps run the eager pass: every row gets its tokens, none gives
    way, and the key is never set up again (before, every step that needed it failed its newest
    row and tried the same capture again)."""
    eager, _ = generate(tiny_model_dir, "off")
    loaded = load_model(str(tiny_model_dir))
    engine = create_engine(
        "batched", loaded, EngineLimits(8, 8, 8 * 1024, max_prefill_tokens=16), workers=1,
        kernels="torch", step_graphs="static",
    )  # fmt: skip
    graphs = engine.runner.graphs  # type: ignore[attr-defined]
    real, tried = graphs._set_up, []

    def set_up(rows: int, width: int) -> Any:
        tried.append((rows, width))
        if rows == 4 or width == 1:  # width 1: every bucket's narrowest table, needed only mid-run
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(rows, width)

    graphs._set_up = set_up
    graphs.prepare(64)  # at start: every bucket at widths 1..4 blocks
    assert graphs.refused == {(rows, 1) for rows in graphs.buckets} | {(4, 2), (4, 4)}
    engine.start()
    try:
        recorders = run_all(engine, requests_for(loaded, sampled=True), timeout=300)
    finally:
        engine.close()
    assert [r.token_ids for r in recorders] == eager
    assert all(isinstance(r.last, FinishEvent) for r in recorders)  # none gave way
    assert len(tried) == len(set(tried))  # a refused key is never tried again
    assert {rows for rows, _ in graphs.refused} >= {4} and graphs.replays > 0


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_a_compiled_step_on_this_cpu_gives_the_same_tokens(tiny_model_dir: Path, quantization: str) -> None:
    """inductor's C++ backend compiles the step once per bucket (2 buckets here: max_active 2).
    int8: where the CPU runs the 8-bit panels, the step calls the compiled ops' ``panel_linear``,
    which inductor traces through its meta kernel (without it: every decode step failed)."""
    eager, _ = generate(tiny_model_dir, "off", max_active=2, quantization=quantization)
    compiled, engine = generate(tiny_model_dir, "auto", compile_step=True, max_active=2, quantization=quantization)
    assert engine.step_graphs == "static"  # type: ignore[attr-defined]
    graphs = engine.runner.graphs  # type: ignore[attr-defined]
    assert graphs.compiled and graphs.replays > 0
    assert engine.runner.native.packed is False  # type: ignore[attr-defined]  # plain weights: inductor traces them
    assert compiled == eager


class FakeGraph:
    """What a CUDA graph does, on a CPU: capture records the step (its function, its input
    buffers, its output buffer); replay runs it again on whatever the buffers now hold and
    writes into the same output. A graph that read stale inputs, or an output read after the
    next replay, shows as wrong tokens."""

    capturing: list[FakeGraph] = []

    def __init__(self) -> None:
        self.recorded: tuple[Any, tuple[torch.Tensor, ...], torch.Tensor] | None = None
        self.replays = 0

    def pool(self) -> tuple[str, int]:
        return ("pool", id(self))

    def replay(self) -> None:
        assert self.recorded is not None, "replayed before anything was captured"
        step, inputs, out = self.recorded
        out.copy_(step(*inputs))
        self.replays += 1


class FakeStream:
    def __init__(self, device: object = None) -> None:
        self.waited: list[FakeStream] = []

    def wait_stream(self, other: FakeStream) -> None:
        self.waited.append(other)


def test_the_capture_warms_up_on_a_side_stream_records_once_per_key_and_replays_with_each_steps_inputs(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import contextlib

    eager, _ = generate(tiny_model_dir, "off")
    loaded = load_model(str(tiny_model_dir))
    engine = create_engine(
        "batched",
        loaded,
        EngineLimits(8, 8, 8 * 1024, max_prefill_tokens=16),
        workers=1,
        kernels="torch",
        step_graphs="static",
    )
    graphs = engine.runner.graphs  # type: ignore[attr-defined]
    graphs.capture = True  # what --step-graphs cuda sets; the CUDA calls below are fakes
    pools: list[object] = []
    calls = {"warm-up": 0, "capture": 0}
    on_side = [False]
    current = FakeStream()
    step = graphs.step

    def recording(*inputs: torch.Tensor) -> torch.Tensor:
        out = step(*inputs)
        if FakeGraph.capturing:
            calls["capture"] += 1
            FakeGraph.capturing[-1].recorded = (step, inputs, out)
        else:
            assert on_side[0], "a step outside a capture ran off the side stream"
            calls["warm-up"] += 1
        return out

    @contextlib.contextmanager
    def side_stream(stream: FakeStream) -> Any:
        on_side[0] = True
        yield
        on_side[0] = False

    @contextlib.contextmanager
    def capture(graph: FakeGraph, pool: object = None) -> Any:
        pools.append(pool)
        FakeGraph.capturing.append(graph)
        yield
        FakeGraph.capturing.pop()

    graphs.step = recording
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", side_stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    engine.start()
    # At start, every bucket (1, 2, 4, 8) at every width (1 ... 64 blocks: the tiny model's
    # 1,024-token context, under --step-graphs-context's 4,096) is captured before any step.
    prepared = graphs.captures
    assert prepared == 4 * 7 and calls["capture"] == prepared
    try:
        recorders = run_all(engine, requests_for(loaded, sampled=True), timeout=300)
        pool, entries = graphs._pool, dict(graphs._entries)
    finally:
        engine.close()
    assert [r.token_ids for r in recorders] == eager
    keys = graphs.keys()
    assert graphs.captures == prepared  # no capture while serving
    assert len(keys) >= 2 and graphs.captures == len(keys) == len(entries)
    assert calls == {"warm-up": 2 * len(keys), "capture": len(keys)}  # WARMUP_RUNS each, then one recording
    assert pools[0] is None and pool is not None
    assert set(pools[1:]) <= {pool}  # every later graph in the first one's pool
    assert sum(entry.graph.replays for entry in entries.values()) == graphs.replays
    assert current.waited  # the capture waited for the side stream's warm-up
    # Closed, the engine holds no graph, no pool and no KV memory any more.
    assert graphs._entries == {} and graphs._pool is None
    assert all(layer.keys.untyped_storage().nbytes() == 0 for layer in engine._cache.layers)
