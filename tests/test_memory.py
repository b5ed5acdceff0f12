"""Memory that matches its check (engine/memory.py), proven on the ``meta`` device.

On a GPU with ``--kv-cache-tokens 0`` the batched engine sizes its KV pool last: it builds
everything else, runs its worst step on a probe pool of a few blocks, and gives KV what
``--kv-cache-memory-fraction`` of the card leaves. Here the card is simulated: every tensor lives
on ``meta`` and ``LiveBytes`` counts what is allocated while it lives, so the weights (the 1B and
8B shapes, bf16), the engine, the pool and each step's peak are counted as a CUDA allocator would
hold them (without its rounding and cache). Shown:

- committed memory (weights + engine + pool) plus the worst step comes to the check, 0.9 of a
  24 GiB or 141 GiB card, within two KV blocks below it and never above;
- a pool that cannot hold a row of the whole context beside the worst step narrows the context
  (the 8B shape on 24 GiB) to a width whose own worst step leaves room for that row;
- there, the pool admits 16 streams of 1,024 tokens at once, and alone one request of 8,192;
- steps the scheduler plans from real requests (a long prompt read and scored in chunks beside
  15 decoding rows, then all 16 decoding, the long one at the last column) never hold more than
  the worst step measured at start.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from test_scheduler import SHAPES, FakeSeq, meta_model, prompt, run_to_end, submit
from tokenwire_server.domain import SamplingOptions
from tokenwire_server.engine.base import EngineLimits
from tokenwire_server.engine.batched import BatchedEngine
from tokenwire_server.engine.blocks import BLOCK_SIZE, Lease, blocks_for
from tokenwire_server.engine.budget import DEFAULT_MAX_ACTIVE, TOKENS_PER_STREAM, active_streams
from tokenwire_server.engine.memory import DeviceMemory, LiveBytes, WorstStep, fit_columns, peak_bytes
from tokenwire_server.engine.options import EngineOptions
from tokenwire_server.engine.scheduler import Part, Row
from tokenwire_server.model import ModelLoadError, kv_bytes_per_token

GIB = 2**30
FRACTION = 0.9  # ServerConfig().kv_cache_memory_fraction
SLACK = 2**20  # what the last step leaves held (its tables and write places on the device: a few KiB)


def test_live_bytes_counts_storages_while_they_live_and_their_peak() -> None:
    before = torch.empty(1000, device="meta")  # made outside: not counted
    with LiveBytes() as live:
        a = torch.empty(1000, device="meta")  # 4,000 bytes
        b = a * 2 + before  # a temporary and b: 8,000 at most at once, b stays
        view = b.view(10, 100)  # a view: nothing new
        before.add_(1).mul_(2)  # in place on a storage made outside: nothing
        assert (live.now, live.peak) == (8000, 12000)
        del b
        assert live.now == 8000  # the view keeps b's storage
        del view, a
        assert (live.now, live.peak) == (0, 12000)


def _affine(base: int, per_column: int) -> Any:
    def measure(columns: int) -> WorstStep:
        return WorstStep(base + per_column * columns, 0, 0, 16, 2048, columns)

    return measure


def test_fit_columns_keeps_the_context_where_it_fits_and_else_finds_the_widest_row_the_pool_holds() -> None:
    per_token, context = 1000, 131072
    # room for the step at the whole context and a row of it
    step = fit_columns(_affine(10**6, 50), 10**6 + 50 * context + per_token * context, per_token, context)
    assert step.columns == context
    # less: the widest row c whose step leaves c tokens: base + (per_column + per_token) c <= room
    room = 10**6 + 1050 * 20000
    step = fit_columns(_affine(10**6, 50), room, per_token, context)
    assert (room - step.total) // per_token >= step.columns
    assert 20000 - BLOCK_SIZE <= step.columns <= 20000 and step.columns % BLOCK_SIZE == 0
    with pytest.raises(ModelLoadError, match="no room for a KV cache.*lower --max-active"):
        fit_columns(_affine(10**6, 50), 10**6 - 1, per_token, context)
    # a width whose step runs out of device memory leaves no room: a narrower one is found
    affine = _affine(10**6, 50)

    def runs_out_past_30000(columns: int) -> WorstStep:
        if columns > 30000:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return affine(columns)

    step = fit_columns(runs_out_past_30000, room, per_token, context)
    assert step.columns <= 20000 and (room - step.total) // per_token >= step.columns


class MetaCard(LiveBytes):
    """A card of ``total`` bytes: what is in use is what lives on ``meta`` since it was entered."""

    def __init__(self, total: int) -> None:
        super().__init__()
        self.total = total

    def read(self) -> tuple[int, int]:
        return self.total, self.total - self.now


def sized_engine(card: MetaCard, shape: str, forward: str) -> BatchedEngine:
    """The 1B or 8B shape in bf16 and the batched engine as the server builds it on a GPU with
    default flags (16 streams, a 512-token prompt budget, KV from 0.9 of the card), on ``card``."""
    loaded = meta_model(SHAPES[shape])
    limits = EngineLimits(16, 64, 0, max_prefill_tokens=512, kv_memory=DeviceMemory(card.read, FRACTION))
    graphs = "static" if forward == "native" else "off"  # the fixed-shape step CUDA captures
    options = EngineOptions(forward=forward, step_graphs=graphs, own_weights=True)
    return BatchedEngine(loaded, limits, options=options)


@pytest.mark.parametrize("forward", ["native", "transformers"])
@pytest.mark.parametrize(("shape", "card_gib"), [("1b", 24), ("1b", 141), ("llama-3.1-8b", 24), ("llama-3.1-8b", 141)])
def test_committed_memory_and_the_worst_step_come_to_the_check(
    shape: str, card_gib: int, forward: str, caplog: pytest.LogCaptureFixture
) -> None:
    with MetaCard(card_gib * GIB) as card, caplog.at_level(logging.INFO, "tokenwire_server.engine.batched"):
        engine = sized_engine(card, shape, forward)
        worst = engine.worst_step
        assert worst is not None and worst.rows == 16 and worst.chunk == 2048  # an idle engine's chunk
        committed = card.now  # the weights, the engine and the pool
        check = int(FRACTION * card.total)
        block = engine._cache.bytes_per_token * BLOCK_SIZE
        (sized,) = [r for r in caplog.records if r.getMessage() == "kv cache sized from device memory"]
        usable = 16 * blocks_for(engine.context_limit)  # what 16 streams of the context could hold
        if shape == "1b":
            # A 1B model's 16 streams of 8,192 tokens fill a small part of either card: the pool is
            # what admission could ever hold, and the rest of the card stays free.
            assert sized.capped_at_admission and engine.pool.num_blocks == usable  # type: ignore[attr-defined]
            assert sized.room_tokens > 4 * engine.limits.kv_cache_tokens  # type: ignore[attr-defined]
        else:
            # The 8B model fills the card before its 16 streams could fill the pool.
            assert not sized.capped_at_admission and engine.pool.num_blocks < usable  # type: ignore[attr-defined]
            assert sized.room_tokens == engine.limits.kv_cache_tokens  # type: ignore[attr-defined]
        # What the card had room for (the pool it holds and, where capped, what it left free) comes to the check.
        unused = (sized.room_tokens - engine.limits.kv_cache_tokens) * engine._cache.bytes_per_token  # type: ignore[attr-defined]
        assert check - 2 * block - SLACK <= committed + unused + worst.total <= check, (committed, unused, worst, check)
        pool = engine._cache.nbytes()
        assert pool == (engine.pool.num_blocks + 1) * block
        assert engine.limits.kv_cache_tokens == engine.pool.num_blocks * BLOCK_SIZE
        # the pool holds a row of the context it publishes, beside that row's worst step
        assert engine.context_limit == worst.columns <= engine.limits.kv_cache_tokens
        if shape == "llama-3.1-8b" and card_gib == 24:
            # 15 GiB of weights: a row of 131,072 tokens needs 16 GiB of KV alone. Narrowed, not refused.
            assert 14.5 * GIB < committed - pool < 15.5 * GIB  # 8.03 B parameters in bf16 (and the engine's few own)
            assert 8192 < engine.context_limit < 131072
            # the operator is told, with what would lengthen it
            (narrowed,) = [r for r in caplog.records if r.getMessage().startswith("context narrowed")]
            assert narrowed.levelno == logging.WARNING and f"to {engine.context_limit} tokens" in narrowed.getMessage()
            assert "--max-active" in narrowed.getMessage()
        else:
            assert engine.context_limit == engine.loaded.context_length
            assert not [r for r in caplog.records if r.getMessage().startswith("context narrowed")]
        assert sized.kv_cache_tokens == engine.limits.kv_cache_tokens  # type: ignore[attr-defined]
        assert sized.context_limit == engine.context_limit  # type: ignore[attr-defined]
        if shape == "llama-3.1-8b" and card_gib == 24 and forward == "native":
            # there, 16 streams of 1,024 tokens are admitted at once, and alone one of 8,192 (transformers'
            # forward, its rectangles' activations larger, leaves a pool of ~15,000 tokens)
            s = engine.scheduler
            streams = [FakeSeq(prompt(1000, 1000 + 2000 * i), 24, f"s{i}") for i in range(16)]
            submit(s, *streams)
            s.admit()
            assert [row.seq for row in s.rows] == streams
            run_to_end(s)
            long = FakeSeq(prompt(7000), 1192)
            submit(s, long)
            s.admit()
            assert [row.seq for row in s.rows] == [long]
            assert blocks_for(8192) <= s.pool.num_blocks
        if shape == "1b":
            assert worst.eager < 3 * GIB  # the scored 2,048-token chunk's logits, twice, and the rest


class SampledSeq(FakeSeq):
    """A scheduler test's request that the runner can also step: sampled, with log-probabilities."""

    def __init__(self, tokens: list[int], max_new: int, name: str, scored: bool = False) -> None:
        super().__init__(tokens, max_new, name)
        self.request.__dict__.update(
            sampling=SamplingOptions(temperature=0.8, top_p=0.95, seed=1), stop_token_ids=frozenset(),
            ignore_eos=True, want_logprobs=True, top_logprobs=5, logprobs_of=(), prompt_top_logprobs=5,
            min_new_tokens=0, prompt_logprobs=scored,
        )  # fmt: skip
        self.scores_prompt = scored
        self.constraint = None
        self.eos_allowed = True
        self.seed = 1

    def seen_ids(self) -> list[int]:
        return self.request.prompt_ids + self.generated

    def generated_counts(self) -> dict[int, int]:
        return dict.fromkeys(self.generated, 1)


@pytest.mark.parametrize("forward", ["native", "transformers"])
def test_the_steps_real_requests_plan_hold_no_more_than_the_worst_step(forward: str) -> None:
    with MetaCard(24 * GIB) as card:
        engine = sized_engine(card, "1b", forward)
        worst = engine.worst_step
        assert worst is not None
        committed = card.now
        s, runner = engine.scheduler, engine.runner
        context = engine.context_limit
        # 15 short chats and one that fills the context, its prompt scored as it is read
        long = SampledSeq(prompt(context - 8, 3), 8, "long", scored=True)
        submit(s, *(SampledSeq(prompt(40 + i, 1000 + 100 * i), 400, f"s{i}") for i in range(15)), long)
        peaks, kinds, step = [], set(), 0
        while not long.finished:
            s.admit()
            plan = s.schedule()
            assert plan is not None
            deep = any(p.row.seq is long and p.start + p.count > context - 1200 for p in plan.parts)
            if step < 3 or deep or step % 16 == 0:  # every step on meta would take minutes: the deep ones
                with peak_bytes(torch.device("meta")) as peak:
                    launched = runner.launch(plan)
                    del launched
                peaks.append(peak[0])
                kinds.add("mixed" if plan.decodes and plan.prompt_tokens else "decode" if plan.decodes else "chunk")
            s.postprocess(plan, [(7, None, (), ())] * len(plan.emitters))
            step += 1
        assert kinds == {"chunk", "mixed", "decode"} and len(peaks) > 10
        assert max(peaks) <= worst.total, (max(peaks), worst)
        assert committed + max(peaks) <= int(FRACTION * card.total)


def test_chunks_read_together_pad_at_most_to_twice_their_tokens_and_the_probe_holds_the_widest() -> None:
    """transformers' forward reads prompt chunks in rectangles (``runner.chunk_groups``): a
    1,000-token chunk beside fifteen one-token ones is read apart from all but one of them (before,
    one pass padded all sixteen to 1,000 tokens); no group's rectangle is more than twice its tokens; and
    the probe's spread plan is one such rectangle of nearly twice the idle budget."""
    import random

    from tokenwire_server.engine.memory import probe_plans
    from tokenwire_server.engine.runner import chunk_groups

    def parts(counts: list[int]) -> list[Any]:
        return [Part(Row(None, Lease([], 0, 0), []), 0, count, False) for count in counts]  # type: ignore[arg-type]

    groups = chunk_groups(parts([1] * 15 + [1000]))
    assert [[p.count for p in g] for g in groups] == [[1000, 1], [1] * 14]  # one rides along: 2 x 1,000 <= 2 x 1,001
    rng = random.Random(0)
    for _ in range(200):
        for group in chunk_groups(parts([rng.randint(1, 2048) for _ in range(rng.randint(1, 16))])):
            assert len(group) * group[0].count <= 2 * sum(p.count for p in group)
    spread = probe_plans(16, 512, 8192, 0)[1]
    (group,) = chunk_groups([p for p in spread.parts if not p.scored])
    assert len(group) == 16 and spread.prompt_tokens == 2048 and 16 * group[0].count >= 1.8 * 2048


def test_a_derived_budget_on_a_gpu_is_left_to_the_engine_and_an_explicit_one_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server's side: with ``--kv-cache-tokens 0`` on CUDA, ``kv_cache_budget`` measures
    nothing itself and hands the engine the card to size from (``EngineLimits.kv_memory``)."""
    import dataclasses

    from tokenwire_server.engine import budget

    loaded = dataclasses.replace(meta_model(SHAPES["1b"]), device=torch.device("cuda", 0))
    monkeypatch.setattr(budget, "free_device_memory", lambda loaded: 20 * GIB)
    read: list[torch.device] = []
    monkeypatch.setattr(budget, "device_memory", lambda device: read.append(device) or (24 * GIB, 20 * GIB))
    derived = budget.kv_cache_budget(0, 16, 8192, 32768, loaded=loaded, memory_fraction=0.8)
    assert derived.tokens == 0 and derived.memory is not None and derived.memory.fraction == 0.8
    assert "worst step" in derived.how and not read  # read when the engine sizes, not before
    assert derived.memory.read() == (24 * GIB, 20 * GIB) and read == [torch.device("cuda", 0)]
    explicit = budget.kv_cache_budget(4096, 16, 8192, 32768, loaded=loaded)
    assert (explicit.tokens, explicit.memory) == (4096, None)
    # and where the engine is not the paged one (the simple engine), the derived budget is checked as before
    assert budget.kv_cache_budget(0, 16, 8192, 32768, loaded=loaded, blocks=False).memory is None


@pytest.mark.parametrize(
    ("shape", "card_gib", "rows"),
    [("1b", 24, 128), ("1b", 141, 128), ("llama-3.1-8b", 24, 16), ("llama-3.1-8b", 141, 32)],
)
def test_max_active_0_takes_the_streams_the_room_holds_and_never_narrows_the_context_for_them(
    shape: str, card_gib: int, rows: int
) -> None:
    """``--max-active 0`` on a GPU whose memory sizes the pool (``budget.active_streams``): a 1B
    model on either card takes the largest bucket, 128 streams; the 8B model on 141 GiB takes 32
    (its widest step's gather, a row of 131,072 tokens per layer, bounds it); on 24 GiB, where its
    context is narrowed at 16 rows already, it keeps 16. The engine built with that count keeps the
    whole context wherever 16 rows kept it, and its pool holds every stream's 2,048 tokens."""
    with MetaCard(card_gib * GIB) as card:
        loaded = meta_model(SHAPES[shape])
        memory = DeviceMemory(card.read, FRACTION)
        per_token = kv_bytes_per_token(loaded.model.config, loaded.dtype)
        layers = int(loaded.model.config.num_hidden_layers)
        sizing = {"context_length": loaded.context_length, "bytes_per_token": per_token, "layers": layers}
        got, why = active_streams(0, memory=memory, **sizing)
        assert got == rows and why.startswith("auto"), why
        assert active_streams(24, memory=memory, **sizing) == (24, "--max-active")
        assert active_streams(0, memory=None, **sizing)[0] == DEFAULT_MAX_ACTIVE
        limits = EngineLimits(rows, 64, 0, max_prefill_tokens=512, kv_memory=memory)
        engine = BatchedEngine(
            loaded, limits, options=EngineOptions(forward="native", step_graphs="static", own_weights=True)
        )
        assert engine.worst_step is not None and engine.worst_step.rows == rows
        if (shape, card_gib) != ("llama-3.1-8b", 24):
            assert engine.context_limit == loaded.context_length
            assert engine.limits.kv_cache_tokens >= rows * min(loaded.context_length, TOKENS_PER_STREAM)
