"""The transport on a fake backend: no model, no torch.

The servicer, its call wrapper and the conversion functions are exercised through
a real grpc.aio server on 127.0.0.1 whose backend is scripted here. Status
mapping, metrics, the one log line per call, cancellation and drain are checked
without loading anything; the real-model tests elsewhere cover the same contract
end to end.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from tokenwire.v1 import generation_pb2 as pb
from tokenwire.v1 import generation_pb2_grpc as pb_grpc
from tokenwire_server.domain import (
    ChatPrompt,
    EmptyPrompt,
    Encoding,
    EngineClosed,
    EngineOverloaded,
    EngineStats,
    ErrorEvent,
    ErrorKind,
    Event,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    InvalidResponseFormat,
    InvalidResume,
    ModelDescription,
    NoChatTemplate,
    NotSupported,
    Prompt,
    PromptTooLong,
    RequestLimits,
    ResponseFormat,
    SamplingOptions,
    TextEvent,
    TextPrompt,
    TokenInfo,
    TokenPrompt,
    Usage,
    fit_to_context,
)
from tokenwire_server.metrics import Metrics
from tokenwire_server.transport import conversion
from tokenwire_server.transport.servicer import TextGenerationServicer

LIMITS = RequestLimits(
    context_length=64,
    vocab_size=1000,
    default_max_new_tokens=16,
    max_new_tokens_limit=48,
    max_stop_sequences=3,
    max_stop_sequence_chars=10,
    max_chat_messages=4,
    max_message_bytes=1 << 20,
)
DEFAULTS = SamplingOptions(temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.1)


def description(**changes: Any) -> ModelDescription:
    base = ModelDescription(
        name="fake",
        engine="fake",
        dtype="float32",
        device="cpu",
        vocab_size=1000,
        eos_token_ids=(2,),
        bos_token_id=1,
        has_chat_template=True,
        default_sampling=DEFAULTS,
        limits=LIMITS,
        max_active=2,
        max_queue=3,
    )
    return dataclasses.replace(base, **changes)


USAGE = Usage(prompt_tokens=3, completion_tokens=2, queue_time_s=0.001, time_to_first_token_s=0.002, total_time_s=0.003)


class FakeSubmission:
    def __init__(self, events: list[Event], gap_s: float = 0.0, forever: bool = False) -> None:
        self._events = events
        self._gap_s = gap_s
        self._forever = forever
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    def end(self, event: ErrorEvent) -> None:
        self.ended = event
        self.cancel()

    ended: ErrorEvent | None = None

    async def __aiter__(self) -> AsyncIterator[Event]:
        for event in self._events:
            await asyncio.sleep(self._gap_s)
            yield event
        while self._forever and not self.cancelled.is_set():
            await asyncio.sleep(0.01)
            yield TextEvent("x", (TokenInfo(7, "x"),))
        if self.ended is not None:
            yield self.ended


class FakeBackend:
    """Scripted: ``behaviour`` decides what ``submit`` does with the next request."""

    def __init__(self, describe: ModelDescription | None = None) -> None:
        self._description = describe or description()
        self.requests: list[GenerationRequest] = []
        self.submissions: list[FakeSubmission] = []
        self.behaviour: Callable[[GenerationRequest], FakeSubmission] = lambda r: FakeSubmission(
            [
                TextEvent("he", (TokenInfo(5, "he"),)),
                FinishEvent("llo", (TokenInfo(6, "llo"),), FinishReason.EOS, USAGE),
            ]
        )
        self.admission_stopped = False
        self.formats = []

    def describe(self) -> ModelDescription:
        return self._description

    async def encode(
        self, prompt: Prompt, *, offsets: bool = False, tokens: bool = False, max_tokens: int | None = None
    ) -> Encoding:
        if isinstance(prompt, ChatPrompt):
            if not self._description.has_chat_template:
                raise NoChatTemplate("no template")
            text = "|".join(f"{role}:{content}" for role, content in prompt.messages)
        elif isinstance(prompt, TokenPrompt):
            return Encoding(list(prompt.ids))
        else:
            text = prompt.text
        if text == "<encodes to nothing>":
            return Encoding([], text)
        ids = [ord(c) % 1000 for c in text]
        return Encoding(
            ids, text, [(i, i + 1) for i in range(len(text))] if offsets else [], list(text) if tokens else []
        )

    async def check_format(self, fmt: ResponseFormat, tenant: str = "default", *, limited: bool = True) -> float | None:
        """As a compiler would: a spec holding "unsupported" is refused with the library's message;
        the first sight of a format takes 0.002 s, the next ones come from the cache."""
        if "unsupported" in fmt.spec:
            raise InvalidResponseFormat(fmt.field, "Unsupported keyword: unsupported")
        seen = fmt in self.formats
        self.formats.append(fmt)
        return None if seen else 0.002

    formats: list[ResponseFormat]

    def submit(self, request: GenerationRequest) -> FakeSubmission:
        self.requests.append(request)
        submission = self.behaviour(request)
        self.submissions.append(submission)
        return submission

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0)

    def stalled(self, timeout_s: float) -> bool:
        return False

    def failure(self) -> str | None:
        return None

    def stop_admission(self) -> None:
        self.admission_stopped = True

    async def close(self) -> None:
        pass


class LogRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def finished(self, request_id: str, wait_s: float = 5.0) -> list[logging.LogRecord]:
        """The call's "request finished" records, once there is one (the wrapper writes it
        after the status has gone out, so the client may see the status first)."""
        deadline = time.monotonic() + wait_s
        while True:
            found = [
                r
                for r in self.records
                if r.getMessage() == "request finished" and r.__dict__.get("request_id") == request_id
            ]
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(0.01)


class Harness:
    """A grpc.aio server with the servicer on a FakeBackend, on its own loop thread."""

    def __init__(self, backend: FakeBackend | None, *, log_prompts: bool = False) -> None:
        self.backend = backend
        self.metrics = Metrics()
        self.servicer = TextGenerationServicer(self.metrics, retry_after_s=0.25, log_prompts=log_prompts)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.server = self.call(self._start())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = pb_grpc.TextGenerationStub(self.channel)

    async def _start(self) -> grpc.aio.Server:
        server = grpc.aio.server()
        self.servicer.add_to_server(server)
        self.port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        if self.backend is not None:
            self.servicer.attach(self.backend)
        return server

    def call(self, coro: Any, timeout: float = 10) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def count(self, method: str, code: str) -> float:
        value = self.metrics.registry.get_sample_value("tokenwire_requests_total", {"method": method, "code": code})
        return value or 0.0

    def close(self) -> None:
        self.channel.close()
        self.call(self.server.stop(0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@pytest.fixture
def logs() -> Iterator[LogRecords]:
    handler = LogRecords()
    logger = logging.getLogger("tokenwire.requests")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness(FakeBackend())
    yield h
    h.close()


def status_details(error: grpc.RpcError) -> tuple[list[tuple[str, str]], float | None]:
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    violations: list[tuple[str, str]] = []
    retry: float | None = None
    for detail in status.details if status else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations += [(v.field, v.description) for v in bad.field_violations]
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            retry = info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    return violations, retry


def trailer(error_or_call: Any, key: str) -> str | None:
    for k, v in error_or_call.trailing_metadata() or ():
        if k == key:
            return str(v)
    return None


# -- the transport loads neither torch nor transformers --------------------------------


def test_importing_the_transport_loads_no_model_stack() -> None:
    code = (
        "import sys\n"
        "import tokenwire_server.transport.servicer, tokenwire_server.transport.conversion\n"
        "import tokenwire_server.transport.status, tokenwire_server.transport.calls\n"
        "import tokenwire_server.backend, tokenwire_server.domain, tokenwire_server.server\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules)\n"
        "print(','.join(heavy) or 'clean')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "clean", out.stdout + out.stderr


# -- conversion: pure functions ---------------------------------------------------------


def test_unset_sampling_fields_take_the_models_defaults_and_set_ones_are_kept() -> None:
    unset = conversion.sampling_options(pb.SamplingParams(), DEFAULTS)
    assert unset == DEFAULTS
    explicit = conversion.sampling_options(
        pb.SamplingParams(temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.0, seed=9), DEFAULTS
    )
    assert explicit == SamplingOptions(temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.0, seed=9)
    mixed = conversion.sampling_options(pb.SamplingParams(top_p=0.5), DEFAULTS)
    assert (mixed.temperature, mixed.top_k, mixed.top_p, mixed.repetition_penalty) == (0.7, 40, 0.5, 1.1)


def test_the_context_rule_in_one_place() -> None:
    assert fit_to_context(10, None, 16, 64) == 16  # default fits
    assert fit_to_context(60, None, 16, 64) == 4  # default is shortened to what fits
    assert fit_to_context(10, 54, 16, 64) == 54  # explicit, exactly full
    with pytest.raises(PromptTooLong):
        fit_to_context(10, 55, 16, 64)  # explicit beyond the context: refused, not shortened
    with pytest.raises(PromptTooLong):
        fit_to_context(64, None, 16, 64)  # the prompt alone fills it
    with pytest.raises(EmptyPrompt):
        fit_to_context(0, None, 16, 64)  # nothing to continue: INVALID_ARGUMENT, never an engine error


def test_generation_request_maps_every_field() -> None:
    request = pb.GenerateRequest(
        prompt="abc",
        stopping=pb.StoppingCriteria(
            max_new_tokens=5,
            min_new_tokens=2,
            stop_sequences=["x", "y"],
            stop_token_ids=[7, 3, 7],
            include_stop_sequence=True,
            ignore_eos=True,
            time_limit_ms=1500,
        ),
        output=pb.OutputOptions(top_logprobs=3),
    )
    got = conversion.generation_request(request, "r1", [1, 2, 3], description(), arrival=5.0, deadline=9.0)
    assert got.sampling.seed is not None  # samples without a seed: the server's own, for a resume
    assert got == GenerationRequest(
        request_id="r1",
        prompt_ids=[1, 2, 3],
        sampling=dataclasses.replace(DEFAULTS, seed=got.sampling.seed),
        max_new_tokens=5,
        min_new_tokens=2,
        stop_sequences=("x", "y"),
        stop_token_ids=frozenset({3, 7}),
        include_stop_sequence=True,
        ignore_eos=True,
        time_limit_s=1.5,
        deadline=9.0,
        want_tokens=True,
        want_logprobs=True,
        top_logprobs=3,
        arrival=5.0,
    )
    plain = conversion.generation_request(
        pb.GenerateRequest(prompt="a"), "r2", [1], description(), arrival=0, deadline=None
    )
    assert (plain.max_new_tokens, plain.time_limit_s, plain.want_tokens, plain.want_logprobs) == (
        16,
        None,
        False,
        False,
    )


def test_prompts_requests_ids_and_chunks() -> None:
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")])
    assert conversion.prompt_of(pb.GenerateRequest(chat=chat)) == ChatPrompt((("user", "hi"),))
    assert conversion.prompt_of(pb.GenerateRequest(prompt="p")) == TextPrompt("p")
    assert conversion.prompt_of(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[4, 5]))) == TokenPrompt((4, 5))
    assert conversion.prompt_of(pb.TokenizeRequest(text="t")) == TextPrompt("t")
    assert conversion.request_id("own", [("x-request-id", "md")]) == "own"
    # An id past the limit, or with control characters, is replaced, not cut or echoed.
    for bad in ("m" * 129, "a\r\nforged", "\x00"):
        replaced = conversion.request_id("", [("x-request-id", bad)])
        assert len(replaced) == 32 and replaced != bad[:32], bad
        assert len(conversion.request_id(bad, None)) == 32
    assert conversion.request_id("", [("x-request-id", "m" * 128)]) == "m" * 128
    assert len(conversion.request_id("", None)) == 32
    last = conversion.chunk("r", 3, "end", (TokenInfo(9, "end", -0.5),), FinishReason.STOP_SEQUENCE, USAGE)
    assert (last.index, last.text, last.finish_reason) == (3, "end", pb.FINISH_REASON_STOP_SEQUENCE)
    assert last.tokens[0].id == 9 and last.tokens[0].logprob == pytest.approx(-0.5)
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 2)
    assert last.usage.total_time_ms == pytest.approx(3.0)
    middle = conversion.chunk("r", 0, "a", ())
    assert middle.finish_reason == pb.FINISH_REASON_UNSPECIFIED and not middle.HasField("usage")
    assert last.WhichOneof("matched_stop") is None and middle.WhichOneof("matched_stop") is None
    # The stop that ended a stream: the sequence that matched, or the stop (or EOS) token.
    by_sequence = conversion.chunk("r", 4, "", (), FinishReason.STOP_SEQUENCE, USAGE, matched="END")
    assert (by_sequence.WhichOneof("matched_stop"), by_sequence.stop_sequence) == ("stop_sequence", "END")
    by_token = conversion.chunk("r", 4, "", (), FinishReason.STOP_TOKEN, USAGE, matched=0)
    assert by_token.finish_reason == pb.FINISH_REASON_STOP_TOKEN
    assert (by_token.WhichOneof("matched_stop"), by_token.stop_token_id) == ("stop_token_id", 0)


def test_model_info_publishes_every_limit_and_the_default_sampling() -> None:
    info = conversion.model_info(description())
    limits = info.limits
    assert (limits.max_new_tokens_limit, limits.default_max_new_tokens, limits.max_stop_sequences) == (48, 16, 3)
    assert (limits.max_stop_sequence_chars, limits.max_chat_messages, limits.max_top_logprobs) == (10, 4, 20)
    assert (limits.max_message_bytes, limits.context_length, limits.vocab_size) == (1 << 20, 64, 1000)
    assert limits.max_stop_token_ids == 16
    assert info.default_sampling.top_k == 40 and info.default_sampling.temperature == pytest.approx(0.7)
    assert (info.max_new_tokens_limit, info.context_length, info.max_active_streams, info.max_queued_requests) == (
        48,
        64,
        2,
        3,
    )


# -- the servicer on a fake backend ----------------------------------------------------------


def test_a_stream_its_trailer_metrics_and_log_line(harness: Harness, logs: LogRecords) -> None:
    call = harness.stub.Generate(pb.GenerateRequest(request_id="ok-1", prompt="hey"), timeout=10)
    chunks = list(call)
    assert [(c.index, c.text, c.finish_reason) for c in chunks] == [
        (0, "he", pb.FINISH_REASON_UNSPECIFIED),
        (1, "llo", pb.FINISH_REASON_EOS),
    ]
    assert trailer(call, "x-request-id") == "ok-1"
    assert harness.count("Generate", "OK") == 1
    [record] = logs.finished("ok-1")
    assert (record.__dict__["code"], record.__dict__["finish_reason"], record.__dict__["completion_tokens"]) == (
        "OK",
        "eos",
        2,
    )
    assert "prompt" not in record.__dict__  # prompts are not logged unless asked for
    [sent] = harness.backend.requests  # type: ignore[union-attr]
    assert sent.prompt_ids == [ord(c) for c in "hey"] and dataclasses.replace(sent.sampling, seed=None) == DEFAULTS
    # The defaults sample and the caller set no seed: the server chose one and named it first.
    assert sent.sampling.seed is not None and chunks[0].seed == sent.sampling.seed and not chunks[1].HasField("seed")


@pytest.mark.parametrize(
    ("setup", "request_", "code", "field"),
    [
        (
            "none",
            pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(temperature=-1)),
            "INVALID_ARGUMENT",
            "sampling.temperature",
        ),
        (
            "none",
            pb.GenerateRequest(prompt="x", stopping=pb.StoppingCriteria(stop_sequences=["a"] * 4)),
            "INVALID_ARGUMENT",
            "stopping.stop_sequences",
        ),
        (
            "none",
            pb.GenerateRequest(prompt="x" * 60, stopping=pb.StoppingCriteria(max_new_tokens=10)),
            "INVALID_ARGUMENT",
            "prompt",
        ),
        ("overloaded", pb.GenerateRequest(prompt="x"), "RESOURCE_EXHAUSTED", None),
        ("closed", pb.GenerateRequest(prompt="x"), "UNAVAILABLE", None),
        ("bug", pb.GenerateRequest(prompt="x"), "INTERNAL", None),
        ("bug-mid-stream", pb.GenerateRequest(prompt="x"), "INTERNAL", None),
        ("deadline-event", pb.GenerateRequest(prompt="x"), "DEADLINE_EXCEEDED", None),
        ("oom-event", pb.GenerateRequest(prompt="x"), "RESOURCE_EXHAUSTED", None),
        ("none", pb.GenerateRequest(), "INVALID_ARGUMENT", "input"),
        ("none", pb.GenerateRequest(prompt="<encodes to nothing>"), "INVALID_ARGUMENT", "prompt"),
    ],
)
def test_every_outcome_maps_to_its_status_once(
    harness: Harness, logs: LogRecords, setup: str, request_: pb.GenerateRequest, code: str, field: str | None
) -> None:
    backend = harness.backend
    assert backend is not None

    def overloaded(r: GenerationRequest) -> FakeSubmission:
        raise EngineOverloaded("full", 0.25)

    def closed(r: GenerationRequest) -> FakeSubmission:
        raise EngineClosed("closing")

    def bug(r: GenerationRequest) -> FakeSubmission:
        raise KeyError("a bug")

    class Broken(FakeSubmission):
        async def __aiter__(self) -> AsyncIterator[Event]:
            yield TextEvent("a")
            raise ValueError("a bug mid-stream")

    behaviours: dict[str, Callable[[GenerationRequest], FakeSubmission]] = {
        "overloaded": overloaded,
        "closed": closed,
        "bug": bug,
        "bug-mid-stream": lambda r: Broken([]),
        "deadline-event": lambda r: FakeSubmission([ErrorEvent(ErrorKind.DEADLINE, "too late")]),
        "oom-event": lambda r: FakeSubmission([ErrorEvent(ErrorKind.OUT_OF_MEMORY, "no memory")]),
    }
    if setup in behaviours:
        backend.behaviour = behaviours[setup]
    request_.request_id = f"case-{setup}-{code}"
    with pytest.raises(grpc.RpcError) as caught:
        list(harness.stub.Generate(request_, timeout=10))
    error = caught.value
    assert error.code().name == code  # type: ignore[attr-defined]
    assert trailer(error, "x-request-id") == request_.request_id
    violations, retry = status_details(error)
    if field is not None:
        assert [f for f, _ in violations] == [field]
    if code == "RESOURCE_EXHAUSTED":
        assert retry == pytest.approx(0.25) and trailer(error, "grpc-retry-pushback-ms") == "250"
    assert [r.__dict__["code"] for r in logs.finished(request_.request_id)] == [code]
    assert harness.count("Generate", code) == 1
    if setup.startswith("bug"):
        assert "internal error" in error.details()  # type: ignore[attr-defined]


def test_chat_without_a_template_is_failed_precondition(logs: LogRecords) -> None:
    h = Harness(FakeBackend(description(has_chat_template=False)))
    try:
        chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")])
        with pytest.raises(grpc.RpcError) as caught:
            list(h.stub.Generate(pb.GenerateRequest(request_id="nochat", chat=chat), timeout=10))
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
        with pytest.raises(grpc.RpcError) as tokenize:
            h.stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=10, metadata=[("x-request-id", "nochat-tok")])
        assert tokenize.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
        assert [r.__dict__["code"] for r in logs.finished("nochat")] == ["FAILED_PRECONDITION"]
        assert [r.__dict__["code"] for r in logs.finished("nochat-tok")] == ["FAILED_PRECONDITION"]
        assert h.count("Tokenize", "FAILED_PRECONDITION") == 1
    finally:
        h.close()


def test_tokenize_and_model_info_go_through_the_same_wrapper(harness: Harness, logs: LogRecords) -> None:
    response, call = harness.stub.Tokenize.with_call(
        pb.TokenizeRequest(text="ab", return_tokens=True, return_offsets=True), metadata=[("x-request-id", "tok-1")]
    )
    assert list(response.ids) == [97, 98] and list(response.tokens) == ["a", "b"]
    assert [(o.start, o.end) for o in response.offsets] == [(0, 1), (1, 2)]
    assert trailer(call, "x-request-id") == "tok-1"
    [record] = logs.finished("tok-1")
    assert record.__dict__["code"] == "OK" and record.__dict__["method"] == "Tokenize"
    info = harness.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10, metadata=[("x-request-id", "info-1")])
    assert info.limits.max_stop_sequences == 3
    assert [r.__dict__["method"] for r in logs.finished("info-1")] == ["GetModelInfo"]
    assert harness.count("GetModelInfo", "OK") == 1
    with pytest.raises(grpc.RpcError) as caught:
        harness.stub.Tokenize(pb.TokenizeRequest(chat=pb.Chat()), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]


class RecordingContext:
    """A servicer context that notes what the metrics said when the status went out."""

    def __init__(self, metrics: Metrics, calls: Any) -> None:
        self.metrics, self.calls = metrics, calls
        self.seen_at_abort: tuple[float, int] | None = None

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass

    def time_remaining(self) -> None:
        return None

    async def abort(self, code: grpc.StatusCode, message: str, trailing_metadata: Any = ()) -> None:
        counted = self.metrics.registry.get_sample_value(
            "tokenwire_requests_total", {"method": "Tokenize", "code": code.name}
        )
        self.seen_at_abort = (counted or 0.0, self.calls.in_flight)
        raise grpc.aio.AbortError()


def test_a_failed_call_is_counted_before_its_status_goes_out() -> None:
    """A client that scrapes /metrics right after its call failed finds the failure counted
    (the status is sent by ``abort``, before the wrapper's ``finally``), and once only."""
    from tokenwire_server.transport.calls import Calls

    metrics = Metrics()
    calls = Calls(metrics)

    async def refuse(request: Any, context: Any, call: Any) -> None:
        raise EmptyPrompt("text")

    context = RecordingContext(metrics, calls)
    with pytest.raises(grpc.aio.AbortError):
        asyncio.run(calls.unary("Tokenize", refuse)(pb.TokenizeRequest(), context))  # type: ignore[arg-type]
    assert context.seen_at_abort == (1.0, 0)  # counted, and no longer in flight, when the status went out
    counted = metrics.registry.get_sample_value(
        "tokenwire_requests_total", {"method": "Tokenize", "code": "INVALID_ARGUMENT"}
    )
    assert counted == 1.0 and calls.in_flight == 0


def test_undecodable_bytes_are_invalid_argument(harness: Harness) -> None:
    raw = harness.channel.unary_stream(
        "/tokenwire.v1.TextGeneration/Generate", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    with pytest.raises(grpc.RpcError) as caught:
        list(raw(b"\xff\xff\xff", timeout=10))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "not a valid tokenwire.v1.GenerateRequest" in caught.value.details()  # type: ignore[attr-defined]


def test_a_client_that_leaves_cancels_the_backend_request(harness: Harness, logs: LogRecords) -> None:
    backend = harness.backend
    assert backend is not None
    backend.behaviour = lambda r: FakeSubmission([], forever=True)
    stream = harness.stub.Generate(pb.GenerateRequest(request_id="leaver", prompt="x"), timeout=30)
    assert next(stream).text == "x"
    stream.cancel()
    assert backend.submissions[0].cancelled.wait(5), "the backend request was not cancelled"
    assert [r.__dict__["code"] for r in logs.finished("leaver")] == ["CANCELLED"]
    assert harness.metrics.registry.get_sample_value("tokenwire_cancelled_requests_total") == 1
    assert harness.servicer.calls.in_flight == 0


def test_a_deadline_that_passes_mid_stream_is_deadline_exceeded(harness: Harness, logs: LogRecords) -> None:
    backend = harness.backend
    assert backend is not None
    backend.behaviour = lambda r: FakeSubmission([], forever=True)
    with pytest.raises(grpc.RpcError) as caught:
        list(harness.stub.Generate(pb.GenerateRequest(request_id="late", prompt="x"), timeout=0.3))
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
    assert backend.submissions[0].cancelled.wait(5)
    assert [r.__dict__["code"] for r in logs.finished("late")] == ["DEADLINE_EXCEEDED"]
    assert backend.requests[0].deadline is not None


def test_before_the_model_is_ready_calls_are_unavailable() -> None:
    h = Harness(None)
    try:
        with pytest.raises(grpc.RpcError) as caught:
            h.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        assert "loading" in caught.value.details()  # type: ignore[attr-defined]
    finally:
        h.close()


def test_log_prompts_puts_prompt_and_output_on_the_line(logs: LogRecords) -> None:
    h = Harness(FakeBackend(), log_prompts=True)
    try:
        list(h.stub.Generate(pb.GenerateRequest(request_id="logged", prompt="secret"), timeout=10))
        [record] = logs.finished("logged")
        assert record.__dict__["prompt"] == "secret" and record.__dict__["output"] == "hello"
    finally:
        h.close()


def test_resume_continues_the_index_names_the_seed_and_is_checked() -> None:
    """GenerateRequest.resume: the ids reach the engine, chunk indexes go on from next_index,
    the first chunk names the seed; more ids than the request may generate is INVALID_ARGUMENT."""
    request = pb.GenerateRequest(
        prompt="abc",
        stopping=pb.StoppingCriteria(max_new_tokens=5),
        resume=pb.Resume(generated_token_ids=[7, 8], next_index=2),
    )
    got = conversion.generation_request(request, "r", [1, 2, 3], description(), arrival=0, deadline=None)
    assert got.resume_ids == (7, 8) and got.max_new_tokens == 5
    greedy = pb.GenerateRequest(prompt="abc", sampling=pb.SamplingParams(temperature=0))
    assert (
        conversion.generation_request(greedy, "g", [1], description(), arrival=0, deadline=None).sampling.seed is None
    )
    too_many = pb.GenerateRequest(
        prompt="abc", resume=pb.Resume(generated_token_ids=[7] * 17)
    )  # default max_new_tokens 16
    with pytest.raises(InvalidResume):
        conversion.generation_request(too_many, "t", [1, 2, 3], description(), arrival=0, deadline=None)
    clamped = pb.GenerateRequest(
        prompt="abc", resume=pb.Resume(generated_token_ids=[7] * 5)
    )  # 60 + 5 > the context (64)
    with pytest.raises(InvalidResume):
        conversion.generation_request(clamped, "c", [1] * 60, description(), arrival=0, deadline=None)


def test_a_resumed_call_over_grpc(harness: Harness) -> None:
    request = pb.GenerateRequest(
        request_id="resumed",
        prompt="hey",
        sampling=pb.SamplingParams(temperature=0.5, seed=77),
        resume=pb.Resume(generated_token_ids=[4, 5, 6], next_index=3),
    )
    chunks = list(harness.stub.Generate(request, timeout=10))
    assert [c.index for c in chunks] == [3, 4] and chunks[0].seed == 77 and not chunks[1].HasField("seed")
    [sent] = harness.backend.requests  # type: ignore[union-attr]
    assert sent.resume_ids == (4, 5, 6)
    assert harness.metrics.registry.get_sample_value("tokenwire_resumed_requests_total") == 1
    for field, bad in (
        ("resume.generated_token_ids[1]", pb.Resume(generated_token_ids=[4, 5000])),
        ("resume.generated_token_ids", pb.Resume(generated_token_ids=list(range(9)))),
    ):
        with pytest.raises(grpc.RpcError) as caught:
            list(
                harness.stub.Generate(
                    pb.GenerateRequest(prompt="hey", stopping=pb.StoppingCriteria(max_new_tokens=8), resume=bad),
                    timeout=10,
                )
            )
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
        assert [f for f, _ in status_details(caught.value)[0]] == [field]


def test_hand_off_ends_the_streams_in_flight_unavailable_with_the_resume_trailer(
    harness: Harness, logs: LogRecords
) -> None:
    backend = harness.backend
    assert backend is not None
    backend.behaviour = lambda r: FakeSubmission([], forever=True)
    stream = harness.stub.Generate(pb.GenerateRequest(request_id="handed", prompt="x"), timeout=30)
    assert next(stream).text == "x"
    harness.loop.call_soon_threadsafe(harness.servicer.hand_off)
    with pytest.raises(grpc.RpcError) as caught:
        list(stream)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    assert trailer(caught.value, "tokenwire-resume") == "handoff"
    assert harness.metrics.registry.get_sample_value("tokenwire_handed_off_streams_total") == 1
    assert backend.submissions[0].cancelled.is_set()
    assert [r.__dict__["code"] for r in logs.finished("handed")] == ["UNAVAILABLE"]
    assert harness.servicer.calls.in_flight == 0


# -- response formats (constrained decoding) --------------------------------------------


def test_response_format_becomes_the_domain_format_of_its_field() -> None:
    for fmt, expected in (
        (pb.ResponseFormat(json_schema='{"type": "object"}'), ResponseFormat("json_schema", '{"type": "object"}')),
        (pb.ResponseFormat(json_object=True), ResponseFormat("json_object")),
        (pb.ResponseFormat(regex="[a-z]+"), ResponseFormat("regex", "[a-z]+")),
        (pb.ResponseFormat(choice=pb.Choice(options=["yes", "no"])), ResponseFormat("choice", options=("yes", "no"))),
        (pb.ResponseFormat(grammar='root ::= "a"'), ResponseFormat("grammar", 'root ::= "a"')),
    ):
        request = pb.GenerateRequest(prompt="x", response_format=fmt)
        made = conversion.generation_request(request, "r", [1, 2], description(), arrival=0, deadline=None)
        assert made.response_format == expected and expected.field == f"response_format.{expected.kind}"
    plain = conversion.generation_request(
        pb.GenerateRequest(prompt="x"), "r", [1], description(), arrival=0, deadline=None
    )
    assert plain.response_format is None


def test_a_constrained_call_compiles_its_format_once_and_counts_it(harness: Harness) -> None:
    backend = harness.backend
    assert backend is not None
    request = pb.GenerateRequest(prompt="hey", response_format=pb.ResponseFormat(regex="[a-z]+"))
    for _ in range(2):
        assert list(harness.stub.Generate(request, timeout=10))[-1].finish_reason == pb.FINISH_REASON_EOS
    assert [r.response_format for r in backend.requests] == [ResponseFormat("regex", "[a-z]+")] * 2
    sample = harness.metrics.registry.get_sample_value
    assert sample("tokenwire_constrained_requests_total", {"format": "regex"}) == 2
    # One compile observed (the second call found it cached).
    assert sample("tokenwire_grammar_compile_seconds_count", {"format": "regex"}) == 1


@pytest.mark.parametrize(
    ("fmt", "field", "words"),
    [
        (pb.ResponseFormat(), "response_format", "set one of json_schema"),
        (pb.ResponseFormat(json_schema=""), "response_format.json_schema", "must not be empty"),
        (pb.ResponseFormat(json_schema="{not json"), "response_format.json_schema", "is not valid JSON"),
        (
            pb.ResponseFormat(json_schema="[1, 2]"),
            "response_format.json_schema",
            "must be a JSON object (a JSON Schema document), got an array",
        ),
        (
            pb.ResponseFormat(json_schema='{"type": "unsupported"}'),
            "response_format.json_schema",
            "Unsupported keyword",
        ),
        (pb.ResponseFormat(json_object=False), "response_format.json_object", "must be true"),
        (pb.ResponseFormat(regex=""), "response_format.regex", "must not be empty"),
        (pb.ResponseFormat(regex="unsupported("), "response_format.regex", "Unsupported keyword"),
        (pb.ResponseFormat(choice=pb.Choice()), "response_format.choice.options", "at least one option"),
        (
            pb.ResponseFormat(choice=pb.Choice(options=["a", "b\x00"])),
            "response_format.choice.options[1]",
            "not valid text",
        ),
        (pb.ResponseFormat(grammar="x" * (64 * 1024 + 1)), "response_format.grammar", "at most 65536"),
        (pb.ResponseFormat(grammar="root ::= unsupported"), "response_format.grammar", "Unsupported keyword"),
    ],
)
def test_a_bad_response_format_is_invalid_argument_naming_its_field(
    harness: Harness, fmt: pb.ResponseFormat, field: str, words: str
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        list(harness.stub.Generate(pb.GenerateRequest(prompt="hey", response_format=fmt), timeout=10))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    [(named, description_)] = status_details(caught.value)[0]
    assert named == field and words in description_
    assert harness.backend is not None and harness.backend.requests == []  # refused before the engine


def test_an_engine_that_cannot_serve_a_valid_request_says_failed_precondition(harness: Harness) -> None:
    backend = harness.backend
    assert backend is not None

    def refuse(request: GenerationRequest) -> FakeSubmission:
        raise NotSupported("the vllm engine cannot resume a stream with a response_format")

    backend.behaviour = refuse
    request = pb.GenerateRequest(
        prompt="hey", response_format=pb.ResponseFormat(regex="[a-z]+"), resume=pb.Resume(generated_token_ids=[4])
    )
    with pytest.raises(grpc.RpcError) as caught:
        list(harness.stub.Generate(request, timeout=10))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
    assert "cannot resume" in (caught.value.details() or "")  # type: ignore[attr-defined]
