"""The client library against the REAL server (tiny random Llama, real SmolLM2 tokenizer).

The fake-server tests pin the client's behaviour; these check that it holds against
``tokenwire_server``: every call sync and async, the client's own validation gives
the server's words, leaving a loop cancels on the server, a full server's refusal
(Overloaded, retried) and a deadline.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import grpc
import pytest
import tokenwire
from google.rpc import error_details_pb2  # type: ignore[import-untyped]
from grpc_status import rpc_status
from servers import ENGINE_ARGS, READINESS, TEST_ENGINE, ServerProcess, seconds_per_token
from tokenwire import FinishReason, HealthStatus, RetryPolicy
from tokenwire.v1 import generation_pb2 as pb
from tokenwire.v1 import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(120)

LIMIT = 512  # tiny_server's --max-new-tokens-limit
LONG = {"max_new_tokens": 500, "ignore_eos": True}  # 0.5 to several seconds of decoding on the tiny model
# The --max-new-tokens-limit of the servers on the long-context tiny model (tiny_long_model_dir):
# a stream of seconds on any machine, ~10x one of LONG.
LONGEST = 8000


def rid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


def finished(
    server: ServerProcess, request_id: str, timeout: float = 10.0, count: int = 1, until: str | None = None
) -> list[dict]:
    """The server's "request finished" records of ``request_id``, waiting until ``count`` are
    there (and, with ``until``, one with that code: a retried call's refusals come first)."""
    deadline = time.monotonic() + timeout
    while True:
        records = [r for r in server.find("request finished") if r.get("request_id") == request_id]
        done = len(records) >= count and (until is None or any(r.get("code") == until for r in records))
        if done or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def records_before_sentinel(server: ServerProcess, client: tokenwire.Client) -> list[dict]:
    """The server's log records up to a fresh call's own "request finished" line.

    For "no line carries these ids" or "these are all the lines": rather than wait a while
    and hope a late line would be there by then. The server writes every call's line from
    its one event loop, in order, as the call ends (before its status goes out); this
    call is sent after the calls before it (on the same channel: after their cancels), so
    any line of theirs is written, and read back, before this one."""
    request_id = rid("sentinel")
    result = client.generate_text("hi", max_new_tokens=1, ignore_eos=True, request_id=request_id)
    assert result.finish_reason is FinishReason.LENGTH
    [record] = finished(server, request_id)
    records = list(server.records)
    return records[: next(i for i, r in enumerate(records) if r is record)]


@pytest.fixture(scope="module")
def info(tiny_server: ServerProcess) -> tokenwire.ModelInfo:
    with tokenwire.Client(tiny_server.target, timeout=10) as client:
        return client.model_info()


@pytest.fixture
def client(tiny_server: ServerProcess) -> Iterator[tokenwire.Client]:
    with tokenwire.Client(tiny_server.target, timeout=30) as c:
        yield c


# -- every call, sync and async --------------------------------------------------------------


def test_model_info_and_health(client, tiny_server):
    info = client.model_info()
    assert info.name == Path(tiny_server.args[1]).name
    assert info.engine == TEST_ENGINE and (info.device == "cpu" or info.device.startswith("cuda"))
    assert info.max_new_tokens_limit == LIMIT
    assert info.vocab_size == 49152 and info.context_length == 1024
    assert info.has_chat_template and info.eos_token_ids
    assert client.health() is HealthStatus.SERVING
    assert client.health(READINESS) is HealthStatus.SERVING
    assert client.health("no.such.Service") is HealthStatus.SERVICE_UNKNOWN

    async def main():
        async with tokenwire.AsyncClient(tiny_server.target, timeout=30) as aclient:
            return (
                await aclient.model_info(),
                await aclient.health(),
                await aclient.health(READINESS),
                await aclient.health("no.such.Service"),
            )

    ainfo, *health = run(main())
    assert ainfo == info
    assert health == [HealthStatus.SERVING, HealthStatus.SERVING, HealthStatus.SERVICE_UNKNOWN]


def test_health_of_an_unreachable_server_is_unavailable():
    with tokenwire.Client("127.0.0.1:1") as client, pytest.raises(tokenwire.Unavailable):
        client.health(timeout=2)


def test_generate_streams_what_generate_text_returns(client, tiny_server):
    request_id = rid("stream")
    chunks = list(
        client.generate(
            "Once upon a time", max_new_tokens=8, ignore_eos=True, token_ids=True, logprobs=True, request_id=request_id
        )
    )
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert {c.request_id for c in chunks} == {request_id}
    assert all(c.finish_reason is None and c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.finish_reason is FinishReason.LENGTH
    assert last.usage is not None and last.usage.completion_tokens == 8 and last.usage.prompt_tokens > 0
    tokens = [t for c in chunks for t in c.tokens]
    assert len(tokens) == 8 and all(t.logprob is not None and t.logprob <= 0 for t in tokens)
    text = "".join(c.text for c in chunks)
    assert text

    # Greedy on the same prompt: the whole answer at once is the joined stream.
    whole = client.generate_text("Once upon a time", max_new_tokens=8, ignore_eos=True)
    assert whole.text == text and whole.finish_reason is FinishReason.LENGTH
    assert whole.usage is not None and whole.usage.completion_tokens == 8

    # The same answer from token ids, and the server logged the call under our id.
    ids = client.tokenize("Once upon a time").ids
    assert client.generate_text(input_ids=ids, max_new_tokens=8, ignore_eos=True).text == text
    [record] = finished(tiny_server, request_id)
    assert record["code"] == "OK" and record["completion_tokens"] == 8

    async def main():
        async with tokenwire.AsyncClient(tiny_server.target, timeout=30) as aclient:
            achunks = [c async for c in aclient.generate("Once upon a time", max_new_tokens=8, ignore_eos=True)]
            awhole = await aclient.generate_text("Once upon a time", max_new_tokens=8, ignore_eos=True)
            return achunks, awhole

    achunks, awhole = run(main())
    assert "".join(c.text for c in achunks) == text == awhole.text
    assert achunks[-1].finish_reason is FinishReason.LENGTH


def test_score_is_the_continuations_share_of_the_prompt_logprobs_sync_and_async(client, tiny_server):
    """client.score splits as lm-eval does (the prompt's trailing space moves to the continuation;
    the continuation's tokens are the whole text's past the context's count) and sums what a
    scoring call reports for them; the async client gives the same."""
    prompt, continuations = "The capital of France is ", ["Paris", "a banana, of course"]
    scores = client.score(prompt, continuations)
    context = client.tokenize("The capital of France is").ids
    for score, continuation in zip(scores, continuations, strict=True):
        whole = client.tokenize(prompt + continuation).ids
        assert score.continuation == continuation and score.token_ids == whole[len(context) :]
        direct = client.generate_text(input_ids=whole, max_new_tokens=0, prompt_logprobs=True, prompt_top_logprobs=1)
        tail = direct.prompt_tokens[len(context) :]
        assert direct.usage.completion_tokens == 0 and direct.text == ""
        assert score.logprobs == tuple(t.logprob for t in tail) and score.logprob == pytest.approx(sum(score.logprobs))
        assert score.is_greedy == all(t.top_logprobs[0].id == t.id for t in tail)
        assert score.logprob < 0 and len(score.logprobs) == len(score.token_ids)

    async def scored_async() -> list[tokenwire.Score]:
        async with tokenwire.AsyncClient(tiny_server.target, timeout=30) as aclient:
            return await aclient.score(prompt, continuations)

    assert asyncio.run(scored_async()) == scores
    with pytest.raises(ValueError, match="continuation"):
        client.score(prompt, [""])


def test_n_samples_come_apart_in_the_completion(client):
    """generate_text(n=3): sample 0's Completion, with every sample's own in ``samples`` (its text,
    finish and usage), each the single call with seed + i; the stream's chunks name their sample."""
    ask = {"max_new_tokens": 6, "ignore_eos": True, "temperature": 1.0, "seed": 50, "token_ids": True}
    done = client.generate_text("Once upon a time", n=3, **ask)
    assert [s.sample for s in done.samples] == [0, 1, 2] and done.text == done.samples[0].text
    for i, sample in enumerate(done.samples):
        alone = client.generate_text("Once upon a time", **{**ask, "seed": 50 + i})
        assert [t.id for t in sample.tokens] == [t.id for t in alone.tokens] and sample.text == alone.text
        assert sample.usage is not None and sample.usage.completion_tokens == 6
    chunks = list(client.generate("Once upon a time", n=2, **ask))
    assert sorted({c.sample for c in chunks}) == [0, 1]
    with pytest.raises(tokenwire.InvalidArgument) as caught:
        client.generate_text("x", n=9)
    assert caught.value.field_violations[0].field == "n"


def test_chat_and_tokenize(client, tiny_server):
    messages = [("system", "You are terse."), ("user", "Say hi")]
    reply = client.chat(messages, max_new_tokens=6, ignore_eos=True)
    assert reply.finish_reason is FinishReason.LENGTH and reply.usage is not None
    assert reply.usage.completion_tokens == 6
    rendered = client.tokenize(messages=messages, return_tokens=True)
    assert "<|im_start|>user" in rendered.text and "Say hi" in rendered.text
    assert rendered.count == len(rendered.ids) == len(rendered.tokens)
    # The chat's prompt is the rendered template (the server may add the generation prompt).
    assert reply.usage.prompt_tokens >= rendered.count

    plain = client.tokenize("Hello world", return_tokens=True, return_offsets=True)
    assert plain.count == len(plain.ids) == len(plain.tokens) == len(plain.offsets) >= 2
    assert plain.text == "Hello world"
    assert [plain.text[o.start : o.end] for o in plain.offsets][0] == "Hello"

    async def main():
        async with tokenwire.AsyncClient(tiny_server.target, timeout=30) as aclient:
            areply = await aclient.chat(messages, max_new_tokens=6, ignore_eos=True)
            astream = [c async for c in aclient.generate(messages=messages, max_new_tokens=6, ignore_eos=True)]
            atok = await aclient.tokenize("Hello world", return_tokens=True, return_offsets=True)
            achat_tok = await aclient.tokenize(messages=messages)
            return areply, astream, atok, achat_tok

    areply, astream, atok, achat_tok = run(main())
    assert areply.text == reply.text == "".join(c.text for c in astream)
    assert atok == plain
    assert achat_tok.ids == rendered.ids


# -- the client's validation says what the server says ----------------------------------------


def _stop_seqs(n: int) -> list[str]:
    return [f"s{i}" for i in range(n)]


# (name, client call kwargs, the same fields as a raw GenerateRequest)
MISTAKES: list[tuple[str, dict[str, Any], Callable[[], pb.GenerateRequest]]] = [
    ("empty prompt", {"prompt": ""}, lambda: pb.GenerateRequest(prompt="")),
    ("no input", {}, lambda: pb.GenerateRequest()),
    ("NUL in prompt", {"prompt": "a\x00b"}, lambda: pb.GenerateRequest(prompt="a\x00b")),
    ("no messages", {"messages": []}, lambda: _with_empty_chat()),
    (
        "unknown role",
        {"messages": [("robot", "hi"), ("user", "ok")]},
        lambda: pb.GenerateRequest(
            chat=pb.Chat(
                messages=[pb.ChatMessage(role="robot", content="hi"), pb.ChatMessage(role="user", content="ok")]
            )
        ),
    ),
    ("empty token ids", {"input_ids": []}, lambda: _with_empty_ids()),
    ("id outside vocab", {"input_ids": [5, 49152]}, lambda: pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 49152]))),
    (
        "bad sampling",
        {"prompt": "x", "temperature": -1.0, "top_p": 1.5, "repetition_penalty": 0.0},
        lambda: pb.GenerateRequest(
            prompt="x", sampling=pb.SamplingParams(temperature=-1.0, top_p=1.5, repetition_penalty=0.0)
        ),
    ),
    (
        "max_new_tokens 0",
        {"prompt": "x", "max_new_tokens": 0},
        lambda: pb.GenerateRequest(prompt="x", stopping=pb.StoppingCriteria(max_new_tokens=0)),
    ),
    (
        "above the cap",
        {"prompt": "x", "max_new_tokens": LIMIT + 1},
        lambda: pb.GenerateRequest(prompt="x", stopping=pb.StoppingCriteria(max_new_tokens=LIMIT + 1)),
    ),
    (
        "min over max",
        {"prompt": "x", "max_new_tokens": 2, "min_new_tokens": 5},
        lambda: pb.GenerateRequest(prompt="x", stopping=pb.StoppingCriteria(max_new_tokens=2, min_new_tokens=5)),
    ),
    (
        "too many stops",
        {"prompt": "x", "stop": _stop_seqs(17)},
        lambda: pb.GenerateRequest(prompt="x", stopping=pb.StoppingCriteria(stop_sequences=_stop_seqs(17))),
    ),
    (
        "bad stops",
        {"prompt": "x", "stop": ["ok", "", "y" * 257]},
        lambda: pb.GenerateRequest(prompt="x", stopping=pb.StoppingCriteria(stop_sequences=["ok", "", "y" * 257])),
    ),
    (
        "top_logprobs",
        {"prompt": "x", "top_logprobs": 21},
        lambda: pb.GenerateRequest(prompt="x", output=pb.OutputOptions(top_logprobs=21)),
    ),
    (
        "scoring asks",
        {"prompt": "x", "prompt_top_logprobs": 21, "logprobs_of": [1, 49152]},
        lambda: pb.GenerateRequest(prompt="x", output=pb.OutputOptions(prompt_top_logprobs=21, logprobs_of=[1, 49152])),
    ),
    (
        "max_new_tokens 0 without prompt_logprobs",
        {"prompt": "x", "max_new_tokens": 0},
        lambda: pb.GenerateRequest(prompt="x", stopping=pb.StoppingCriteria(max_new_tokens=0)),
    ),
    (
        "long request id",
        {"prompt": "x", "request_id": "r" * 129},
        lambda: pb.GenerateRequest(prompt="x", request_id="r" * 129),
    ),
]


def _with_empty_chat() -> pb.GenerateRequest:
    request = pb.GenerateRequest()
    request.chat.SetInParent()
    return request


def _with_empty_ids() -> pb.GenerateRequest:
    request = pb.GenerateRequest()
    request.token_ids.SetInParent()
    return request


def _server_says(
    stub: pb_grpc.TextGenerationStub, request: pb.GenerateRequest
) -> tuple[str, list[tuple[str, str]], str]:
    """The INVALID_ARGUMENT message and field violations the server gives a raw request, and
    the request id it echoed (x-request-id)."""
    call = stub.Generate(request, timeout=10)
    with pytest.raises(grpc.RpcError) as caught:
        next(call)
    assert call.code() == grpc.StatusCode.INVALID_ARGUMENT, call.details()
    status = rpc_status.from_call(call)
    violations: list[tuple[str, str]] = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations.extend((v.field, v.description) for v in bad.field_violations)
    assert caught.value is call
    echoed = dict(call.trailing_metadata() or ()).get("x-request-id", "")
    return call.details(), violations, echoed


@pytest.mark.parametrize(("kwargs", "raw"), [(m[1], m[2]) for m in MISTAKES], ids=[m[0] for m in MISTAKES])
def test_client_validation_matches_the_server(tiny_server, info, kwargs, raw):
    limits = info.limits  # what this server publishes
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt", None)
    request = raw()
    request.request_id = request.request_id or rid("raw")
    # A fixed id (the long-id case) may already be in the shared server's log from another test.
    before = len(finished(tiny_server, request.request_id, timeout=0))
    with tiny_server.channel() as channel:
        details, violations, echoed = _server_says(pb_grpc.TextGenerationStub(channel), request)
    assert violations, details
    if len(request.request_id) > info.max_request_id_chars:
        # An invalid id is never echoed: the trailer and the log line carry an id of the server's.
        assert echoed != request.request_id and len(echoed) == 32
        assert finished(tiny_server, request.request_id, timeout=0) == []
        records = finished(tiny_server, echoed)
    else:
        assert echoed == request.request_id
        records = finished(tiny_server, request.request_id, count=before + 1)[before:]
    assert [r["code"] for r in records] == ["INVALID_ARGUMENT"]

    logged = len(tiny_server.records)
    with tokenwire.Client(tiny_server.target, timeout=10, limits=limits) as client:
        # Raised by generate() itself: nothing is sent.
        with pytest.raises(tokenwire.InvalidArgument) as caught:
            client.generate(prompt, **kwargs)
    error = caught.value
    assert error.details == details
    assert [(v.field, v.description) for v in error.field_violations] == violations
    assert error.request_id

    async def main():
        async with tokenwire.AsyncClient(tiny_server.target, timeout=10, limits=limits) as aclient:
            with pytest.raises(tokenwire.InvalidArgument) as acaught:
                aclient.generate(prompt, **kwargs)
            return acaught.value

    aerror = run(main())
    assert aerror.details == details and aerror.field_violations == error.field_violations
    # The server never heard of either: no record since then, up to a later call's own line,
    # carries their ids. (Not a count of all records: the session's server may still be
    # logging calls that earlier tests cancelled.)
    with tokenwire.Client(tiny_server.target, timeout=10) as sentinel_client:
        since = {r.get("request_id") for r in records_before_sentinel(tiny_server, sentinel_client)[logged:]}
    assert error.request_id not in since and aerror.request_id not in since


def test_a_mistake_the_client_lets_through_reads_the_same_from_the_server(tiny_server, info):
    """Without limits the client cannot check the cap or the vocabulary; the server's answer
    comes back as the same InvalidArgument the client would have raised."""
    limits = info.limits  # what this server publishes
    cases = [
        {"prompt": "x", "max_new_tokens": LIMIT + 1},
        {"input_ids": [1, info.vocab_size + 7]},
    ]
    with (
        tokenwire.Client(tiny_server.target, timeout=10, limits=limits) as checking,
        tokenwire.Client(tiny_server.target, timeout=10) as trusting,
    ):
        for kwargs in cases:
            with pytest.raises(tokenwire.InvalidArgument) as local:
                checking.generate_text(**kwargs)
            request_id = rid("remote")
            with pytest.raises(tokenwire.InvalidArgument) as remote:
                trusting.generate_text(**kwargs, request_id=request_id)
            assert remote.value.details == local.value.details
            assert remote.value.field_violations == local.value.field_violations
            assert remote.value.request_id == request_id
            [record] = finished(tiny_server, request_id)
            assert record["code"] == "INVALID_ARGUMENT"

        # Only the server knows the prompt's length: too long for the context.
        with pytest.raises(tokenwire.InvalidArgument) as too_long:
            trusting.generate_text(input_ids=[5] * 1000, max_new_tokens=100)
        [violation] = too_long.value.field_violations
        assert violation.field == "token_ids" and "above the 1024 tokens one request may hold" in violation.description

    # Tokenize: the same words on both sides too.
    with tiny_server.channel() as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        bad = pb.TokenizeRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="robot", content="x")]))
        with pytest.raises(grpc.RpcError) as raw:
            stub.Tokenize(bad, timeout=10)
    with tokenwire.Client(tiny_server.target, timeout=10) as client:
        with pytest.raises(tokenwire.InvalidArgument) as mine:
            client.tokenize(messages=[("robot", "x")])
    assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert mine.value.details == raw.value.details()


# -- leaving a loop early cancels on the server ------------------------------------------------


def test_break_cancels_the_call_on_the_server(client, tiny_server):
    request_id = rid("break")
    for chunk in client.generate("go", request_id=request_id, **LONG):
        assert chunk.request_id == request_id
        break
    [record] = finished(tiny_server, request_id)
    assert record["code"] == "CANCELLED", record  # not OK: it did not run to 500 tokens

    # A with-block left early, and a stream cancelled by hand, are cancelled too.
    with_id, manual_id = rid("with"), rid("manual")
    with client.generate("go", request_id=with_id, **LONG) as stream:
        next(stream)
    manual = client.generate("go", request_id=manual_id, **LONG)
    next(manual)
    manual.cancel()
    assert list(manual) == []
    assert [r["code"] for r in finished(tiny_server, with_id)] == ["CANCELLED"]
    assert [r["code"] for r in finished(tiny_server, manual_id)] == ["CANCELLED"]


def test_async_break_cancels_the_call_on_the_server(tiny_server):
    request_id = rid("abreak")

    async def main():
        async with tokenwire.AsyncClient(tiny_server.target, timeout=30) as aclient:
            async for _ in aclient.generate("go", request_id=request_id, **LONG):
                break
            # The channel stays open while the server notices.
            for _ in range(100):
                if finished(tiny_server, request_id, timeout=0):
                    break
                await asyncio.sleep(0.05)

    run(main())
    [record] = finished(tiny_server, request_id)
    assert record["code"] == "CANCELLED", record


# -- a full server: Overloaded, then a retry that gets in --------------------------------------


@pytest.fixture(scope="module")
def one_slot_server(tiny_long_model_dir: Path) -> Iterator[ServerProcess]:
    """One slot, no queue; the long-context tiny model, so that a hog of LONGEST tokens holds
    the slot for seconds (a 500-token one ended within half a second at times, and a refusal
    the test counted on was then served)."""
    args = [
        "--model",
        str(tiny_long_model_dir),
        "--max-active",
        "1",
        "--max-queue",
        "0",
        "--max-new-tokens-limit",
        str(LONGEST),
        "--kv-cache-tokens",
        "8192",
    ]
    with ServerProcess(args) as server:
        yield server


def test_overloaded_then_retried_into_a_free_slot(one_slot_server):
    server = one_slot_server
    with tokenwire.Client(server.target, timeout=30, retry=tokenwire.NO_RETRY) as client:
        long_id = rid("hog")
        hog = client.generate("go", request_id=long_id, max_new_tokens=LONGEST, ignore_eos=True)
        next(hog)  # admitted: the only slot is taken

        refused_id = rid("refused")
        with pytest.raises(tokenwire.Overloaded) as caught:
            client.generate_text("hi", max_new_tokens=2, request_id=refused_id)
        error = caught.value
        assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.retry_after is not None and error.retry_after > 0
        assert error.request_id == refused_id
        assert [r["code"] for r in finished(server, refused_id)] == ["RESOURCE_EXHAUSTED"]

        async def refused_async():
            async with tokenwire.AsyncClient(server.target, timeout=30, retry=tokenwire.NO_RETRY) as aclient:
                with pytest.raises(tokenwire.Overloaded) as acaught:
                    await aclient.generate_text("hi", max_new_tokens=2)
                return acaught.value

        assert run(refused_async()).retry_after == error.retry_after

        # With retries, the same call waits out the refusal and gets the slot once the hog leaves.
        retrying = tokenwire.Client(server.target, timeout=30, retry=RetryPolicy(max_attempts=10))
        timer = threading.Timer(0.3, hog.cancel)
        timer.start()
        try:
            retried_id = rid("retried")
            result = retrying.generate_text("hi", max_new_tokens=2, ignore_eos=True, request_id=retried_id)
        finally:
            timer.cancel()
            retrying.close()
        assert result.finish_reason is FinishReason.LENGTH and result.request_id == retried_id
        codes = [r["code"] for r in finished(server, retried_id, until="OK")]
        assert codes[-1] == "OK" and "RESOURCE_EXHAUSTED" in codes[:-1], codes
        assert [r["code"] for r in finished(server, long_id)] == ["CANCELLED"]


# -- deadlines ---------------------------------------------------------------------------------


# Margins of the deadline tests, on this machine's own pace (measured first): the deadline
# is DEADLINE_MARGIN times the time to a first chunk, and the stream asked for would take
# at least STREAM_MARGIN times the deadline. A machine twice as fast or twice as slow
# changes all three times alike, so the verdict with them.
DEADLINE_MARGIN = 20
STREAM_MARGIN = 10


@pytest.fixture(scope="module")
def long_server(tiny_long_model_dir: Path) -> Iterator[ServerProcess]:
    """The tiny model with an 8192-token context: a stream long enough to outlast any
    deadline these tests set, on any machine."""
    args = ["--model", str(tiny_long_model_dir), *ENGINE_ARGS, "--max-new-tokens-limit", str(LONGEST)]
    with ServerProcess(args) as server:
        yield server


def pace(client: tokenwire.Client) -> tuple[float, float]:
    """(seconds to a whole one-token answer, the median of five; seconds per decoded token,
    from a 200-token stream) on this machine, now."""
    firsts = []
    for _ in range(5):
        started = time.monotonic()
        client.generate_text("go", max_new_tokens=1)
        firsts.append(time.monotonic() - started)
    return statistics.median(firsts), seconds_per_token(client)


def test_a_tiny_timeout_on_a_long_generation_is_deadline_exceeded(long_server):
    server = long_server
    with tokenwire.Client(server.target, timeout=60) as client:
        # The deadline leaves DEADLINE_MARGIN first chunks' time, so the call surely reaches the
        # server (and a stream its first chunk) before it; the stream asked for cannot end
        # before it by a factor STREAM_MARGIN. (Measured again, up to three times, when a busy
        # moment made one first chunk slow: the margins hold for the pace measured.)
        for _ in range(3):
            first_s, per_token_s = pace(client)
            deadline_s = DEADLINE_MARGIN * first_s
            whole_s = LONGEST * per_token_s
            if whole_s >= STREAM_MARGIN * deadline_s:
                break
        assert whole_s >= STREAM_MARGIN * deadline_s, (
            f"{LONGEST} tokens at {per_token_s * 1000:.2f} ms take {whole_s:.2f} s: not {STREAM_MARGIN}x "
            f"the {deadline_s:.2f} s deadline ({DEADLINE_MARGIN}x a first chunk's {first_s * 1000:.1f} ms)"
        )
        longest = {"max_new_tokens": LONGEST, "ignore_eos": True}

        request_id = rid("deadline")
        started = time.monotonic()
        with pytest.raises(tokenwire.DeadlineExceeded) as caught:
            client.generate_text("go", timeout=deadline_s, request_id=request_id, **longest)
        # Ended by the deadline, not by the stream's end: long before half of it could be decoded.
        assert time.monotonic() - started < whole_s / 2
        assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert caught.value.request_id == request_id
        [record] = finished(server, request_id)
        assert record["code"] == "DEADLINE_EXCEEDED", record

        # Mid-stream: chunks arrive, then the deadline ends the stream.
        stream = client.generate("go", timeout=deadline_s, **longest)
        seen = 0
        with pytest.raises(tokenwire.DeadlineExceeded):
            for _ in stream:
                seen += 1
        assert 0 < seen < LONGEST

    async def main():
        async with tokenwire.AsyncClient(server.target, timeout=deadline_s) as aclient:
            with pytest.raises(tokenwire.DeadlineExceeded):
                await aclient.generate_text("go", **longest)

    run(main())


# -- a complete answer ends OK on the server too -----------------------------------------------


def test_complete_answers_end_ok_on_the_server(client, tiny_server):
    """The client reads each stream to its status after the last chunk. Dropping the call
    before that status arrived made grpc cancel it, so about 1 in 20 complete answers was
    logged (and counted in the metrics) as CANCELLED on the server."""
    request_ids = [rid("whole") for _ in range(100)]
    for request_id in request_ids:
        client.generate_text("hi", request_id=request_id, max_new_tokens=2, ignore_eos=True)
    last = list(client.generate("hi", max_new_tokens=2, ignore_eos=True, request_id=request_ids[0] + "-s"))[-1]
    assert last.finish_reason is FinishReason.LENGTH
    # Every line these calls get, a late CANCELLED included, is logged before the sentinel's.
    wanted = {*request_ids, request_ids[0] + "-s"}
    codes = [
        r["code"]
        for r in records_before_sentinel(tiny_server, client)
        if r.get("msg") == "request finished" and r.get("request_id") in wanted
    ]
    assert len(codes) == 101 and set(codes) == {"OK"}, sorted(codes)


def test_a_client_accepts_what_a_server_with_other_limits_accepts(tiny_model_dir):
    """Limits come from the server the client talks to, never from copied defaults: a server
    started with 32 stop sequences and 4 chat messages accepts 20 stops, and so does a default
    Client and a Client checking against the limits that server publishes."""
    args = [
        "--model",
        str(tiny_model_dir),
        "--max-stop-sequences",
        "32",
        "--max-chat-messages",
        "4",
        "--max-new-tokens-limit",
        "64",
        "--default-max-new-tokens",
        "8",
    ]
    stops = [f"zq{i}" for i in range(20)]  # more than the 16 a default server allows
    with ServerProcess(args) as server, tokenwire.Client(server.target, timeout=30) as client:
        info = client.model_info()
        assert (info.limits.max_stop_sequences, info.limits.max_chat_messages) == (32, 4)
        assert (info.max_stop_sequences, info.max_chat_messages, info.limits.max_new_tokens_limit) == (32, 4, 64)
        assert info.max_top_logprobs == 20 and info.max_logprobs_of == 20 and info.max_message_bytes == 4 * 1024 * 1024
        assert client.generate_text("hello", max_new_tokens=2, stop=stops).finish_reason is not None
        with tokenwire.Client(server.target, timeout=30, limits=info.limits) as checking:
            assert checking.generate_text("hello", max_new_tokens=2, stop=stops).finish_reason is not None
            too_many = [f"zq{i}" for i in range(33)]
            with pytest.raises(tokenwire.InvalidArgument) as local:
                checking.generate("hello", stop=too_many)  # refused before sending
            five = [{"role": "user", "content": "hi"}] * 5
            with pytest.raises(tokenwire.InvalidArgument) as local_chat:
                checking.generate(messages=five)
        with pytest.raises(tokenwire.InvalidArgument) as remote:
            client.generate_text("hello", stop=too_many)
        with pytest.raises(tokenwire.InvalidArgument) as remote_chat:
            client.generate_text(messages=five)
        assert remote.value.details == local.value.details
        assert "at most 32" in remote.value.details
        assert remote_chat.value.field_violations == local_chat.value.field_violations


# -- response formats ---------------------------------------------------------------------------


SHORT_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
    "required": ["ok", "color"],
}


def test_response_format_takes_a_dict_a_pydantic_class_or_the_message_and_generate_json_parses(client):
    import pydantic
    from tokenwire import formats

    class Answer(pydantic.BaseModel):
        ok: bool
        color: Literal["red", "green"]

    parsed = client.generate_json("Answer as JSON", schema=SHORT_SCHEMA, temperature=0, max_new_tokens=40)
    assert isinstance(parsed, dict) and set(parsed) == {"ok", "color"} and parsed["color"] in ("red", "green")
    model = client.generate_json("Answer as JSON", schema=Answer, temperature=0.7, seed=3, max_new_tokens=60)
    assert isinstance(model, Answer) and model.color in ("red", "green")
    picked = client.generate_text("Pick", response_format=formats.choice(["alpha", "beta"]), temperature=0)
    assert picked.text in ("alpha", "beta") and picked.finish_reason is FinishReason.EOS
    # Cut by max_new_tokens: a valid prefix, and generate_json says so instead of a JSON error.
    with pytest.raises(tokenwire.IncompleteAnswer) as caught:
        client.generate_json("Answer as JSON", schema=SHORT_SCHEMA, temperature=0, max_new_tokens=3)
    assert caught.value.completion.finish_reason is FinishReason.LENGTH
    assert caught.value.text.startswith('{"')  # compact JSON, cut short


def test_async_generate_json_and_the_servers_refusal_names_the_field(tiny_server):
    async def main():
        async with tokenwire.AsyncClient(tiny_server.target, timeout=30) as client:
            parsed = await client.generate_json("Answer as JSON", schema=SHORT_SCHEMA, temperature=0, max_new_tokens=40)
            with pytest.raises(tokenwire.InvalidArgument) as caught:
                await client.generate_text(
                    "x", response_format={"type": "object", "properties": {"a": {"type": "nonsense"}}}
                )
            return parsed, caught.value

    parsed, error = run(main())
    assert set(parsed) == {"ok", "color"}
    assert [v.field for v in error.field_violations] == ["response_format.json_schema"]
    assert "nonsense" in error.field_violations[0].description


def test_the_clients_own_checks_of_a_response_format(client):
    with pytest.raises(tokenwire.InvalidArgument) as caught:
        client.generate("x", response_format=pb.ResponseFormat(json_schema="{oops"))
    assert [v.field for v in caught.value.field_violations] == ["response_format.json_schema"]
    with pytest.raises(TypeError, match="response_format takes"):
        client.generate("x", response_format="[a-z]+")  # a string is ambiguous: say which format
    with pytest.raises(TypeError, match="schema="):
        client.generate_json("x", response_format=SHORT_SCHEMA)


def test_a_response_format_becomes_the_message_it_names():
    import pydantic
    from tokenwire.request import build_generate_request

    class Point(pydantic.BaseModel):
        x: int

    def sent(fmt):
        return build_generate_request("p", options={"response_format": fmt}).response_format

    assert json.loads(sent(SHORT_SCHEMA).json_schema) == SHORT_SCHEMA
    assert json.loads(sent(Point).json_schema) == Point.model_json_schema()
    assert sent(pb.ResponseFormat(regex="a+")).regex == "a+"
    assert not build_generate_request("p").HasField("response_format")
