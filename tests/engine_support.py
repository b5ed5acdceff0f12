"""What the engine tests share: a sink that records a request's events, and a helper
that runs requests on an engine and waits for all of them."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenwire_server.domain import ErrorEvent, FinishEvent, GenerationRequest


class Recorder:
    """An engine sink: every event of one request, and ``done`` once it ends."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.done = threading.Event()
        self.request: GenerationRequest | None = None

    def __call__(self, event: Any) -> None:
        self.events.append(event)
        if isinstance(event, FinishEvent | ErrorEvent):
            self.done.set()

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if not isinstance(e, ErrorEvent))

    @property
    def last(self) -> Any:
        return self.events[-1]

    @property
    def token_ids(self) -> list[int]:
        return [t.id for e in self.events if not isinstance(e, ErrorEvent) for t in e.tokens]


def run_all(engine: Any, requests: Sequence[GenerationRequest], timeout: float = 60.0) -> list[Recorder]:
    """Submit every request at once; wait until each has ended."""
    recorders = [Recorder() for _ in requests]
    for req, rec in zip(requests, recorders, strict=True):
        rec.request = req
        engine.submit(req, rec)
    for rec in recorders:
        assert rec.done.wait(timeout), "request did not finish"
    return recorders


def kernel_unbuildable() -> str | None:
    """Why this machine cannot build the decode attention kernel (no AVX2+FMA x86 CPU, no
    C++ compiler); None where it can, and then tests that use it must find it built."""
    from tokenwire_server.engine import kernels

    return kernels.cpu_reason() or (None if kernels.compiler() else "no C++ compiler")


def kernel_choices() -> list[Any]:
    """``--kernels compiled`` and ``--kernels torch``, to run an engine test on both; the
    first skipped, with the reason, only where this machine cannot build the compiled CPU
    ops (``kernel_unbuildable``): where it can, an engine that cannot load them fails."""
    import pytest

    reason = kernel_unbuildable()
    skip = pytest.mark.skipif(reason is not None, reason=f"compiled CPU ops: {reason}")
    return [pytest.param("compiled", marks=skip), "torch"]


def engine_kinds() -> list[Any]:
    """The batched engine on each kernel set and the simple engine, as ``(kind, options)``
    parameters for ``engine_of``; the compiled set skipped as in ``kernel_choices``."""
    import pytest

    compiled, torch_ops = kernel_choices()
    return [
        pytest.param(("batched", {"kernels": "compiled"}), id="batched-compiled", marks=compiled.marks),
        pytest.param(("batched", {"kernels": torch_ops}), id="batched-torch"),
        pytest.param(("simple", {}), id="simple"),
    ]


def engine_of(loaded: Any, kind: str, options: dict[str, Any]) -> Any:
    """An engine of ``kind`` (``engine_kinds``) for a test's handful of requests, not started."""
    from tokenwire_server.engine import create_engine
    from tokenwire_server.engine.base import EngineLimits

    limits = EngineLimits(max_active=16, max_queue=32, kv_cache_tokens=16 * 1024, max_prefill_tokens=24)
    if kind == "simple":
        return create_engine("simple", loaded, limits, workers=2)
    return create_engine("batched", loaded, limits, workers=1, **options)


SLOTS = 4  # the requests a test's fresh cache holds
BLOCK = 16


def fresh_cache(model: Any, capacity: int = 256, poisoned: bool = False) -> Any:
    """A float32 CPU paged cache shaped for ``model``, room for ``SLOTS`` requests of
    ``capacity`` tokens (``slot_segment``): every block zeroed, or (``poisoned``) NaN, as
    uninitialised memory may be, so any read of a column no row wrote shows in the logits."""
    import torch
    from tokenwire_server.engine.kv import PagedCache
    from tokenwire_server.model import attention_shape

    _, kv_heads, head_dim = attention_shape(model.config)
    layers = model.config.num_hidden_layers
    cache = PagedCache(
        SLOTS * capacity // BLOCK, BLOCK, kv_heads, head_dim, [(torch.device("cpu"), torch.float32)] * layers
    )
    for layer in cache.layers:
        layer.keys.fill_(float("nan") if poisoned else 0.0)
        layer.values.fill_(float("nan") if poisoned else 0.0)
    return cache


def slot_table(slot: int, capacity: int = 256) -> tuple[int, ...]:
    """Request ``slot``'s block table in a ``fresh_cache``: its blocks interleaved with the
    other requests' (block b of request s is pool block ``b * SLOTS + s``), never adjacent."""
    return tuple(b * SLOTS + slot for b in range(capacity // BLOCK))


def slot_segment(slot: int, start: int, count: int, capacity: int = 256) -> Any:
    """A native-pass segment of request ``slot`` in a ``fresh_cache``."""
    from tokenwire_server.engine.ops import Segment

    return Segment(slot_table(slot, capacity), start, count)


def make_adapter(
    base: Path, target: Path, rank: int, modules: list[str], seed: int, scale: float = 4.0, **settings: Any
) -> Path:
    """A PEFT LoRA adapter over ``base`` with random A and B (B times ``scale``, so that it moves
    the tiny model's greedy picks), saved as PEFT saves it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=modules, lora_dropout=0.0, init_lora_weights=False, **settings
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.mul_(scale)
    peft_model.save_pretrained(target)
    return target
