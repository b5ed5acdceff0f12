"""The contract on CUDA in bf16 (`make test-gpu`): what differs from the CPU runs is the
device, the dtype and CUDA's own failure modes. Skipped without a GPU. Each forward runs:
``transformers`` (the model's own) and ``native`` (the engine's pass, decode steps replayed
as CUDA graphs per batch bucket, ``--step-graphs auto``).

- the stream's shape and text == decode(ids), on the tiny model in bf16 on cuda:0, and a
  constrained answer (the grammar's mask applied by torch ops on the device);
- in fp32, greedy and seeded requests give the same tokens alone and in a concurrent batch,
  and (native) the same with the overlapped loop off and with the CUDA graphs off;
- in bf16, cuBLAS may round a row differently by the batch's shape (and a graph's bucket is
  that shape): greedy tokens alone and batched are equal up to the first step whose two
  likeliest tokens were within ``NEAR_TIE`` nats alone (docs/architecture.md);
- an out-of-memory error fails that request with RESOURCE_EXHAUSTED, gives its slot and
  KV reservation back, empties torch's CUDA cache (memory back to its level before), and
  the server keeps serving (also on a CPU, the OOM faked: it runs without a GPU too);
- drain on SIGTERM lets the stream in flight finish, then exits 0;
- a real device-side assert (a sticky fault, ``site/sitecustomize.py``) ends the stream
  INTERNAL and turns liveness NOT_SERVING;
- a server capped to a 24 GiB card (``set_per_process_memory_fraction``) sizes its KV cache
  from the cap after its worst step, on either forward, and serves the traffic that step stands
  for (15 decoding rows beside a scored 2,000-token prompt) within the cap's 0.9;
- an eager native step and the sampler's launch make no synchronisation (sync debug mode
  ``error``): the host is free while the device computes, which ``--overlap`` relies on;
- a prompt chunk's attention runs with SDPA held to flash attention in bf16, grouped heads
  included (its causal mask is a lower-right bias, not a tensor);
- ``--quantization int4`` and ``fp8`` (fp8 from compute capability 8.9) quantize every
  decoder projection with torchao and serve (the CPU tests only record the quantizer call).
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import torch
from production_support import (
    LIVENESS,
    NOT_SERVING,
    InProcessServer,
    generation_stub,
    health_status,
    long_request,
    short_request,
    wait_until,
)
from servers import ServerProcess
from tokenwire.v1 import generation_pb2 as pb
from transformers import AutoTokenizer

from benchmarks.gpu_bench import reserved_bytes

pytestmark = pytest.mark.timeout(300)
CUDA_DEVICE = ["--device", "cuda", "--dtype", "auto"]
# A KV budget of its own for every server (conftest.KV_CACHE_TOKENS); the one test of sizing
# from the card's memory uses CUDA_DEVICE alone.
CUDA = [*CUDA_DEVICE, "--kv-cache-tokens", str(1 << 16)]


FORWARDS = ("transformers", "native")
# In bf16 two tokens whose log-probabilities lie closer than this may swap between a row alone
# and in a batch (cuBLAS picks its kernels by the GEMM's shape). Stated, to be measured on the
# device (docs/architecture.md): bf16 keeps 8 bits of mantissa, about 0.4 % of a logit.
NEAR_TIE = 0.1


@pytest.fixture(scope="module", params=FORWARDS)
def cuda_server(request: pytest.FixtureRequest, tiny_model_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(
        ["--model", str(tiny_model_dir), *CUDA, "--max-active", "16", "--forward", request.param]
    ) as server:
        yield server


def test_the_contract_on_cuda_in_bf16(cuda_server: ServerProcess, tiny_model_dir: Path) -> None:
    [engine] = cuda_server.find("batched engine forward pass")
    if engine["forward"] == "native":
        assert engine["step_graphs"] == "cuda"  # the decode step replayed as CUDA graphs
    assert engine["overlap"] is True  # --overlap auto: each step's text delivered while the next runs
    stub = generation_stub(cuda_server.target)
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert info.device.startswith("cuda")
    major, _ = torch.cuda.get_device_capability()
    assert info.dtype == ("bfloat16" if major >= 8 else "float16")
    request = pb.GenerateRequest(
        prompt="Café 日本語 🧑‍🚀", sampling=pb.SamplingParams(temperature=0),
        stopping=pb.StoppingCriteria(max_new_tokens=32, ignore_eos=True), output=pb.OutputOptions(token_ids=True),
    )  # fmt: skip
    chunks = list(stub.Generate(request, timeout=60))
    ids = [t.id for c in chunks for t in c.tokens]
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert len(ids) == 32 == chunks[-1].usage.completion_tokens
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert "".join(c.text for c in chunks) == tokenizer.decode(
        ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    # A constrained call: its token mask applied on the device by torch ops (no kernel is
    # compiled at run time: the runtime image has no C compiler for Triton's launcher).
    for temperature in (0.0, 0.8):
        constrained = pb.GenerateRequest(
            prompt="Answer:", response_format=pb.ResponseFormat(choice=pb.Choice(options=["yes", "no"])),
            sampling=pb.SamplingParams(temperature=temperature, seed=5), stopping=pb.StoppingCriteria(max_new_tokens=8),
        )  # fmt: skip
        answer = list(stub.Generate(constrained, timeout=60))
        assert "".join(c.text for c in answer) in ("yes", "no")


def story_requests(samplings: list[pb.SamplingParams], top_logprobs: int = 0) -> list[pb.GenerateRequest]:
    return [
        pb.GenerateRequest(prompt=f"Story {i}: " + "once " * i, sampling=samplings[i % len(samplings)],
                           output=pb.OutputOptions(token_ids=True, top_logprobs=top_logprobs),
                           stopping=pb.StoppingCriteria(max_new_tokens=24, ignore_eos=True))
        for i in range(12)
    ]  # fmt: skip


def alone_and_together(
    target: str, requests: list[pb.GenerateRequest]
) -> tuple[list[list[pb.Token]], list[list[pb.Token]]]:
    stub = generation_stub(target)

    def tokens(request: pb.GenerateRequest) -> list[pb.Token]:
        return [t for c in stub.Generate(request, timeout=120) for t in c.tokens]

    alone = [tokens(r) for r in requests]
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(tokens, requests))
    return alone, together


@pytest.mark.parametrize("forward", FORWARDS)
def test_alone_equals_batched_on_cuda_in_fp32(forward: str, tiny_model_dir: Path) -> None:
    samplings = [pb.SamplingParams(temperature=0), pb.SamplingParams(temperature=0.8, top_p=0.9, seed=7),
                 pb.SamplingParams(temperature=1.0, top_k=20, repetition_penalty=1.2, seed=11)]  # fmt: skip
    args = [
        "--model",
        str(tiny_model_dir),
        "--device",
        "cuda",
        "--dtype",
        "float32",
        "--max-active",
        "16",
        "--forward",
        forward,
        "--kv-cache-tokens",
        str(1 << 16),
    ]
    with ServerProcess(args) as server:
        alone, together = alone_and_together(server.target, story_requests(samplings))
    assert [[t.id for t in row] for row in together] == [[t.id for t in row] for row in alone]
    if forward == "native":  # the overlapped loop (CUDA's default) gives the plain loop's tokens
        with ServerProcess([*args, "--overlap", "off"]) as server:
            _, plain = alone_and_together(server.target, story_requests(samplings))
        assert [[t.id for t in row] for row in plain] == [[t.id for t in row] for row in together]
        # The CUDA graphs give the eager step's tokens: on a CPU the graphs are faked
        # (FakeGraph re-runs the step), so a step unsafe to capture shows only here.
        with ServerProcess([*args, "--step-graphs", "off"]) as server:
            [engine] = server.find("batched engine forward pass")
            assert engine["step_graphs"] == "off"
            _, eager = alone_and_together(server.target, story_requests(samplings))
        assert [[t.id for t in row] for row in eager] == [[t.id for t in row] for row in together]


def test_alone_and_batched_in_bf16_differ_only_past_a_near_tie(cuda_server: ServerProcess) -> None:
    alone, together = alone_and_together(
        cuda_server.target, story_requests([pb.SamplingParams(temperature=0)], top_logprobs=2)
    )
    differing = 0
    for solo, batched in zip(alone, together, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(solo, batched, strict=True)) if a.id != b.id), None)
        if first is None:
            continue
        differing += 1
        best, second = solo[first].top_logprobs[0].logprob, solo[first].top_logprobs[1].logprob
        assert best - second < NEAR_TIE, (
            f"step {first}: alone {solo[first].id}, batched {batched[first].id}, margin {best - second:.3f} nats"
        )
    assert differing <= len(alone) // 2, f"{differing} of {len(alone)} rows differ"


def engine_holds_nothing(engine: Any) -> bool:
    """No request admitted, queued or in the batch, no KV reserved, and (the batched engine)
    every slot back in the free list."""
    stats = engine.stats()
    if (stats.active, stats.queued, stats.batch_size, stats.kv_tokens_reserved) != (0, 0, 0, 0):
        return False
    free = getattr(engine, "_free", None)
    return free is None or sorted(free) == list(range(engine.limits.max_active))


# The same test on a CPU (it runs everywhere, conftest.py skips only the cuda one without a
# GPU): the OOM is faked there, and torch.cuda.empty_cache watched instead of measured.
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_out_of_memory_is_resource_exhausted_frees_the_cache_and_the_server_goes_on(
    device: str, in_process_server: Callable[..., InProcessServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    server = in_process_server(device=device)
    engine = server.backend.engine
    # the batched engine's own pass where it runs one, else the model's forward
    owner, name = (
        (engine.runner, "native")
        if getattr(engine, "forward", None) == "native"
        else (server.backend.loaded.model, "forward")
    )
    forward = getattr(owner, name)
    calls = {"n": 0}
    emptied: list[bool] = []
    if device == "cuda":
        torch.cuda.synchronize()
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    else:
        # No GPU: make the engine believe it has one, and watch it empty the cache.
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    assert engine_holds_nothing(engine)

    def failing(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == 1:
            if device == "cuda":
                # What a real OOM leaves behind: blocks this pass took, freed, kept in
                # torch's cache (memory_reserved) until someone empties it.
                scratch = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
                del scratch
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return forward(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)
    stub = generation_stub(server.target)
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(short_request(), timeout=30))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # The request's slot and KV reservation are given back ...
    assert wait_until(lambda: engine_holds_nothing(engine), 10), engine.stats()
    # ... and the device's cache emptied: allocations back to where they were, the 256 MiB
    # the failed pass left cached handed back (torch.cuda.empty_cache ran).
    if device == "cuda":
        torch.cuda.synchronize()
        # Back to where it was, give or take the few KB of the last step's plan tensors (the
        # cache keeps the latest step's tables and indexes: the failed step's now, not the
        # warm-up's); the failed pass's 256 MiB is nowhere.
        assert abs(torch.cuda.memory_allocated() - allocated) <= 64 << 10
        assert torch.cuda.memory_reserved() <= reserved
    else:
        assert emptied
        monkeypatch.undo()  # the real torch.cuda (and forward) again before serving on
    assert list(stub.Generate(short_request(), timeout=30))[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
    assert wait_until(lambda: engine_holds_nothing(engine), 10), engine.stats()


def test_drain_on_cuda(tiny_model_dir: Path) -> None:
    with ServerProcess(
        ["--model", str(tiny_model_dir), *CUDA, "--grace-period", "60", "--handoff-after-s", "0"]
    ) as server:
        stub = generation_stub(server.target)
        stream = stub.Generate(long_request(1000), timeout=120)
        first = next(stream)
        server.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: server.find("draining") != [], 30)
        rest = [first, *stream]
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert server.proc.wait(60) == 0


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_a_device_side_assert_ends_the_stream_and_turns_liveness_off(
    overlap: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    trigger = tmp_path / "fault-now"
    env = {
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent / "site"), os.environ.get("PYTHONPATH", "")]),
        "TOKENWIRE_TEST_DEVICE_ASSERT_FILE": str(trigger),
    }
    args = ["--model", str(tiny_model_dir), *CUDA, "--forward", "native", "--overlap", overlap]
    with ServerProcess(args, env=env) as server:
        stub = generation_stub(server.target)
        assert health_status(server.target, LIVENESS) != NOT_SERVING
        stream = stub.Generate(long_request(1000), timeout=120)
        next(stream)
        trigger.touch()
        with pytest.raises(grpc.RpcError) as caught:
            list(stream)
        assert caught.value.code() == grpc.StatusCode.INTERNAL
        assert wait_until(lambda: health_status(server.target, LIVENESS) == NOT_SERVING, 10)
        with pytest.raises(grpc.RpcError):
            list(stub.Generate(short_request(), timeout=10))


@pytest.mark.parametrize("forward", ["native", "transformers"])
def test_a_24_gib_card_on_a_larger_one_sizes_kv_after_the_worst_step_and_serves_it(
    tiny_long_model_dir: Path, forward: str
) -> None:
    """The KV pool sized from the cap after the engine's worst step (engine/memory.py; the CPU
    proof on meta: tests/test_memory.py), then the traffic that step stands for: 15 streams
    decoding beside a prompt of 2,000 tokens scored as it is read, every row sampled with
    log-probabilities. Nothing runs out of memory, and torch's high-water mark stays under the
    cap's 0.9 that the check gave out. The tiny model with an 8,192-token context: the decoding
    rows' tables reach to it in the worst step."""
    cap = 24
    env = {
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent / "site"), os.environ.get("PYTHONPATH", "")]),
        "TOKENWIRE_TEST_MEMORY_CAP_GIB": str(cap),
    }
    flags = ["--model", str(tiny_long_model_dir), *CUDA_DEVICE, "--forward", forward, "--metrics-port", "-1"]
    with ServerProcess(flags, env=env) as server:
        [sized] = server.find("kv cache sized from device memory")
        assert abs(sized["total_bytes"] - cap * 2**30) < 2**20  # the cap, not the device's 141 GB
        assert sized["worst_step_bytes"] > 0 and sized["kv_cache_tokens"] > 0
        stub = generation_stub(server.target)
        sampled = pb.SamplingParams(temperature=0.8, top_p=0.95, min_p=0.05, repetition_penalty=1.1, seed=1)
        out = pb.OutputOptions(top_logprobs=20)
        scored = pb.GenerateRequest(
            prompt="hello " * 2000,
            sampling=sampled,
            output=pb.OutputOptions(top_logprobs=20, prompt_logprobs=True),
            stopping=pb.StoppingCriteria(max_new_tokens=8, ignore_eos=True),
        )
        streams = [long_request(256, sampling=sampled, output=out) for _ in range(15)] + [scored]
        with concurrent.futures.ThreadPoolExecutor(len(streams)) as pool:
            ends = list(pool.map(lambda r: list(stub.Generate(r, timeout=240))[-1].finish_reason, streams))
        assert ends == [pb.FINISH_REASON_LENGTH] * len(streams)
        reserved = reserved_bytes(server.metrics_port)
        assert reserved is not None and reserved <= 0.9 * cap * 2**30


def test_a_launch_does_not_synchronise_with_the_device(tiny_model_dir: Path) -> None:
    """With torch's sync debug mode on ``error``, an eager native step (decode rows beside a
    prompt chunk, some positions' logits kept) and the sampler's launch for every kind of row
    queue their kernels and host values without one synchronisation (transfer.py: a
    plain host -> device copy syncs the stream, which would undo --overlap). Reading the
    picks is the step's one synchronisation, outside the mode. The CPU twin, on ``meta``:
    tests/test_overlap.py."""
    from engine_support import BLOCK, SLOTS, slot_segment
    from tokenwire_server.domain import GenerationRequest, RequestHandle, SamplingOptions
    from tokenwire_server.engine.generation import Generation
    from tokenwire_server.engine.kv import PagedCache
    from tokenwire_server.engine.native import NativeForward
    from tokenwire_server.engine.sampling import Sampler
    from tokenwire_server.model import attention_shape, load_model

    model = load_model(str(tiny_model_dir), device="cuda", dtype="float32").model
    _, kv_heads, head_dim = attention_shape(model.config)
    placements = [(torch.device("cuda"), torch.float32)] * model.config.num_hidden_layers
    native = NativeForward(model, PagedCache(SLOTS * 256 // BLOCK, BLOCK, kv_heads, head_dim, placements), batch_hint=4)

    def row(sampling: SamplingOptions, generated: list[int], **more: Any) -> Generation:
        text = SimpleNamespace(decode=lambda ids, **kw: "x")  # the alternatives' text: not what is checked here
        seq = Generation(
            GenerationRequest("r", [5, 6], sampling, 8, **more),
            RequestHandle(),
            lambda event: None,
            text,
            (2,),
            torch.device("cuda"),
        )
        seq.generated = list(generated)
        return seq

    rows = [
        row(SamplingOptions(temperature=0.0), [], ignore_eos=True),
        row(SamplingOptions(temperature=0.9, top_k=20, top_p=0.8, seed=11), [7], ignore_eos=True),
        row(SamplingOptions(temperature=1.2, repetition_penalty=1.3, seed=12), [9, 4], ignore_eos=True),
        row(SamplingOptions(temperature=0.7, seed=13), [], min_new_tokens=4, want_logprobs=True, top_logprobs=3),
    ]
    ids, positions = torch.tensor([5, 5, 5, *range(10, 25)]), torch.tensor([0, 0, 0, *range(15)])
    segments = [slot_segment(0, 0, 1), slot_segment(1, 0, 1), slot_segment(3, 0, 1), slot_segment(2, 0, 15)]
    sampler = Sampler([2])

    def step() -> Any:
        return sampler.launch(native(ids, positions, segments, [0, 1, 2, 17]), rows)

    sampler.collect(step())  # warm: cuBLAS handles, the caching allocators
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        drawn = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(sampler.collect(drawn)) == 4


def test_a_prompt_chunk_attends_by_flash_attention_in_bf16(tiny_model_dir: Path) -> None:
    """A prompt chunk's causal mask on CUDA is ``causal_lower_right`` (``ops.chunk_plan``), which
    flash attention takes with grouped heads: a native step of chunks alone (the tiny model: 4
    query heads over 2 KV heads, bf16) runs with SDPA held to flash attention, and its logits are
    the math backend's up to bf16's rounding. Before, the mask with ``enable_gqa`` left SDPA no
    kernel but math."""
    from engine_support import BLOCK, SLOTS, slot_segment
    from tokenwire_server.engine.kv import PagedCache
    from tokenwire_server.engine.native import NativeForward
    from tokenwire_server.model import attention_shape, load_model
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = load_model(str(tiny_model_dir), device="cuda", dtype="bfloat16").model
    heads, kv_heads, head_dim = attention_shape(model.config)
    assert heads > kv_heads
    placements = [(torch.device("cuda"), torch.bfloat16)] * model.config.num_hidden_layers
    native = NativeForward(model, PagedCache(SLOTS * 256 // BLOCK, BLOCK, kv_heads, head_dim, placements), batch_hint=4)
    ids, positions = torch.tensor([*range(10, 25), *range(30, 50)]), torch.tensor([*range(15), *range(20)])
    segments = [slot_segment(0, 0, 15), slot_segment(1, 0, 20)]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        flash = native(ids, positions, segments, [14, 34])
    with sdpa_kernel([SDPBackend.MATH]):  # the same step again (it writes the same keys and values)
        math = native(ids, positions, segments, [14, 34])
    assert flash.shape[0] == 2 and torch.isfinite(flash).all()
    assert (flash - math).abs().max() <= 0.05 * math.abs().max() + 1e-2  # bf16 sums in another order


@pytest.mark.parametrize("mode", ["int4", "fp8"])
def test_int4_and_fp8_quantize_every_projection_and_serve_on_cuda(mode: str, tiny_wide_model_dir: Path) -> None:
    """The CPU tests replace torchao's ``quantize_`` with a recorder: here the real one runs.
    Every decoder projection's weight becomes torchao's quantized tensor (a subclass, where
    bf16's is a plain Parameter), and a server in that mode serves and says so."""
    pytest.importorskip("torchao")
    if mode == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 needs compute capability 8.9 or newer")
    from tokenwire_server.model import load_model

    model = load_model(str(tiny_wide_model_dir), device="cuda", dtype="bfloat16", quantization=mode).model
    projections = [
        m for name, m in model.named_modules() if name.startswith("model.layers.") and isinstance(m, torch.nn.Linear)
    ]
    assert projections and all(type(m.weight) is not torch.nn.Parameter for m in projections)
    args = ["--model", str(tiny_wide_model_dir), *CUDA, "--quantization", mode, "--allow-unmet-quality-bar"]
    with ServerProcess(args) as server:
        request = pb.GenerateRequest(prompt="Hello", stopping=pb.StoppingCriteria(max_new_tokens=16, ignore_eos=True))
        chunks = list(generation_stub(server.target).Generate(request, timeout=120))
        assert chunks[-1].usage.completion_tokens == 16
        info = generation_stub(server.target).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        assert info.quantization == mode
