"""Bad input: every field is validated and answered INVALID_ARGUMENT with a google.rpc.BadRequest
naming the field; every bound (context, max_new_tokens cap, stop sequences, chat messages,
top_logprobs, message size) holds; never UNKNOWN, never a dead server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from production_support import READINESS, SERVING, generation_stub, health_status, short_request
from servers import ServerProcess
from tokenwire.v1 import generation_pb2 as pb

pytestmark = pytest.mark.timeout(60)

MESSAGE_BYTES = 64 * 1024
LIMITS = [
    "--max-new-tokens-limit", "64",
    "--default-max-new-tokens", "16",
    "--max-stop-sequences", "4",
    "--max-stop-sequence-chars", "16",
    "--max-chat-messages", "8",
    "--max-message-bytes", str(MESSAGE_BYTES),
]  # fmt: skip


@pytest.fixture(scope="module")
def limited_server(tiny_model_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(["--model", str(tiny_model_dir), *LIMITS]) as server:
        yield server


def stopping(**fields: object) -> pb.StoppingCriteria:
    return pb.StoppingCriteria(**fields)  # type: ignore[arg-type]


def chat(count: int, role: str = "user", content: str = "hi") -> pb.Chat:
    return pb.Chat(messages=[pb.ChatMessage(role=role, content=content) for _ in range(count)])


P = "hello"
BAD_REQUESTS = {
    "no input": (pb.GenerateRequest(), "input"),
    "empty prompt": (pb.GenerateRequest(prompt=""), "prompt"),
    "NUL in prompt": (pb.GenerateRequest(prompt="a\x00b"), "prompt"),
    "request id too long": (pb.GenerateRequest(prompt=P, request_id="r" * 129), "request_id"),
    "empty token ids": (pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids.ids"),
    "token id outside vocab": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2**32 - 1])), "token_ids.ids[1]"),
    "chat without messages": (pb.GenerateRequest(chat=pb.Chat()), "chat.messages"),
    "too many chat messages": (pb.GenerateRequest(chat=chat(9)), "chat.messages"),
    "unknown role": (pb.GenerateRequest(chat=chat(1, role="robot")), "chat.messages[0].role"),
    "NUL in chat content": (pb.GenerateRequest(chat=chat(1, content="\x00")), "chat.messages[0].content"),
    "negative temperature": (
        pb.GenerateRequest(prompt=P, sampling=pb.SamplingParams(temperature=-1)),
        "sampling.temperature",
    ),
    "NaN temperature": (
        pb.GenerateRequest(prompt=P, sampling=pb.SamplingParams(temperature=float("nan"))),
        "sampling.temperature",
    ),
    "infinite temperature": (
        pb.GenerateRequest(prompt=P, sampling=pb.SamplingParams(temperature=float("inf"))),
        "sampling.temperature",
    ),
    "top_p zero": (pb.GenerateRequest(prompt=P, sampling=pb.SamplingParams(top_p=0)), "sampling.top_p"),
    "top_p above one": (pb.GenerateRequest(prompt=P, sampling=pb.SamplingParams(top_p=1.5)), "sampling.top_p"),
    "repetition penalty zero": (
        pb.GenerateRequest(prompt=P, sampling=pb.SamplingParams(repetition_penalty=0)),
        "sampling.repetition_penalty",
    ),
    "presence penalty above two": (
        pb.GenerateRequest(prompt=P, sampling=pb.SamplingParams(presence_penalty=2.5)),
        "sampling.presence_penalty",
    ),
    "NaN frequency penalty": (
        pb.GenerateRequest(prompt=P, sampling=pb.SamplingParams(frequency_penalty=float("nan"))),
        "sampling.frequency_penalty",
    ),
    "min_p above one": (pb.GenerateRequest(prompt=P, sampling=pb.SamplingParams(min_p=1.5)), "sampling.min_p"),
    "negative min_p": (pb.GenerateRequest(prompt=P, sampling=pb.SamplingParams(min_p=-0.1)), "sampling.min_p"),
    "logit bias outside the vocabulary": (
        pb.GenerateRequest(prompt=P, sampling=pb.SamplingParams(logit_bias={5: 1.0, 50000: 2.0})),
        "sampling.logit_bias[50000]",
    ),
    "logit bias below -100": (
        pb.GenerateRequest(prompt=P, sampling=pb.SamplingParams(logit_bias={7: -101.0})),
        "sampling.logit_bias[7]",
    ),
    "infinite logit bias": (
        pb.GenerateRequest(prompt=P, sampling=pb.SamplingParams(logit_bias={7: float("inf")})),
        "sampling.logit_bias[7]",
    ),
    "too many logit biases": (
        pb.GenerateRequest(prompt=P, sampling=pb.SamplingParams(logit_bias={i: 1.0 for i in range(301)})),
        "sampling.logit_bias",
    ),
    "max_new_tokens zero": (
        pb.GenerateRequest(prompt=P, stopping=stopping(max_new_tokens=0)),
        "stopping.max_new_tokens",
    ),
    "max_new_tokens above cap": (
        pb.GenerateRequest(prompt=P, stopping=stopping(max_new_tokens=65)),
        "stopping.max_new_tokens",
    ),
    "max_new_tokens huge": (
        pb.GenerateRequest(prompt=P, stopping=stopping(max_new_tokens=2**32 - 1)),
        "stopping.max_new_tokens",
    ),
    "min above max": (
        pb.GenerateRequest(prompt=P, stopping=stopping(max_new_tokens=4, min_new_tokens=5)),
        "stopping.min_new_tokens",
    ),
    "min above cap": (pb.GenerateRequest(prompt=P, stopping=stopping(min_new_tokens=65)), "stopping.min_new_tokens"),
    "too many stop sequences": (
        pb.GenerateRequest(prompt=P, stopping=stopping(stop_sequences=["a"] * 5)),
        "stopping.stop_sequences",
    ),
    "empty stop sequence": (
        pb.GenerateRequest(prompt=P, stopping=stopping(stop_sequences=["a", ""])),
        "stopping.stop_sequences[1]",
    ),
    "stop sequence too long": (
        pb.GenerateRequest(prompt=P, stopping=stopping(stop_sequences=["x" * 17])),
        "stopping.stop_sequences[0]",
    ),
    "too many stop token ids": (
        pb.GenerateRequest(prompt=P, stopping=stopping(stop_token_ids=list(range(17)))),
        "stopping.stop_token_ids",
    ),
    "stop token id outside the vocabulary": (
        pb.GenerateRequest(prompt=P, stopping=stopping(stop_token_ids=[2, 49152])),
        "stopping.stop_token_ids[1]",
    ),
    "top_logprobs above twenty": (
        pb.GenerateRequest(prompt=P, output=pb.OutputOptions(top_logprobs=21)),
        "output.top_logprobs",
    ),
    "prompt_top_logprobs above twenty": (
        pb.GenerateRequest(prompt=P, output=pb.OutputOptions(prompt_logprobs=True, prompt_top_logprobs=21)),
        "output.prompt_top_logprobs",
    ),
    "logprobs_of outside the vocabulary": (
        pb.GenerateRequest(prompt=P, output=pb.OutputOptions(logprobs_of=[3, 49152])),
        "output.logprobs_of[1]",
    ),
    "too many logprobs_of": (
        pb.GenerateRequest(prompt=P, output=pb.OutputOptions(logprobs_of=list(range(21)))),
        "output.logprobs_of",
    ),
    "a scoring call's max_new_tokens zero without prompt_logprobs": (
        pb.GenerateRequest(prompt=P, stopping=stopping(max_new_tokens=0), output=pb.OutputOptions(logprobs=True)),
        "stopping.max_new_tokens",
    ),
    "prompt longer than the context": (pb.GenerateRequest(prompt="word " * 1100), "prompt"),
    "prompt + max_new_tokens past the context": (
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 1000), stopping=stopping(max_new_tokens=64)),
        "token_ids",
    ),
}


def violations(error: grpc.RpcError) -> list[str]:
    status = rpc_status.from_call(error)
    assert status is not None, "INVALID_ARGUMENT must carry a google.rpc.Status"
    bad_request = error_details_pb2.BadRequest()
    assert any(detail.Unpack(bad_request) for detail in status.details), "no google.rpc.BadRequest detail"
    return [v.field for v in bad_request.field_violations]


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_field_is_invalid_argument_naming_the_field(name: str, limited_server: ServerProcess) -> None:
    request, field = BAD_REQUESTS[name]
    with pytest.raises(grpc.RpcError) as caught:
        list(generation_stub(limited_server.target).Generate(request, timeout=10))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert field in violations(caught.value)
    assert field in caught.value.details()


def test_bounds_that_are_met_exactly_are_served(limited_server: ServerProcess) -> None:
    request = pb.GenerateRequest(
        chat=chat(8),
        stopping=stopping(max_new_tokens=64, min_new_tokens=64, stop_sequences=["x" * 16] * 4),
        output=pb.OutputOptions(top_logprobs=20, logprobs_of=list(range(20))),
    )
    chunks = list(generation_stub(limited_server.target).Generate(request, timeout=20))
    last = chunks[-1]
    assert last.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    tokens = [token for chunk in chunks for token in chunk.tokens]
    # min = max = 64: exactly 64 tokens unless a stop sequence ended it first, and each carries
    # its 20 alternatives and 20 logprobs_of (checked over a non-empty list: all() of nothing would pass).
    if last.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE:
        assert 1 <= last.usage.completion_tokens <= 64
    else:
        assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.usage.completion_tokens == 64
    assert len(tokens) == last.usage.completion_tokens
    assert [(len(token.top_logprobs), len(token.logprobs_of)) for token in tokens] == [(20, 20)] * len(tokens)


def test_oversize_message_is_resource_exhausted_from_grpc(limited_server: ServerProcess) -> None:
    # grpc itself refuses a request above --max-message-bytes, before any of our code runs;
    # its code for that is RESOURCE_EXHAUSTED ("Received message larger than max").
    with pytest.raises(grpc.RpcError) as caught:
        list(
            generation_stub(limited_server.target).Generate(
                pb.GenerateRequest(prompt="x" * (MESSAGE_BYTES + 1)), timeout=10
            )
        )
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in caught.value.details()
    # just under the limit is read (and then refused for its length in tokens, not its bytes)
    with pytest.raises(grpc.RpcError) as under:
        list(
            generation_stub(limited_server.target).Generate(
                pb.GenerateRequest(prompt="x" * (MESSAGE_BYTES - 64)), timeout=10
            )
        )
    assert under.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    "payload",
    [
        pb.GenerateRequest(prompt="AB").SerializeToString().replace(b"AB", b"\xff\xfe"),  # a string that is not UTF-8
        b"\x0a\xff\xff\xff\xff\x0f",  # a length past the end
        b"\x12",  # truncated
    ],
    ids=["bad-utf8", "bad-length", "truncated"],
)
def test_undecodable_bytes_are_invalid_argument_not_unknown(payload: bytes, limited_server: ServerProcess) -> None:
    with grpc.insecure_channel(limited_server.target) as channel:
        raw = channel.unary_stream(
            "/tokenwire.v1.TextGeneration/Generate",
            request_serializer=lambda data: data,
            response_deserializer=pb.TokenChunk.FromString,
        )
        with pytest.raises(grpc.RpcError) as caught:
            list(raw(payload, timeout=10))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert violations(caught.value) == ["request"]
        tokenize = channel.unary_unary(
            "/tokenwire.v1.TextGeneration/Tokenize",
            request_serializer=lambda data: data,
            response_deserializer=pb.TokenizeResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as caught_tokenize:
            tokenize(payload, timeout=10)
        assert caught_tokenize.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_tiny_temperature_and_penalty_do_not_break_sampling(limited_server: ServerProcess) -> None:
    stub = generation_stub(limited_server.target)
    for sampling in (
        pb.SamplingParams(temperature=1e-45),  # would overflow logits / temperature to inf: greedy instead
        pb.SamplingParams(temperature=1e-6, top_k=1),
        pb.SamplingParams(temperature=3.4e38),
        pb.SamplingParams(temperature=1.0, top_p=1e-45, top_k=2**32 - 1, seed=2**64 - 1),
        pb.SamplingParams(temperature=1.0, repetition_penalty=1e-45),  # seen tokens' logits overflow to inf
        pb.SamplingParams(temperature=0.5, repetition_penalty=3.4e38),
    ):
        request = pb.GenerateRequest(
            prompt=P, sampling=sampling, stopping=stopping(max_new_tokens=4), output=pb.OutputOptions(token_ids=True)
        )
        chunks = list(stub.Generate(request, timeout=10))
        last = chunks[-1]
        assert last.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_EOS)
        ids = [token.id for chunk in chunks for token in chunk.tokens]
        assert len(ids) == last.usage.completion_tokens >= 1
        assert all(0 <= i < 49152 for i in ids)  # real vocabulary ids, not NaN picks


def test_server_is_alive_and_ready_after_all_of_it(limited_server: ServerProcess) -> None:
    assert health_status(limited_server.target, READINESS) == SERVING
    assert list(generation_stub(limited_server.target).Generate(short_request(), timeout=10))
    assert limited_server.proc.poll() is None
    codes = {r.get("code") for r in limited_server.find("request finished")}
    assert "UNKNOWN" not in codes and "INTERNAL" not in codes
