"""Faults injected into the model of a server running in this process.

- An exception inside generation fails that request with INTERNAL and a message, after every
  chunk of the steps before it (no token or text lost, none out of order, --overlap's
  last step included); the server keeps serving.
- torch.cuda.OutOfMemoryError (simulated) fails it with RESOURCE_EXHAUSTED and a RetryInfo,
  frees the device cache, and the server keeps serving.
- A wedged engine loop (no progress while work is pending past --stall-timeout) turns
  liveness NOT_SERVING, and SERVING again once the loop moves.
- A device fault (a sticky CUDA error, faked) ends every stream and waiting request INTERNAL,
  turns liveness and readiness NOT_SERVING within a second, and refuses new calls; so do
  steps that keep failing.
- Out of memory in a step with several rows fails only the newest rows; the others keep
  their tokens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import engine_support
import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from production_support import (
    LIVENESS,
    NOT_SERVING,
    READINESS,
    SERVING,
    InProcessServer,
    generation_stub,
    health_status,
    long_request,
    short_request,
    wait_until,
)
from tokenwire.v1 import generation_pb2 as pb

pytestmark = pytest.mark.timeout(60)

# The engines under fault: the batched one on both kernel choices (its native pass runs the
# work around the GEMMs compiled or on stock torch) and with --overlap on, and the simple one.
_UNBUILDABLE = engine_support.kernel_unbuildable()
ENGINES = [
    pytest.param(
        {"engine": "batched", "kernels": "compiled"},
        id="batched-compiled",
        marks=pytest.mark.skipif(_UNBUILDABLE is not None, reason=f"compiled CPU ops: {_UNBUILDABLE}"),
    ),
    pytest.param({"engine": "batched", "kernels": "torch"}, id="batched-torch"),
    # Each step's text delivered while the next step is launched (--overlap, CUDA's default).
    pytest.param({"engine": "batched", "kernels": "torch", "overlap": "on"}, id="batched-overlap"),
    pytest.param({"engine": "simple"}, id="simple"),
]


class ForwardFault:
    """Stands in for the engine's forward pass (the batched engine's native pass, or
    ``model.forward``): from call number ``at`` (counted from arming) raises ``error`` once,
    or on every call that ``when(*args)`` accepts; blocks while ``gate`` is closed; otherwise
    runs the real forward."""

    def __init__(self, forward: Any) -> None:
        self._forward = forward
        self.calls = 0
        self.raised = 0
        self.error: BaseException | None = None
        self.at = 0
        self.when: Callable[..., bool] | None = None
        self.gate = threading.Event()
        self.gate.set()
        self.held = threading.Event()  # set while a call waits at the closed gate

    def arm(self, error: BaseException, at: int = 1, when: Callable[..., bool] | None = None) -> None:
        self.calls, self.raised, self.error, self.at, self.when = 0, 0, error, at, when

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if not self.gate.is_set():
            self.held.set()
            self.gate.wait()
        error = self.error
        if error is not None and self.calls >= self.at and (self.when is None or self.when(*args)):
            self.raised += 1
            if self.when is None:
                self.error = None
            raise type(error)(*error.args)
        return self._forward(*args, **kwargs)


def inject(server: InProcessServer, monkeypatch: pytest.MonkeyPatch) -> ForwardFault:
    engine = server.backend.engine
    if getattr(engine, "forward", None) == "native":  # the batched engine's own pass
        fault = ForwardFault(engine.runner.native)
        monkeypatch.setattr(engine.runner, "native", fault)
        return fault
    model = server.backend.loaded.model
    fault = ForwardFault(model.forward)
    monkeypatch.setattr(model, "forward", fault)
    return fault


def chunks_until_error(stream: Any) -> tuple[list[pb.TokenChunk], grpc.RpcError]:
    """The chunks a stream delivered before it failed, and its error."""
    chunks: list[pb.TokenChunk] = []
    with pytest.raises(grpc.RpcError) as caught:
        for chunk in stream:
            chunks.append(chunk)
    return chunks, caught.value


def ids_of(chunks: list[pb.TokenChunk]) -> list[int]:
    return [t.id for c in chunks for t in c.tokens]


def streamed_text(server: InProcessServer, ids: list[int]) -> str:
    """The text a stream of ``ids`` has delivered so far (no stop sequence): the server's own
    incremental detokenizer, which holds back a partial character at the end."""
    from tokenwire_server.text import Detokenizer

    detokenizer = Detokenizer(server.backend.loaded.tokenizer)
    return "".join(detokenizer.push(token) for token in ids)


def assert_still_serving(server: InProcessServer) -> None:
    chunks = list(generation_stub(server.target).Generate(short_request(), timeout=10))
    assert chunks[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
    assert health_status(server.target, READINESS) == SERVING
    assert health_status(server.target, LIVENESS) == SERVING


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("at", [1, 4], ids=["first-forward", "mid-stream"])
def test_exception_in_generation_is_internal_and_server_keeps_serving(
    engine: dict, at: int, in_process_server: Callable[..., InProcessServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forward pass number ``at`` raises: the stream ends INTERNAL with the cause, after every
    token of the passes before it (one each: the prompt's, then each decode), in chunks
    numbered from 0 with no gap: the very tokens of an undisturbed run that far, and their text."""
    server = in_process_server(**engine)
    fault = inject(server, monkeypatch)
    stub = generation_stub(server.target)
    greedy = {"sampling": pb.SamplingParams(temperature=0.0), "output": pb.OutputOptions(token_ids=True)}
    undisturbed = list(stub.Generate(long_request(at - 1, **greedy), timeout=10)) if at > 1 else []
    fault.arm(RuntimeError("injected fault"), at=at)
    chunks, error = chunks_until_error(stub.Generate(long_request(50, **greedy), timeout=10))
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "injected fault" in error.details()
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert ids_of(chunks) == ids_of(undisturbed) and len(ids_of(chunks)) == at - 1
    assert "".join(c.text for c in chunks) == streamed_text(server, ids_of(chunks))
    assert_still_serving(server)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("at", [1, 4], ids=["prefill", "decode"])
def test_out_of_memory_is_resource_exhausted_frees_cache_and_server_keeps_serving(
    engine: dict, at: int, in_process_server: Callable[..., InProcessServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    server = in_process_server(**engine, retry_after_ms=300)
    fault = inject(server, monkeypatch)
    emptied: list[bool] = []
    # This machine has no GPU: make the engine believe it has one, and watch it empty the cache.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    fault.arm(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)"), at=at)
    with pytest.raises(grpc.RpcError) as caught:
        list(generation_stub(server.target).Generate(long_request(50), timeout=10))
    error = caught.value
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "out of memory" in error.details()
    status = rpc_status.from_call(error)
    assert status is not None
    retry = error_details_pb2.RetryInfo()
    assert any(detail.Unpack(retry) for detail in status.details)
    assert retry.retry_delay.ToMilliseconds() == 300
    assert emptied
    monkeypatch.undo()  # the real torch.cuda again before serving on
    assert_still_serving(server)


@pytest.mark.parametrize("engine", ENGINES[:-1])
def test_a_failed_step_fails_the_streams_in_its_batch_and_not_the_one_queued(
    engine: dict, in_process_server: Callable[..., InProcessServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three streams decode together and a fourth waits for a slot; the engine step that
    fails holds the three (the engine is stopped inside that step's forward pass, and its
    own state says so). Each of the three gets INTERNAL with the cause after the chunks it
    had: every token the engine had generated for it before that step (with --overlap, the
    last step's too, whose text goes out while the next one is launched), in chunks numbered
    from 0 with no gap. The queued one then runs to its end, and the server keeps serving."""
    server = in_process_server(**engine, max_active=3, max_queue=1)
    fault = inject(server, monkeypatch)
    stub = generation_stub(server.target)
    ids = pb.OutputOptions(token_ids=True)
    streams = [stub.Generate(long_request(1000, request_id=f"in-batch-{i}", output=ids), timeout=30) for i in range(3)]
    firsts = [next(stream) for stream in streams]  # each is decoding in the batch
    engine = server.backend.engine
    fault.gate.clear()
    assert fault.held.wait(10)  # the engine is inside a step's forward pass, and stays there
    assert engine.stats().batch_size == 3 and engine.queue.active == 3
    generated = {row.seq.request.request_id: list(row.seq.generated) for row in engine.scheduler.rows}
    assert sorted(generated) == [f"in-batch-{i}" for i in range(3)] and all(generated.values())
    # A deadline that deadline-aware admission cannot refuse, whatever the steps cost: the
    # estimate is 1000 steps of the three long streams (the test's own timeout bounds it).
    queued = stub.Generate(short_request(6, request_id="queued"), timeout=3600)
    assert wait_until(lambda: engine.queue.queued == 1, 10)
    fault.arm(RuntimeError("injected step fault"), at=0)  # the held call raises once the gate opens
    fault.gate.set()
    for i, (first, stream) in enumerate(zip(firsts, streams, strict=True)):
        assert first.index == 0
        rest, error = chunks_until_error(stream)
        assert error.code() == grpc.StatusCode.INTERNAL
        assert error.details() == "generation failed: RuntimeError: injected step fault"
        chunks = [first, *rest]
        assert [c.index for c in chunks] == list(range(len(chunks)))
        assert ids_of(chunks) == generated[f"in-batch-{i}"]
        assert "".join(c.text for c in chunks) == streamed_text(server, generated[f"in-batch-{i}"])
    chunks = list(queued)
    assert chunks[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED and chunks[-1].usage.completion_tokens >= 1
    assert_still_serving(server)


def test_wedged_engine_loop_turns_liveness_not_serving(
    in_process_server: Callable[..., InProcessServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    server = in_process_server(engine="batched", stall_timeout=1.0)
    fault = inject(server, monkeypatch)
    assert health_status(server.target, LIVENESS) == SERVING
    fault.gate.clear()  # the next forward pass never returns until the gate opens
    stub = generation_stub(server.target)
    stuck = stub.Generate(short_request(3), timeout=30)
    reader = threading.Thread(target=lambda: list(stuck), daemon=True)
    reader.start()
    try:
        assert wait_until(lambda: health_status(server.target, LIVENESS) == NOT_SERVING, 6, interval=0.1)
        assert server.server.health.live is False
    finally:
        fault.gate.set()
    reader.join(10)
    assert wait_until(lambda: health_status(server.target, LIVENESS) == SERVING, 4, interval=0.1)
    assert_still_serving(server)


def test_an_allocation_failure_is_out_of_memory_and_a_faulted_context_a_device_fault() -> None:
    from tokenwire_server.engine.faults import Fault, classify

    assert [classify(e) for e in OUT_OF_MEMORY_AS.values()] == [Fault.OUT_OF_MEMORY] * 3
    assert classify(RuntimeError("CUDNN_STATUS_ALLOC_FAILED")) is Fault.OUT_OF_MEMORY
    for sticky in (
        torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
        RuntimeError("CUDA error: device-side assert triggered"),
        RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasSgemm"),
    ):
        assert classify(sticky) is Fault.DEVICE, sticky
    assert classify(ValueError("a bug")) is Fault.STEP


CUDA_FAULT = "CUDA error: an illegal memory access was encountered"


def always(*args: Any) -> bool:
    return True


@pytest.mark.parametrize("engine", ENGINES)
def test_a_device_fault_ends_every_stream_and_turns_liveness_not_serving(
    engine: dict, in_process_server: Callable[..., InProcessServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sticky device error (faked as CUDA raises it: torch.AcceleratorError, on this and
    every later forward pass) while three streams decode and a fourth waits: each of the four
    ends INTERNAL naming the fault, liveness and readiness turn NOT_SERVING within a second
    (Kubernetes restarts the pod), and a new call is refused UNAVAILABLE."""
    slots = {"max_active": 3} if engine["engine"] == "batched" else {"workers": 3}
    server = in_process_server(**engine, **slots, max_queue=1)
    fault = inject(server, monkeypatch)
    stub = generation_stub(server.target)
    streams = [stub.Generate(long_request(1000, request_id=f"running-{i}"), timeout=30) for i in range(3)]
    for stream in streams:
        assert next(stream).index == 0
    fault.gate.clear()
    assert fault.held.wait(10)
    queued = stub.Generate(short_request(6, request_id="queued"), timeout=3600)
    assert wait_until(lambda: server.backend.engine.queue.queued == 1, 10)
    fault.arm(torch.AcceleratorError(CUDA_FAULT), at=0, when=always)
    opened = time.monotonic()
    fault.gate.set()
    # A state that comes: wait_until returns as soon as it holds (here ~0.1-0.3 s), so only a
    # loaded host reads the bound, which a 1 s stopwatch made a flake on CI's 2 cores.
    assert wait_until(lambda: health_status(server.target, LIVENESS) == NOT_SERVING, 10.0, interval=0.02), (
        "liveness still SERVING ten seconds after the device fault"
    )
    print(f"liveness NOT_SERVING {time.monotonic() - opened:.3f} s after the fault")
    assert health_status(server.target, READINESS) == NOT_SERVING
    for stream in [*streams, queued]:
        with pytest.raises(grpc.RpcError) as caught:
            list(stream)
        assert caught.value.code() == grpc.StatusCode.INTERNAL
        assert "device failed and it must restart" in caught.value.details()
        assert CUDA_FAULT in caught.value.details()
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(short_request(), timeout=10))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "faulted" in refused.value.details() and CUDA_FAULT in refused.value.details()
    assert server.backend.failure() == f"device error: AcceleratorError: {CUDA_FAULT}"


@pytest.mark.parametrize("engine", ENGINES)
def test_steps_that_keep_failing_fault_the_engine(
    engine: dict, in_process_server: Callable[..., InProcessServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that fails is that step's rows' failure; FAILED_STEPS_FAULT in a row, none
    working between, is the engine's: liveness NOT_SERVING, new calls UNAVAILABLE."""
    from tokenwire_server.engine.faults import FAILED_STEPS_FAULT

    server = in_process_server(**engine)
    fault = inject(server, monkeypatch)
    fault.arm(RuntimeError("injected step fault"), when=always)
    stub = generation_stub(server.target)
    for attempt in range(FAILED_STEPS_FAULT):
        assert health_status(server.target, LIVENESS) == SERVING, f"faulted after {attempt} failed steps"
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(short_request(), timeout=10))
        assert caught.value.code() == grpc.StatusCode.INTERNAL
        assert "injected step fault" in caught.value.details()
    assert wait_until(lambda: health_status(server.target, LIVENESS) == NOT_SERVING, 10.0)
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(short_request(), timeout=10))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"{FAILED_STEPS_FAULT} engine steps in a row failed" in refused.value.details()


@pytest.mark.parametrize("engine", [ENGINES[1]])
def test_a_working_step_between_failed_ones_starts_the_count_again(
    engine: dict, in_process_server: Callable[..., InProcessServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three "in a row": FAILED_STEPS_FAULT - 1 failed steps, a call that works, then as many failed
    steps again leave the engine serving; a server that counted every failed step ever would
    fault on the second run."""
    from tokenwire_server.engine.faults import FAILED_STEPS_FAULT

    server = in_process_server(**engine)
    fault = inject(server, monkeypatch)
    stub = generation_stub(server.target)
    for _ in range(2):
        fault.arm(RuntimeError("injected step fault"), when=always)
        for _ in range(FAILED_STEPS_FAULT - 1):
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(short_request(), timeout=10))
            assert caught.value.code() == grpc.StatusCode.INTERNAL
        fault.error = None  # the device works again
        assert_still_serving(server)
        assert health_status(server.target, LIVENESS) == SERVING
    assert server.backend.engine.fault is None


def rows_request(i: int) -> pb.GenerateRequest:
    """Greedy and seeded-sampled rows, long enough to be decoding together when the step fails."""
    sampling = pb.SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i) if i % 2 else pb.SamplingParams()
    return pb.GenerateRequest(
        prompt=f"row {i}: once upon a time",
        sampling=sampling,
        stopping=pb.StoppingCriteria(max_new_tokens=300, ignore_eos=True),
        output=pb.OutputOptions(token_ids=True),
        request_id=f"row-{i}",
    )


# An allocation failure in each of the forms a device reports it: torch's own, CUDA's error
# code as an accelerator error (a graph that could not be instantiated for want of memory
# says the same), and cuBLAS's. None of them faults the device.
OUT_OF_MEMORY_AS = {
    "batched-torch": torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB (simulated)"),
    "batched-compiled": torch.AcceleratorError("CUDA error: out of memory (simulated)"),
    "batched-overlap": RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
}


@pytest.mark.parametrize("engine", ENGINES[:-1])
def test_out_of_memory_in_a_step_fails_only_the_newest_rows(
    engine: dict,
    in_process_server: Callable[..., InProcessServer],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """Row 0 decodes; rows 1-3 arrive in that order while the engine is held, and join it in
    one step. Any step of more than two rows runs out of memory (faked). Rows 3 and then 2,
    admitted last, give way with RESOURCE_EXHAUSTED; rows 0 and 1 finish with the very tokens
    of an undisturbed run of the same four."""
    server = in_process_server(**engine, max_active=4)
    fault = inject(server, monkeypatch)
    stub = generation_stub(server.target)
    engine_ = server.backend.engine

    def run(oom: bool) -> list[list[int] | grpc.RpcError]:
        first = stub.Generate(rows_request(0), timeout=60)
        head = next(first)
        fault.gate.clear()
        assert fault.held.wait(10)
        rest = []
        for i in range(1, 4):  # one by one, so the admission order is 1, 2, 3
            rest.append(stub.Generate(rows_request(i), timeout=60))
            assert wait_until(lambda i=i: engine_.queue.queued == i, 10)
        if oom:
            too_many = OUT_OF_MEMORY_AS[request.node.callspec.id]  # each engine one of the three forms
            fault.arm(too_many, at=0, when=lambda ids, positions, segments, emit: len(segments) > 2)
        fault.held.clear()
        fault.gate.set()
        results: list[list[int] | grpc.RpcError] = []
        for index, stream in enumerate([first, *rest]):
            try:
                chunks = ([head] if index == 0 else []) + list(stream)
                results.append([t.id for c in chunks for t in c.tokens])
            except grpc.RpcError as error:
                results.append(error)
        return results

    undisturbed = run(oom=False)
    assert all(isinstance(ids, list) and len(ids) == 300 for ids in undisturbed)
    disturbed = run(oom=True)
    assert fault.raised >= 2  # each time, one row fewer: until two rows fit
    for newest in disturbed[2:]:
        assert isinstance(newest, grpc.RpcError)
        assert newest.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "the newest request gave way" in newest.details()
    assert disturbed[:2] == undisturbed[:2]
    fault.arm(RuntimeError("unused"), at=10**9)  # disarmed
    assert_still_serving(server)
