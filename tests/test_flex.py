"""FlexAttention over the paged pool in place (``engine/flex.py``, ``--attention flex``, #39 item 9)
equals today's attention, which copies the blocks out (``ops.static_decode_attention``,
``ops.chunk_attention``), within float32 rounding: mixed lengths, grouped query heads, blocks
shared by two rows (a cached prefix), a chunk after a cached prefix and a chunk that starts a
table. Uncompiled (FlexAttention's dense reference, the page lists as wide as the step's
longest table, as CUDA reads them) and compiled on this CPU (inductor's C++ template, the lists
as wide as the pool). Then the engine with ``--attention flex`` generates what it generates with
SDPA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_support import run_all
from tokenwire_server.domain import FinishEvent, GenerationRequest, SamplingOptions
from tokenwire_server.engine import create_engine
from tokenwire_server.engine.base import EngineLimits
from tokenwire_server.engine.flex import FlexAttention
from tokenwire_server.engine.kv import table_tensor
from tokenwire_server.engine.ops import Segment, chunk_attention, chunk_plan, static_decode_attention
from tokenwire_server.model import load_model

pytestmark = pytest.mark.timeout(600)

BLOCKS, KV_HEADS, BLOCK, DIM, HEADS = 64, 3, 16, 32, 9
CPU = torch.device("cpu")


def pool_and_tables(lengths: list[int], shared: tuple[int, ...] = (2, 5)) -> tuple[torch.Tensor, ...]:
    """A random pool (with its scratch block) and a table per length, blocks drawn at random; rows
    ``shared`` start with the same two blocks (a cached prefix)."""
    generator = torch.Generator().manual_seed(1)
    keys = torch.randn(BLOCKS + 1, KV_HEADS, BLOCK, DIM, generator=generator)
    values = torch.randn(BLOCKS + 1, KV_HEADS, BLOCK, DIM, generator=generator)
    # What a row must not read must not count: the scratch block, and its last block's columns
    # past its length (what an earlier holder left), are loud. (Finite: a masked column still
    # meets FlexAttention's sum with weight 0, which is why the engine zeroes the pool first.)
    keys[BLOCKS], values[BLOCKS] = 1e4, -1e4
    free = torch.randperm(BLOCKS, generator=generator).tolist()
    prefix, free = free[:2], free[2:]
    tables = []
    for row, length in enumerate(lengths):
        need = -(-length // BLOCK)
        own = need - 2 if row in shared else need
        table, free = (prefix if row in shared else []) + free[:own], free[own:]
        tables.append(tuple(table))
        if length % BLOCK and row not in shared:
            keys[table[-1], :, length % BLOCK :] = 1e4
            values[table[-1], :, length % BLOCK :] = -1e4
    return keys, values, tables  # type: ignore[return-value]


LENGTHS = [5, 33, 100, 16, 17, 200, 1]


@pytest.mark.parametrize("compiled", [False, True], ids=["reference", "compiled"])
def test_decode_rows_equal_gathered_sdpa(compiled: bool) -> None:
    keys, values, tables = pool_and_tables(LENGTHS)
    q = torch.randn(len(LENGTHS), HEADS, DIM, generator=torch.Generator().manual_seed(2))
    scale = DIM**-0.5
    expected = static_decode_attention(
        q, keys, values, table_tensor([list(t) for t in tables], BLOCKS), torch.tensor(LENGTHS), KV_HEADS, scale
    )
    flex = FlexAttention(HEADS, KV_HEADS, scale, compiled=compiled, dynamic=False)
    singles = [Segment(table, length - 1, 1) for table, length in zip(tables, LENGTHS, strict=True)]
    got = flex(q, keys, values, flex.plan(singles, BLOCK, BLOCKS, CPU))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if compiled:
        return  # a CPU compiles once per shape (~10 s): the reference shows the rest
    # Each row reads its own blocks only: one row alone gets the same.
    alone = flex(q[2:3], keys, values, flex.plan(singles[2:3], BLOCK, BLOCKS, CPU))
    torch.testing.assert_close(alone, expected[2:3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compiled", [False, True], ids=["reference", "compiled"])
def test_prompt_chunks_equal_causal_sdpa(compiled: bool) -> None:
    keys, values, tables = pool_and_tables(LENGTHS)
    scale = DIM**-0.5
    # After a cached prefix (40 columns, across the shared blocks) over two query blocks, from a
    # table's start, and two tokens that straddle a block's end (compiled: the first alone, as a
    # CPU compiles once per shape).
    chunks = [Segment(tables[5], 40, 150), Segment(tables[2], 0, 100), Segment(tables[1], 15, 2)]
    chunks = chunks[:1] if compiled else chunks
    generator = torch.Generator().manual_seed(3)
    queries = [torch.randn(c.count, HEADS, DIM, generator=generator) for c in chunks]
    flex = FlexAttention(HEADS, KV_HEADS, scale, compiled=compiled, dynamic=False)
    plans = flex.chunk_plans(chunks, BLOCK, BLOCKS, CPU)
    for query, segment, plan, stock in zip(queries, chunks, plans, chunk_plan(chunks, BLOCK, BLOCKS, CPU), strict=True):
        expected = chunk_attention(query, keys, values, segment, stock, scale)
        torch.testing.assert_close(flex.chunk(query, keys, values, segment, plan), expected, rtol=1e-5, atol=1e-5)


def test_page_lists_name_each_rows_own_pages() -> None:
    """The block mask reads exactly the row's pages for its KV head: full ones before the last
    (no mask evaluated), the last one partial; a chunk's query block reads, in full, the pages
    every one of its queries sees, and partially the ones its diagonal crosses."""
    _, _, tables = pool_and_tables([40, 16])
    flex = FlexAttention(HEADS, KV_HEADS, 1.0, compiled=False)
    count, partial, full_count, full_pages, *_ = flex._pages(
        [Segment(tables[0], 39, 1), Segment(tables[1], 15, 1)], [(0, 0)], BLOCK, BLOCKS
    )
    a, b, c = tables[0]
    for head in range(KV_HEADS):
        assert full_count[head, 0, 0] == 2 and full_pages[head, 0, 0, :2].tolist() == [a * 3 + head, b * 3 + head]
        assert count[head, 0, 0] == 1 and partial[head, 0, 0, 0] == c * 3 + head
        # The second row's one block is full: its last column is the query's.
        assert full_count[KV_HEADS + head, 0, 0] == 1 and count[KV_HEADS + head, 0, 0] == 0
    count, _, full_count, _, *_ = flex._pages([Segment(tables[0], 0, 40)], [(0, 15), (16, 31), (32, 39)], BLOCK, 64)
    assert full_count[0, 0].tolist() == [0, 1, 2] and count[0, 0].tolist() == [1, 1, 1]


def request(rid: str, prompt: list[int], new: int, temperature: float = 0.0) -> GenerationRequest:
    return GenerationRequest(
        rid, prompt, SamplingOptions(temperature=temperature, seed=7), new, ignore_eos=True, want_tokens=True
    )


def test_engine_with_flex_attention_generates_what_sdpa_does(tiny_model_dir: Path) -> None:
    """The batched engine's native pass with ``attention="flex"`` (uncompiled here: a CPU
    compiles once per step shape) against ``"sdpa"``: rows of several lengths in one batch,
    prompts read in chunks beside decoding rows, and a second prompt that starts with the
    first's cached blocks, greedy and sampled, give the same tokens."""
    from torch.nn.attention.flex_attention import flex_attention

    loaded = load_model(str(tiny_model_dir), device="cpu", dtype="float32")
    ids: list[int] = loaded.tokenizer(" ".join(f"item {i} is {i * 7 % 13}" for i in range(60)))["input_ids"]
    requests = [
        request("long", ids[:150], 20),
        request("short", ids[:7], 24),
        request("shared", ids[:96] + ids[10:30], 16, temperature=0.9),
        request("sampled", ids[40:75], 20, temperature=0.7),
    ]
    got = {}
    for attention in ("sdpa", "flex"):
        limits = EngineLimits(max_active=4, max_queue=8, kv_cache_tokens=2048, max_prefill_tokens=48)
        engine = create_engine("batched", loaded, limits, workers=1, kernels="torch", attention=attention)
        native = engine.runner.native  # type: ignore[attr-defined]
        assert native.decode_attention.name == attention.replace("sdpa", "torch")
        if attention == "flex":
            native.decode_attention._flex = flex_attention  # the dense reference, not a compile per shape
        engine.start()
        try:
            first = run_all(engine, requests[:1])  # its blocks are then cached for "shared"
            rest = run_all(engine, requests[1:])
        finally:
            engine.close()
        for recorder in first + rest:
            assert isinstance(recorder.last, FinishEvent), recorder.last
        got[attention] = [recorder.token_ids for recorder in first + rest]
        assert engine.pool.hit_tokens >= 96  # type: ignore[attr-defined]  # "shared" read its prefix from the cache
    assert got["flex"] == got["sdpa"]


def test_flex_on_cuda_keeps_its_decode_steps_out_of_the_sdpa_graphs(tiny_model_dir: Path) -> None:
    """On CUDA the step graphs hold a fixed-shape decode step that attends through SDPA: with
    ``--attention flex``, ``--step-graphs auto`` is off (said why), so every step is flex's;
    ``--step-graphs cuda`` still asks for the mix."""
    from types import SimpleNamespace

    from tokenwire_server.engine.options import EngineOptions, resolve

    model = load_model(str(tiny_model_dir), device="cpu", dtype="float32").model
    on_cuda: Any = SimpleNamespace(model=model, device=torch.device("cuda"))
    flex = resolve(EngineOptions(forward="native", attention="flex"), on_cuda)
    assert flex.step_graphs == "off" and "--attention flex" in str(flex.why_no_step_graphs)
    assert resolve(EngineOptions(forward="native"), on_cuda).step_graphs == "cuda"
    assert resolve(EngineOptions(forward="native", attention="flex", step_graphs="cuda"), on_cuda).step_graphs == "cuda"
    with pytest.raises(ValueError, match="unknown attention"):
        EngineOptions(attention="paged")
    # Without the native pass (auto keeps transformers' forward on CUDA) flex would do nothing: refused.
    with pytest.raises(ValueError, match="--attention flex is the native pass's.*--forward native"):
        resolve(EngineOptions(attention="flex"), on_cuda)


def test_cuda_tiles_divide_the_block_masks_blocks() -> None:
    """Triton's flex kernel skips a tile size that does not divide the block mask's blocks, and
    fails when none is left: its own KV tiles (32-128) never divide a 16-token page. On CUDA the
    calls name tiles that do: the KV tile one page, the query tile a divisor of the query block."""
    from tokenwire_server.engine import flex as flex_module

    options = FlexAttention(HEADS, KV_HEADS, 1.0, compiled=False)._options(torch.device("cuda"), BLOCK)
    assert options is not None and options["BLOCK_N"] == BLOCK and flex_module.QUERY_BLOCK % options["BLOCK_M"] == 0
    assert options["FORCE_USE_FLEX_ATTENTION"]  # not the decoding kernel, which reads the mask by KV head
    assert FlexAttention(HEADS, KV_HEADS, 1.0, compiled=False)._options(CPU, BLOCK) is None
