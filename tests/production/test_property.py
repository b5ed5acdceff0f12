"""Property: whatever GenerateRequest arrives (random fields, extreme values, odd Unicode,
NaN and infinite floats), the call ends in OK, INVALID_ARGUMENT or FAILED_PRECONDITION, never
UNKNOWN or INTERNAL, and the one server that took them all is still SERVING afterwards.

A concurrent variant sends generated requests 8 to 12 at a time, so extreme sampling values
share a batch, and checks each stream's shape, its stops, its text against its ids, and that
a seed gives the same tokens in the batch as alone. Tokenize is fuzzed too.

Under CI (CI=true) the search is derandomised (tests/conftest.py); run this file locally for
a fresh random search, or with HYPOTHESIS_PROFILE=ci to replay CI's examples."""

from __future__ import annotations

import collections
import concurrent.futures
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from production_support import LIVENESS, READINESS, SERVING, generation_stub, health_status
from servers import ServerProcess
from tokenwire.v1 import generation_pb2 as pb
from tokenwire.validation import Limits, validate_generate_request

# A backstop for a hung process only: each call has its own deadline, and the search's time
# budget comes from the server's own pace (PACE_SLACK), so a slow, shared machine is not a failure
# while a server that slows down as the calls go by is.
pytestmark = pytest.mark.timeout(1200)

EXAMPLES = 2000
PACE_SLACK = 10  # the search may take this many times the pace measured at its start
ACCEPTABLE = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}
U32 = 2**32 - 1
U64 = 2**64 - 1

# Text that stresses the tokenizer and the validators: emoji (with ZWJ and skin tones), CJK,
# combining marks, right-to-left, control characters, NUL, BOM, private use, replacement char.
ODD = [
    "\U0001f600", "\U0001f468\u200d\U0001f469\u200d\U0001f467", "\U0001f44d\U0001f3fd", "中文", "日本語", "한국어",
    "e\u0301", "\u05e9\u05dc\u05d5\u05dd", "\u202e", "\x00", "\x01", "\x1b[31m", "\x7f", "\ufeff", "\ue000",
    "\ufffd", "\r\n", "\t", " ", "<|im_start|>", "<|endoftext|>", "{{", "%s", "\\", "'", '"',
]  # fmt: skip
text = st.one_of(
    st.text(max_size=40),
    st.lists(st.sampled_from(ODD) | st.text(max_size=4), max_size=12).map("".join),
    st.sampled_from(["", "hello", "a" * 300]),
)
floats = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-45, 1e-38, 1e-6, 0.5, 1.0, 2.0, 3.4e38, float("nan"), float("inf"), -float("inf")]),
)
u32 = st.one_of(
    st.integers(0, 16), st.sampled_from([0, 1, 5, 6, 8, 9, 255, 1023, 1024, 49151, 49152, U32]), st.integers(0, U32)
)

sampling = st.builds(
    pb.SamplingParams,
    temperature=st.none() | floats,
    top_k=st.none() | u32,
    top_p=st.none() | floats,
    repetition_penalty=st.none() | floats,
    seed=st.none() | st.integers(0, U64),
)
stopping = st.builds(
    pb.StoppingCriteria,
    max_new_tokens=st.none() | u32,
    min_new_tokens=u32,
    stop_sequences=st.lists(text, max_size=6),
    include_stop_sequence=st.booleans(),
    ignore_eos=st.booleans(),
    time_limit_ms=st.none() | u32,
)
output = st.builds(
    pb.OutputOptions,
    token_ids=st.booleans(),
    logprobs=st.booleans(),
    top_logprobs=u32,
    prompt_logprobs=st.booleans(),
    prompt_top_logprobs=u32,
    logprobs_of=st.lists(u32, max_size=24),
)
message = st.builds(
    pb.ChatMessage, role=st.sampled_from(["system", "user", "assistant", "", "tool", "USER"]) | text, content=text
)
inputs = st.one_of(
    st.builds(dict),  # no input at all
    st.builds(lambda t: {"prompt": t}, text),
    st.builds(lambda m: {"chat": pb.Chat(messages=m)}, st.lists(message, max_size=10)),
    st.builds(lambda ids: {"token_ids": pb.TokenIds(ids=ids)}, st.lists(u32, max_size=20)),
)


# Requests that pass validation but sit at its edges, so the engine sees extremes too.
edge_floats = st.sampled_from([1e-45, 1e-38, 1e-30, 1e-6, 1e-3, 0.5, 1.0, 1.5, 100.0, 3.4e38])
valid_inputs = st.one_of(
    st.builds(lambda t: {"prompt": t}, text.filter(bool)),
    st.builds(
        lambda m: {"chat": pb.Chat(messages=m)},
        st.lists(
            st.builds(pb.ChatMessage, role=st.sampled_from(["system", "user", "assistant"]), content=text),
            min_size=1,
            max_size=4,
        ),
    ),
    st.builds(
        lambda ids: {"token_ids": pb.TokenIds(ids=ids)}, st.lists(st.integers(0, 49151), min_size=1, max_size=20)
    ),
)


@st.composite
def edge_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    scores = draw(st.booleans())
    max_new = draw(st.integers(0 if scores else 1, 8))  # 0: a scoring call
    return pb.GenerateRequest(
        **draw(valid_inputs),
        sampling=pb.SamplingParams(
            temperature=draw(st.sampled_from([0.0]) | edge_floats),
            top_k=draw(st.sampled_from([0, 1, 2, 50, 49151, 49152, U32])),
            top_p=draw(st.sampled_from([1e-45, 1e-3, 0.5, 0.999, 1.0])),
            repetition_penalty=draw(edge_floats),
            seed=draw(st.integers(0, U64)),
        ),
        stopping=pb.StoppingCriteria(
            max_new_tokens=max_new,
            min_new_tokens=draw(st.integers(0, max_new)),
            stop_sequences=draw(st.lists(text.filter(lambda t: 0 < len(t) <= 256), max_size=3)),
            include_stop_sequence=draw(st.booleans()),
            ignore_eos=draw(st.booleans()),
            time_limit_ms=draw(st.sampled_from([0, 1, 5, 1000, U32])),
        ),
        output=pb.OutputOptions(
            token_ids=draw(st.booleans()),
            logprobs=draw(st.booleans()),
            top_logprobs=draw(st.integers(0, 20)),
            prompt_logprobs=scores,
            prompt_top_logprobs=draw(st.integers(0, 20)) if scores else 0,
            logprobs_of=draw(st.lists(st.sampled_from([0, 1, 2, 49151]), max_size=20)),
        ),
        n=draw(st.integers(0, 3)),
    )


@st.composite
def any_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=draw(st.sampled_from(["", "r-1", "x" * 129]) | text), **draw(inputs))
    if draw(st.booleans()):
        request.sampling.CopyFrom(draw(sampling))
    if draw(st.booleans()):
        request.stopping.CopyFrom(draw(stopping))
    if draw(st.booleans()):
        request.output.CopyFrom(draw(output))
    if draw(st.booleans()):
        request.n = draw(st.integers(0, 12) | u32)
    return request


generate_requests = st.one_of(any_requests(), edge_requests())


@pytest.fixture(scope="module")
def property_server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    # Small generations keep 2,000 calls inside a couple of minutes; admission limits stay at
    # their defaults, so RESOURCE_EXHAUSTED would be a finding too.
    args = ["--model", str(tiny_model_dir), "--default-max-new-tokens", "4", "--max-new-tokens-limit", "8"]
    with ServerProcess(args) as server:
        yield server


def seconds_per_call(stub: object, calls: int = 40) -> float:
    """The median time of a small valid call on this server, on this machine, now."""
    request = pb.GenerateRequest(prompt="hello", stopping=pb.StoppingCriteria(max_new_tokens=4, ignore_eos=True))
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        list(stub.Generate(request, timeout=10))  # type: ignore[attr-defined]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def test_any_generate_request_ends_in_a_deliberate_status(property_server: ServerProcess) -> None:
    stub = generation_stub(property_server.target)
    seen: collections.Counter[str] = collections.Counter()
    pace = seconds_per_call(stub)
    budget = max(60.0, PACE_SLACK * EXAMPLES * pace)
    deadline = time.monotonic() + budget
    late = 0

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(request=generate_requests)
    def call(request: pb.GenerateRequest) -> None:
        nonlocal late
        if time.monotonic() > deadline:
            late += 1  # counted, not raised: a raise here would send Hypothesis shrinking
            return
        try:
            chunks = list(stub.Generate(request, timeout=10))
            code = grpc.StatusCode.OK
            assert chunks and chunks[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
        except grpc.RpcError as error:
            code = error.code()
            assert code in ACCEPTABLE, f"{code}: {error.details()} for {request!r}"
        seen[code.name] += 1

    call()
    print("statuses:", dict(seen), f"pace {pace * 1000:.1f} ms/call, budget {budget:.0f} s")
    assert not late, (
        f"{late} calls were left when {budget:.0f} s ran out: {PACE_SLACK}× the {pace * 1000:.1f} ms a call "
        "took at the start; the server slows down as the calls go by"
    )
    assert sum(seen.values()) >= EXAMPLES
    assert seen["OK"] > EXAMPLES // 4 and seen["INVALID_ARGUMENT"] > EXAMPLES // 4
    assert health_status(property_server.target, READINESS) == SERVING
    assert health_status(property_server.target, LIVENESS) == SERVING
    assert property_server.proc.poll() is None


@st.composite
def concurrent_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    """Valid requests at the edges, with ids asked for and no time limit (so a rerun alone must
    give the same tokens)."""
    request = draw(edge_requests().filter(lambda r: not validate_generate_request(r, Limits())))
    request.stopping.time_limit_ms = 0
    request.output.token_ids = True
    return request


def check_stream(request: pb.GenerateRequest, chunks: list[pb.TokenChunk], decode: object) -> list[list[int]]:
    """Every per-call property of a finished call, each sample's stream on its own (GenerateRequest.n);
    returns each sample's token ids."""
    samples = max(1, request.n)
    assert sorted({c.sample for c in chunks}) == list(range(samples))
    return [check_sample(request, [c for c in chunks if c.sample == i], decode) for i in range(samples)]


def check_sample(request: pb.GenerateRequest, chunks: list[pb.TokenChunk], decode: object) -> list[int]:
    """Every property of one sample's stream; returns its token ids."""
    assert [c.index for c in chunks] == list(range(len(chunks)))
    reasons = [c.finish_reason for c in chunks]
    assert reasons[-1] != pb.FINISH_REASON_UNSPECIFIED and reasons[:-1] == [pb.FINISH_REASON_UNSPECIFIED] * (
        len(chunks) - 1
    )
    assert [c.HasField("usage") for c in chunks] == [False] * (len(chunks) - 1) + [True]
    last = chunks[-1]
    ids = [t.id for c in chunks for t in c.tokens]
    assert len(ids) == last.usage.completion_tokens <= request.stopping.max_new_tokens
    text = "".join(c.text for c in chunks)
    stops = [s for s in request.stopping.stop_sequences if s]
    if last.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE and request.stopping.include_stop_sequence:
        assert any(text.endswith(s) for s in stops)
        assert not any(s in text[:-1] for s in stops)  # the first complete stop ends the stream
    else:
        assert not any(s in text for s in stops)
    if last.finish_reason != pb.FINISH_REASON_STOP_SEQUENCE:
        assert text == decode(ids)  # type: ignore[operator]
    return ids


def test_concurrent_generated_requests_keep_every_stream_property(
    property_server: ServerProcess, tiny_model_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))

    stub = generation_stub(property_server.target)
    pool = concurrent.futures.ThreadPoolExecutor(12)
    batches = 0

    @settings(
        max_examples=30,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(batch=st.lists(concurrent_requests(), min_size=8, max_size=12))
    def call(batch: list[pb.GenerateRequest]) -> None:
        nonlocal batches
        batches += 1
        # A raw prompt of only characters the tokenizer drops (e.g. "\x1d") is valid on the
        # wire but has nothing to continue: INVALID_ARGUMENT on `prompt`, alone or in a batch.
        empty = [r.WhichOneof("input") == "prompt" and not tokenizer(r.prompt)["input_ids"] for r in batch]

        def run(request: pb.GenerateRequest, encodes_to_nothing: bool) -> list[list[int]] | None:
            try:
                chunks = list(stub.Generate(request, timeout=60))
            except grpc.RpcError as error:
                if encodes_to_nothing and error.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    assert error.details().startswith("prompt: encodes to no tokens")
                    return None
                raise
            assert not encodes_to_nothing, f"a prompt of no tokens was served: {request!r}"
            return check_stream(request, chunks, decode)

        together_ids = list(pool.map(run, batch, empty))
        for request, nothing, ids in zip(batch, empty, together_ids, strict=True):
            alone = run(request, nothing)
            assert alone == ids, f"seeded/greedy tokens differ alone and in a batch for {request!r}"

    try:
        call()
    finally:
        pool.shutdown()
    assert batches >= 30
    assert health_status(property_server.target, LIVENESS) == SERVING


tokenize_requests = st.builds(
    pb.TokenizeRequest,
    text=text,
    return_tokens=st.booleans(),
    return_offsets=st.booleans(),
) | st.builds(
    lambda messages, tokens, offsets: pb.TokenizeRequest(
        chat=pb.Chat(messages=messages), return_tokens=tokens, return_offsets=offsets
    ),
    st.lists(message, max_size=6),
    st.booleans(),
    st.booleans(),
)


def test_any_tokenize_request_ends_in_a_deliberate_status(property_server: ServerProcess) -> None:
    stub = generation_stub(property_server.target)
    seen: collections.Counter[str] = collections.Counter()

    @settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(request=tokenize_requests)
    def call(request: pb.TokenizeRequest) -> None:
        try:
            response = stub.Tokenize(request, timeout=10)
        except grpc.RpcError as error:
            assert error.code() in ACCEPTABLE, f"{error.code()}: {error.details()} for {request!r}"
            seen[error.code().name] += 1
            return
        seen["OK"] += 1
        assert response.count == len(response.ids)
        assert len(response.tokens) == (response.count if request.return_tokens else 0)
        if request.return_offsets:
            assert len(response.offsets) == response.count
            assert all(0 <= o.start <= o.end <= len(response.text) for o in response.offsets)
        if request.WhichOneof("input") == "text":
            assert response.text == request.text

    call()
    assert seen["OK"] > 50 and seen["INVALID_ARGUMENT"] > 10
    assert health_status(property_server.target, READINESS) == SERVING
