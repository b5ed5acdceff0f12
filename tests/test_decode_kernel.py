"""The compiled decode attention (``engine/kernels``) against SDPA, and how the native pass picks it.

- Each one-token row attends over its own slot's first ``length`` columns: the same
  numbers as ``scaled_dot_product_attention`` over those columns (grouped query heads,
  ragged lengths on both sides of the 8-column blocks, slots in any order).
- A row's output does not depend on the other rows of the call, nor on what lies past
  its length (NaN there changes nothing): batch invariance by construction.
- Bad arguments are errors with a reason, never a crash.
- ``--decode-attention auto`` keeps SDPA where the kernel is unavailable and says why;
  ``kernel`` refuses to start without it; ``sdpa`` never takes it.

On a machine with a C++ compiler and an AVX2+FMA x86 CPU (CI's) the kernel must build:
those tests fail rather than skip if it does not.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from engine_support import kernel_unbuildable
from tokenwire_server.engine import create_engine, kernels
from tokenwire_server.engine.base import EngineLimits
from tokenwire_server.engine.native import NativeForward
from tokenwire_server.engine.slots import SlotCache
from tokenwire_server.model import load_model

pytestmark = pytest.mark.timeout(300)


def kernel_op():
    """The loaded op; skipped only where the machine cannot build it (no compiler, no AVX2+FMA)."""
    reason = kernel_unbuildable()
    if reason:
        pytest.skip(f"decode attention kernel: {reason}")
    loaded = kernels.decode_attention()
    assert loaded.op is not None, loaded.reason
    return loaded.op


def reference(q, keys, values, slots, lengths, scale):
    rows, heads, dim = q.shape
    kv_heads = keys.shape[1]
    out = torch.empty_like(q)
    for r in range(rows):
        s, n = int(slots[r]), int(lengths[r])
        grouped = q[r].view(kv_heads, heads // kv_heads, dim)
        out[r] = F.scaled_dot_product_attention(grouped, keys[s, :, :n], values[s, :, :n], scale=scale).reshape(heads, dim)
    return out


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 16)])
def test_the_kernel_gives_sdpa_numbers_over_each_rows_own_columns(heads: int, kv_heads: int, dim: int) -> None:
    op = kernel_op()
    generator = torch.Generator().manual_seed(0)
    slots_n, capacity = 6, 320
    keys = torch.randn(slots_n, kv_heads, capacity, dim, generator=generator)
    values = torch.randn(slots_n, kv_heads, capacity, dim, generator=generator)
    lengths = torch.tensor([1, 7, 8, 9, 300, 64], dtype=torch.long)  # around the 8-column blocks
    slots = torch.tensor([4, 0, 5, 2, 1, 3], dtype=torch.long)  # any order
    q = torch.randn(6, heads, dim, generator=generator) * 3  # large scores: softmax's max matters
    got = op(q, keys, values, slots, lengths, dim**-0.5)
    want = reference(q, keys, values, slots, lengths, dim**-0.5)
    assert got.shape == q.shape
    assert (got - want).abs().max().item() < 1e-5


def test_a_row_gives_the_same_bits_alone_as_among_others_and_never_reads_past_its_length() -> None:
    op = kernel_op()
    generator = torch.Generator().manual_seed(1)
    keys = torch.randn(4, 3, 200, 64, generator=generator)
    values = torch.randn(4, 3, 200, 64, generator=generator)
    q = torch.randn(4, 9, 64, generator=generator)
    slots = torch.tensor([0, 1, 2, 3])
    lengths = torch.tensor([17, 150, 3, 90])
    together = op(q, keys, values, slots, lengths, 0.125)
    keys[:, :, 150:] = float("nan")  # past every row's length
    values[:, :, 150:] = float("nan")
    keys[2, :, 3:] = float("nan")  # past row 2's
    for row in range(4):
        alone = op(q[row : row + 1].contiguous(), keys, values, slots[row : row + 1], lengths[row : row + 1], 0.125)
        assert torch.equal(alone[0], together[row])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"slots": torch.tensor([0, 9])}, "slot out of range"),
        ({"lengths": torch.tensor([0, 4])}, "length out of range"),
        ({"lengths": torch.tensor([4, 65])}, "length out of range"),
        ({"lengths": torch.tensor([4])}, "one slot and one length per row"),
        ({"q": torch.randn(2, 9, 64, dtype=torch.float64)}, "float32 only"),
        ({"q": torch.randn(2, 8, 64)}, "multiple of KV heads"),
        ({"q": torch.randn(9, 2, 64).transpose(0, 1)}, "contiguous"),
    ],
)
def test_bad_arguments_are_errors_that_say_which(change: dict, message: str) -> None:
    op = kernel_op()
    args = {
        "q": torch.randn(2, 9, 64),
        "keys": torch.zeros(2, 3, 64, 64),
        "values": torch.zeros(2, 3, 64, 64),
        "slots": torch.tensor([0, 1]),
        "lengths": torch.tensor([4, 4]),
    }
    args.update(change)
    with pytest.raises(RuntimeError, match=message):
        op(args["q"], args["keys"], args["values"], args["slots"], args["lengths"], 0.125)


def test_a_built_kernel_is_found_again_without_compiling() -> None:
    kernel_op()
    path, seconds = kernels.build()
    assert seconds == 0.0 and path == kernels.decode_attention().path and path.is_file()


def cache_for(model) -> SlotCache:
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    return SlotCache(2, 64, config.num_key_value_heads, head_dim, [(torch.device("cpu"), torch.float32)] * config.num_hidden_layers)


def test_auto_keeps_sdpa_where_the_kernel_is_unavailable_and_kernel_refuses_to_start(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = load_model(str(tiny_model_dir))
    monkeypatch.setattr(kernels, "decode_attention", lambda: kernels.Kernel(None, "no C++ compiler (test)"))
    native = NativeForward(loaded.model, cache_for(loaded.model), batch_hint=2)
    assert native.kernel is None and native.kernel_reason == "no C++ compiler (test)"
    with pytest.raises(ValueError, match=r"--decode-attention kernel: no C\+\+ compiler \(test\)"):
        NativeForward(loaded.model, cache_for(loaded.model), batch_hint=2, decode_attention="kernel")
    with pytest.raises(ValueError, match="unknown decode attention 'fast'"):
        NativeForward(loaded.model, cache_for(loaded.model), batch_hint=2, decode_attention="fast")


def test_a_failed_build_is_a_reason_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    if kernels.cpu_reason():
        pytest.skip(kernels.cpu_reason() or "")

    def broken(directory=None):
        raise RuntimeError("c++ failed (1): error: something")

    monkeypatch.setattr(kernels, "build", broken)
    loaded = kernels._load()
    assert loaded.op is None and "c++ failed (1)" in (loaded.reason or "")


def test_the_engine_takes_the_kernel_on_this_cpu_and_sdpa_when_told(tiny_model_dir: Path) -> None:
    kernel_op()
    loaded = load_model(str(tiny_model_dir))
    engine = create_engine("batched", loaded, EngineLimits(2, 2, 1024), workers=1)
    assert engine._native.kernel is not None  # type: ignore[attr-defined]
    assert engine.decode_attention == "kernel"  # type: ignore[attr-defined]
    engine = create_engine("batched", loaded, EngineLimits(2, 2, 1024), workers=1, decode_attention="sdpa")
    assert engine._native.kernel is None and engine.decode_attention == "sdpa"  # type: ignore[attr-defined]
