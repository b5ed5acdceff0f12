"""The vLLM engine behind the same contract (`make test-vllm`; skipped elsewhere).

The contract tests in test_server.py run against vLLM too (TOKENWIRE_TEST_ENGINE=vllm
switches the shared tiny server). These add what only the vLLM engine does or what
needs its own server: admission past --max-queue, cancellation freeing vLLM's
request, drain, its gauges, and the default model answering over grpcurl's path.
"""

from __future__ import annotations

import concurrent.futures
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from servers import TEST_ENGINE, ServerProcess
from tokenwire.v1 import generation_pb2 as pb
from tokenwire.v1 import generation_pb2_grpc as pb_grpc

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(TEST_ENGINE != "vllm", reason="vLLM tests run under `make test-vllm` (TOKENWIRE_TEST_ENGINE=vllm)"),
    pytest.mark.timeout(600),
]

VLLM = ["--engine", "vllm", "--enforce-eager"]


def long_request(tokens: int = 400, **fields: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt="hello",
        sampling=pb.SamplingParams(temperature=0),
        stopping=pb.StoppingCriteria(max_new_tokens=tokens, ignore_eos=True),
        **fields,  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def small_server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    """Two slots, two places in the queue, metrics on."""
    args = ["--model", str(tiny_model_dir), *VLLM, "--max-active", "2", "--max-queue", "2", "--metrics-port", "-1",
            "--retry-after-ms", "300", "--grace-period", "30"]  # fmt: skip
    with ServerProcess(args, ready_timeout=400) as server:
        yield server


def gauge(server: ServerProcess, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not exported")


def wait_for_gauges(server: ServerProcess, active: int, queued: int, within_s: float = 30) -> None:
    """Wait until the server itself reports these counts (a fixed sleep raced on a loaded CI machine)."""
    deadline = time.monotonic() + within_s
    seen = (-1.0, -1.0)
    while time.monotonic() < deadline:
        seen = (gauge(server, "tokenwire_active_streams"), gauge(server, "tokenwire_queue_depth"))
        if seen == (active, queued):
            return
        time.sleep(0.05)
    raise AssertionError(f"active/queued stayed {seen}, expected {(active, queued)}")


def test_model_info_names_the_vllm_engine(small_server: ServerProcess) -> None:
    with grpc.insecure_channel(small_server.target) as channel:
        info = pb_grpc.TextGenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert info.engine == "vllm"
    assert (info.max_active_streams, info.max_queued_requests) == (2, 2)
    assert any("batch" in note for note in info.notes)  # the differences are published


def test_past_active_plus_queue_is_resource_exhausted_before_the_first_chunk(small_server: ServerProcess) -> None:
    # vLLM runs the tiny model so fast that 1,000 tokens can be done in about a second,
    # before the check below. So the held calls are made unable to finish: their client
    # reads nothing, and with a small receive window (no BDP growth) and ~200-byte chunks
    # (ids and 5 alternatives per token) the server's writes stall after a few chunks.
    # Until a stream is written out it counts as in flight, whatever vLLM has computed.
    options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
    with grpc.insecure_channel(small_server.target, options=options) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        heavy = pb.OutputOptions(token_ids=True, logprobs=True, top_logprobs=5)
        held = [stub.Generate(long_request(1000, output=heavy), timeout=300) for _ in range(4)]
        for call in held[:2]:
            next(call)
        wait_for_gauges(small_server, active=2, queued=2)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(long_request(4), timeout=30))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(caught.value.trailing_metadata())["grpc-retry-pushback-ms"] == "300"
        for call in held:
            call.cancel()


def test_cancelled_streams_free_vllm_and_16_streams_then_end_ok(tiny_model_dir: Path) -> None:
    args = ["--model", str(tiny_model_dir), *VLLM, "--max-active", "16", "--max-queue", "16"]
    with ServerProcess(args, ready_timeout=400) as server, grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        for _ in range(10):
            call = stub.Generate(long_request(1000), timeout=120)
            next(call)
            call.cancel()

        def one(i: int) -> pb.TokenChunk:
            return list(stub.Generate(long_request(16, request_id=f"after-{i}"), timeout=300))[-1]

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            lasts = list(pool.map(one, range(16)))
        assert [last.finish_reason for last in lasts] == [pb.FINISH_REASON_LENGTH] * 16
        assert [last.usage.completion_tokens for last in lasts] == [16] * 16
        assert sum(r.get("code") == "CANCELLED" for r in server.find("request finished")) == 10


def test_vllm_gauges_are_exported(small_server: ServerProcess) -> None:
    with grpc.insecure_channel(small_server.target) as channel:
        list(pb_grpc.TextGenerationStub(channel).Generate(long_request(8), timeout=60))
    text = urllib.request.urlopen(f"http://127.0.0.1:{small_server.metrics_port}/metrics", timeout=10).read().decode()
    assert "tokenwire_vllm_kv_cache_usage_ratio" in text
    assert "tokenwire_vllm_prefix_cache_hit_ratio" in text
    assert 'tokenwire_requests_total{code="OK",method="Generate"}' in text


def test_kv_gauges_follow_vllm_cache_so_the_kv_alert_works(small_server: ServerProcess) -> None:
    # The KV alert divides tokenwire_kv_cache_tokens_reserved by _budget: both must be live on vLLM.
    budget = gauge(small_server, "tokenwire_kv_cache_tokens_budget")
    assert budget > 0
    with grpc.insecure_channel(small_server.target) as channel:
        call = pb_grpc.TextGenerationStub(channel).Generate(long_request(1000), timeout=120)
        next(call)
        deadline = time.monotonic() + 30
        reserved = 0.0
        while time.monotonic() < deadline and reserved == 0:
            reserved = gauge(small_server, "tokenwire_kv_cache_tokens_reserved")
            time.sleep(0.1)
        call.cancel()
    assert 0 < reserved <= budget


def test_drain_lets_the_stream_in_flight_finish(tiny_model_dir: Path) -> None:
    args = ["--model", str(tiny_model_dir), *VLLM, "--grace-period", "60"]
    with ServerProcess(args, ready_timeout=400) as server, grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        in_flight = stub.Generate(long_request(300), timeout=120)
        first = next(in_flight)
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                list(stub.Generate(long_request(2), timeout=5))
            except grpc.RpcError as error:
                if error.code() == grpc.StatusCode.UNAVAILABLE:
                    break
            time.sleep(0.05)
        else:
            pytest.fail("new calls were not refused during the drain")
        rest = [first, *in_flight]
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH and rest[-1].usage.completion_tokens == 300
        assert server.proc.wait(60) == 0


@pytest.mark.e2e
def test_the_default_model_answers_on_vllm(default_model_dir: Path) -> None:
    with ServerProcess(["--model", "default", *VLLM], ready_timeout=400) as server, grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="What is the capital of France?")])
        chunks = list(stub.Generate(pb.GenerateRequest(chat=chat, stopping=pb.StoppingCriteria(max_new_tokens=48)), timeout=300))
        assert "Paris" in "".join(c.text for c in chunks)
        assert chunks[-1].finish_reason in (pb.FINISH_REASON_EOS, pb.FINISH_REASON_LENGTH)
