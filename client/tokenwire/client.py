"""The blocking client: ``tokenwire.Client``.

``generate`` returns a :class:`ChunkStream`, an iterator of :class:`Chunk` that owns
its RPC: leaving the loop early (``break``, an exception, the stream being garbage
collected) cancels the call on the server. Until the first chunk arrives a refused
call is retried per the :class:`RetryPolicy`; after it, a stream that its replica cuts
(UNAVAILABLE: it died, or drained and handed the stream off) is resumed on the next
replica from the tokens received (``tokenwire.resume``), within the same policy, unless
``generate(..., resume=False)``.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped]

from tokenwire.channel import TLSConfig, channel_options, credentials, resolve_target, trace_metadata
from tokenwire.errors import DeadlineExceeded, TokenwireError, Unavailable, from_rpc_error
from tokenwire.formats import ResponseFormatLike, parse_answer
from tokenwire.request import GenerateOptions, build_generate_request, build_tokenize_request, json_options
from tokenwire.results import Chunk, Completion, HealthStatus, MessageLike, ModelInfo, Tokenization
from tokenwire.resume import Resumption
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

_HEALTH_STATUS = {
    0: HealthStatus.UNKNOWN,
    1: HealthStatus.SERVING,
    2: HealthStatus.NOT_SERVING,
    3: HealthStatus.SERVICE_UNKNOWN,
}


class _StreamCall(Protocol):
    def __next__(self) -> pb.TokenChunk: ...
    def cancel(self) -> bool: ...


class Deadline:
    """One budget for a call and all its retries (None: no deadline)."""

    def __init__(self, timeout: float | None) -> None:
        self.at = None if timeout is None else time.monotonic() + timeout

    def remaining(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def allows(self, delay: float) -> bool:
        """Whether waiting ``delay`` seconds still leaves time for another attempt."""
        return self.at is None or time.monotonic() + delay < self.at

    def expired_error(self, request_id: str | None) -> DeadlineExceeded:
        return DeadlineExceeded("deadline exceeded before the call could start", request_id=request_id)


class ChunkStream(Iterator[Chunk]):
    """The chunks of one Generate call, in order; the last carries finish_reason and usage.

    Use it in a ``for`` loop or ``with`` block; :meth:`cancel` (or leaving either
    early) cancels the RPC on the server.
    """

    def __init__(
        self,
        start: Callable[[float | None, pb.GenerateRequest], _StreamCall],
        *,
        resumption: Resumption,
        request_id: str,
        retry: RetryPolicy,
        deadline: Deadline,
        rng: random.Random | None = None,
    ) -> None:
        self.request_id = request_id
        self._start = start
        self._resumption = resumption
        self._request = resumption.request  # what the next attempt sends
        self._retry = retry
        self._deadline = deadline
        self._rng = rng
        self._call: _StreamCall | None = None
        self._started = False  # a chunk has arrived: from here on, resume (never replay)
        self._done = False
        self._lock = threading.Lock()
        self.attempts = 0

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> Chunk:
        if self._done:
            raise StopIteration
        try:
            message = self._next_message()
        except StopIteration:
            self._done = True
            raise
        except TokenwireError:
            self._done = True
            raise
        except BaseException:
            # KeyboardInterrupt, GeneratorExit, ...: the caller is leaving; so is the RPC.
            self.cancel()
            raise
        chunk = self._resumption.received(message)
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
                if self._deadline.remaining() == 0.0:
                    raise self._deadline.expired_error(self.request_id)
                self.attempts += 1
                with self._lock:
                    self._call = self._start(self._deadline.remaining(), self._request)
            try:
                message = next(self._call)
            except grpc.RpcError as rpc_error:
                error = from_rpc_error(rpc_error, request_id=self.request_id)
                # Before the first chunk a refused call is tried again as it was; after it, a
                # stream cut by its replica is resumed from what has arrived (tokenwire.resume).
                resume = self._started and self._resumption.resumable(error, cancelled_here=self._done)
                delay = (
                    self._retry.backoff(self.attempts, error, self._rng, cancelled_here=self._done)
                    if resume or not self._started
                    else None
                )
                if delay is None or not self._deadline.allows(delay):
                    raise error from None
                self._call = None
                time.sleep(delay)
                if resume:
                    self._request = self._resumption.resumed_request()
                continue
            self._started = True
            return message

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

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            try:
                self.cancel()
            except Exception:  # pragma: no cover - e.g. the event loop is already closed
                pass

    def text(self) -> Completion:
        """Read the rest of the stream into one Completion."""
        return Completion.from_chunks(list(self), self.request_id)


class Client:
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
        creds = credentials(tls)
        opts = channel_options(tls=tls, extra=options)
        if creds is None:
            self._channel = grpc.insecure_channel(self.target, options=opts)
        else:
            self._channel = grpc.secure_channel(self.target, creds, options=opts)
        self._stub = pb_grpc.TextGenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        auth = (("authorization", f"Bearer {token}"),) if token else ()
        self._metadata: tuple[tuple[str, str], ...] = (*auth, *metadata)

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
        request = build_generate_request(
            prompt, messages=messages, input_ids=input_ids, options=params, limits=self.limits
        )
        metadata = trace_metadata(self._metadata)  # the caller's trace context, as of this call

        def start(remaining: float | None, message: pb.GenerateRequest) -> _StreamCall:
            return self._stub.Generate(message, timeout=remaining, metadata=metadata)

        deadline = Deadline(self.timeout if timeout is None else timeout)
        return ChunkStream(
            start,
            resumption=Resumption(request, resume),
            request_id=request.request_id,
            retry=self.retry,
            deadline=deadline,
        )

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
        deadline = Deadline(self.timeout if timeout is None else timeout)
        attempt = 0
        while True:
            attempt += 1
            try:
                return call(deadline.remaining())
            except grpc.RpcError as rpc_error:
                error = from_rpc_error(rpc_error)
                delay = self.retry.backoff(attempt, error, cancelled_here=False)  # a caller leaving raises no RpcError
                if delay is None or not deadline.allows(delay):
                    raise error from None
            time.sleep(delay)

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
            error = from_rpc_error(rpc_error)
            if error.code == grpc.StatusCode.NOT_FOUND:
                return HealthStatus.SERVICE_UNKNOWN
            raise error from None
        return _HEALTH_STATUS.get(int(response.status), HealthStatus.UNKNOWN)
