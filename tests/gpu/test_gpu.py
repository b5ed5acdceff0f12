"""The contract on CUDA in bf16 (`make test-gpu`): what differs from the CPU runs is the
device, the dtype and CUDA's own failure modes. Skipped without a GPU.

- the stream's shape and text == decode(ids), on the tiny model in bf16 on cuda:0;
- greedy and seeded requests give the same tokens alone and in a concurrent batch;
- an out-of-memory error fails that request with RESOURCE_EXHAUSTED, gives its slot and
  KV reservation back, empties torch's CUDA cache (memory back to its level before), and
  the server keeps serving (also on a CPU, the OOM faked: it runs without a GPU too);
- drain on SIGTERM lets the stream in flight finish, then exits 0.
"""

from __future__ import annotations

import concurrent.futures
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from production_support import InProcessServer, generation_stub, long_request, short_request, wait_until
from servers import ServerProcess
from tokenwire.v1 import generation_pb2 as pb
from transformers import AutoTokenizer

pytestmark = pytest.mark.timeout(300)
CUDA = ["--device", "cuda", "--dtype", "auto"]


@pytest.fixture(scope="module")
def cuda_server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(["--model", str(tiny_model_dir), *CUDA, "--max-active", "16"]) as server:
        yield server


def test_the_contract_on_cuda_in_bf16(cuda_server: ServerProcess, tiny_model_dir: Path) -> None:
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
    assert "".join(c.text for c in chunks) == tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_alone_equals_batched_on_cuda(cuda_server: ServerProcess) -> None:
    stub = generation_stub(cuda_server.target)
    samplings = [pb.SamplingParams(temperature=0), pb.SamplingParams(temperature=0.8, top_p=0.9, seed=7),
                 pb.SamplingParams(temperature=1.0, top_k=20, repetition_penalty=1.2, seed=11)]  # fmt: skip
    requests = [
        pb.GenerateRequest(prompt=f"Story {i}:", sampling=samplings[i % 3], output=pb.OutputOptions(token_ids=True),
                           stopping=pb.StoppingCriteria(max_new_tokens=24, ignore_eos=True))
        for i in range(12)
    ]  # fmt: skip

    def ids(request: pb.GenerateRequest) -> list[int]:
        return [t.id for c in stub.Generate(request, timeout=120) for t in c.tokens]

    alone = [ids(r) for r in requests]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        together = list(pool.map(ids, requests))
    assert together == alone


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
    owner, name = (engine.runner, "native") if getattr(engine, "forward", None) == "native" else (server.backend.loaded.model, "forward")
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
        assert torch.cuda.memory_allocated() == allocated
        assert torch.cuda.memory_reserved() <= reserved
    else:
        assert emptied
        monkeypatch.undo()  # the real torch.cuda (and forward) again before serving on
    assert list(stub.Generate(short_request(), timeout=30))[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
    assert wait_until(lambda: engine_holds_nothing(engine), 10), engine.stats()


def test_drain_on_cuda(tiny_model_dir: Path) -> None:
    with ServerProcess(["--model", str(tiny_model_dir), *CUDA, "--grace-period", "60", "--handoff-after-s", "0"]) as server:
        stub = generation_stub(server.target)
        stream = stub.Generate(long_request(1000), timeout=120)
        first = next(stream)
        server.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: server.find("draining") != [], 30)
        rest = [first, *stream]
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert server.proc.wait(60) == 0
