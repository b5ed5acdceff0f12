"""The vLLM engine behind the same contract (`make test-vllm`; skipped elsewhere).

The contract tests in test_server.py run against vLLM too (TOKENWIRE_TEST_ENGINE=vllm
switches the shared tiny server). These add what only the vLLM engine does or what
needs its own server: admission past --max-queue, cancellation freeing vLLM's
request, drain, liveness following vLLM's engine, prefix-cache hits in the usage,
its gauges, and the default model answering over grpcurl's path.

No test here depends on how fast this machine runs vLLM (the tiny model's 1,000 tokens
take about a second on 2 CPU cores, far less on a GPU): a stream is held open by
HTTP/2 flow control (its client stops reading), not by being slow, and waits are for a
state the server reports, with a cap far above the time that state takes to appear.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from engine_support import make_adapter
from grpc_health.v1 import health_pb2, health_pb2_grpc
from servers import TEST_ENGINE, ServerProcess
from tokenwire.v1 import generation_pb2 as pb
from tokenwire.v1 import generation_pb2_grpc as pb_grpc
from tokenwire_server.health import LIVENESS_SERVICE, NOT_SERVING, READINESS_SERVICE, SERVING
from tokenwire_server.transport.status import DRAINING

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        TEST_ENGINE != "vllm", reason="vLLM tests run under `make test-vllm` (TOKENWIRE_TEST_ENGINE=vllm)"
    ),
    pytest.mark.timeout(600),
]

VLLM = ["--engine", "vllm", "--enforce-eager"]

# A channel whose streams stall once their client stops reading: a small receive window
# (no BDP growth). With ids and 5 alternatives per token a chunk is ~200 bytes, so a
# 1,000-token stream (~200 KB) is many windows long: its server cannot write it out, and
# a stream counts as in flight until it is written out, whatever vLLM has computed.
STALLING = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
HEAVY = pb.OutputOptions(token_ids=True, logprobs=True, top_logprobs=5)
# Caps on waits for a state the server reports (a gauge, a health status, a log line):
# each state takes well under a second to appear (the watchdog checks liveness every
# second); the cap only bounds a failing test.
STATE_WITHIN_S = 30.0


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


def gauges(server: ServerProcess, *names: str) -> tuple[float, ...]:
    """Several gauges from one scrape."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            values[name] = float(value)
    return tuple(values[name] for name in names)


def finished_line(server: ServerProcess, request_id: str) -> dict:
    """The server's "request finished" log line of one call (logged as the call ends;
    read from the server's output a moment later)."""
    deadline = time.monotonic() + STATE_WITHIN_S
    while time.monotonic() < deadline:
        for record in server.find("request finished"):
            if record.get("request_id") == request_id:
                return record
        time.sleep(0.05)
    raise AssertionError(f"no 'request finished' line for {request_id}")


def watch_until(target: str, service: str, status: int, within_s: float = STATE_WITHIN_S) -> None:
    """Follow grpc.health.v1 Watch of ``service`` until it reports ``status``."""
    with grpc.insecure_channel(target) as channel:
        stream = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=service), timeout=within_s
        )
        seen = []
        try:
            for response in stream:
                seen.append(response.status)
                if response.status == status:
                    return
        except grpc.RpcError as error:
            raise AssertionError(f"health of {service!r} went {seen}, never {status}: {error.code()}") from error
        raise AssertionError(f"health of {service!r} went {seen}, never {status}")


def engine_core_pid(server_pid: int) -> int:
    """vLLM's engine core: the child process of the server that vLLM titles EngineCore."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rpartition(")")[2].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == server_pid and "EngineCore" in cmdline:
            found.append(int(stat.parent.name))
    assert len(found) == 1, f"expected one vLLM engine core process under {server_pid}, found {found}"
    return found[0]


def wait_for_gauges(server: ServerProcess, active: int, queued: int, within_s: float = STATE_WITHIN_S) -> None:
    """Wait until the server itself reports these counts (a fixed sleep raced on a loaded CI machine)."""
    deadline = time.monotonic() + within_s
    seen = (-1.0, -1.0)
    while time.monotonic() < deadline:
        seen = (gauge(server, "tokenwire_active_streams"), gauge(server, "tokenwire_queue_depth"))
        if seen == (active, queued):
            return
        time.sleep(0.05)
    raise AssertionError(f"active/queued stayed {seen}, expected {(active, queued)}")


def test_a_kv_budget_below_one_context_is_refused_before_vllm_starts(tiny_model_dir: Path) -> None:
    """vLLM refuses a pool that cannot hold one full context beside its own block, with a
    traceback; the server says so first, naming the smallest budget it would take (exit 2)."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "tokenwire_server", "--engine", "vllm", "--enforce-eager",
         "--model", str(tiny_model_dir), "--kv-cache-tokens", "1000", "--port", "0"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--kv-cache-tokens 1000 is too small for --engine vllm" in result.stderr and "at least 1152" in result.stderr
    assert "Traceback" not in result.stderr


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
    with grpc.insecure_channel(small_server.target, options=STALLING) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        held = [stub.Generate(long_request(1000, output=HEAVY), timeout=300) for _ in range(4)]
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
        # The cancelled streams cannot end before their cancel, however fast vLLM is: they
        # are not read past their first chunk, so they are not written out (see STALLING).
        with grpc.insecure_channel(server.target, options=STALLING) as stalling:
            for i in range(10):
                call = pb_grpc.TextGenerationStub(stalling).Generate(
                    long_request(1000, output=HEAVY, request_id=f"cancelled-{i}"), timeout=120
                )
                next(call)
                call.cancel()
        stub = pb_grpc.TextGenerationStub(channel)

        def one(i: int) -> pb.TokenChunk:
            return list(stub.Generate(long_request(16, request_id=f"after-{i}"), timeout=300))[-1]

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            lasts = list(pool.map(one, range(16)))
        assert [last.finish_reason for last in lasts] == [pb.FINISH_REASON_LENGTH] * 16
        assert [last.usage.completion_tokens for last in lasts] == [16] * 16
        assert [finished_line(server, f"cancelled-{i}")["code"] for i in range(10)] == ["CANCELLED"] * 10
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
    # vLLM may compute a whole 1,000-token request between two scrapes, so instead of
    # hoping to catch it, each scrape pairs two gauges from the same vLLM step report: a
    # step with a request running (tokenwire_batch_size, vLLM's running count) holds KV
    # blocks. One scrape per chunk read, and requests are repeated until a scrape lands
    # while vLLM runs one.
    budget = gauge(small_server, "tokenwire_kv_cache_tokens_budget")
    assert budget > 0
    caught: list[tuple[float, float]] = []
    with grpc.insecure_channel(small_server.target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        for _ in range(20):
            call = stub.Generate(long_request(1000), timeout=120)
            for _chunk in call:
                running, reserved = gauges(small_server, "tokenwire_batch_size", "tokenwire_kv_cache_tokens_reserved")
                if running >= 1:
                    caught.append((running, reserved))
                    break
            call.cancel()
            if caught:
                break
    assert caught, "no scrape saw vLLM running a request in 20 requests of 1,000 tokens"
    running, reserved = caught[0]
    assert 0 < reserved <= budget


def test_drain_lets_the_stream_in_flight_finish(tiny_model_dir: Path) -> None:
    """SIGTERM with a stream in flight (docs/operations.md, Graceful rollout): new calls
    are refused with UNAVAILABLE, the stream runs to its end with all its tokens, and
    the server exits 0.

    The stream is in flight at SIGTERM by construction, not by being slow: its client
    reads one chunk and nothing more until the drain has been seen, and a stream that
    is not read cannot be written out (see STALLING). The server's own log confirms it:
    the stream's "request finished" line comes after its "draining" line.
    """
    tokens = 1000
    args = ["--model", str(tiny_model_dir), *VLLM, "--grace-period", "60", "--handoff-after-s", "0"]
    with (
        ServerProcess(args, ready_timeout=400) as server,
        grpc.insecure_channel(server.target, options=STALLING) as held,
    ):
        in_flight = pb_grpc.TextGenerationStub(held).Generate(
            long_request(tokens, output=HEAVY, request_id="in-flight"), timeout=300
        )
        first = next(in_flight)
        server.proc.send_signal(signal.SIGTERM)
        watch_until(server.target, READINESS_SERVICE, NOT_SERVING)  # the drain has begun
        # A channel of its own: its connection is not the one the held stream stalls.
        with grpc.insecure_channel(server.target) as channel, pytest.raises(grpc.RpcError) as refused:
            list(pb_grpc.TextGenerationStub(channel).Generate(long_request(2, request_id="refused"), timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert refused.value.details() == DRAINING  # the server's refusal, not a closed port
        assert server.proc.poll() is None  # still serving the stream in flight
        rest = [first, *in_flight]
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH and rest[-1].usage.completion_tokens == tokens
        assert sum(len(chunk.tokens) for chunk in rest) == tokens
        assert in_flight.code() == grpc.StatusCode.OK
        assert server.proc.wait(60) == 0
    messages = [(r.get("msg"), r.get("request_id")) for r in server.records]
    draining = messages.index(("draining", None))
    finished = messages.index(("request finished", "in-flight"))
    assert draining < finished, "the stream had ended before the drain began: the test proved nothing"
    assert finished_line(server, "in-flight")["code"] == "OK"
    assert finished_line(server, "refused")["code"] == "UNAVAILABLE"


def test_liveness_follows_vllm_engine_death(tiny_model_dir: Path) -> None:
    """docs/operations.md (vLLM engine, Probes): liveness turns NOT_SERVING once vLLM's
    engine has died, so the kubelet restarts the pod. The engine core process is killed;
    vLLM marks its engine dead (``errored``) and the server's watchdog, which checks every
    second, turns liveness NOT_SERVING. New calls end UNAVAILABLE instead of hanging."""
    args = ["--model", str(tiny_model_dir), *VLLM]
    with ServerProcess(args, ready_timeout=400) as server:
        assert server.health(LIVENESS_SERVICE) == SERVING
        with grpc.insecure_channel(server.target) as channel:
            last = list(pb_grpc.TextGenerationStub(channel).Generate(long_request(4), timeout=60))[-1]
        assert last.usage.completion_tokens == 4
        os.kill(engine_core_pid(server.proc.pid), signal.SIGKILL)
        watch_until(server.target, LIVENESS_SERVICE, NOT_SERVING)
        assert server.proc.poll() is None  # the process answers its probes; the kubelet restarts it
        with grpc.insecure_channel(server.target) as channel, pytest.raises(grpc.RpcError) as refused:
            list(pb_grpc.TextGenerationStub(channel).Generate(long_request(4), timeout=60))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert server.health(LIVENESS_SERVICE) == NOT_SERVING
        server.kill()  # a dead engine: nothing to drain


def test_usage_counts_vllm_prefix_cache_hits(small_server: ServerProcess) -> None:
    """docs/architecture.md: on vLLM a request's usage counts the prompt tokens vLLM
    found in its prefix cache (``num_cached_tokens``); it appears as
    ``cached_prompt_tokens`` on the call's "request finished" log line. The same long
    prompt twice: the first finds nothing (it starts with a fresh id), the second finds
    at least one whole KV block of it (vLLM's block_size: 128 tokens on a CPU)."""
    words = " ".join(f"word{i}" for i in range(200))
    prompt = f"{uuid.uuid4().hex} {words}"
    usage = []
    with grpc.insecure_channel(small_server.target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        for attempt in ("first", "second"):
            request_id = f"cached-{attempt}-{uuid.uuid4().hex[:8]}"
            request = pb.GenerateRequest(
                prompt=prompt,
                request_id=request_id,
                sampling=pb.SamplingParams(temperature=0),
                stopping=pb.StoppingCriteria(max_new_tokens=2, ignore_eos=True),
            )
            last = list(stub.Generate(request, timeout=60))[-1]
            line = finished_line(small_server, request_id)
            assert line["code"] == "OK" and line["prompt_tokens"] == last.usage.prompt_tokens
            assert line["cached_prompt_tokens"] == last.usage.cached_prompt_tokens  # on the wire too
            usage.append((line["prompt_tokens"], line["cached_prompt_tokens"]))
    (first_prompt, first_cached), (second_prompt, second_cached) = usage
    assert first_prompt == second_prompt > 256  # more than two blocks of 128
    assert first_cached == 0
    assert 0 < second_cached <= second_prompt


@pytest.mark.e2e
def test_the_default_model_answers_on_vllm(default_model_dir: Path) -> None:
    with (
        ServerProcess(["--model", "default", *VLLM], ready_timeout=400) as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        stub = pb_grpc.TextGenerationStub(channel)
        chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="What is the capital of France?")])
        chunks = list(
            stub.Generate(pb.GenerateRequest(chat=chat, stopping=pb.StoppingCriteria(max_new_tokens=48)), timeout=300)
        )
        assert "Paris" in "".join(c.text for c in chunks)
        assert chunks[-1].finish_reason in (pb.FINISH_REASON_EOS, pb.FINISH_REASON_LENGTH)


def test_prefix_cache_off_and_a_resumed_stream_on_vllm(tiny_model_dir: Path) -> None:
    """``--prefix-cache off`` reaches vLLM: the same long prompt twice finds nothing cached.
    A cut stream resumed with ``GenerateRequest.resume`` goes on from the caller's next index,
    with usage covering the whole answer; a greedy one gives the uncut stream's text
    (measured: make bench-resume, the resume section of docs/benchmarks.md)."""
    args = ["--model", str(tiny_model_dir), *VLLM, "--prefix-cache", "off", "--max-active", "2"]
    prompt = f"{uuid.uuid4().hex} " + " ".join(f"word{i}" for i in range(200))
    with ServerProcess(args, ready_timeout=400) as server, grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        cached = []
        for _ in range(2):
            request = pb.GenerateRequest(
                prompt=prompt,
                sampling=pb.SamplingParams(temperature=0),
                stopping=pb.StoppingCriteria(max_new_tokens=2, ignore_eos=True),
            )
            cached.append(list(stub.Generate(request, timeout=60))[-1].usage.cached_prompt_tokens)
        assert cached == [0, 0]

        request = pb.GenerateRequest(
            prompt="hello",
            sampling=pb.SamplingParams(temperature=0),
            stopping=pb.StoppingCriteria(max_new_tokens=40, ignore_eos=True),
            output=pb.OutputOptions(token_ids=True),
        )
        uncut = list(stub.Generate(request, timeout=60))
        cut = 15
        request.resume.generated_token_ids.extend(t.id for c in uncut[:cut] for t in c.tokens)
        request.resume.next_index = cut
        rest = list(stub.Generate(request, timeout=60))
    assert [c.index for c in rest] == list(range(cut, cut + len(rest)))
    assert rest[-1].usage.completion_tokens == 40 and sum(len(c.tokens) for c in rest) == 40 - cut
    assert "".join(c.text for c in rest) == "".join(c.text for c in uncut[cut:])


def test_a_constrained_stream_on_vllm_is_refused_as_a_resume_but_served_whole(small_server: ServerProcess) -> None:
    """vLLM's grammar would start again at the cut, so a resume with a response_format is
    FAILED_PRECONDITION (it says why); the same request without resume is served."""
    fmt = pb.ResponseFormat(choice=pb.Choice(options=["yes", "no"]))
    with grpc.insecure_channel(small_server.target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        request = pb.GenerateRequest(prompt="Well?", sampling=pb.SamplingParams(temperature=0), response_format=fmt,
                                     output=pb.OutputOptions(token_ids=True))  # fmt: skip
        whole = list(stub.Generate(request, timeout=60))
        assert "".join(c.text for c in whole) in ("yes", "no") and whole[-1].finish_reason == pb.FINISH_REASON_EOS
        request.resume.generated_token_ids.extend(t.id for t in whole[0].tokens)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(request, timeout=60))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
    assert "response_format" in (caught.value.details() or "")  # type: ignore[attr-defined]


def test_a_call_naming_a_lora_adapter_on_vllm_started_without_lora_is_refused(small_server: ServerProcess) -> None:
    """vLLM reserves its LoRA slots as it starts: a server started without --lora or --lora-dir
    answers a call naming an adapter FAILED_PRECONDITION saying how to start it, before any
    chunk (ModelInfo lists none)."""
    with grpc.insecure_channel(small_server.target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        assert list(stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).adapters) == []
        request = pb.GenerateRequest(prompt="Hi", adapter="sql", stopping=pb.StoppingCriteria(max_new_tokens=4))
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(request, timeout=60))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
    assert "started without LoRA adapters" in (caught.value.details() or "")  # type: ignore[attr-defined]
    assert "--lora" in (caught.value.details() or "")  # type: ignore[attr-defined]


ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = ["Once upon a time", "The weather today is", "Hello there"]


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    """vLLM with one adapter from the start (``--lora first=``) and a --lora-dir holding a second
    (rank 16, MLP only) for LoadAdapter; at most two loaded."""
    root = tmp_path_factory.mktemp("vllm-loras")
    make_adapter(tiny_model_dir, root / "first", 8, ALL_PROJECTIONS, seed=3)
    make_adapter(tiny_model_dir, root / "second", 16, ALL_PROJECTIONS[4:], seed=2)
    args = ["--model", str(tiny_model_dir), *VLLM, "--lora", f"first={root / 'first'}", "--lora-dir", str(root),
            "--adapter-service-without-auth", "--max-loras", "2", "--max-lora-rank", "16"]  # fmt: skip
    with ServerProcess(args, ready_timeout=400) as server:
        yield server, root


def peft_greedy(base: Path, adapter: Path | None, prompt: list[int], tokens: int) -> list[int]:
    """Greedy tokens of PEFT's unmerged model (``adapter`` None: the base model), in this process."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def greedy_ids(stub: pb_grpc.TextGenerationStub, prompt: list[int], tokens: int, adapter: str = "") -> list[int]:
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt), adapter=adapter, sampling=pb.SamplingParams(temperature=0),
        stopping=pb.StoppingCriteria(max_new_tokens=tokens, ignore_eos=True), output=pb.OutputOptions(token_ids=True),
    )  # fmt: skip
    return [t.id for chunk in stub.Generate(request, timeout=120) for t in chunk.tokens]


def test_an_adapter_call_on_vllm_answers_as_pefts_unmerged_model(
    lora_server: tuple[ServerProcess, Path], tiny_model_dir: Path
) -> None:
    """``--lora first=``: ModelInfo lists it (rank, modules) and says how vLLM applies it; a greedy
    call naming it gives PEFT's unmerged model's tokens, one naming none the base model's, and the
    adapter moves the answers; a name not loaded is NOT_FOUND naming ``adapter``."""
    from transformers import AutoTokenizer

    server, root = lora_server
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        assert [(a.name, a.rank, sorted(a.target_modules)) for a in info.adapters] == [
            ("first", 8, sorted(ALL_PROJECTIONS))
        ]
        assert info.limits.max_loras == 2 and info.limits.max_lora_rank == 16
        assert any("LoRA adapters run in vLLM's own LoRA layers" in note for note in info.notes)
        got = {(name, i): greedy_ids(stub, p, 12, name) for name in ("", "first") for i, p in enumerate(prompts)}
        with pytest.raises(grpc.RpcError) as caught:
            greedy_ids(stub, prompts[0], 4, "nope")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
    assert "adapter" in (caught.value.details() or "") and "nope" in (caught.value.details() or "")  # type: ignore[attr-defined]
    for i, prompt in enumerate(prompts):
        assert got[("", i)] == peft_greedy(tiny_model_dir, None, prompt, 12), i
        assert got[("first", i)] == peft_greedy(tiny_model_dir, root / "first", prompt, 12), i
    assert any(got[("first", i)] != got[("", i)] for i in range(len(prompts)))


def test_adapters_load_and_unload_at_run_time_on_vllm(
    lora_server: tuple[ServerProcess, Path], tiny_model_dir: Path
) -> None:
    """LoadAdapter hands a --lora-dir folder to vLLM (its calls then answer as PEFT does); past
    --max-loras is RESOURCE_EXHAUSTED, a mismatched folder INVALID_ARGUMENT naming ``path``; an
    unload while a stream runs lets it finish (streams_in_flight 1), then the name is NOT_FOUND."""
    from transformers import AutoTokenizer

    server, root = lora_server
    prompt = AutoTokenizer.from_pretrained(tiny_model_dir)(PROMPTS[0])["input_ids"]
    (root / "broken").mkdir(exist_ok=True)
    (root / "broken" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]}')
    with grpc.insecure_channel(server.target, options=STALLING) as channel:
        adapters = pb_grpc.AdaptersStub(channel)
        stub = pb_grpc.TextGenerationStub(channel)
        with pytest.raises(grpc.RpcError) as bad:
            adapters.LoadAdapter(pb.LoadAdapterRequest(name="broken", path="broken"), timeout=120)
        loaded = adapters.LoadAdapter(pb.LoadAdapterRequest(name="second", path="second"), timeout=120)
        assert (loaded.name, loaded.rank) == ("second", 16)
        with pytest.raises(grpc.RpcError) as full:
            adapters.LoadAdapter(pb.LoadAdapterRequest(name="third", path="first"), timeout=120)
        listed = [a.name for a in adapters.ListAdapters(pb.ListAdaptersRequest(), timeout=30).adapters]
        assert greedy_ids(stub, prompt, 12, "second") == peft_greedy(tiny_model_dir, root / "second", prompt, 12)
        # A stream held open by flow control (its client reads nothing) while "second" is unloaded.
        held = stub.Generate(long_request(1000, adapter="second", output=HEAVY), timeout=120)
        first = next(held)
        unloaded = adapters.UnloadAdapter(pb.UnloadAdapterRequest(name="second"), timeout=30)
        with pytest.raises(grpc.RpcError) as gone:
            greedy_ids(stub, prompt, 4, "second")
        rest = list(held)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "adapter_model.safetensors" in (bad.value.details() or "")  # type: ignore[attr-defined]
    assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
    assert listed == ["first", "second"]
    assert unloaded.streams_in_flight == 1
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert len(first.tokens) + sum(len(c.tokens) for c in rest) == 1000


@pytest.mark.e2e
def test_the_default_model_answers_in_a_json_schema_on_vllm(default_model_dir: Path) -> None:
    import json

    import jsonschema

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
    }
    with (
        ServerProcess(["--model", "default", *VLLM], ready_timeout=400) as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        stub = pb_grpc.TextGenerationStub(channel)
        chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="What is the capital of France? Answer in JSON.")])
        request = pb.GenerateRequest(chat=chat, stopping=pb.StoppingCriteria(max_new_tokens=48),
                                     response_format=pb.ResponseFormat(json_schema=json.dumps(schema)))  # fmt: skip
        chunks = list(stub.Generate(request, timeout=300))
    assert chunks[-1].finish_reason == pb.FINISH_REASON_EOS
    answer = json.loads("".join(c.text for c in chunks))
    jsonschema.validate(answer, schema)
    assert answer["city"] == "Paris"


def test_a_stop_token_id_ends_a_stream_on_vllm(small_server: ServerProcess) -> None:
    """``stop_token_ids`` reach vLLM's SamplingParams: the stream ends at the token's first
    occurrence with FINISH_REASON_STOP_TOKEN, and the last chunk names it."""
    with grpc.insecure_channel(small_server.target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)

        def ids(stopping: pb.StoppingCriteria) -> tuple[list[int], pb.TokenChunk]:
            request = pb.GenerateRequest(
                prompt="Count:", sampling=pb.SamplingParams(temperature=0.0), stopping=stopping,
                output=pb.OutputOptions(token_ids=True),
            )  # fmt: skip
            chunks = list(stub.Generate(request, timeout=120))
            return [t.id for c in chunks for t in c.tokens], chunks[-1]

        full, _ = ids(pb.StoppingCriteria(max_new_tokens=16, ignore_eos=True))
        at = next(i for i in range(3, len(full)) if full[i] not in full[:i])
        cut, last = ids(pb.StoppingCriteria(max_new_tokens=16, ignore_eos=True, stop_token_ids=[full[at]]))
    assert cut == full[: at + 1]
    assert last.finish_reason == pb.FINISH_REASON_STOP_TOKEN and last.stop_token_id == full[at]


def test_logit_bias_penalties_and_min_p_reach_vllm(small_server: ServerProcess) -> None:
    """The sampling controls map to vLLM's SamplingParams: a -100 bias on the greedy first token
    changes it (vLLM adds it; ModelInfo.notes says so), and a call with every control set ends OK."""
    with grpc.insecure_channel(small_server.target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        notes = " ".join(stub.GetModelInfo(pb.GetModelInfoRequest()).notes)
        assert "logit_bias of -100" in notes

        def first_ids(sampling: pb.SamplingParams) -> list[int]:
            request = pb.GenerateRequest(
                prompt="Count:", sampling=sampling, output=pb.OutputOptions(token_ids=True),
                stopping=pb.StoppingCriteria(max_new_tokens=6, ignore_eos=True),
            )  # fmt: skip
            return [t.id for c in stub.Generate(request, timeout=120) for t in c.tokens]

        plain = first_ids(pb.SamplingParams(temperature=0.0))
        banned = first_ids(pb.SamplingParams(temperature=0.0, logit_bias={plain[0]: -100.0}))
        assert banned[0] != plain[0]
        every = first_ids(
            pb.SamplingParams(
                temperature=0.8, seed=3, presence_penalty=0.5, frequency_penalty=0.5, min_p=0.05, logit_bias={5: 2.0}
            )
        )
        assert len(every) == 6


def test_prompt_logprobs_on_vllm_are_the_models(small_server: ServerProcess, tiny_model_dir: Path) -> None:
    """OutputOptions.prompt_logprobs maps to vLLM's own: a scoring call's prompt logprobs equal an
    in-process transformers forward's log_softmax (within vLLM's CPU rounding), and it sends no token."""
    import torch
    from transformers import AutoModelForCausalLM

    with grpc.insecure_channel(small_server.target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        prompt = "The quick brown fox jumps over the lazy dog"
        ids = list(stub.Tokenize(pb.TokenizeRequest(text=prompt)).ids)
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=ids), stopping=pb.StoppingCriteria(max_new_tokens=0),
            output=pb.OutputOptions(prompt_logprobs=True, prompt_top_logprobs=1),
        )  # fmt: skip
        (only,) = list(stub.Generate(request, timeout=120))
    assert only.finish_reason == pb.FINISH_REASON_LENGTH and only.usage.completion_tokens == 0 and not only.tokens
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.inference_mode():
        expected = model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
    scored = list(only.prompt_tokens)
    assert [t.id for t in scored] == ids and not scored[0].HasField("logprob")
    wanted = [float(expected[p, ids[p + 1]]) for p in range(len(ids) - 1)]
    assert [t.logprob for t in scored[1:]] == pytest.approx(wanted, abs=2e-2)
