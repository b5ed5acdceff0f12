"""The batched engine's scheduler and block pool, without a model; its KV memory on ``meta``.

- The block pool promises each admitted request its worst case (prompt + max_new_tokens)
  in blocks; a request waits while they are not free, and one that could never fit fails.
- Prefix caching: full prompt blocks, once written, are published under a key of their
  tokens and everything before them; a later prompt shares the longest cached run (never
  its own last token), idle cached blocks are evicted least recently used first, and
  ``--prefix-cache off`` shares nothing.
- A step's plan: decode rows first, then prompt chunks within the budget; nothing moves
  until ``postprocess``, which delivers each picked token to its request and publishes
  the blocks the step completed; a cancelled row's blocks come back at once.
- Memory: the batched engine built on the ``meta`` device for the 135M, 1B, Llama-2-7B and
  Llama-3.1-8B shapes with default flags commits for KV exactly the budget start-up
  checks, plus one (scratch) block per layer. On a GPU the engine sizes the pool from the
  card's memory after its worst step: tests/test_memory.py.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tokenwire_server.config import ServerConfig
from tokenwire_server.domain import DEFAULT_TENANT, ErrorKind, Priority
from tokenwire_server.engine.base import AdmissionQueue, EngineLimits
from tokenwire_server.engine.batched import BatchedEngine, kv_blocks
from tokenwire_server.engine.blocks import BLOCK_SIZE, BlockPool, blocks_for, prefix_keys
from tokenwire_server.engine.budget import DEFAULT_MAX_ACTIVE, VLLM_RESERVED_TOKENS, active_streams, kv_cache_budget
from tokenwire_server.engine.scheduler import Scheduler
from tokenwire_server.model import LoadedModel, ModelLoadError, kv_budget_for_device, kv_bytes_per_token


class FakeSeq:
    """What the scheduler reads of a request, and what it calls."""

    def __init__(
        self,
        prompt: list[int],
        max_new: int,
        name: str = "",
        resumed: tuple[int, ...] = (),
        tenant: str = DEFAULT_TENANT,
        priority: Priority = Priority.NORMAL,
    ) -> None:
        self.request = SimpleNamespace(
            prompt_ids=list(prompt),
            max_new_tokens=max_new,
            request_id=name,
            arrival=0.0,
            resume_ids=resumed,
            tenant=tenant,
            priority=priority,
            after_prompt=None,
        )
        self.handle = SimpleNamespace(cancelled=False)
        self.adapter = None  # the base model: its prefix-cache chains start from b""
        self.prefix_root = b""
        self.reader = None  # no stream behind it: never parked
        self.finished = False
        self.failed: tuple[ErrorKind, str] | None = None
        self.generated: list[int] = list(resumed)
        self.cached_prompt_tokens = 0
        self.admitted_at: float | None = None
        self.preemptions = 0
        self._context = self.request.prompt_ids + list(resumed)
        self.scores_prompt = False  # OutputOptions.prompt_logprobs (tests/test_prompt_logprobs.py)

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def context_ids(self) -> list[int]:
        return self._context

    def preempt(self) -> None:
        self._context = self.request.prompt_ids + self.generated
        self.preemptions += 1

    @property
    def context_len(self) -> int:
        return len(self.context_ids)

    @property
    def budget_tokens(self) -> int:
        return self.prompt_len + self.request.max_new_tokens

    def expired(self, now: float) -> None:
        return None

    def mark_admitted(self, now: float) -> None:
        if self.admitted_at is None:
            self.admitted_at = now

    def fail(self, kind: ErrorKind, message: str) -> None:
        self.finished, self.failed = True, (kind, message)

    def abandon(self) -> None:
        self.finished = True

    def take(self, token: int, logprob: float | None = None, top: Any = (), named: Any = ()) -> bool:
        self.generated.append(token)
        self.finished = len(self.generated) >= self.request.max_new_tokens
        return self.finished

    def deliver(self) -> bool:
        return self.finished


def scheduler(
    blocks: int, prefix_cache: bool = True, max_active: int = 16, prefill: int = 20, fresh_limit: int | None = None
) -> Scheduler:
    limits = EngineLimits(max_active=max_active, max_queue=64, kv_cache_tokens=blocks * BLOCK_SIZE)
    pool = BlockPool(blocks, BLOCK_SIZE, prefix_cache=prefix_cache, fresh_limit=fresh_limit)
    return Scheduler(AdmissionQueue(limits), pool, max_active, prefill, span_columns=1e9, batch_window_s=0.0)


def submit(s: Scheduler, *seqs: FakeSeq) -> None:
    for seq in seqs:
        s.queue.put(seq)


def run_to_end(s: Scheduler, token: int = 7) -> None:
    """Step with a fixed token for every emitter until no row is left."""
    while s.rows:
        plan = s.schedule()
        assert plan is not None
        s.postprocess(plan, [(token, None, (), ())] * len(plan.emitters))


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


# -- admission by blocks -------------------------------------------------------------------


def test_admission_promises_each_requests_worst_case_and_the_next_waits_for_blocks() -> None:
    s = scheduler(blocks=10)  # 160 tokens
    a, b, c = FakeSeq(prompt(40), 24, "a"), FakeSeq(prompt(40, 5000), 24, "b"), FakeSeq(prompt(40, 9000), 24, "c")
    submit(s, a, b, c)
    s.admit()
    assert [row.seq for row in s.rows] == [a, b]  # 4 blocks each; c's 4 more do not fit in the 2 left
    assert s.pool.available == 2 and s.queue.queued == 1
    assert s.pool.tokens_committed() == 8 * BLOCK_SIZE
    run_to_end(s)  # a and b finish; their blocks come back
    s.admit()
    assert [row.seq for row in s.rows] == [c]


def test_blocks_are_taken_as_a_row_grows_never_past_its_promise() -> None:
    s = scheduler(blocks=10)
    seq = FakeSeq(prompt(20), 30)  # 50 tokens: 4 blocks promised
    submit(s, seq)
    s.admit()
    row = s.rows[0]
    assert row.table == [] and row.lease.promised == 4
    plan = s.schedule()
    assert plan is not None and len(row.table) == 2  # the 20 prompt tokens' blocks, taken for this step
    s.postprocess(plan, [(1, None, (), ())])
    while not seq.finished:
        plan = s.schedule()
        assert plan is not None
        assert len(row.table) * BLOCK_SIZE >= row.length + 1
        s.postprocess(plan, [(1, None, (), ())])
    assert len(seq.generated) == 30
    with pytest.raises(RuntimeError, match="past its reservation"):
        s.pool.grow(row.lease, 100 * BLOCK_SIZE)


def test_the_pools_held_count_is_kept_not_summed_and_always_equals_the_holders() -> None:
    """``held`` (read by every /metrics scrape) is a counter: after random leases, growth,
    publishing, shared prefixes and give-backs it equals the blocks with a holder."""
    import random

    rng = random.Random(3)
    pool = BlockPool(64, BLOCK_SIZE)
    leases = []
    prompts = [list(range(1, 1 + 16 * n)) for n in (1, 2, 3)]
    for _ in range(400):
        if leases and rng.random() < 0.4:
            pool.give_back(leases.pop(rng.randrange(len(leases))))
        else:
            prompt = rng.choice(prompts)
            keys = prefix_keys(prompt, BLOCK_SIZE)
            lease = pool.lease(len(prompt) + 16, keys, len(prompt))
            if lease is None:
                continue
            pool.grow(lease, len(prompt) + rng.randrange(17))
            for index in range(min(len(keys), len(lease.blocks))):
                pool.publish(lease, index, keys[index])
            leases.append(lease)
        assert pool.held == sum(1 for count in pool._holders if count)
    assert pool.held > 0
    for lease in leases:
        pool.give_back(lease)
    assert pool.held == 0 and pool.tokens_committed() == 0


def test_a_pool_of_thirty_million_blocks_costs_four_bytes_a_block() -> None:
    """A GPU's pool for a small model can be tens of millions of blocks (the tiny model on a
    141 GB card: ~30 M): the never-used blocks are a count and the holders an array of 4-byte
    counts, not Python lists (which took ~1 GB: a list slot and an int object per block). Blocks
    are still handed out never-used in order, block 0 first."""
    import tracemalloc

    tracemalloc.start()
    try:
        pool = BlockPool(30_000_000, BLOCK_SIZE)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 30_000_000 * 4 + 2**20, peak
    assert pool.available == 30_000_000 and pool.touched == 0
    lease = pool.lease(40, [], 40)
    assert lease is not None
    pool.grow(lease, 40)
    assert lease.blocks == [0, 1, 2] and pool.touched == 3 and pool.available == 30_000_000 - 3


def test_a_request_past_the_whole_pool_fails_at_once_and_the_others_go_on() -> None:
    s = scheduler(blocks=4)
    big, small = FakeSeq(prompt(60), 10), FakeSeq(prompt(10), 5)
    submit(s, big, small)
    s.admit()
    assert (
        big.failed is not None and big.failed[0] is ErrorKind.INTERNAL and "more than the whole budget" in big.failed[1]
    )
    assert [row.seq for row in s.rows] == [small]
    assert s.queue.active == 1


def test_a_cancelled_row_gives_its_blocks_back_at_the_next_retire() -> None:
    s = scheduler(blocks=8)
    seq = FakeSeq(prompt(30), 50)
    submit(s, seq)
    s.admit()
    plan = s.schedule()
    assert plan is not None
    s.postprocess(plan, [(1, None, (), ())])
    assert s.pool.available == 8 - blocks_for(80)
    seq.handle.cancelled = True
    s.retire(expire=False)
    assert not s.rows and s.pool.available == 8 and s.queue.active == 0


# -- the plan -------------------------------------------------------------------------------


def test_a_step_decodes_every_decoding_row_and_reads_prompt_chunks_within_the_budget() -> None:
    s = scheduler(blocks=64, prefill=20)
    first = FakeSeq(prompt(5), 100)
    submit(s, first)
    s.admit()
    plan = s.schedule()
    assert plan is not None and [(p.start, p.count, p.decodes) for p in plan.parts] == [(0, 5, False)]
    s.postprocess(plan, [(11, None, (), ())])
    assert first.generated == [11]
    second, third = FakeSeq(prompt(30, 3000), 10), FakeSeq(prompt(30, 6000), 10)
    submit(s, second, third)
    s.admit()
    plan = s.schedule()
    assert plan is not None
    # the decode row first, then 20 prompt tokens: 20 of the second prompt, none of the third
    assert [(p.row.seq, p.start, p.count, p.decodes) for p in plan.parts] == [
        (first, 5, 1, True),
        (second, 0, 20, False),
    ]
    assert plan.emitters == [plan.parts[0].row] and plan.prompt_tokens == 20
    assert s.rows[1].length == 0  # nothing moves before postprocess
    s.postprocess(plan, [(12, None, (), ())])
    assert first.generated == [11, 12] and s.rows[0].length == 6 and s.rows[1].length == 20


def test_a_resumed_row_reads_its_prompt_and_resumed_tokens_and_shares_the_prompts_cached_blocks() -> None:
    """A resume (GenerationRequest.resume_ids) reads prompt + the ids it already has as its
    prompt, emits its first token only after the last of them, keeps its promise at prompt +
    max_new_tokens, and shares the blocks an earlier run of the same prompt published."""
    s = scheduler(blocks=64, prefill=20)
    first = FakeSeq(prompt(40), 8)
    submit(s, first)
    s.admit()
    run_to_end(s)
    resumed = FakeSeq(prompt(40), 8, resumed=(5, 6, 7))
    submit(s, resumed)
    s.admit()
    [row] = s.rows
    assert resumed.cached_prompt_tokens == 32 and row.length == 32  # two prompt blocks from before
    assert (
        len(row.lease.blocks) + row.lease.promised == 3
    )  # prompt + max_new_tokens (48) in blocks: unchanged by the resume
    plan = s.schedule()
    assert plan is not None and [(p.start, p.count, p.decodes) for p in plan.parts] == [(32, 11, False)]
    assert plan.parts[0].ids == [*prompt(8, 1032), 5, 6, 7] and plan.emitters == [row]
    s.postprocess(plan, [(9, None, (), ())])
    assert resumed.generated == [5, 6, 7, 9]  # the first new token, at step 3
    run_to_end(s)
    assert len(resumed.generated) == 8


# -- prefix caching ---------------------------------------------------------------------------


def test_prefix_keys_name_the_whole_prefix() -> None:
    a, b = prefix_keys(prompt(40)), prefix_keys([*prompt(16), *prompt(24, 77)])
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    c = prefix_keys([*prompt(16, 99), *prompt(16, 1016)])  # same second block, other first
    assert c[1] != a[1]


def test_a_later_prompt_shares_the_cached_blocks_of_its_longest_cached_prefix() -> None:
    s = scheduler(blocks=64)
    system = prompt(100)
    first = FakeSeq([*system, 1, 2, 3], 4)
    submit(s, first)
    s.admit()
    run_to_end(s)
    assert s.pool.cached == 103 // BLOCK_SIZE  # every full prompt block, published
    second = FakeSeq([*system, 9, 9], 4)
    same = FakeSeq(prompt(96), 4)  # exactly 6 blocks: its last token is read, so 5 are shared
    submit(s, second, same)
    s.admit()
    row, other = s.rows
    assert second.cached_prompt_tokens == 96 and row.length == 96 and row.published == 6
    assert same.cached_prompt_tokens == 80 and other.length == 80
    assert row.table[:5] == other.table[:5]  # the same blocks, held by both
    plan = s.schedule()
    assert plan is not None and [(p.start, p.count) for p in plan.parts] == [(96, 6), (80, 16)]
    assert s.pool.hit_tokens == 176


def test_with_the_prefix_cache_off_nothing_is_shared() -> None:
    s = scheduler(blocks=64, prefix_cache=False)
    first = FakeSeq(prompt(100), 4)
    submit(s, first)
    s.admit()
    run_to_end(s)
    again = FakeSeq(prompt(100), 4)
    submit(s, again)
    s.admit()
    assert again.cached_prompt_tokens == 0 and s.rows[0].length == 0 and s.pool.cached == 0


def test_idle_cached_blocks_are_evicted_least_recently_used_first() -> None:
    s = scheduler(blocks=8)
    old, recent = FakeSeq(prompt(33, 100), 15), FakeSeq(prompt(33, 500), 15)  # 3 blocks each, 2 cached
    for seq in (old, recent):
        submit(s, seq)
        s.admit()
        run_to_end(s)
    assert s.pool.cached == 4 and s.pool.available == 8
    big = FakeSeq(prompt(40, 9000), 56)  # 6 blocks: the free one, the 3 never used, then the 2 oldest idle ones
    submit(s, big)
    s.admit()
    run_to_end(s)
    assert s.pool.cached == 2 + 5  # recent's, and big's 5 full blocks (its answer's too)
    # recent's blocks are idle longer than big's now: the next eviction would take them, so look them up first
    for seq, hit in ((FakeSeq(prompt(33, 500), 1), 32), (FakeSeq(prompt(33, 100), 1), 0)):
        submit(s, seq)
        s.admit()
        assert seq.cached_prompt_tokens == hit
        run_to_end(s)


def test_idle_cached_blocks_are_reused_only_once_the_resident_limit_is_touched() -> None:
    """``fresh_limit`` (``--kv-resident-tokens``): distinct prompts one after another touch
    never-used blocks until that many are touched, then reuse the idle cached ones (least
    recently used first), so the resident KV stays at the limit (a CPU's). With no limit
    (a GPU's committed pool) the same traffic spreads over the pool and keeps every prompt
    cached; with a limit of 0 the resident KV stays at one request's worth."""
    for fresh_limit, touched, first_kept in ((0, 4, False), (12, 12, False), (None, 26, True)):
        s = scheduler(blocks=64, fresh_limit=fresh_limit)
        for i in range(9):
            seq = FakeSeq(prompt(40, 1000 * i) if i < 8 else prompt(40, 7000), 24)  # 4 blocks; the last repeats the 8th
            submit(s, seq)
            s.admit()
            assert seq.cached_prompt_tokens == (32 if i == 8 else 0), (fresh_limit, i)
            run_to_end(s)
        # Each request wrote 63 columns: 3 full blocks published (2 of prompt, 1 shared with its answer), and
        # its 4th given back uncached, which the next one takes first.
        assert s.pool.touched == touched, fresh_limit
        first_again = FakeSeq(prompt(40, 0), 24)
        submit(s, first_again)
        s.admit()
        assert first_again.cached_prompt_tokens == (32 if first_kept else 0), fresh_limit
        run_to_end(s)


def test_a_table_is_given_back_tail_first_so_a_chain_keeps_its_head() -> None:
    """Eviction takes the least recently idle block first. A table given back head first
    made a chain's head the first to go, and a lookup walks from the head: the whole chain
    was lost for one evicted block. Given back tail first, evicting two blocks costs the
    chain its last two blocks only."""
    s = scheduler(blocks=8, fresh_limit=0)
    long = FakeSeq(prompt(81, 100), 1)  # 6 blocks, 5 full ones published
    submit(s, long)
    s.admit()
    run_to_end(s)
    assert s.pool.cached == 5
    other = FakeSeq(prompt(20, 5000), 12)  # 2 blocks: the uncached one given back, then one idle block evicted
    submit(s, other)
    s.admit()
    run_to_end(s)
    again = FakeSeq(prompt(81, 100), 1)
    submit(s, again)
    s.admit()
    assert again.cached_prompt_tokens == 64  # 4 of its 5 blocks: only the tail went


def test_full_blocks_of_generated_tokens_are_published_as_they_fill() -> None:
    """A stream resumed on the same replica (its prompt + the tokens it had) finds every
    full block its first run wrote, generated ones included, and reads only the last
    partial block, as vLLM does; before, only the prompt's blocks were cached."""
    s = scheduler(blocks=64)
    first = FakeSeq(prompt(20, 300), 40)  # writes 20 + 39 columns: 3 full blocks, 2 of them generated tokens
    submit(s, first)
    s.admit()
    run_to_end(s, token=7)
    assert first.generated == [7] * 40 and s.pool.cached == 3
    resumed = FakeSeq(prompt(20, 300) + [7] * 36, 4)  # its prompt + 36 of the 40 tokens
    submit(s, resumed)
    s.admit()
    assert resumed.cached_prompt_tokens == 48 and s.rows[0].length == 48
    run_to_end(s, token=7)
    different = FakeSeq(prompt(20, 300) + [8] * 36, 4)  # the same prompt, other tokens after it
    submit(s, different)
    s.admit()
    assert different.cached_prompt_tokens == 16


def test_a_block_held_by_a_running_request_is_never_evicted() -> None:
    s = scheduler(blocks=6)
    holder = FakeSeq(prompt(33), 15)  # 3 blocks
    submit(s, holder)
    s.admit()
    plan = s.schedule()
    assert plan is not None
    s.postprocess(plan, [(1, None, (), ())])
    sharer = FakeSeq([*prompt(32), 5], 15)
    submit(s, sharer)
    s.admit()
    assert sharer.cached_prompt_tokens == 32 and s.pool.available == 6 - 3 - 1
    taker = FakeSeq(prompt(20, 7000), 28)  # 3 blocks: 2 are left; the cached ones held by running rows do not count
    submit(s, taker)
    s.admit()
    assert taker.finished is False and s.queue.queued == 1


# -- memory: what the engine commits, on meta ----------------------------------------------------

SHAPES = {
    "smollm2-135m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        vocab_size=49152,
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        vocab_size=128256,
    ),
    "llama-2-7b": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        vocab_size=32000,
    ),
    "llama-3.1-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        vocab_size=128256,
    ),
}


def meta_model(shape: dict[str, int], dtype: torch.dtype = torch.bfloat16) -> LoadedModel:
    """A Llama model of this shape on the ``meta`` device: real sizes, no memory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, torch_dtype=dtype)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(dtype)
    return LoadedModel(
        model=model,
        tokenizer=None,
        name="meta",
        device=torch.device("meta"),
        dtype=dtype,
        context_length=shape["max_position_embeddings"],
        vocab_size=shape["vocab_size"],
        eos_token_ids=(2,),
        bos_token_id=1,
        pad_token_id=0,
    )


def block_bytes_per_layer(loaded: LoadedModel) -> int:
    """Keys and values of one block in one layer."""
    config = loaded.model.config
    return kv_bytes_per_token(config, loaded.dtype) // int(config.num_hidden_layers) * BLOCK_SIZE


@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_engine_commits_the_kv_budget_start_up_checks_and_no_more(shape: str) -> None:
    loaded = meta_model(SHAPES[shape])
    config = ServerConfig()  # default flags
    per_token = kv_bytes_per_token(loaded.model.config, loaded.dtype)
    layers = int(loaded.model.config.num_hidden_layers)
    # as the server sizes them: no GPU's memory here, so the default count and its budget
    max_active, _ = active_streams(
        config.max_active, memory=None, context_length=loaded.context_length, bytes_per_token=per_token, layers=layers
    )
    assert max_active == DEFAULT_MAX_ACTIVE
    budget = kv_cache_budget(config.kv_cache_tokens, max_active, loaded.context_length, per_token).tokens
    checked = budget * per_token
    limits = EngineLimits(max_active, config.max_queue, budget)
    engine = BatchedEngine(loaded, limits)
    committed = engine._cache.nbytes()
    assert checked <= committed <= checked + layers * block_bytes_per_layer(loaded), (committed, checked)
    assert engine.pool.num_blocks == kv_blocks(budget)
    # "No more", as the engine's scheduler acts on it: asked for max_active streams of a whole
    # context each (what the slot layout this replaced committed for), it promises each admitted
    # one its worst case, and only as many as the committed cache holds; the rest wait.
    context = min(loaded.context_length, budget)
    s = engine.scheduler
    submit(s, *(FakeSeq(prompt(1, 1000 + i), context - 1, f"s{i}") for i in range(max_active)))
    s.admit()
    promised = s.pool.tokens_committed()
    assert len(s.rows) == budget // context and s.queue.queued == max_active - len(s.rows)
    assert promised == len(s.rows) * context and promised * per_token <= committed
    # the slot layout committed max_active x (context + 1) tokens: 2-16x what the scheduler promised
    slots = max_active * (context + 1) * kv_bytes_per_token(loaded.model.config, loaded.dtype)
    assert slots >= 2 * checked and slots >= 2 * promised * per_token


GIB = 2**30


@pytest.mark.parametrize("max_active", [1, 2, 4, 8])
def test_a_derived_kv_budget_holds_at_least_one_full_context(max_active: int) -> None:
    """``--max-active 4`` on the default model (8,192 context) derived 4 x 2,048 tokens: no
    room for vLLM's null block beside one context, and vLLM refused to start (#23's note)."""
    context, per_token = 8192, 92160
    batched = kv_cache_budget(0, max_active, context, per_token)
    assert batched.tokens >= context and batched.tokens % BLOCK_SIZE == 0
    assert batched.tokens == max(context, max_active * 2048)
    vllm = kv_cache_budget(0, max_active, context, per_token, blocks=False, reserved=VLLM_RESERVED_TOKENS)
    assert vllm.tokens >= context + VLLM_RESERVED_TOKENS
    # a short context is not padded out: the derived budget is per stream, up to 2,048 each
    assert kv_cache_budget(0, max_active, 1000, per_token).tokens == blocks_for(max_active * 1000) * BLOCK_SIZE
    # an explicit budget is the operator's, rounded down to whole blocks, even below one context
    assert kv_cache_budget(1000, max_active, context, per_token).tokens == 992


def test_a_model_that_leaves_no_room_for_kv_refuses_to_start_with_the_sizes() -> None:
    with pytest.raises(ModelLoadError, match="no room for a KV cache.*raise --kv-cache-memory-fraction"):
        kv_budget_for_device(24 * GIB, 22 * GIB, 0.9, 131072)
    assert kv_budget_for_device(80 * GIB, 17 * GIB, 0.9, 131072) == (int(80 * GIB * 0.9) - 17 * GIB) // 131072


# -- engine/options.py: every ``auto`` decided once, with the reasons -------------------------


def _on(device: str, loaded: LoadedModel) -> LoadedModel:
    return dataclasses.replace(loaded, device=torch.device(device))


def test_each_auto_is_decided_once_per_device_with_its_reason() -> None:
    from tokenwire_server.engine.options import EngineOptions, resolve

    loaded = meta_model(SHAPES["smollm2-135m"])
    cpu = resolve(EngineOptions(), _on("cpu", loaded))
    assert (cpu.forward, cpu.step_graphs, cpu.overlap, cpu.resident_kv_tokens) == ("native", "off", False, 8192)
    assert cpu.why_not_native is None and "CUDA" in (cpu.why_no_step_graphs or "") and "cpu" in cpu.why_overlap
    cuda = resolve(EngineOptions(), _on("cuda", loaded))
    assert (cuda.forward, cuda.step_graphs, cuda.overlap, cuda.resident_kv_tokens) == (
        "transformers",
        "off",
        True,
        None,
    )
    assert "cpu" in cpu.why_resident_kv and "whole pool" in cuda.why_resident_kv
    given = resolve(EngineOptions(kv_resident_tokens=1000), _on("cuda", loaded))
    assert (given.resident_kv_tokens, given.why_resident_kv) == (1000, "--kv-resident-tokens")
    assert "CPU only" in (cuda.why_not_native or "")
    native = resolve(EngineOptions(forward="native"), _on("cuda", loaded))
    assert (native.forward, native.step_graphs, native.overlap) == ("native", "cuda", True)
    off = resolve(EngineOptions(forward="native", overlap="off", step_graphs="static"), _on("cuda", loaded))
    assert (off.overlap, off.why_overlap, off.step_graphs) == (False, "--overlap off", "static")
    assert resolve(EngineOptions(forward="transformers"), _on("cpu", loaded)).why_not_native == "--forward transformers"
    compiled = resolve(EngineOptions(compile_step=True), _on("cpu", loaded))
    assert (compiled.step_graphs, compiled.pack_weights) == ("static", False)
    fields = cuda.log_fields()
    assert {"forward", "why_not_native", "step_graphs", "why_no_step_graphs", "overlap", "why_overlap"} <= set(fields)


@pytest.mark.parametrize(
    ("options", "device", "message"),
    [
        ({"overlap": "sometimes"}, "cpu", "unknown overlap"),
        ({"forward": "fast"}, "cpu", "unknown forward"),
        ({"kernels": "asm"}, "cpu", "unknown kernels"),
        ({"step_graphs": "cuda"}, "cpu", "needs a CUDA device"),
        ({"step_graphs": "static", "forward": "transformers"}, "cpu", "needs the native pass"),
    ],
)
def test_options_that_cannot_run_are_refused_with_the_flag(options: dict[str, str], device: str, message: str) -> None:
    from tokenwire_server.engine.options import EngineOptions, resolve

    with pytest.raises(ValueError, match=message):
        resolve(EngineOptions(**options), _on(device, meta_model(SHAPES["smollm2-135m"])))  # type: ignore[arg-type]


def test_the_admission_queue_and_the_scheduler_load_without_torch() -> None:
    """They decide who runs and what a step holds: plain Python, typed (the scheduler's queue
    is an ``AdmissionQueue``, not ``Any``), and testable without the model's libraries."""
    import inspect
    import subprocess
    import sys

    from tokenwire_server.engine.admission import AdmissionQueue
    from tokenwire_server.engine.scheduler import Scheduler

    code = (
        "import sys\n"
        "import tokenwire_server.engine.admission, tokenwire_server.engine.scheduler\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    annotation = inspect.signature(Scheduler.__init__).parameters["queue"].annotation
    assert annotation == AdmissionQueue.__name__, annotation
