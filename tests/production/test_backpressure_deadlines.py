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
from production_support import generation_stub, long_request, scrape, short_request, value, wait_until
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


@pytest.fixture(scope="module")
def slot_and_queue_server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    """One slot and one place in the queue (the limit is active plus queued)."""
    args = ["--max-active", "1", "--max-queue", "1", "--retry-after-ms", "750", "--metrics-port", "-1"]
    with ServerProcess(["--model", str(tiny_model_dir), "--engine", "batched", *args]) as server:
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


@pytest.mark.parametrize("server_name", ["one_slot_server", "one_worker_server", "slot_and_queue_server"])
def test_full_server_refuses_fast_with_retry_info(server_name: str, request: pytest.FixtureRequest) -> None:
    """The one place for the full-server refusal: past --max-active plus --max-queue."""
    server: ServerProcess = request.getfixturevalue(server_name)
    stub = generation_stub(server.target)
    busy = stub.Generate(long_request(request_id=f"busy-{server_name}"), timeout=30)
    next(busy)  # the only slot is taken
    queued = None
    if server_name == "slot_and_queue_server":  # and the only place in the queue
        # a deadline that deadline-aware admission cannot refuse behind 1000 steps, whatever they cost
        queued = stub.Generate(short_request(request_id="queued"), timeout=3600)
        assert wait_until(lambda: value(scrape(server), "tokenwire_queue_depth") == 1.0, 10)
    try:
        refused = stub.Generate(short_request(request_id=f"refused-{server_name}"), timeout=10)
        with pytest.raises(grpc.RpcError) as caught:
            next(refused)  # no message arrives before the status
        error = caught.value
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        if queued is not None:
            assert "1 active and 1 queued requests (limits 1 + 1)" in error.details()
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
    # Refused without waiting for the slot: the busy stream (1000 tokens) was cancelled after
    # the refusal arrived, and the server says it was still generating then. Order, not a stopwatch.
    assert busy_outcome(server, f"busy-{server_name}") == "CANCELLED"
    if queued is not None:  # the queued call was kept, and runs once the slot frees
        assert list(queued)[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
    # the slot comes back and the server serves again
    assert admitted(stub, short_request())[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED


def busy_outcome(server: ServerProcess, request_id: str) -> str:
    """How the server ended a call: the code of its "request finished" record."""
    assert wait_until(lambda: any(r.get("request_id") == request_id for r in server.find("request finished")), 10)
    [record] = [r for r in server.find("request finished") if r.get("request_id") == request_id]
    return str(record["code"])


def test_deadline_stops_generation_and_frees_the_slot(one_slot_server: ServerProcess) -> None:
    stub = generation_stub(one_slot_server.target)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(long_request(), timeout=0.3))
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The 0.3 s deadline ends the call; the bound only catches a hang, not the machine's speed.
    assert time.monotonic() - started < 20
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
    chunks = admitted(stub, request)
    last = chunks[-1]
    assert last.finish_reason == pb.FINISH_REASON_TIME_LIMIT
    assert 0 < last.usage.completion_tokens < 1000
    # The limit counts from admission: the request ran at least that long, and stopped
    # long before its 1000 tokens (checked above) however fast the machine is.
    assert last.usage.total_time_ms - last.usage.queue_time_ms >= 150
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
    # A leak would add a thread per cancelled stream (CANCELLED_STREAMS of them); grpc's
    # and the tokenizer pools may settle a thread or two either way.
    assert process_status(pid)["threads"] <= threads_before + 2 < threads_before + CANCELLED_STREAMS

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


# -- deadline-aware admission ------------------------------------------------------------------

BUSY_STEPS = 8000


@pytest.fixture(scope="module", params=["batched", "simple"])
def queueing_server(tiny_long_model_dir: Path, request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """One slot and room to queue: without deadline-aware admission a late request would wait."""
    engine_args = (
        ["--engine", "batched", "--max-active", "1"]
        if request.param == "batched"
        else ["--engine", "simple", "--workers", "1"]
    )
    args = ["--model", str(tiny_long_model_dir), *engine_args, "--max-queue", "4", "--retry-after-ms", "400",
            "--metrics-port", "-1", "--max-new-tokens-limit", str(BUSY_STEPS), "--kv-cache-tokens", "8192"]  # fmt: skip
    with ServerProcess(args) as server:
        yield server


def fastest_step_floor(server: ServerProcess) -> float:
    """A lower bound on every decode step this server has timed (the deadline estimator's
    steps among them), from its own histogram: the top edge of its last empty bucket."""
    empty = [float(dict(labels)["le"]) for (name, labels), count in scrape(server).items()
             if name == "tokenwire_decode_step_seconds_bucket" and count == 0]  # fmt: skip
    return max(empty, default=0.0)


def test_a_request_that_cannot_start_before_its_deadline_is_refused_at_once(queueing_server: ServerProcess) -> None:
    stub = generation_stub(queueing_server.target)
    # BUSY_STEPS tokens that ignore EOS keep the only slot for that many decode steps, and
    # the server knows it: it has timed its steps (the warm-up's, and this short call's), and
    # its estimate is the remaining steps times the fastest recent one. No step it timed was
    # faster than the floor of its own histogram, so while fewer than half the steps are done
    # the estimate is above half of BUSY_STEPS x floor: a request that allows that much must
    # be refused at once, by construction, and a machine twice as fast or as slow gives the
    # same verdict. (The steps are many, on the long-context tiny model, so that the allowed
    # time, ~1 s here, also dwarfs a call's own way to the server on a loaded machine: 1000
    # steps allowed ~0.25 s, and a loaded run once took longer than that to reach the server.)
    assert list(stub.Generate(long_request(8), timeout=60))[-1].usage.completion_tokens == 8
    floor = fastest_step_floor(queueing_server)
    assert floor > 0, "a decode step ran faster than the histogram's smallest bucket"
    allowed_s = 0.5 * BUSY_STEPS * floor
    busy = stub.Generate(long_request(BUSY_STEPS, request_id="busy-1"), timeout=3600)
    next(busy)
    try:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(short_request(request_id="late-1"), timeout=allowed_s))
        elapsed = time.monotonic() - started
        error = caught.value
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
        assert "cannot start before its deadline" in error.details()
        assert dict(error.trailing_metadata())["grpc-retry-pushback-ms"] == "400"

        def records() -> list[dict]:
            return [r for r in queueing_server.find("request finished") if r.get("request_id") == "late-1"]

        assert wait_until(lambda: bool(records()), 10)  # written just after the status went out
        [record] = records()
        assert record["code"] == "RESOURCE_EXHAUSTED"
        # Refused on arrival, not after waiting out its deadline: the server's own measure of
        # the call, and the client's, end before the deadline would have.
        assert record["duration_ms"] < allowed_s * 1000, record
        assert elapsed < allowed_s
        assert value(scrape(queueing_server), "tokenwire_deadline_refusals_total") == 1.0

        # A request that can start in time is admitted as before: it waits in the queue (the
        # server's own gauge says so) until the slot frees.
        waiting = stub.Generate(short_request(2, request_id="patient-1"), timeout=3600)
        assert wait_until(lambda: value(scrape(queueing_server), "tokenwire_queue_depth") == 1.0, 10)
        busy.cancel()
        assert list(waiting)[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
    finally:
        busy.cancel()
    # The busy stream was still generating when the refusal came and when the patient request
    # queued: the server ended it on the cancel that came after both.
    assert busy_outcome(queueing_server, "busy-1") == "CANCELLED"


def test_a_request_whose_worst_case_exceeds_the_kv_budget_is_refused_or_shortened(tiny_model_dir: Path) -> None:
    """The design: the KV budget bounds one request like the context does. An explicit
    max_new_tokens that cannot fit is INVALID_ARGUMENT on the prompt field; the server's
    default max_new_tokens is shortened to what fits. Never admitted over the budget."""
    args = ["--model", str(tiny_model_dir), "--kv-cache-tokens", "48", "--default-max-new-tokens", "200"]
    with ServerProcess(args) as server:
        stub = generation_stub(server.target)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert (info.limits.max_request_tokens, info.limits.context_length) == (48, 1024)
        prompt_tokens = stub.Tokenize(pb.TokenizeRequest(text="hello"), timeout=10).count
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(long_request(48 - prompt_tokens + 1), timeout=30))
        error = caught.value
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details() == (
            f"prompt: the prompt is {prompt_tokens} tokens; with max_new_tokens={48 - prompt_tokens + 1} it needs 49, "
            "above the 48 tokens one request may hold on this server (the model's context, "
            "or the KV-cache budget where that is smaller)"
        )
        exactly = list(stub.Generate(long_request(48 - prompt_tokens), timeout=30))
        assert exactly[-1].usage.completion_tokens == 48 - prompt_tokens
        defaulted = list(
            stub.Generate(pb.GenerateRequest(prompt="hello", stopping=pb.StoppingCriteria(ignore_eos=True)), timeout=30)
        )
        assert defaulted[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert defaulted[-1].usage.completion_tokens == 48 - prompt_tokens
