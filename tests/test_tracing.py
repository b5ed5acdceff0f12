"""OpenTelemetry tracing: a call's server span reaches an OTLP/gRPC collector (one run in
this test, on 127.0.0.1), continues the caller's trace from its ``traceparent``, carries the
call's attributes (the ``gen_ai.usage.*`` ones too) and, for Generate, its queue/prefill/decode
phases; a cancelled or timed-out call's span is in error with its code; the drain sends the
spans still batched and waits a bounded time for a collector that is gone; ``https://`` is TLS
and ``http://`` plaintext; with tracing off nothing is sent and ``opentelemetry`` is not even
imported."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from tokenwire.v1 import generation_pb2 as pb
from tokenwire.v1 import generation_pb2_grpc as pb_grpc
from tokenwire_server import tracing
from tokenwire_server.config import ServerConfig
from tokenwire_server.domain import Usage
from tokenwire_server.server import TokenwireServer
from tokenwire_server.transport.calls import Call

REPO = Path(__file__).resolve().parent.parent
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
OTEL_VARIABLES = (
    "OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_EXPORTER_OTLP_INSECURE", "OTEL_EXPORTER_OTLP_TRACES_INSECURE", "OTEL_PROPAGATORS",
)  # fmt: skip
WAIT_S = 15.0


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector on 127.0.0.1 that keeps what it is sent."""

    def __init__(self, tls: Any = None) -> None:
        """``tls``: a ``Pki`` whose server certificate it presents (then it speaks only TLS)."""
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        if tls is None:
            self.port = self.server.add_insecure_port("127.0.0.1:0")
        else:
            pair = (tls.server_key.read_bytes(), tls.server_cert.read_bytes())
            self.port = self.server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([pair]))
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def Export(self, request: Any, context: Any) -> trace_service_pb2.ExportTraceServiceResponse:  # noqa: N802
        with self.lock:
            self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[tuple[dict[str, Any], trace_pb2.Span]]:
        """Every span received, with its resource's attributes."""
        with self.lock:
            requests = list(self.requests)
        return [
            (attributes(rs.resource.attributes), span)
            for request in requests
            for rs in request.resource_spans
            for ss in rs.scope_spans
            for span in ss.spans
        ]


def attributes(pairs: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kv in pairs:
        kind = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, kind) if kind else None
    return out


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r.server.start()
    try:
        yield r
    finally:
        r.server.stop(grace=None)


@pytest.fixture()
def no_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)


class InProcess:
    """A TokenwireServer on its own event loop in a thread, reached over 127.0.0.1."""

    def __init__(self, config: ServerConfig, load: bool = True) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="tracing-test-loop", daemon=True)
        self.thread.start()
        self.server = TokenwireServer(config)
        self.call(self.server.start())
        if load:
            self.call(self.server.load(), timeout=120)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")
        self.stub = pb_grpc.TextGenerationStub(self.channel)

    def call(self, coro: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        try:
            self.channel.close()
            self.call(self.server.drain("test over"), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)


@pytest.fixture()
def traced(tiny_model_dir: Path, receiver: Receiver, no_otel_env: None) -> Iterator[InProcess]:
    config = ServerConfig(
        model=str(tiny_model_dir), host="127.0.0.1", port=0, warmup=False, grace_period=2.0,
        otlp_endpoint=receiver.endpoint,
    )  # fmt: skip
    server = InProcess(config)
    try:
        yield server
    finally:
        server.close()


def wait_for_spans(
    tracer: tracing.Tracing, receiver: Receiver, done: Callable[[list[trace_pb2.Span]], bool]
) -> list[trace_pb2.Span]:
    """The spans of TRACE_ID once ``done`` holds of them (flushing meanwhile); fails after WAIT_S.
    The server ends a call's span right after its status is sent: it may come a moment later."""
    deadline = time.monotonic() + WAIT_S
    while True:
        assert tracer.force_flush(5.0)
        spans = [span for _, span in receiver.spans() if span.trace_id.hex() == TRACE_ID]
        if done(spans) or time.monotonic() > deadline:
            return spans
        time.sleep(0.05)


def by_name(spans: list[trace_pb2.Span]) -> dict[str, trace_pb2.Span]:
    return {span.name: span for span in spans}


def test_generate_span_continues_the_callers_trace(traced: InProcess, receiver: Receiver) -> None:
    request = pb.GenerateRequest(
        prompt="hello there", request_id="trace-me",
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_new_tokens=4, ignore_eos=True),
    )  # fmt: skip
    # The client's own clock (the server runs in this process, on the same clock): the spans
    # must sit inside the call as the client saw it, not only agree with the usage they came from.
    sent_ns = time.time_ns()
    chunks, arrived_ns = [], []
    for chunk in traced.stub.Generate(request, metadata=[("traceparent", TRACEPARENT)], timeout=60):
        chunks.append(chunk)
        arrived_ns.append(time.time_ns())
    usage = chunks[-1].usage
    assert usage.completion_tokens == 4

    spans = wait_for_spans(traced.server.tracing, receiver, lambda s: len(s) >= 4)
    named = by_name(spans)
    assert sorted(named) == ["decode", "prefill", "queue", "tokenwire.v1.TextGeneration/Generate"]
    server = named["tokenwire.v1.TextGeneration/Generate"]
    assert server.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert server.parent_span_id.hex() == PARENT_ID
    assert server.status.code != trace_pb2.Status.STATUS_CODE_ERROR
    attrs = attributes(server.attributes)
    assert attrs["rpc.system"] == "grpc"
    assert attrs["rpc.service"] == "tokenwire.v1.TextGeneration"
    assert attrs["rpc.method"] == "Generate"
    assert attrs["tokenwire.request_id"] == "trace-me"
    assert attrs["tokenwire.tenant"] == "default"
    assert attrs["tokenwire.priority"] == "normal"
    assert attrs["tokenwire.prompt_tokens"] == usage.prompt_tokens > 0
    assert attrs["tokenwire.completion_tokens"] == 4
    assert attrs["tokenwire.cached_prompt_tokens"] == usage.cached_prompt_tokens
    assert (attrs["gen_ai.usage.input_tokens"], attrs["gen_ai.usage.output_tokens"]) == (usage.prompt_tokens, 4)
    assert attrs["tokenwire.finish_reason"] == "length"
    assert attrs["rpc.grpc.status_code"] == 0
    assert attrs["tokenwire.status"] == "OK"

    queue, prefill, decode = named["queue"], named["prefill"], named["decode"]
    for child in (queue, prefill, decode):
        assert child.parent_span_id == server.span_id
        assert child.start_time_unix_nano <= child.end_time_unix_nano
        assert server.start_time_unix_nano <= child.start_time_unix_nano
        assert child.end_time_unix_nano <= server.end_time_unix_nano
    # One after the other, and their lengths are the usage's (to the nanosecond rounding of each end).
    assert queue.end_time_unix_nano == prefill.start_time_unix_nano
    assert prefill.end_time_unix_nano == decode.start_time_unix_nano
    assert abs((prefill.end_time_unix_nano - queue.start_time_unix_nano) / 1e6 - usage.time_to_first_token_ms) <= 0.01
    assert abs((decode.end_time_unix_nano - queue.start_time_unix_nano) / 1e6 - usage.total_time_ms) <= 0.01
    slack_ns = 2_000_000  # the spans' wall times come from a monotonic clock and one offset
    assert sent_ns - slack_ns <= server.start_time_unix_nano <= queue.start_time_unix_nano
    first_text = next(i for i, c in enumerate(chunks) if c.text)
    assert prefill.end_time_unix_nano <= arrived_ns[first_text] + slack_ns  # the first token, before it came
    assert decode.end_time_unix_nano <= arrived_ns[-1] + slack_ns
    assert prefill.end_time_unix_nano - queue.start_time_unix_nano > 0 and decode.end_time_unix_nano > sent_ns

    (resource,) = {tuple(sorted(r.items())) for r, span in receiver.spans() if span.trace_id.hex() == TRACE_ID}
    assert dict(resource)["service.name"] == "tokenwire"


def test_failed_call_span_has_error_status_and_code(traced: InProcess, receiver: Receiver) -> None:
    request = pb.GenerateRequest(prompt="hello", stopping=pb.StoppingCriteria(max_new_tokens=10**6))
    with pytest.raises(grpc.RpcError) as raised:
        list(traced.stub.Generate(request, metadata=[("traceparent", TRACEPARENT)], timeout=60))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    spans = wait_for_spans(traced.server.tracing, receiver, lambda s: len(s) >= 1)
    (span,) = spans  # no phases: it never reached the engine
    assert span.name == "tokenwire.v1.TextGeneration/Generate"
    assert span.parent_span_id.hex() == PARENT_ID
    assert span.status.code == trace_pb2.Status.STATUS_CODE_ERROR
    attrs = attributes(span.attributes)
    assert attrs["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0] == 3
    assert attrs["tokenwire.status"] == "INVALID_ARGUMENT"
    assert "tokenwire.completion_tokens" not in attrs


def test_tracing_off_sends_nothing(receiver: Receiver, no_otel_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # The receiver's endpoint is given, and OTEL_SDK_DISABLED turns tracing off all the same.
    # No model: the call is refused (UNAVAILABLE, still loading) but goes through the same wrapper.
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    config = ServerConfig(host="127.0.0.1", port=0, grace_period=0.5, otlp_endpoint=receiver.endpoint)
    server = InProcess(config, load=False)
    try:
        assert server.server.tracing is tracing.NO_TRACING
        assert server.server._servicer.calls.tracing is tracing.NO_TRACING
        with pytest.raises(grpc.RpcError) as raised:
            server.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=[("traceparent", TRACEPARENT)], timeout=10)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.close()
    assert receiver.spans() == []


def test_tracing_off_does_not_import_opentelemetry() -> None:
    probe = (
        "import sys\n"
        "from tokenwire_server.config import ServerConfig\n"
        "from tokenwire_server.server import TokenwireServer\n"
        "from tokenwire_server.transport.calls import Call\n"
        "server = TokenwireServer(ServerConfig())\n"
        "span = server.tracing.start_call('Generate', [('traceparent', '" + TRACEPARENT + "')], 'r')\n"
        "span.finish(Call('Generate', 'r', 0.0))\n"
        "assert not server.tracing.enabled\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
        "assert not loaded, loaded\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "service"), str(REPO / "client")])
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("flag", "environ", "expected"),
    [
        ("", {}, None),
        ("http://collector:4317", {}, "http://collector:4317"),
        ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, ""),
        ("", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4317"}, ""),
        ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, None),
        ("http://collector:4317", {"OTEL_SDK_DISABLED": "true"}, None),
        ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SDK_DISABLED": "TRUE"}, None),
        ("http://collector:4317", {"OTEL_SDK_DISABLED": "false"}, "http://collector:4317"),
    ],
)
def test_when_tracing_is_on(flag: str, environ: dict[str, str], expected: str | None) -> None:
    assert tracing.tracing_endpoint(flag, environ) == expected


def test_variables_turn_tracing_on(receiver: Receiver, no_otel_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The standard variables alone: endpoint, service name and resource attributes; the
    phases' times are the usage's, to the nanosecond's rounding."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "llm-gateway")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
    tracer = tracing.create_tracing("")
    try:
        assert tracer.enabled and tracer.endpoint == receiver.endpoint
        call = Call("Generate", "r-1", time.monotonic())
        span = tracer.start_call("Generate", (("traceparent", TRACEPARENT), ("x-other", b"bin")), call.request_id)
        call.tenant, call.priority, call.reason = "acme", "high", "eos"
        call.usage = Usage(prompt_tokens=7, completion_tokens=3, queue_time_s=0.010, time_to_first_token_s=0.025,
                           total_time_s=0.040, cached_prompt_tokens=2)  # fmt: skip
        time.sleep(0.06)  # the call ends after its last token
        span.finish(call)
        spans = wait_for_spans(tracer, receiver, lambda s: len(s) >= 4)
    finally:
        tracer.shutdown()
    named = by_name(spans)
    attrs = attributes(named["tokenwire.v1.TextGeneration/Generate"].attributes)
    assert (attrs["tokenwire.tenant"], attrs["tokenwire.priority"], attrs["tokenwire.finish_reason"]) == (
        "acme",
        "high",
        "eos",
    )
    assert (
        attrs["tokenwire.prompt_tokens"],
        attrs["tokenwire.completion_tokens"],
        attrs["tokenwire.cached_prompt_tokens"],
    ) == (7, 3, 2)
    lengths = {
        name: named[name].end_time_unix_nano - named[name].start_time_unix_nano
        for name in ("queue", "prefill", "decode")
    }
    for name, expected_ms in (("queue", 10), ("prefill", 15), ("decode", 15)):
        assert abs(lengths[name] - expected_ms * 1_000_000) <= 2, (name, lengths)
    resource = {r["service.name"]: r for r, span in receiver.spans()}["llm-gateway"]
    assert resource["deployment.environment"] == "test"


def test_shutdown_is_bounded_when_the_collector_is_gone(no_otel_env: None) -> None:
    with socket_closed_port() as port:
        tracer = tracing.create_tracing(f"http://127.0.0.1:{port}")
        call = Call("Tokenize", "r", time.monotonic())
        tracer.start_call("Tokenize", None, "r").finish(call)
        started = time.monotonic()
        tracer.shutdown(timeout_s=1.0)
        assert time.monotonic() - started < 3.0
        tracer.shutdown()  # twice is fine


def test_a_cancelled_and_a_timed_out_call_end_their_spans_in_error_by_their_code(
    traced: InProcess, receiver: Receiver
) -> None:
    long = pb.GenerateRequest(prompt="hello", stopping=pb.StoppingCriteria(max_new_tokens=1000, ignore_eos=True))
    stream = traced.stub.Generate(long, metadata=[("traceparent", TRACEPARENT)], timeout=60)
    next(stream)
    stream.cancel()  # the client leaves mid-stream
    with pytest.raises(grpc.RpcError) as late:  # 1,000 tokens take ~2 s on this 2-core host: the deadline comes first
        list(traced.stub.Generate(long, metadata=[("traceparent", TRACEPARENT)], timeout=0.3))
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
    spans = wait_for_spans(traced.server.tracing, receiver, lambda s: len(by_status(s)) >= 2)
    statuses = by_status(spans)
    assert sorted(statuses) == ["CANCELLED", "DEADLINE_EXCEEDED"]
    for name, span in statuses.items():
        assert span.status.code == trace_pb2.Status.STATUS_CODE_ERROR and span.status.message == name
        assert attributes(span.attributes)["rpc.grpc.status_code"] == getattr(grpc.StatusCode, name).value[0]


def by_status(spans: list[trace_pb2.Span]) -> dict[str, trace_pb2.Span]:
    """The Generate server spans, by their tokenwire.status."""
    return {
        attributes(span.attributes)["tokenwire.status"]: span
        for span in spans
        if span.name == "tokenwire.v1.TextGeneration/Generate"
    }


def test_the_drain_sends_the_spans_still_batched(
    tiny_model_dir: Path, receiver: Receiver, no_otel_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch processor would wait a minute; the drain's flush sends the span at once."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")
    config = ServerConfig(host="127.0.0.1", port=0, grace_period=0.5, otlp_endpoint=receiver.endpoint)
    server = InProcess(config, load=False)
    try:
        with pytest.raises(grpc.RpcError):  # no model: UNAVAILABLE, through the same wrapper and span
            server.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=[("traceparent", TRACEPARENT)], timeout=10)
        time.sleep(0.5)
        assert receiver.spans() == []  # still in the batch
    finally:
        server.close()
    assert [span.name for _, span in receiver.spans()] == ["tokenwire.v1.TextGeneration/GetModelInfo"]


def test_the_drain_waits_a_bounded_time_for_a_collector_that_is_gone(no_otel_env: None) -> None:
    with socket_closed_port() as port:
        config = ServerConfig(host="127.0.0.1", port=0, grace_period=0.5, otlp_endpoint=f"http://127.0.0.1:{port}")
        server = InProcess(config, load=False)
        with pytest.raises(grpc.RpcError):
            server.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        started = time.monotonic()
        server.close()
    # The flush waits at most 5 s (docs/operations.md), the grace 0.5 s: not the exporter's own retries.
    assert time.monotonic() - started < 5 + 0.5 + 3


def test_https_means_tls_and_http_means_plaintext(tmp_path: Path, no_otel_env: None) -> None:
    """A collector that speaks only TLS: an https:// endpoint (its CA trusted through the
    standard variable) reaches it; the same collector as http:// gets nothing."""
    if str(REPO / "tests" / "production") not in sys.path:  # its test CA (as tests/gpu/conftest.py)
        sys.path.insert(0, str(REPO / "tests" / "production"))
    from production_support import make_pki

    pki = make_pki(tmp_path)
    collector = Receiver(tls=pki)
    collector.server.start()
    try:
        for scheme in ("http", "https"):
            os.environ["OTEL_EXPORTER_OTLP_CERTIFICATE"] = str(pki.ca_cert)
            tracer = tracing.create_tracing(f"{scheme}://localhost:{collector.port}")
            try:
                tracer.start_call("Tokenize", (("traceparent", TRACEPARENT),), scheme).finish(
                    Call("Tokenize", scheme, 0.0)
                )
                sent = tracer.force_flush(5.0 if scheme == "https" else 1.0)
            finally:
                tracer.shutdown(timeout_s=2.0)
                del os.environ["OTEL_EXPORTER_OTLP_CERTIFICATE"]
            ids = {attributes(span.attributes)["tokenwire.request_id"] for _, span in collector.spans()}
            assert (scheme in ids) is (scheme == "https"), (scheme, sent, ids)
    finally:
        collector.server.stop(grace=None)


class socket_closed_port:  # noqa: N801 (a context manager used like a function)
    """A 127.0.0.1 port nothing listens on."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("endpoint", ["localhost:4317", "collector.observability:4317", "grpc://c:4317", "http://"])
def test_scheme_less_endpoint_is_a_usage_error(endpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Without a scheme the exporter would speak TLS to a plaintext collector and drop every
    span with a warning: the flag is refused (exit 2), showing the two forms."""
    from tokenwire_server.config import parse_config

    with pytest.raises(SystemExit) as exited:
        parse_config(["--otlp-endpoint", endpoint])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--otlp-endpoint" in err and "http://HOST:PORT" in err and "https://HOST:PORT" in err
    for good in ("http://localhost:4317", "https://collector:4317", "HTTP://c:4317", ""):
        assert parse_config(["--otlp-endpoint", good]).otlp_endpoint == good
