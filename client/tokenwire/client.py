"""The blocking client: ``tokenwire.Client``.

``generate`` returns a :class:`ChunkStream`, an iterator of :class:`Chunk` that owns
its RPC: leaving the loop early (``break``, an exception, the stream being garbage
collected) cancels the call on the server. Until the first chunk arrives a refused
call is retried per the :class:`RetryPolicy`; after it, a stream that its replica cuts
(UNAVAILABLE: it died, or drained and handed the stream off) is resumed on the next
replica from the tokens received (``tokenwire.resume``), within the same policy, unless
``generate(..., resume=False)``. Those decisions are ``tokenwire.attempts``', shared with
``tokenwire.aio``; this module does the blocking I/O around them.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]

from tokenwire.attempts import Attempt, GiveUp, StreamAttempts, UnaryAttempts, health_failure, health_status
from tokenwire.channel import TLSConfig, channel_options, credentials, resolve_target, trace_metadata
from tokenwire.errors import TokenwireError, Unavailable
from tokenwire.formats import ResponseFormatLike, parse_answer
from tokenwire.request import GenerateOptions, build_generate_request, build_tokenize_request, json_options
from tokenwire.results import Chunk, Completion, HealthStatus, MessageLike, ModelInfo, Tokenization
from tokenwire.retry import RetryPolicy
from tokenwire.v1 import generation_pb2 as pb
from tokenwire.v1 import generation_pb2_grpc as pb_grpc
from tokenwire.validation import Limits

if TYPE_CHECKING:
    from typing_extensions import Self, Unpack

__all__ = ["DEFAULT_TARGET", "ChunkStream", "Client", "Metadata"]

DEFAULT_TARGET = "localhost:50051"
Metadata = Sequence[tuple[str, str]]
_T = TypeVar("_T")
_Call = TypeVar("_Call")


class _StreamCall(Protocol):
    def __next__(self) -> pb.TokenChunk: ...
    def cancel(self) -> bool: ...


class _StreamBase(abc.ABC, Generic[_Call]):
    """What ChunkStream and AsyncChunkStream share: the call's attempts (tokenwire.attempts
    decides what each sends and what follows a failed one) and the call in flight."""

    def __init__(self, start: Callable[[Attempt], _Call], attempts: StreamAttempts) -> None:
        self.request_id = attempts.request_id
        self._start = start
        self._attempts = attempts
        self._call: _Call | None = None
        self._done = False

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


class ChunkStream(_StreamBase[_StreamCall], Iterator[Chunk]):
    """The chunks of one Generate call, in order; the last carries finish_reason and usage.

    Use it in a ``for`` loop or ``with`` block; :meth:`cancel` (or leaving either
    early) cancels the RPC on the server.
    """

    def __init__(self, start: Callable[[Attempt], _StreamCall], attempts: StreamAttempts) -> None:
        super().__init__(start, attempts)
        self._lock = threading.Lock()  # cancel() may come from another thread

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> Chunk:
        if self._done:
            raise StopIteration
        try:
            message = self._next_message()
        except (StopIteration, TokenwireError):
            self._done = True
            raise
        except BaseException:
            # KeyboardInterrupt, GeneratorExit, ...: the caller is leaving; so is the RPC.
            self.cancel()
            raise
        chunk = self._attempts.received(message)
        if chunk.finish_reason is not None:
            self._done = True  # the last chunk: nothing left to cancel
            self._read_status()
        return chunk

    def _read_status(self) -> None:
        """Read the call to its end after the last chunk.

        The server sends its status right after the last chunk. A call object that is
        dropped before that status has arrived is cancelled by grpc, so without this
        read a complete answer would sometimes end as CANCELLED on the server (its
        logs and metrics). The answer is whole either way, so a failed status here
        is not raised.
        """
        with self._lock:
            call = self._call
        if call is None:
            return
        try:
            next(call)
        except (StopIteration, grpc.RpcError):
            return
        call.cancel()  # a message after the last chunk: nothing more is wanted

    def _next_message(self) -> pb.TokenChunk:
        while True:
            if self._call is None:
                attempt = self._attempts.start()
                if isinstance(attempt, GiveUp):
                    raise attempt.error
                with self._lock:
                    self._call = self._start(attempt)
            try:
                return next(self._call)
            except grpc.RpcError as rpc_error:
                # Retry, resume or give up: tokenwire.attempts decides; this side only waits.
                decision = self._attempts.failed(rpc_error, cancelled_here=self._done)
                if isinstance(decision, GiveUp):
                    raise decision.error from None
            self._call = None
            time.sleep(decision.delay)

    def cancel(self) -> None:
        """Cancel the RPC on the server (no-op once it has ended)."""
        self._done = True
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()

    close = cancel

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if not self._done:
            self.cancel()

    def text(self) -> Completion:
        """Read the rest of the stream into one Completion."""
        return Completion.from_chunks(list(self), self.request_id)


class _ClientBase(abc.ABC):
    """What Client and AsyncClient share but their I/O: the arguments (see ``Client``), the
    metadata every call sends, and each call's attempts; a subclass opens the channel."""

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

    def _generate_call(
        self,
        generate: Callable[..., _Call],
        prompt: str | None,
        messages: Iterable[MessageLike] | None,
        input_ids: Sequence[int] | None,
        timeout: float | None,
        resume: bool,
        params: GenerateOptions,
    ) -> tuple[Callable[[Attempt], _Call], StreamAttempts]:
        """How to start each attempt of a Generate call on ``generate`` (a stub's), and the
        call's attempts. The request is built and checked here, before anything is sent."""
        request = build_generate_request(
            prompt, messages=messages, input_ids=input_ids, options=params, limits=self.limits
        )
        attempts = StreamAttempts(request, resume=resume, retry=self.retry, timeout=self._timeout(timeout))
        metadata = trace_metadata(self._metadata)  # the caller's trace context, as of this call

        def start(attempt: Attempt) -> _Call:
            return generate(attempt.request, timeout=attempt.timeout, metadata=metadata)

        return start, attempts

    def _unary_attempts(self, timeout: float | None) -> UnaryAttempts:
        return UnaryAttempts(self.retry, self._timeout(timeout))

    def _timeout(self, timeout: float | None) -> float | None:
        """A call's deadline: its own ``timeout``, else the client's."""
        return self.timeout if timeout is None else timeout


class Client(_ClientBase):
    """A blocking client of tokenwire.v1.TextGeneration.

    ``target``: ``host:port``, any gRPC target (``dns:///tokenwire.default.svc:50051``)
    or a list of ``host:port`` addresses (calls are spread with round_robin).
    ``tls``: False (plaintext), True (system trust store) or a :class:`TLSConfig`.
    ``token``: sent as ``authorization: Bearer <token>`` on every call but health.
    ``timeout``: default deadline in seconds for each call, retries included.
    ``limits``: a server's limits to check requests against before sending them
    (``client.model_info().limits``). By default only the rules that hold on every
    server are checked here; the server enforces its own limits either way.
    """

    def _connect(self, creds: grpc.ChannelCredentials | None, options: list[tuple[str, str | int]]) -> None:
        self._channel = (
            grpc.insecure_channel(self.target, options) if creds is None else grpc.secure_channel(self.target, creds, options)
        )
        self._stub = pb_grpc.TextGenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    # -- lifetime -----------------------------------------------------------------

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the channel is connected; raise Unavailable if it is not in time."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise Unavailable(f"could not connect to {self.target} within {timeout} s") from None

    # -- Generate -----------------------------------------------------------------

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Iterable[MessageLike] | None = None,
        input_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        resume: bool = True,
        **params: Unpack[GenerateOptions],
    ) -> ChunkStream:
        """Stream the completion of a prompt, a chat (``messages``) or token ids.

        The request is checked here, before anything is sent; the call starts on the
        first ``next()``. ``resume``: a stream cut by its replica goes on on another one
        from the tokens received, with no duplicate, gap or exception (docs/client.md).
        """
        return ChunkStream(*self._generate_call(self._stub.Generate, prompt, messages, input_ids, timeout, resume, params))

    def generate_text(
        self,
        prompt: str | None = None,
        *,
        messages: Iterable[MessageLike] | None = None,
        input_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        resume: bool = True,
        **params: Unpack[GenerateOptions],
    ) -> Completion:
        """The whole completion at once."""
        stream = self.generate(prompt, messages=messages, input_ids=input_ids, timeout=timeout, resume=resume, **params)
        with stream:
            return stream.text()

    def chat(
        self,
        messages: Iterable[MessageLike],
        *,
        timeout: float | None = None,
        resume: bool = True,
        **params: Unpack[GenerateOptions],
    ) -> Completion:
        """The model's whole reply to a conversation (stream it with ``generate(messages=...)``)."""
        return self.generate_text(messages=messages, timeout=timeout, resume=resume, **params)


    def generate_json(
        self,
        prompt: str | None = None,
        *,
        schema: ResponseFormatLike | None = None,
        messages: Iterable[MessageLike] | None = None,
        input_ids: Sequence[int] | None = None,
        timeout: float | None = None,
        resume: bool = True,
        **params: Unpack[GenerateOptions],
    ) -> Any:
        """An answer in a JSON schema (a dict or a pydantic model class; None: any JSON object),
        parsed: a pydantic instance for a model class, else the JSON value. Raises
        ``tokenwire.formats.IncompleteAnswer`` when max_new_tokens cut the answer short."""
        completion = self.generate_text(
            prompt, messages=messages, input_ids=input_ids, timeout=timeout, resume=resume, **json_options(params, schema)
        )
        return parse_answer(completion, schema)

    # -- unary calls --------------------------------------------------------------

    def _unary(self, call: Callable[[float | None], _T], timeout: float | None) -> _T:
        attempts = self._unary_attempts(timeout)
        while True:
            try:
                return call(attempts.start())
            except grpc.RpcError as rpc_error:
                decision = attempts.failed(rpc_error)
                if isinstance(decision, GiveUp):
                    raise decision.error from None
            time.sleep(decision.delay)

    def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Iterable[MessageLike] | None = None,
        return_tokens: bool = False,
        return_offsets: bool = False,
        timeout: float | None = None,
    ) -> Tokenization:
        """The token ids of a text, or of a chat rendered with the model's template."""
        request = build_tokenize_request(
            text, messages=messages, return_tokens=return_tokens, return_offsets=return_offsets,
            limits=self.limits,
        )
        metadata = trace_metadata(self._metadata)
        response = self._unary(lambda t: self._stub.Tokenize(request, timeout=t, metadata=metadata), timeout)
        return Tokenization.from_proto(response)

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """The model being served and the server's limits."""
        metadata = trace_metadata(self._metadata)
        response = self._unary(
            lambda t: self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=t, metadata=metadata),
            timeout,
        )
        return ModelInfo.from_proto(response)

    def health(self, service: str = "", *, timeout: float | None = 5.0) -> HealthStatus:
        """The grpc.health.v1 status of ``service`` ("" is the whole server).

        An unknown service reads as SERVICE_UNKNOWN; an unreachable server raises
        Unavailable. Not retried and sent without the token, like a probe's check.
        """
        try:
            response = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as rpc_error:
            return health_failure(rpc_error)
        return health_status(response)
