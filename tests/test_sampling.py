"""The sampler's candidate paths against the implementation they replaced (``reference_draw``, kept
here verbatim): the same picks, row for row, over random and realistic logits, ties, masks,
overflow, every mix of top_k/top_p, the cases where the prefilter must hand a row to the full
sort, and the same row at other places in other batches."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenwire_server.domain import GenerationRequest, RequestHandle, SamplingOptions
from tokenwire_server.engine import kernels, sampling
from tokenwire_server.engine.generation import Generation
from tokenwire_server.engine.sampling import CANDIDATES, Sampler, gumbel_noise, noise_at, row_keys

VOCAB = 49152
NEG_INF = float("-inf")

# -- the reference: the sampler's draw before the candidate paths (f3560f2), verbatim --------------

_M32 = 0xFFFF_FFFF
_K1 = 0x7FEB_352D
_K2 = 0x5A6C_A68B
_K3 = 0x2C1B_3C6D


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * _K1) & _M32
    x = x ^ (x >> 15)
    x = (x * _K2) & _M32
    x = x ^ (x >> 16)
    x = (x * _K3) & _M32
    return x ^ (x >> 15)


def _gumbel_of(bits: torch.Tensor) -> torch.Tensor:
    uniform = (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    return -torch.log(-torch.log(uniform))


def reference_gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    ids = torch.arange(vocab, dtype=torch.int64, device=keys.device).unsqueeze(0)
    h = _mix32(ids ^ keys[:, :1])
    h = _mix32(h ^ keys[:, 1:])
    return _gumbel_of(h >> 9)


def _overflow_safe(rows: torch.Tensor) -> torch.Tensor:
    top = torch.isposinf(rows)
    has_top = top.any(dim=-1, keepdim=True)
    cleaned = torch.where(torch.isnan(rows), NEG_INF, rows)
    only_top = torch.where(top, 0.0, NEG_INF)
    return torch.where(has_top, only_top, cleaned)


def reference_draw(processed: torch.Tensor, options: list[SamplingOptions], keys: torch.Tensor) -> torch.Tensor:
    """The old ``Sampler._draw`` for every row of ``processed`` (its parameters as arguments)."""
    vocab = int(processed.shape[1])
    temperature = torch.tensor([o.temperature for o in options], dtype=torch.float32).unsqueeze(1)
    scaled = _overflow_safe(processed / temperature)
    noise = reference_gumbel_noise(keys, vocab)
    if not any(0 < o.top_k < vocab or o.top_p < 1.0 for o in options):
        return torch.argmax(scaled + noise, dim=-1)
    top_k = torch.tensor([o.top_k if 0 < o.top_k < vocab else vocab for o in options], dtype=torch.long).unsqueeze(1)
    top_p = torch.tensor([o.top_p for o in options], dtype=torch.float32).unsqueeze(1)
    limited_p = torch.tensor([o.top_p < 1.0 for o in options], dtype=torch.bool).unsqueeze(1)
    ordered, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab).unsqueeze(0)
    ordered = ordered.masked_fill(rank >= top_k, NEG_INF)
    probs = torch.softmax(ordered, dim=-1)
    before = probs.cumsum(dim=-1) - probs
    ordered = ordered.masked_fill(limited_p & (before >= top_p) & (rank > 0), NEG_INF)
    picked = torch.argmax(ordered + noise.gather(1, order), dim=-1, keepdim=True)
    return order.gather(1, picked).squeeze(1)


# -- helpers ---------------------------------------------------------------------------------------

Row = tuple[torch.Tensor, SamplingOptions, int]  # logits, options (seed set), step


def generation(options: SamplingOptions, step: int) -> Generation:
    request = GenerationRequest("s", [1], options, 8, ignore_eos=True)
    seq = Generation(request, RequestHandle(), lambda event: None, None, (2,), torch.device("cpu"))
    seq.generated = [0] * step
    return seq


def new_picks(rows: list[Row], library: Any = None) -> list[int]:
    logits = torch.stack([r[0] for r in rows])
    return [pick[0] for pick in Sampler([], library)(logits, [generation(o, step) for _, o, step in rows])]


def reference_picks(rows: list[Row]) -> list[int]:
    """Each row alone through the reference (its picks do not depend on the batch)."""
    out = []
    for logits, options, step in rows:
        keys = torch.tensor([row_keys(options.seed or 0, step)], dtype=torch.int64)
        out += reference_draw(logits.unsqueeze(0), [options], keys).tolist()
    return out


@pytest.fixture(params=["torch", "compiled"])
def library(request: pytest.FixtureRequest) -> Any:
    """The sampler's passes over the rows: stock torch's (None), or the compiled CPU ops' (``RowOps``)."""
    if request.param == "torch":
        return None
    loaded = kernels.load()
    if loaded.ops is None:
        pytest.skip(f"compiled CPU ops: {loaded.reason}")
    return loaded.ops


@pytest.fixture
def fallbacks(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How many rows the full sort drew (handed over by the candidate path, limited rows) and the free path."""
    counts = {"limited": 0, "free": 0, "wider": 0}

    def counting(name: str, full: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def wrapped(scaled: torch.Tensor, *args: Any) -> torch.Tensor:
            counts[name] += scaled.shape[0]
            return full(scaled, *args)

        return wrapped

    candidates = sampling._limited_candidates

    def tiers(scaled: torch.Tensor, *args: Any) -> torch.Tensor:
        if len(args) > 5 and args[5] == sampling.WIDER:  # a row the first candidates could not settle
            counts["wider"] += scaled.shape[0]
        return candidates(scaled, *args)

    monkeypatch.setattr(sampling, "_limited_full", counting("limited", sampling._limited_full))
    monkeypatch.setattr(sampling, "_free_full", counting("free", sampling._free_full))
    monkeypatch.setattr(sampling, "_limited_candidates", tiers)
    return counts


def model_logits(folder: Path, prompts: list[str], positions: int) -> torch.Tensor:
    """Real next-token logits: the last ``positions`` positions of each prompt."""
    from tokenwire_server.model import load_model

    loaded = load_model(str(folder), device="cpu", dtype="float32")
    rows = []
    with torch.no_grad():
        for text in prompts:
            messages = [{"role": "user", "content": text}]
            ids = loaded.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            out = loaded.model(torch.tensor([list(ids)]))
            rows.append(out.logits[0, -positions:].float())
    return torch.cat(rows)


PROMPTS = ["What is the capital of France?", "Write a haiku about rain.", "Tell me a story about a fox."]

OPTIONS = [
    *(dict(temperature=t, top_p=p) for t, p in itertools.product((0.3, 0.8, 1.0, 1.5), (0.5, 0.9, 0.95, 0.99))),
    *(dict(temperature=t, top_k=k) for t, k in itertools.product((0.8, 1.2), (1, 5, 50, CANDIDATES, CANDIDATES + 44))),
    *(dict(temperature=0.8, top_k=k, top_p=p) for k, p in itertools.product((1, 40, CANDIDATES, 1000), (0.3, 0.95))),
    dict(temperature=0.7),
    dict(temperature=1.0),
    dict(temperature=2.0),
]


def grid(logits: torch.Tensor, seeds: int = 2, steps: tuple[int, ...] = (0, 5)) -> list[Row]:
    """Every row of ``logits`` with options, seeds and steps taken in turn."""
    rows = []
    combos = list(itertools.product(OPTIONS, range(seeds), steps))
    for i, row in enumerate(logits):
        for j in range(4):
            options, seed, step = combos[(i * 4 + j) % len(combos)]
            rows.append((row, SamplingOptions(**options, seed=seed * 1000 + i), step))
    return rows


def assert_same(rows: list[Row], library: Any = None, chunk: int = 16) -> None:
    expected = reference_picks(rows)
    got = [p for start in range(0, len(rows), chunk) for p in new_picks(rows[start : start + chunk], library)]
    differ = [(i, rows[i][1], rows[i][2], expected[i], got[i]) for i in range(len(rows)) if expected[i] != got[i]]
    assert not differ, f"{len(differ)} of {len(rows)} rows differ, e.g. {differ[:3]}"


# -- the tests -------------------------------------------------------------------------------------


def test_candidate_noise_is_gumbel_noise_bit_for_bit(library: Any) -> None:
    gen = torch.Generator().manual_seed(0)
    keys = torch.tensor([row_keys(seed, step) for seed in range(8) for step in (0, 1, 77)], dtype=torch.int64)
    ids = torch.randint(0, VOCAB, (keys.shape[0], CANDIDATES), generator=gen)
    ops = sampling.RowOps(library)
    full = gumbel_noise(keys, VOCAB, ops)
    assert torch.equal(full, reference_gumbel_noise(keys, VOCAB))
    assert torch.equal(noise_at(keys, ids, ops), full.gather(1, ids))
    assert torch.equal(noise_at(keys[3:4], ids[3:4], ops), full[3:4].gather(1, ids[3:4]))
    pairs = torch.tensor([5, 0, 5, 23])  # one (key, id) per row: the free rows' near tokens
    assert torch.equal(noise_at(keys[pairs], ids[pairs, :1], ops).squeeze(1), full[pairs, ids[pairs, 0]])


def test_the_row_passes_give_torchs_results(library: Any) -> None:
    """``RowOps``: a top k (the same values; ids where no tie straddles the cut), the first argmax (ties,
    -inf rows, NaN), and the near tokens with their noise and counts, as torch's ops give them."""
    gen = torch.Generator().manual_seed(7)
    ops = sampling.RowOps(library)
    x = torch.randn(6, VOCAB, generator=gen) * 3
    x[1] = torch.round(x[1])  # ties everywhere
    x[2, 100:] = NEG_INF
    x[3] = NEG_INF
    for k in (1, 7, CANDIDATES, sampling.WIDER):
        values, ids = ops.top(x, k)
        expected = torch.topk(x, k, dim=-1).values
        assert torch.equal(values.sort(dim=-1, descending=True).values, expected)
        assert torch.equal(x.gather(1, ids), values) and all(len(set(row.tolist())) == k for row in ids)
    x[4, [9, 40000]] = 50.0  # a tie for the largest: the first
    x[5, [30, 7]] = float("nan")
    assert ops.argmax(x).tolist() == torch.argmax(x, dim=-1).tolist() == [*ops.argmax(x)[:4].tolist(), 9, 7]
    keys = torch.tensor([row_keys(seed, 2) for seed in range(5)], dtype=torch.int64)
    rows = x[:5].contiguous()
    floors = torch.tensor([[4.0], [3.0], [0.0], [NEG_INF], [20.0]])
    row, token, value, noise, counts = ops.near(rows, keys, floors, 600)
    mask = rows >= floors
    assert counts.tolist() == mask.sum(dim=-1).tolist() and counts[3] == VOCAB and counts[4] == 2
    mask[counts > 600] = False  # a row past ``most`` gives none
    want_row, want_token = mask.nonzero(as_tuple=True)
    assert torch.equal(row, want_row) and torch.equal(token, want_token) and torch.equal(value, rows[row, token])
    assert torch.equal(noise, gumbel_noise(keys, VOCAB)[row, token])


def test_the_new_draw_picks_as_the_old_on_random_logits(library: Any, fallbacks: dict[str, int]) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.cat([torch.randn(40, VOCAB, generator=gen) * scale for scale in (1.0, 3.0, 8.0)])
    assert_same(grid(logits), library)
    # bf16-rounded: many ties, at the cut too
    assert_same(grid(logits[::2].to(torch.bfloat16).float(), steps=(3,)), library)
    assert fallbacks["limited"] > 0


def test_the_new_draw_picks_as_the_old_on_realistic_logits(
    library: Any, tiny_model_dir: Path, fallbacks: dict[str, int]
) -> None:
    # The tiny model's (random weights: near-flat rows) and peaked ones shaped like a trained model's: a
    # few tokens well above a broad normal bulk.
    tiny = model_logits(tiny_model_dir, PROMPTS, 8)
    gen = torch.Generator().manual_seed(2)
    peaked = torch.randn(48, VOCAB, generator=gen) * 2.5
    for i in range(48):
        top = torch.randint(0, VOCAB, (1 + i % 7,), generator=gen)
        peaked[i, top] = 12.0 + torch.rand(len(top), generator=gen) * 14.0
    rows = grid(torch.cat([tiny, peaked]))
    assert_same(rows, library)
    assert_same(grid(torch.cat([tiny, peaked]).to(torch.bfloat16).float(), seeds=1, steps=(9,)), library)
    limited = sum(1 for _, o, _ in rows if o.top_k or o.top_p < 1.0) * 2
    assert 0 < fallbacks["limited"] < limited  # both paths were taken
    free = sum(1 for _, o, _ in rows if not o.top_k and o.top_p == 1.0) * 2
    assert 0 < fallbacks["free"] < free  # the peaked rows hashed only their near tokens, the flat ones all


@pytest.mark.e2e
def test_the_new_draw_picks_as_the_old_on_the_default_models_logits(library: Any, default_model_dir: Path) -> None:
    logits = model_logits(default_model_dir, PROMPTS, 12)
    assert_same(grid(logits, seeds=3, steps=(0, 1, 40)), library)


def test_masked_and_overflowing_rows_pick_as_the_old(library: Any, fallbacks: dict[str, int]) -> None:
    gen = torch.Generator().manual_seed(3)
    rows: list[Row] = []
    for i in range(24):
        logits = torch.randn(VOCAB, generator=gen) * 4
        if i % 3 == 0:  # a grammar's mask: a few tokens allowed
            allowed = torch.randint(0, VOCAB, (1 + i,), generator=gen)
            masked = torch.full((VOCAB,), NEG_INF)
            masked[allowed] = logits[allowed]
            logits = masked
        elif i % 3 == 1:  # most of the row masked, more than the candidates left
            logits[torch.rand(VOCAB, generator=gen) < 0.9] = NEG_INF
        else:  # overflow at a small temperature: a few tokens reach +inf
            logits[torch.randint(0, VOCAB, (1 + i % 4,), generator=gen)] = 3e38
        for options in (dict(temperature=1e-5), dict(temperature=0.9, top_p=0.9), dict(temperature=1e-5, top_k=5)):
            rows.append((logits, SamplingOptions(**options, seed=i), i))  # type: ignore[arg-type]
    assert_same(rows, library)


def test_rows_whose_kept_tokens_pass_the_candidates_take_the_full_sort(library: Any, fallbacks: dict[str, int]) -> None:
    """Flat rows, ties at the cut, top_k above the candidates: the prefilter cannot be exact, and the
    wider candidates or the full path give the old picks."""
    gen = torch.Generator().manual_seed(4)
    flat = torch.zeros(VOCAB)
    # Two levels: the CANDIDATES-th value tied with thousands of others, scattered (torch.topk keeps
    # any of them, not the first by id as the full stable sort does).
    steps = torch.zeros(VOCAB)
    steps[torch.randperm(VOCAB, generator=gen)[:10]] = 1.0
    near_flat = torch.randn(VOCAB, generator=gen) * 0.01
    # Coarse levels: ~250 of the ~800 tokens of the CANDIDATES-th value among the candidates
    rounded = torch.round(torch.randn(VOCAB, generator=gen) * 0.7)
    rows: list[Row] = []
    for i, logits in enumerate((flat, steps, near_flat, rounded)):
        for options in (
            dict(temperature=1.0, top_p=0.99),
            dict(temperature=1.0, top_p=0.5),
            dict(temperature=1.0, top_k=CANDIDATES),
            dict(temperature=1.0, top_k=CANDIDATES + 1),
            dict(temperature=0.8, top_k=CANDIDATES + 44, top_p=0.9),
            dict(temperature=1.0, top_k=150, top_p=0.999),
            dict(temperature=1.0),
        ):
            for seed in range(6):
                rows.append((logits, SamplingOptions(**options, seed=seed), i))  # type: ignore[arg-type]
    assert_same(rows, library)
    # Every row the candidates cannot settle tries WIDER first (some settle there: the coarse levels'
    # nuclei), and the flat ones still need the sort.
    assert fallbacks["wider"] >= 6 * 6 * 3 and fallbacks["limited"] >= 6 * 6 * 2
    assert fallbacks["wider"] > fallbacks["limited"]


def test_free_rows_hash_only_the_tokens_that_can_win_and_pick_as_the_full_path(
    library: Any,
) -> None:
    """A free row (temperature alone) hashes the tokens near enough to its best sum: the same pick as the
    whole vocabulary's noise, a tie of sums going to the first id (two tokens whose noise is equal, with
    equal logits), a row of -inf (all banned) to id 0, and a row mostly that near to the full path."""
    gen = torch.Generator().manual_seed(6)
    keys = torch.tensor([row_keys(seed, 3) for seed in range(6)], dtype=torch.int64)
    noise = gumbel_noise(keys, VOCAB)
    scaled = torch.randn(6, VOCAB, generator=gen) * 3.0
    scaled[1, :10] += 30.0  # peaked: a handful near the top
    ids, counts = noise[2].unique(return_counts=True)
    twins = torch.nonzero(noise[2] == ids[counts > 1][-1]).squeeze(1)[:2]  # equal 23 bits: equal noise
    scaled[2] = 0.0
    scaled[2, twins] = 40.0  # they tie on the sum, far above the rest
    scaled[3] = NEG_INF
    scaled[4] = torch.randn(VOCAB, generator=gen) * 0.1  # flat: every token near
    near = (scaled >= (scaled + noise).amax(dim=-1, keepdim=True) - sampling._NOISE_SPAN).sum(dim=-1)
    assert near[1] < 100 and near[2] == 2 and near[4] > VOCAB // 4
    ops = sampling.RowOps(library)
    picks = sampling._free_near(scaled, keys, VOCAB, ops)
    assert torch.equal(picks, sampling._free_full(scaled, keys, VOCAB))
    assert torch.equal(picks, sampling._free_full(scaled, keys, VOCAB, ops))
    assert picks[2] == twins.min() and picks[3] == 0


def test_a_row_picks_the_same_anywhere_in_any_batch(
    library: Any,
) -> None:
    """Each row alone, then at other places among other neighbours (other kinds, rows that need the
    full path): the same pick, and the reference's."""
    gen = torch.Generator().manual_seed(5)
    peaked = torch.randn(12, VOCAB, generator=gen) * 2.5
    peaked[:, :3] += 15.0
    flat = torch.zeros(4, VOCAB)
    rows = grid(torch.cat([peaked, flat]), seeds=1, steps=(2,))
    alone = [new_picks([row], library)[0] for row in rows]
    assert alone == reference_picks(rows)
    rng = random.Random(0)
    for _ in range(6):
        order = list(range(len(rows)))
        rng.shuffle(order)
        size = rng.choice((3, 7, 16))
        for start in range(0, len(order), size):
            part = order[start : start + size]
            assert new_picks([rows[i] for i in part], library) == [alone[i] for i in part]
