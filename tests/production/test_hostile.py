"""Hostile callers (issue 36): each defect a hostile-client campaign found, against a real
server on the tiny model, with bearer tokens and tenants.

- resumed token ids are charged as prompt tokens (they were a second, free prompt);
- a deeply nested json_schema is INVALID_ARGUMENT, not INTERNAL (RecursionError);
- error replies stay small whatever the input: quotes are cut, an invalid request id is
  replaced before anything echoes it, trailers stay under the published bound;
- resume.next_index near 2**32 is INVALID_ARGUMENT before any chunk, not INTERNAL after one;
- a Tokenize answer past the send limit is INVALID_ARGUMENT (and logged so), not "OK";
- a prompt longer than any that fits is refused before it is tokenized;
- a response format that compiles too long is refused "too complex", a resend at once;
- control characters in a request id never reach a log line; two authorization headers
  are refused.

Every call has its own deadline; traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import tokenwire
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from production_support import READINESS, SERVING, generation_stub, scrape, value, wait_until
from servers import ServerProcess
from tokenwire.v1 import generation_pb2 as pb

pytestmark = pytest.mark.timeout(180)

MESSAGE_BYTES = 256 * 1024
COMPILE_LIMIT_S = 0.4
TENANTS = """
[tenants.capped]
tokens_per_minute = 120

[tenants.alpha]
weight = 1

[tenants.beta]
weight = 1
"""
# Compiles in 2.2-2.8 s on this tokenizer on a 2-core AMD EPYC busy with the suite (xgrammar), and "\x13"
# in 1 ms: the limit sits between them with room either way. (0.1 s was too little room: a simple
# format's compile, queued behind a busy host, went past it and read as "too complex".)
SLOW_REGEX = "[a-zA-Z0-9 ]{1,20000}"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("hostile")
    (folder / "tenants.toml").write_text(TENANTS)
    (folder / "tokens").write_text("tok-capped capped\ntok-alpha alpha\ntok-beta beta\ntok-plain\n")
    args = [
        "--model", str(tiny_model_dir),
        "--tenant-config", str(folder / "tenants.toml"),
        "--auth-token-file", str(folder / "tokens"),
        "--max-message-bytes", str(MESSAGE_BYTES),
        "--format-compile-timeout-s", str(COMPILE_LIMIT_S),
        "--metrics-port", "-1",
    ]  # fmt: skip
    with ServerProcess(args) as process:
        yield process


def auth(token: str = "tok-plain") -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def refusal(call: grpc.Call) -> tuple[grpc.StatusCode, str, list[tuple[str, str]], tuple[tuple[str, str | bytes], ...]]:
    """A failed call's code, message, BadRequest violations and trailers."""
    violations: list[tuple[str, str]] = []
    status = rpc_status.from_call(call)
    for detail in status.details if status else ():
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations.extend((v.field, v.description) for v in bad.field_violations)
    return call.code(), call.details() or "", violations, tuple(call.trailing_metadata() or ())


def generate(
    server: ServerProcess, request: pb.GenerateRequest, token: str = "tok-plain", timeout: float = 30
) -> tuple[list[pb.TokenChunk], grpc.RpcError | None]:
    """The chunks a Generate call sent, and the error it ended with (None: it finished)."""
    chunks: list[pb.TokenChunk] = []
    stub = generation_stub(server.target)
    try:
        for chunk in stub.Generate(request, metadata=auth(token), timeout=timeout):
            chunks.append(chunk)
    except grpc.RpcError as error:
        return chunks, error
    return chunks, None


def trailer_bytes(trailers: tuple[tuple[str, str | bytes], ...], message: str) -> int:
    # grpc-message goes percent-encoded: at most 3 bytes a UTF-8 byte.
    return sum(len(k) + len(v) for k, v in trailers) + 3 * len(message.encode())


def logged_codes(server: ServerProcess, request_id: str) -> list[str]:
    """The codes of the call's "request finished" lines, once there is one (the line is
    written after the status has gone out)."""

    def lines() -> list[str]:
        return [r["code"] for r in server.find("request finished") if r.get("request_id") == request_id]

    wait_until(lambda: bool(lines()), 10)
    return lines()


def model_limits(server: ServerProcess) -> pb.RequestLimits:
    info = generation_stub(server.target).GetModelInfo(pb.GetModelInfoRequest(), metadata=auth(), timeout=10)
    return info.limits


def test_the_new_limits_are_published(server: ServerProcess) -> None:
    limits = model_limits(server)
    assert limits.max_request_id_chars == 128
    assert limits.max_json_schema_depth == 64
    assert limits.max_format_chars == 64 * 1024
    assert limits.max_quoted_chars == 64
    assert limits.max_format_compile_ms == round(COMPILE_LIMIT_S * 1000)
    assert limits.max_error_trailer_bytes == 8 * 1024
    # This tokenizer's longest entry is 81 characters: no longer text fits max_request_tokens.
    assert limits.max_prompt_chars == limits.max_request_tokens * 81


# -- 1: resumed ids are charged -----------------------------------------------------------


def resumed(ids: int, **fields: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt="hello",
        resume=pb.Resume(generated_token_ids=[100 + i % 500 for i in range(ids)], next_index=ids),
        stopping=pb.StoppingCriteria(max_new_tokens=ids + 1, ignore_eos=True),
        **fields,  # type: ignore[arg-type]
    )


def test_resumed_ids_are_charged_as_prompt_tokens_so_a_quota_holds(server: ServerProcess) -> None:
    before = scrape(server)
    # Eight calls at once, each carrying 900 resumed ids, against 120 tokens a minute: the
    # first is admitted and charged what it reads; the others find the quota spent. (Before,
    # each was charged its 1-token prompt and 1 new token: all eight ran.)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(lambda _: generate(server, resumed(900), "tok-capped"), range(8)))
    codes = [error.code() if error else grpc.StatusCode.OK for _, error in outcomes]
    assert codes.count(grpc.StatusCode.OK) == 1, codes
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 7, codes
    for _, error in outcomes:
        if error is not None:
            assert "tokens per minute" in (error.details() or "")
    after = scrape(server)
    prompt = value(after, "tokenwire_tenant_tokens_total", tenant="capped", priority="normal", kind="prompt") - value(
        before, "tokenwire_tenant_tokens_total", tenant="capped", priority="normal", kind="prompt"
    )
    completion = value(
        after, "tokenwire_tenant_tokens_total", tenant="capped", priority="normal", kind="completion"
    ) - value(before, "tokenwire_tenant_tokens_total", tenant="capped", priority="normal", kind="completion")
    assert prompt >= 900  # the prompt and the 900 ids it read
    assert completion == 1  # only what it generated after the cut
    # The usage still tells the uncut stream's counts (its 900 ids are completion tokens there).
    chunks = next(chunks for chunks, error in outcomes if error is None)
    assert chunks[-1].usage.completion_tokens == 901 and chunks[0].index == 900


# -- 2: a deep json_schema -------------------------------------------------------------


def nested_schema(levels: int) -> str:
    schema = '{"type": "string"}'
    for _ in range(levels):
        schema = '{"type": "object", "properties": {"a": ' + schema + '}, "required": ["a"]}'
    return schema


def test_a_deeply_nested_json_schema_is_invalid_argument_on_the_field(server: ServerProcess) -> None:
    schema = nested_schema(500)  # 1,000 levels of JSON, 27 KB: under the 64 KiB cap
    assert len(schema) < 64 * 1024
    request = pb.GenerateRequest(prompt="hi", response_format=pb.ResponseFormat(json_schema=schema))
    chunks, error = generate(server, request)
    assert error is not None and not chunks
    code, message, violations, _ = refusal(error)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, message
    assert violations == [("response_format.json_schema", violations[0][1])]
    assert "more than 64 levels deep" in violations[0][1]
    # The client library refuses it the same way before sending (it raised RecursionError).
    with tokenwire.Client(server.target, timeout=10, metadata=auth()) as client:
        with pytest.raises(tokenwire.InvalidArgument) as caught:
            client.generate("hi", response_format=pb.ResponseFormat(json_schema=schema))
    assert caught.value.field_violations[0].field == "response_format.json_schema"
    # Under the limit (32 schema levels = 64 of JSON) it is served.
    chunks, error = generate(
        server,
        pb.GenerateRequest(
            prompt="hi",
            response_format=pb.ResponseFormat(json_schema=nested_schema(31)),
            stopping=pb.StoppingCriteria(max_new_tokens=4),
        ),
    )
    assert error is None, error
    assert not server.find("Generate failed")  # no traceback was logged


# -- 3: error replies that grow with the input ----------------------------------------


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (
            pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="r" * 9000, content="hi")])),
            "chat.messages[0].role",
        ),
        (pb.GenerateRequest(prompt="hi", request_id="i" * 200_000), "request_id"),
        (
            pb.GenerateRequest(
                prompt="hi", response_format=pb.ResponseFormat(json_schema='{"type": "' + "t" * 60_000 + '"}')
            ),
            "response_format.json_schema",
        ),
        (
            pb.GenerateRequest(prompt="hi", response_format=pb.ResponseFormat(grammar="start: " + "x" * 60_000 + " (")),
            "response_format.grammar",
        ),
    ],
    ids=["9 KB role", "200 KB request id", "60 KB schema type", "60 KB Lark line"],
)
def test_error_replies_stay_small_and_invalid_argument(
    server: ServerProcess, request_: pb.GenerateRequest, field: str
) -> None:
    chunks, error = generate(server, request_)
    assert error is not None and not chunks
    code, message, violations, trailers = refusal(error)
    # Before: RESOURCE_EXHAUSTED "received metadata size exceeds hard limit" (the whole value quoted).
    assert code == grpc.StatusCode.INVALID_ARGUMENT, message[:200]
    assert [v[0] for v in violations] == [field]
    assert len(message.encode()) <= 512
    assert all(len(description.encode()) <= 256 for _, description in violations)
    assert trailer_bytes(trailers, message) < model_limits(server).max_error_trailer_bytes
    # No log line grew with it either.
    assert max(len(line) for line in server.lines) < 8 * 1024


def test_an_invalid_request_id_is_replaced_before_it_is_echoed(server: ServerProcess) -> None:
    for bad in ("i" * 129, 'forged\r\n{"msg": "request finished"}'):
        chunks, error = generate(server, pb.GenerateRequest(prompt="hi", request_id=bad))
        assert error is not None and not chunks
        code, _, violations, trailers = refusal(error)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and [v[0] for v in violations] == ["request_id"]
        echoed = dict(trailers)["x-request-id"]
        assert echoed != bad and len(echoed) == 32
        assert logged_codes(server, echoed) == ["INVALID_ARGUMENT"]
        assert not [r for r in server.records if r.get("request_id") == bad]
    # The header form: replaced too, and the call goes on (it is not a request field).
    stub = generation_stub(server.target)
    call = stub.Generate(
        pb.GenerateRequest(prompt="hi", stopping=pb.StoppingCriteria(max_new_tokens=2)),
        metadata=(*auth(), ("x-request-id", "h" * 4000)),
        timeout=30,
    )
    chunks = list(call)
    assert chunks[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
    assert len(chunks[0].request_id) == 32 and dict(call.trailing_metadata())["x-request-id"] == chunks[0].request_id


# -- 4: the chunk index ------------------------------------------------------------------


@pytest.mark.parametrize("max_new", [8, None], ids=["max_new_tokens", "the server's cap"])
def test_a_next_index_near_2_32_is_invalid_argument_before_any_chunk(
    server: ServerProcess, max_new: int | None
) -> None:
    stopping = pb.StoppingCriteria(max_new_tokens=max_new) if max_new else pb.StoppingCriteria()
    request = pb.GenerateRequest(prompt="hi", resume=pb.Resume(next_index=2**32 - 4), stopping=stopping)
    chunks, error = generate(server, request)
    assert not chunks  # before: one chunk, then INTERNAL (the uint32 index overflowed)
    assert error is not None
    code, message, violations, _ = refusal(error)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, message
    assert [v[0] for v in violations] == ["resume.next_index"]
    # At the edge it still fits: next_index + max_new_tokens == 2**32 - 1.
    chunks, error = generate(
        server,
        pb.GenerateRequest(
            prompt="hi",
            resume=pb.Resume(next_index=2**32 - 1 - 4),
            stopping=pb.StoppingCriteria(max_new_tokens=4, ignore_eos=True),
        ),
    )
    assert error is None, error
    assert chunks[-1].index <= 2**32 - 1


# -- 5: an oversized Tokenize answer --------------------------------------------------------


def test_a_tokenize_answer_past_the_send_limit_is_refused_and_recorded_so(server: ServerProcess) -> None:
    text = "a b " * 25_000  # 100 KB in, ~50,000 tokens: with tokens and offsets the answer is far past 256 KiB
    stub = generation_stub(server.target)
    before = scrape(server)
    with pytest.raises(grpc.RpcError) as caught:
        stub.Tokenize(
            pb.TokenizeRequest(text=text, return_tokens=True, return_offsets=True), metadata=auth(), timeout=60
        )
    code, message, violations, _ = refusal(caught.value)
    # Before: the client got RESOURCE_EXHAUSTED while the server recorded OK with a traceback.
    assert code == grpc.StatusCode.INVALID_ARGUMENT, message
    assert [v[0] for v in violations] == ["text"]
    assert "return_tokens and return_offsets" in violations[0][1] and str(MESSAGE_BYTES) in violations[0][1]
    after = scrape(server)
    assert value(after, "tokenwire_requests_total", method="Tokenize", code="INVALID_ARGUMENT") == 1 + value(
        before, "tokenwire_requests_total", method="Tokenize", code="INVALID_ARGUMENT"
    )
    assert value(after, "tokenwire_requests_total", method="Tokenize", code="OK") == value(
        before, "tokenwire_requests_total", method="Tokenize", code="OK"
    )
    # The count alone fits.
    answer = stub.Tokenize(pb.TokenizeRequest(text=text), metadata=auth(), timeout=60)
    assert answer.count > 40_000


# -- 6: near-limit prompts -----------------------------------------------------------------


def test_a_prompt_longer_than_any_that_fits_is_refused_unread(server: ServerProcess) -> None:
    limits = model_limits(server)
    giant = "x" * (limits.max_prompt_chars + 1)
    assert len(giant) < MESSAGE_BYTES
    chunks, error = generate(server, pb.GenerateRequest(prompt=giant))
    assert error is not None and not chunks
    code, message, violations, _ = refusal(error)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert violations[0][0] == "prompt" and "not read whole" in violations[0][1]
    assert f"more than {limits.max_request_tokens} tokens" in violations[0][1]
    # A prompt under the character bound but over the token limit is read only up to it.
    over = "a " * (limits.max_request_tokens + 10)
    chunks, error = generate(server, pb.GenerateRequest(prompt=over))
    assert error is not None and refusal(error)[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert f"more than {limits.max_request_tokens} tokens" in refusal(error)[2][0][1]
    # A chat is measured as the model would read it (rendered).
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content=giant)])
    chunks, error = generate(server, pb.GenerateRequest(chat=chat))
    assert error is not None and refusal(error)[2][0][0] == "chat"


# -- 8: a format that compiles too long -----------------------------------------------------


def test_a_format_that_compiles_past_the_limit_is_too_complex_and_a_resend_refused_at_once(
    server: ServerProcess,
) -> None:
    request = pb.GenerateRequest(prompt="hi", response_format=pb.ResponseFormat(regex=SLOW_REGEX))
    warned = len(server.find("response format too complex"))
    for _ in range(2):
        chunks, error = generate(server, request, "tok-alpha")
        assert error is not None and not chunks
        code, message, violations, _ = refusal(error)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, message
        assert violations[0][0] == "response_format.regex" and "too complex" in violations[0][1]
        assert f"{round(COMPILE_LIMIT_S * 1000)} ms" in violations[0][1]
    # The second was refused from memory: only one compile ran past the limit.
    assert wait_until(lambda: len(server.find("response format too complex")) > warned, 5)  # the log line's way here
    assert len(server.find("response format too complex")) == warned + 1
    # Meanwhile other tenants' formats compile.
    chunks, error = generate(
        server,
        pb.GenerateRequest(
            prompt="hi",
            response_format=pb.ResponseFormat(regex="[0-9]{3}"),
            stopping=pb.StoppingCriteria(max_new_tokens=8),
        ),
        "tok-beta",
    )
    assert error is None, error


# -- 9: log lines and credentials --------------------------------------------------------------


def test_two_authorization_headers_are_refused(server: ServerProcess) -> None:
    stub = generation_stub(server.target)
    for metadata in (
        (("authorization", "Bearer tok-alpha"), ("authorization", "Bearer tok-beta")),
        (("authorization", "Bearer wrong"), ("authorization", "Bearer tok-alpha")),
    ):
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(pb.GenerateRequest(prompt="hi"), metadata=metadata, timeout=10))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "more than one 'authorization' header" in (caught.value.details() or "")
    assert server.health() == SERVING and server.health(READINESS) == SERVING


# -- found by the fuzz test: a format that no token can start, or continue ---------------------


def test_a_format_no_token_can_start_is_invalid_argument_before_any_chunk(server: ServerProcess) -> None:
    for fmt, field in (
        (pb.ResponseFormat(regex="\x13"), "response_format.regex"),
        (pb.ResponseFormat(choice=pb.Choice(options=["\x06"])), "response_format.choice"),
        (pb.ResponseFormat(json_schema='{"$ref": "#"}'), "response_format.json_schema"),
    ):
        chunks, error = generate(
            server,
            pb.GenerateRequest(prompt="Say:", response_format=fmt, stopping=pb.StoppingCriteria(max_new_tokens=4)),
        )
        assert error is not None and not chunks, fmt  # before: INTERNAL "token 0 breaks the response format"
        code, message, violations, _ = refusal(error)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, message
        assert violations[0][0] == field and "can begin an answer" in violations[0][1]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_format_no_token_can_continue_ends_its_own_stream_invalid_argument(
    server: ServerProcess, temperature: float
) -> None:
    # "a" can start it, but no token holds the control character that must follow.
    stuck = pb.GenerateRequest(
        prompt="Say:",
        response_format=pb.ResponseFormat(regex="a\x13"),
        sampling=pb.SamplingParams(temperature=temperature, seed=1),
        stopping=pb.StoppingCriteria(max_new_tokens=8),
    )
    neighbour = pb.GenerateRequest(prompt="hello", stopping=pb.StoppingCriteria(max_new_tokens=24, ignore_eos=True))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        other = pool.submit(generate, server, neighbour)
        chunks, error = generate(server, stuck)
        other_chunks, other_error = other.result()
    assert error is not None
    code, message, violations, _ = refusal(error)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, message
    assert violations[0][0] == "response_format.regex" and "can continue" in violations[0][1]
    # The batch it shared goes on: only its own stream ended.
    assert other_error is None and len(other_chunks) >= 1 and other_chunks[-1].usage.completion_tokens == 24
