"""tokenwire.calls on its own: each call built from the public call's arguments, and the
stream's and the unary call's decisions, with no channel, no server and no sleep."""

from __future__ import annotations

import inspect
import types

import grpc
import pytest
import tokenwire
from fakes import FakeRpcError
from tokenwire import AsyncClient, Client, ModelInfo, RetryPolicy, Tokenization
from tokenwire.attempts import Attempt, GiveUp, Retry, StreamAttempts
from tokenwire.calls import ClientBase, GenerateCall, StreamBase, delay_or_raise, same_arguments
from tokenwire.v1 import generation_pb2 as pb

POLICY = RetryPolicy(max_attempts=3, initial_backoff=0.1, max_backoff=1.0, multiplier=2.0, jitter=0.0)


class Offline(ClientBase):
    """A ClientBase with no channel: what a call sends is all there is to see."""

    def _connect(self, creds: grpc.ChannelCredentials | None, options: list[tuple[str, str | int]]) -> None:
        self.connected = (creds, options)


def offline(**kwargs) -> Offline:
    return Offline("localhost:1", retry=POLICY, **kwargs)


# -- the public calls take the arguments declared once in ClientBase ----------------------

GENERATE = (
    "(self, prompt: 'str | None' = None, *, messages: 'Iterable[MessageLike] | None' = None, "
    "input_ids: 'Sequence[int] | None' = None, timeout: 'float | None' = None, resume: 'bool' = True, "
    "**params: 'Unpack[GenerateOptions]')"
)
SIGNATURES = {
    "generate": (GENERATE, {Client: "'ChunkStream'", AsyncClient: "'AsyncChunkStream'"}),
    "generate_text": (GENERATE, "'Completion'"),
    "chat": (
        "(self, messages: 'Iterable[MessageLike]', *, timeout: 'float | None' = None, resume: 'bool' = True, "
        "**params: 'Unpack[GenerateOptions]')",
        "'Completion'",
    ),
    "generate_json": (
        "(self, prompt: 'str | None' = None, *, schema: 'ResponseFormatLike | None' = None, "
        "messages: 'Iterable[MessageLike] | None' = None, input_ids: 'Sequence[int] | None' = None, "
        "timeout: 'float | None' = None, resume: 'bool' = True, **params: 'Unpack[GenerateOptions]')",
        "'Any'",
    ),
    "tokenize": (
        "(self, text: 'str | None' = None, *, messages: 'Iterable[MessageLike] | None' = None, "
        "return_tokens: 'bool' = False, return_offsets: 'bool' = False, timeout: 'float | None' = None)",
        "'Tokenization'",
    ),
}


@pytest.mark.parametrize("cls", [Client, AsyncClient])
@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_each_call_shows_its_own_parameters_and_return_type(cls, name):
    parameters, returns = SIGNATURES[name]
    returns = returns[cls] if isinstance(returns, dict) else returns
    assert str(inspect.signature(getattr(cls, name))) == f"{parameters} -> {returns}"
    bound = types.MethodType(getattr(cls, name), object())  # as on an instance: no self
    assert str(inspect.signature(bound)) == f"{parameters.replace('(self, ', '(', 1)} -> {returns}"


def test_async_calls_stay_coroutine_functions_with_their_own_docstrings():
    for name in ("generate_text", "chat", "generate_json", "tokenize"):
        assert inspect.iscoroutinefunction(getattr(AsyncClient, name)), name
    assert not inspect.iscoroutinefunction(AsyncClient.generate)  # a stream, opened without awaiting
    assert Client.chat.__doc__ != AsyncClient.chat.__doc__  # each keeps its own, not the template's
    assert Client.generate.__doc__ and "next()" in Client.generate.__doc__
    assert ClientBase._generate_call.__doc__ not in (Client.generate.__doc__, AsyncClient.generate.__doc__)


def test_same_arguments_keeps_the_method_and_its_return_annotation():
    def template(self, a: int, *, b: str = "x") -> bool:
        return True

    def method(self, *args, **kwargs) -> str:
        return "own"

    declared = same_arguments(template)(method)
    assert declared is method  # nothing wraps it
    assert str(inspect.signature(declared)) == "(self, a: 'int', *, b: 'str' = 'x') -> 'str'"


# -- building each call -------------------------------------------------------------------


def test_a_generate_call_is_checked_before_anything_is_sent():
    with pytest.raises(tokenwire.InvalidArgument):
        offline()._generate_call("hi", max_new_tokens=0)
    with pytest.raises(tokenwire.InvalidArgument):
        offline()._generate_call()  # no input at all


def test_a_generate_call_sends_the_request_with_the_calls_deadline_and_the_clients_metadata():
    client = offline(token="s3cret", timeout=30.0, metadata=[("x-tenant", "t1")])
    call = client._generate_call("hello", max_new_tokens=4, request_id="r-7")
    assert isinstance(call, GenerateCall)
    attempt = call.attempts.start()
    assert isinstance(attempt, Attempt)
    assert attempt.request.prompt == "hello" and attempt.request.request_id == "r-7"
    assert attempt.request.stopping.max_new_tokens == 4
    assert attempt.timeout == pytest.approx(30.0, abs=1.0)  # the client's
    assert ("authorization", "Bearer s3cret") in call.metadata and ("x-tenant", "t1") in call.metadata
    own = client._generate_call("hello", timeout=2.0).attempts.start()
    assert isinstance(own, Attempt) and own.timeout == pytest.approx(2.0, abs=0.5)  # the call's own wins
    assert isinstance(offline()._generate_call("hello").attempts.start(), Attempt)
    assert offline()._generate_call("hello").attempts.start().timeout is None  # no deadline at all


def test_resume_false_reaches_the_attempts():
    assert offline()._generate_call("hello").attempts.start().request.output.token_ids  # what a resume needs
    assert not offline()._generate_call("hello", resume=False).attempts.start().request.output.token_ids


def test_a_chat_call_sends_the_conversation():
    request = offline()._chat_call([("user", "hi")], max_new_tokens=3).attempts.start().request
    assert request.WhichOneof("input") == "chat"
    assert [(m.role, m.content) for m in request.chat.messages] == [("user", "hi")]
    assert request.stopping.max_new_tokens == 3
    assert request.output.token_ids  # resumable by default, as generate is
    assert not offline()._chat_call([("user", "hi")], resume=False).attempts.start().request.output.token_ids


def test_a_json_call_asks_for_the_schema_and_keeps_it_for_parsing():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    call, kept = offline()._json_call("q", schema=schema)
    assert kept is schema
    assert call.attempts.start().request.HasField("response_format")
    call, kept = offline()._json_call("q")
    assert kept is None and call.attempts.start().request.HasField("response_format")  # any JSON object
    with pytest.raises(TypeError, match="schema="):
        offline()._json_call("q", response_format=schema)


def test_generate_call_on_starts_each_attempt_on_the_stub_with_its_request_and_deadline():
    sent = []
    call = offline(token="t")._generate_call("hello")

    def stub_generate(request, *, timeout, metadata):
        sent.append((request, timeout, metadata))
        return "call"

    start, attempts = call.on(stub_generate)
    assert attempts is call.attempts
    attempt = Attempt(pb.GenerateRequest(prompt="again"), 1.5)
    assert start(attempt) == "call"
    assert sent == [(attempt.request, 1.5, call.metadata)]


def test_a_tokenize_call_builds_its_request_and_reads_its_response():
    client = offline(token="t", timeout=9.0)
    call = client._tokenize_call("a b", return_tokens=True)
    assert call.request == pb.TokenizeRequest(text="a b", return_tokens=True)
    assert client._tokenize_call("a", return_offsets=True).request == pb.TokenizeRequest(text="a", return_offsets=True)
    assert ("authorization", "Bearer t") in call.metadata
    assert call.attempts.start() == pytest.approx(9.0, abs=1.0)
    result = call.result(pb.TokenizeResponse(count=2, ids=[1, 2], text="a b", tokens=["a", " b"]))
    assert result == Tokenization(count=2, ids=(1, 2), text="a b", tokens=("a", " b"))
    with pytest.raises(tokenwire.InvalidArgument):
        client._tokenize_call()  # no input


def test_a_model_info_call_sends_an_empty_request_and_reads_the_info():
    call = offline()._model_info_call(3.0)
    assert call.request == pb.GetModelInfoRequest()
    assert call.attempts.start() == pytest.approx(3.0, abs=0.5)
    info = call.result(pb.ModelInfo(name="m", context_length=64))
    assert isinstance(info, ModelInfo) and info.name == "m" and info.context_length == 64


def test_a_unary_call_retries_what_the_policy_retries_and_raises_the_rest():
    call = offline()._model_info_call(None)
    call.attempts.start()
    assert call.retry_delay(FakeRpcError(grpc.StatusCode.UNAVAILABLE)) == pytest.approx(0.1)
    call.attempts.start()
    with pytest.raises(tokenwire.PermissionDenied):
        call.retry_delay(FakeRpcError(grpc.StatusCode.PERMISSION_DENIED, "no"))


def test_delay_or_raise():
    assert delay_or_raise(Retry(0.25)) == 0.25
    error = tokenwire.Unavailable("gone")
    try:
        try:
            raise FakeRpcError(grpc.StatusCode.UNAVAILABLE)
        except grpc.RpcError:
            delay_or_raise(GiveUp(error))
    except tokenwire.Unavailable as raised:
        assert raised is error and raised.__suppress_context__  # the RpcError stays out of the traceback
    else:
        pytest.fail("GiveUp did not raise")


# -- a stream's decisions ------------------------------------------------------------------


class Stream(StreamBase[str]):
    def __init__(self, attempts: StreamAttempts) -> None:
        super().__init__(lambda attempt: "call", attempts)
        self.cancelled = 0

    def cancel(self) -> None:
        self._done = True
        self.cancelled += 1


def stream_attempts(timeout: float | None = 10.0, clock=None) -> StreamAttempts:
    request = pb.GenerateRequest(request_id="r-1", prompt="hello")
    return StreamAttempts(request, resume=True, retry=POLICY, timeout=timeout, **({"clock": clock} if clock else {}))


def chunk(index: int, *, last: bool = False) -> pb.TokenChunk:
    message = pb.TokenChunk(request_id="r-1", index=index, tokens=[pb.Token(id=10 + index, text=f"t{index}")])
    if last:
        message.finish_reason = pb.FINISH_REASON_LENGTH
    return message


@pytest.mark.parametrize("error", [StopIteration(), StopAsyncIteration(), tokenwire.Unavailable("gone")])
def test_the_end_of_a_stream_or_its_error_ends_it_without_a_cancel(error):
    stream = Stream(stream_attempts())
    stream._read_failed(error)
    assert stream._done and stream.cancelled == 0


@pytest.mark.parametrize("error", [KeyboardInterrupt(), GeneratorExit(), RuntimeError("caller's own")])
def test_a_caller_leaving_cancels_the_rpc(error):
    stream = Stream(stream_attempts())
    stream._read_failed(error)
    assert stream.cancelled == 1


def test_only_the_last_chunk_ends_the_stream():
    stream = Stream(stream_attempts())
    assert stream._received(chunk(0)).index == 0 and not stream._done
    last = stream._received(chunk(1, last=True))
    assert last.finish_reason is not None and stream._done
    assert stream.cancelled == 0  # nothing left to cancel


def test_a_cut_stream_is_resumed_and_one_cancelled_here_is_not():
    stream = Stream(stream_attempts())
    stream._call = stream._start(stream._next_attempt())
    stream._received(chunk(0))
    assert stream._retry_delay(FakeRpcError(grpc.StatusCode.UNAVAILABLE)) == pytest.approx(0.1)
    assert stream._call is None  # the next attempt starts afresh
    assert stream._next_attempt().request.resume.next_index == 1  # a resume, never a replay
    stream._call = "call"
    stream.cancel()
    with pytest.raises(tokenwire.Cancelled):
        stream._retry_delay(FakeRpcError(grpc.StatusCode.CANCELLED))


def test_no_attempt_starts_past_the_deadline():
    class Clock:
        now = 100.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    stream = Stream(stream_attempts(timeout=1.0, clock=clock))
    clock.now += 2.0
    with pytest.raises(tokenwire.DeadlineExceeded):
        stream._next_attempt()
    assert stream.attempts == 0
