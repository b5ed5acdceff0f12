"""Backpressure, deadlines and cancellation against real servers with one slot and no queue.

- Past admission a call is refused with RESOURCE_EXHAUSTED before its first message, fast,
  with a google.rpc.RetryInfo and the grpc-retry-pushback-ms trailer (both engines).
- A call's deadline bounds its work: the slot frees when it passes.
- time_limit_ms ends the stream cleanly with FINISH_REASON_TIME_LIMIT and the text so far.
- Cancelled streams give their slot back, and many of them leave no thread behind.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from production_support import generation_stub, long_request, short_request, wait_until
from servers import ServerProcess, process_status
from tokenwire.v1 import generation_pb2 as pb

pytestmark = pytest.mark.timeout(120)

CANCELLED_STREAMS = 200  # `make soak` runs far more
ONE_SLOT = ["--max-active", "1", "--max-queue", "0", "--retry-after-ms", "750"]


@pytest.fixture(scope="module")
def one_slot_server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(["--model", str(tiny_model_dir), "--engine", "batched", *ONE_SLOT]) as server:
        yield server


@pytest.fixture(scope="module")
def one_worker_server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(["--model", str(tiny_model_dir), "--engine", "simple", "--workers", "1", *ONE_SLOT]) as server:
        yield server


def admitted(stub: object, request: pb.GenerateRequest, timeout: float = 5.0) -> list[pb.TokenChunk]:
    """Run a call to the end, retrying only while the one slot is still being given back."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return list(stub.Generate(request, timeout=10))  # type: ignore[attr-defined]
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


@pytest.mark.parametrize("server_name", ["one_slot_server", "one_worker_server"])
def test_full_server_refuses_fast_with_retry_info(server_name: str, request: pytest.FixtureRequest) -> None:
    server: ServerProcess = request.getfixturevalue(server_name)
    stub = generation_stub(server.target)
    busy = stub.Generate(long_request(), timeout=30)
    next(busy)  # the only slot is taken
    try:
        started = time.monotonic()
        refused = stub.Generate(short_request(), timeout=10)
        with pytest.raises(grpc.RpcError) as caught:
            next(refused)  # no message arrives before the status
        elapsed = time.monotonic() - started
        error = caught.value
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert elapsed < 1.0
        assert "full" in error.details()
        trailers = dict(error.trailing_metadata())
        assert trailers["grpc-retry-pushback-ms"] == "750"
        status = rpc_status.from_call(error)
        assert status is not None and status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        retry = error_details_pb2.RetryInfo()
        assert [d.Unpack(retry) for d in status.details] == [True]
        assert retry.retry_delay.ToMilliseconds() == 750
    finally:
        busy.cancel()
    # the slot comes back and the server serves again
    assert admitted(stub, short_request())[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED


def test_deadline_stops_generation_and_frees_the_slot(one_slot_server: ServerProcess) -> None:
    stub = generation_stub(one_slot_server.target)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(long_request(), timeout=0.3))
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 2.0
    # max-active 1 and max-queue 0: a new call is admitted only if the slot came back
    chunks = admitted(stub, short_request(), timeout=2.0)
    assert chunks[-1].usage.completion_tokens >= 1
    assert wait_until(
        lambda: any(r.get("code") == "DEADLINE_EXCEEDED" for r in one_slot_server.find("request finished")), 5
    )


def test_time_limit_ends_cleanly_with_the_text_so_far(one_slot_server: ServerProcess) -> None:
    stub = generation_stub(one_slot_server.target)
    request = pb.GenerateRequest(
        prompt="hello", stopping=pb.StoppingCriteria(max_new_tokens=1000, ignore_eos=True, time_limit_ms=150)
    )
    started = time.monotonic()
    chunks = admitted(stub, request)
    assert time.monotonic() - started < 3.0
    last = chunks[-1]
    assert last.finish_reason == pb.FINISH_REASON_TIME_LIMIT
    assert 0 < last.usage.completion_tokens < 1000
    assert "".join(c.text for c in chunks)  # the text generated before the limit is all there
    assert [c.index for c in chunks] == list(range(len(chunks)))


def test_cancelled_streams_free_their_slot_and_leave_no_threads(one_slot_server: ServerProcess) -> None:
    stub = generation_stub(one_slot_server.target)
    pid = one_slot_server.proc.pid

    def cancel_streams(count: int) -> None:
        for _ in range(count):
            deadline = time.monotonic() + 5
            while True:
                call = stub.Generate(long_request(), timeout=10)
                try:
                    next(call)  # generating: it holds the only slot
                    break
                except grpc.RpcError as error:  # the previous one's slot is still on its way back
                    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                    time.sleep(0.005)
            call.cancel()

    # Warm the lazily grown pools (tokenizer threads, grpc's) to their working size first.
    tokenize = [stub.Tokenize.future(pb.TokenizeRequest(text="warm " * 200), timeout=10) for _ in range(16)]
    assert all(f.result().count for f in tokenize)
    cancel_streams(50)
    assert wait_until(lambda: _idle(stub), 5)
    threads_before = process_status(pid)["threads"]
    started = time.monotonic()
    cancel_streams(CANCELLED_STREAMS)
    assert time.monotonic() - started < 60
    assert wait_until(lambda: _idle(stub), 5)
    assert process_status(pid)["threads"] == threads_before

    def cancelled() -> int:
        return sum(r.get("code") == "CANCELLED" for r in one_slot_server.find("request finished"))

    assert wait_until(lambda: cancelled() >= 50 + CANCELLED_STREAMS, 5), cancelled()
    assert one_slot_server.proc.poll() is None


def _idle(stub: object) -> bool:
    """The one slot is free: a short call is admitted at once."""
    try:
        list(stub.Generate(short_request(1), timeout=5))  # type: ignore[attr-defined]
        return True
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return False
        raise
