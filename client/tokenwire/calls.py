"""What ``Client`` and ``AsyncClient`` share but their I/O: each call, built and decided.

A call's arguments are declared once, here, on the method that turns them into what
the call sends (``ClientBase._generate_call``, ``_chat_call``, ``_json_call``,
``_tokenize_call``): the request, checked before anything is sent, the metadata, and
the call's attempts (``tokenwire.attempts`` decides retries and resumes). The clients'
methods take the same arguments (:func:`same_arguments`) and only do the I/O:
``tokenwire.client`` blocks, ``tokenwire.aio`` awaits. ``StreamBase`` is the same split
for a Generate stream: what to do with each chunk, each failed attempt and each way the
caller leaves is decided here; reading, cancelling and waiting are the subclass's.
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar

import grpc

from tokenwire.attempts import Attempt, GiveUp, Retry, StreamAttempts, UnaryAttempts
from tokenwire.channel import TLSConfig, channel_options, credentials, resolve_target, trace_metadata
from tokenwire.errors import TokenwireError
from tokenwire.formats import ResponseFormatLike
from tokenwire.request import GenerateOptions, build_generate_request, build_tokenize_request, json_options
from tokenwire.results import Chunk, MessageLike, ModelInfo, Tokenization
from tokenwire.retry import RetryPolicy
from tokenwire.v1 import generation_pb2 as pb
from tokenwire.validation import Limits

if TYPE_CHECKING:
    from google.protobuf.message import Message
    from typing_extensions import Unpack

__all__ = [
    "DEFAULT_TARGET",
    "ClientBase",
    "GenerateCall",
    "Metadata",
    "StreamBase",
    "UnaryCall",
    "delay_or_raise",
    "same_arguments",
]

DEFAULT_TARGET = "localhost:50051"
Metadata = Sequence[tuple[str, str]]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_Self = TypeVar("_Self")
_Call = TypeVar("_Call")
_Response = TypeVar("_Response")
_Result = TypeVar("_Result")


def same_arguments(
    template: Callable[Concatenate[Any, _P], object],
) -> Callable[[Callable[Concatenate[_Self, ...], _R]], Callable[Concatenate[_Self, _P], _R]]:
    """Give a method the parameters of ``template`` (a method too), for type checkers and
    ``inspect.signature``; the method keeps its own body, return type and docstring and
    passes its arguments on to ``template``. Nothing wraps it: an ``async def`` stays one."""

    def declare(method: Callable[Concatenate[_Self, ...], _R]) -> Callable[Concatenate[_Self, _P], _R]:
        returns = inspect.signature(method).return_annotation
        setattr(method, "__signature__", inspect.signature(template).replace(return_annotation=returns))  # noqa: B010
        return method

    return declare


def delay_or_raise(decision: Retry | GiveUp) -> float:
    """The wait before the next attempt, or the call's error when it is over. The error
    replaces the grpc.RpcError it was made from (no chained context)."""
    if isinstance(decision, GiveUp):
        raise decision.error from None
    return decision.delay


@dataclasses.dataclass(frozen=True)
class GenerateCall:
    """A Generate call, checked and built: its attempts (what each one sends) and the
    metadata every attempt sends."""

    attempts: StreamAttempts
    metadata: Metadata

    def on(self, generate: Callable[..., _Call]) -> tuple[Callable[[Attempt], _Call], StreamAttempts]:
        """A stream's arguments: how to start each attempt on ``generate`` (a stub's), and
        the attempts."""

        def start(attempt: Attempt) -> _Call:
            return generate(attempt.request, timeout=attempt.timeout, metadata=self.metadata)

        return start, self.attempts


def adapter_ranks(response: pb.ListAdaptersResponse) -> dict[str, int]:
    """The adapters a ListAdapters response names, each with its rank."""
    return {adapter.name: adapter.rank for adapter in response.adapters}


@dataclasses.dataclass(frozen=True)
class UnaryCall(Generic[_Response, _Result]):
    """A unary call, checked and built: its request (sent as it is on every attempt),
    metadata and attempts, and what its response reads as."""

    request: Message
    metadata: Metadata
    attempts: UnaryAttempts
    result: Callable[[_Response], _Result]

    def retry_delay(self, rpc_error: grpc.RpcError) -> float:
        """After an attempt that ended in ``rpc_error``: the wait before the next one, or
        raise the call's error."""
        return delay_or_raise(self.attempts.failed(rpc_error))


class StreamBase(abc.ABC, Generic[_Call]):
    """What ChunkStream and AsyncChunkStream share: the call's attempts (tokenwire.attempts
    decides what each sends and what follows a failed one) and the call in flight."""

    def __init__(self, start: Callable[[Attempt], _Call], attempts: StreamAttempts) -> None:
        self.request_id = attempts.request_id
        self._start = start
        self._attempts = attempts
        self._call: _Call | None = None
        self._done = False
        # An n-call (GenerateRequest.n) ends after every sample's last chunk.
        self._samples_left = max(1, attempts.request.n)

    @property
    def attempts(self) -> int:
        """The calls started so far: 1, plus one per retry or resume."""
        return self._attempts.attempts

    @abc.abstractmethod
    def cancel(self) -> None: ...

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            try:
                self.cancel()
            except Exception:  # pragma: no cover - e.g. the event loop is already closed
                pass

    def _next_attempt(self) -> Attempt:
        """What the next attempt sends, or raise DEADLINE_EXCEEDED when no time is left."""
        attempt = self._attempts.start()
        if isinstance(attempt, GiveUp):
            raise attempt.error
        return attempt

    def _retry_delay(self, rpc_error: grpc.RpcError) -> float:
        """After the call in flight ended in ``rpc_error``: retry, resume or give up
        (tokenwire.attempts decides; a call this side cancelled is not tried again).
        Returns the wait before the next attempt, or raises the stream's error."""
        delay = delay_or_raise(self._attempts.failed(rpc_error, cancelled_here=self._done))
        self._call = None
        return delay

    def _received(self, message: pb.TokenChunk) -> Chunk:
        """Take one chunk off the wire; after the last one (of every sample), nothing is left to cancel."""
        chunk = self._attempts.received(message)
        if chunk.finish_reason is not None:
            self._samples_left -= 1
            self._done = self._samples_left <= 0
        return chunk

    def _read_failed(self, error: BaseException) -> None:
        """Reading the next chunk raised ``error``. The end of the stream or its error ends
        it; anything else (KeyboardInterrupt, GeneratorExit, asyncio.CancelledError, ...)
        means the caller is leaving, and so is the RPC."""
        if isinstance(error, (StopIteration, StopAsyncIteration, TokenwireError)):
            self._done = True
        else:
            self.cancel()


class ClientBase(abc.ABC):
    """What Client and AsyncClient share but their I/O: the arguments (see ``Client``), the
    metadata every call sends, and each call built from its arguments; a subclass opens
    the channel and sends the calls."""

    def __init__(
        self,
        target: str | Sequence[str] = DEFAULT_TARGET,
        *,
        tls: bool | TLSConfig = False,
        token: str | None = None,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        limits: Limits | None = None,
        metadata: Metadata = (),
        options: Sequence[tuple[str, str | int]] = (),
    ) -> None:
        self.target = resolve_target(target)
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self.limits = limits or Limits()
        self._connect(credentials(tls), channel_options(tls=tls, extra=options))
        auth = (("authorization", f"Bearer {token}"),) if token else ()
        self._metadata: tuple[tuple[str, str], ...] = (*auth, *metadata)

    @abc.abstractmethod
    def _connect(self, creds: grpc.ChannelCredentials | None, options: list[tuple[str, str | int]]) -> None:
        """Open the channel to ``self.target`` (plaintext when ``creds`` is None) and its stubs."""

    # -- each call, built from the public call's arguments -------------------------------

    def _generate_call(
        self,
        prompt: str | None = None,
        *,
        messages: Iterable[MessageLike] | None = None,
        input_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        resume: bool = True,
        **params: Unpack[GenerateOptions],
    ) -> GenerateCall:
        """``generate``'s arguments (and ``generate_text``'s): the request is built and
        checked here, before anything is sent."""
        request = build_generate_request(
            prompt, messages=messages, input_ids=input_ids, options=params, limits=self.limits
        )
        # A cut n-call is not resumed whole (the contract resumes one sample at a time): it fails as cut.
        attempts = StreamAttempts(
            request, resume=resume and request.n <= 1, retry=self.retry, timeout=self._timeout(timeout)
        )
        return GenerateCall(attempts, trace_metadata(self._metadata))  # the caller's trace context, as of this call

    def _json_call(
        self,
        prompt: str | None = None,
        *,
        schema: ResponseFormatLike | None = None,
        messages: Iterable[MessageLike] | None = None,
        input_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        resume: bool = True,
        **params: Unpack[GenerateOptions],
    ) -> tuple[GenerateCall, ResponseFormatLike | None]:
        """``generate_json``'s arguments: the Generate call that asks for an answer in
        ``schema``, and the schema the answer is parsed with."""
        options = json_options(params, schema)
        call = self._generate_call(
            prompt, messages=messages, input_ids=input_ids, timeout=timeout, resume=resume, **options
        )
        return call, schema

    def _chat_call(
        self,
        messages: Iterable[MessageLike],
        *,
        timeout: float | None = None,
        resume: bool = True,
        **params: Unpack[GenerateOptions],
    ) -> GenerateCall:
        """``chat``'s arguments: a Generate call on a conversation."""
        return self._generate_call(messages=messages, timeout=timeout, resume=resume, **params)

    @staticmethod
    def _score_texts(prompt: str, continuation: str) -> tuple[str, str]:
        """``score``'s (context, whole text): as lm-eval splits them, the prompt's trailing
        whitespace moves to the continuation (a tokenizer joins a space to the word after it).
        The continuation's tokens are then the whole text's past the context's token count."""
        if not prompt:
            raise ValueError("score needs a prompt: its first token has nothing before it to be scored against")
        if not continuation:
            raise ValueError("score needs a non-empty continuation")
        spaces = len(prompt) - len(prompt.rstrip())
        if spaces and spaces < len(prompt):
            prompt, continuation = prompt[:-spaces], prompt[-spaces:] + continuation
        return prompt, prompt + continuation

    def _score_call(self, whole_ids: Sequence[int], timeout: float | None) -> GenerateCall:
        """A scoring call: the whole text's token ids read, each scored with its likeliest alternative,
        nothing generated (``max_new_tokens`` 0)."""
        return self._generate_call(
            input_ids=whole_ids, timeout=timeout, max_new_tokens=0, prompt_logprobs=True, prompt_top_logprobs=1
        )

    def _tokenize_call(
        self,
        text: str | None = None,
        *,
        messages: Iterable[MessageLike] | None = None,
        return_tokens: bool = False,
        return_offsets: bool = False,
        timeout: float | None = None,
    ) -> UnaryCall[pb.TokenizeResponse, Tokenization]:
        """``tokenize``'s arguments."""
        request = build_tokenize_request(
            text,
            messages=messages,
            return_tokens=return_tokens,
            return_offsets=return_offsets,
            limits=self.limits,
        )
        return self._unary_call(request, timeout, Tokenization.from_proto)

    def _model_info_call(self, timeout: float | None) -> UnaryCall[pb.ModelInfo, ModelInfo]:
        return self._unary_call(pb.GetModelInfoRequest(), timeout, ModelInfo.from_proto)

    def _list_adapters_call(self, timeout: float | None) -> UnaryCall[pb.ListAdaptersResponse, dict[str, int]]:
        return self._unary_call(pb.ListAdaptersRequest(), timeout, adapter_ranks)

    def _load_adapter_call(self, name: str, path: str, timeout: float | None) -> UnaryCall[pb.AdapterInfo, int]:
        return self._unary_call(pb.LoadAdapterRequest(name=name, path=path), timeout, lambda info: int(info.rank))

    def _unload_adapter_call(self, name: str, timeout: float | None) -> UnaryCall[pb.UnloadAdapterResponse, int]:
        return self._unary_call(
            pb.UnloadAdapterRequest(name=name), timeout, lambda response: int(response.streams_in_flight)
        )

    def _unary_call(
        self, request: Message, timeout: float | None, result: Callable[[_Response], _Result]
    ) -> UnaryCall[_Response, _Result]:
        attempts = UnaryAttempts(self.retry, self._timeout(timeout))
        return UnaryCall(request, trace_metadata(self._metadata), attempts, result)

    def _timeout(self, timeout: float | None) -> float | None:
        """A call's deadline: its own ``timeout``, else the client's."""
        return self.timeout if timeout is None else timeout
